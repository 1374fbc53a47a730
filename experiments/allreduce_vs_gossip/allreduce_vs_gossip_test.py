"""Three epochs of the AllReduce / D-PSGD / AD-PSGD study: schema and what each method is."""

import dataclasses
import json

from allreduce_vs_gossip import train
from allreduce_vs_gossip.configs import default, quick


def test_configs():
  assert default.get_config().num_nodes == 16
  assert quick.get_config().epochs < default.get_config().epochs


def test_three_epochs(tmp_path):
  config = dataclasses.replace(default.get_config(), epochs=3, seeds=(0,))
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert (tmp_path / "allreduce_vs_gossip.png").exists()
  assert "| ad-psgd |" in (tmp_path / "results.md").read_text()
  runs = {r["method"]: r for r in results["runs"]}
  assert set(runs) == {"allreduce", "d-psgd", "ad-psgd"}
  for r in runs.values():
    assert len(r["history"]) == 4 and r["history"][0]["epoch"] == 0
    assert 3.0 <= r["epoch"] < 3.1  # one epoch = one pass of the cluster over the training set
    assert r["train_loss"] < 0.8 * r["history"][0]["train_loss"]
  # AllReduce keeps the learners identical; gossip leaves a (small) disagreement
  assert runs["allreduce"]["consensus_distance"] < 1e-10
  assert runs["d-psgd"]["consensus_distance"] > 1e-8 and runs["ad-psgd"]["consensus_distance"] > 1e-8
  # same loss per epoch: within 15% of each other after three epochs
  losses = [r["train_loss"] for r in runs.values()]
  assert max(losses) < 1.15 * min(losses)
