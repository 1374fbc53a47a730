"""A short run of the low-communication study: schema, exact byte counts, the equal-bytes table."""

import dataclasses
import json

from low_communication import train
from low_communication.configs import default, quick


def test_configs():
  config, fast = default.get_config(), quick.get_config()
  assert fast.steps < config.steps and config.num_nodes == 16
  assert config.log_every % config.inner_steps == 0 and config.log_every % config.chunk == 0


def test_bytes_per_node_count_each_message():
  config = default.get_config()  # 16 nodes, H = 20, one-peer exponential gossip
  m, allreduce = 1000, 2 * 15 / 16 * 1000
  assert train.bytes_per_node("allreduce_adamw", config, m, 40) == 40 * allreduce
  assert train.bytes_per_node("dpsgd_adamw", config, m, 40) == 40 * m
  assert train.bytes_per_node("dsgd_pga_adamw", config, m, 40) == 40 * m + 2 * allreduce
  assert train.bytes_per_node("diloco", config, m, 59) == 2 * allreduce  # two outer steps, the third at step 60
  assert train.bytes_per_node("noloco", config, m, 60) == 3 * m


def test_short_run(tmp_path):
  config = dataclasses.replace(default.get_config(), num_nodes=4, steps=16, inner_steps=4, log_every=8, early_steps=8,
                               train_eval_samples=64, methods=("diloco", "noloco"))
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  runs = {r["method"]: r for r in results["runs"]}
  assert [h["step"] for h in runs["diloco"]["history"]] == [0, 4, 8, 16]
  m = runs["diloco"]["model_bytes"]
  assert runs["noloco"]["history"][-1]["bytes_per_node"] == 4 * m == results["budget_bytes_per_node"]
  assert runs["diloco"]["history"][-1]["consensus_distance"] < 1e-10  # just after an outer step: one model
  md = (tmp_path / "results.md").read_text()
  assert "| DiLoCo | 8 |" in md  # two outer steps fit in NoLoCo's budget of four peer exchanges, a third does not
  assert "| NoLoCo | 16 |" in md and (tmp_path / "low_communication.png").exists()
