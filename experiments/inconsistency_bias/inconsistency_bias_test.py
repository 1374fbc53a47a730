"""A short run of the inconsistency-bias study: results.json's schema and the facts of Yuan (2021)."""

import dataclasses
import json

import numpy as np
import pytest

from inconsistency_bias import train
from inconsistency_bias.configs import default, quick


def test_configs():
  full, fast = default.get_config(), quick.get_config()
  assert fast.steps <= full.steps and set(fast.topologies) <= set(full.topologies)
  assert all(name in train.TOPOLOGIES for name in full.topologies)
  assert all(name in train.ALGORITHMS for name in full.algorithms)


@pytest.mark.slow
def test_short_run(tmp_path):
  config = dataclasses.replace(default.get_config(), topologies=("ring",), steps=7000, lr_sweep=(0.01, 0.005),
                               beta_sweep=(0.0, 0.9))
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert (tmp_path / "bias.png").exists() and (tmp_path / "sweeps.png").exists()
  rows = {(r["algorithm"], r["learning_rate"]): r for r in results["rows"] if r["kind"] == "figure"}
  assert set(rows) == {(a, lr) for a in config.algorithms for lr in (0.01, 0.005)}
  assert len(results["curves"]) == len(rows)
  assert all(len(c["error"]) == len(results["curve_steps"]) for c in results["curves"])
  for lr in (0.01, 0.005):
    dpsgd, dmsgd, decentlam = (rows[a, lr] for a in ("d-psgd", "dmsgd", "decentlam"))
    for r in (dpsgd, dmsgd, decentlam):  # each biased method settles at its closed-form fixed point
      np.testing.assert_allclose(r["limit"], r["predicted_limit"], rtol=1e-8)
      assert r["tail_relative_spread"] < 1e-9
    # Yuan (2021): DmSGD is faster but more biased; DecentLaM as fast, and as accurate as D-PSGD
    assert dmsgd["limit"] > 10 * dpsgd["limit"]
    np.testing.assert_allclose(decentlam["limit"], dpsgd["limit"], rtol=1e-8)
    assert 3 * dmsgd["steps_to_settle"] < dpsgd["steps_to_settle"]
    assert 3 * decentlam["steps_to_settle"] < dpsgd["steps_to_settle"]
    for a in train.EXACT:  # the exact methods reach the optimum, down to round-off
      assert rows[a, lr]["steps_to_tolerance"] is not None and rows[a, lr]["limit"] < 1e-18
  halving = {h["algorithm"]: h for h in results["halving"]}
  assert 3.0 < halving["d-psgd"]["ratio"] < 4.0  # O(lr^2): 4 as lr -> 0; ring(16) at lr 0.01 is not there yet
  beta = {(r["algorithm"], r["beta"]): r["limit"] for r in results["rows"] if r["kind"] == "beta_sweep"}
  np.testing.assert_allclose(beta["decentlam", 0.9], beta["decentlam", 0.0], rtol=1e-8)
  assert beta["dmsgd", 0.9] > 10 * beta["dmsgd", 0.0]
