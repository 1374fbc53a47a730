"""One short epoch of the straggler study: results.json's schema and the basic shape."""

import dataclasses
import json
import os

from stragglers import train
from stragglers.configs import default, quick


def test_configs():
  assert default.get_config().num_nodes == 16
  assert quick.get_config().epochs < default.get_config().epochs


def test_one_short_epoch(tmp_path):
  config = dataclasses.replace(default.get_config(), slowdowns=(1, 100), epochs=1.0, stale_probe_slowdown=None)
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert os.path.exists(tmp_path / "stragglers.png")
  rows = {(r["method"], r["slowdown"]): r for r in results["rows"]}
  assert set(rows) == {(m, s) for m in ("ad-psgd", "d-psgd", "allreduce") for s in (1, 100)}
  for r in rows.values():
    assert {"method", "slowdown", "time_per_epoch", "speedup", "final_loss", "final_accuracy"} <= set(r)
    assert r["epochs"] >= 1.0 and r["final_loss"] > 0 and 0 <= r["final_accuracy"] <= 1
  # AD-PSGD keeps its speed with a 100x straggler; the synchronous methods drop ~100x
  assert rows["ad-psgd", 100]["speedup"] > 0.8 * rows["ad-psgd", 1]["speedup"] > 10
  for m in ("d-psgd", "allreduce"):
    assert rows[m, 1]["speedup"] > 8
    assert rows[m, 100]["speedup"] < 16 / 100
  # one epoch (11 synchronous rounds) already moves every model past chance
  assert all(r["final_accuracy"] > 0.2 for r in rows.values())  # chance is 0.1
