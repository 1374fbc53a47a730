"""A short run of the topology study: results.json's schema, the spectral facts and the decay bound."""

import dataclasses
import json
import math

import numpy as np
import pytest

import gossipjax as gj
from topologies import spectra, train
from topologies.configs import default, quick


def test_configs():
  full, fast = default.get_config(), quick.get_config()
  assert full.sizes == (16, 64, 256, 1024) and fast.sizes == full.sizes
  assert all(math.isqrt(n) ** 2 == n for n in full.sizes)  # grid and torus are square
  assert set(full.train_sizes) <= set(full.sizes) and max(full.train_sizes) <= 64
  assert fast.train_steps <= full.train_steps and len(fast.train_seeds) <= len(full.train_seeds)


@pytest.mark.parametrize("name", list(spectra.TOPOLOGIES))
def test_every_topology_is_doubly_stochastic_and_rho_is_the_librarys(name):
  topo = spectra.TOPOLOGIES[name](16, 0).check("doubly")
  for k in range(topo.period):
    np.testing.assert_allclose(spectra.rho(topo.matrix(k)), gj.topology.rho(topo, k), rtol=0, atol=1e-10)


@pytest.mark.slow
def test_short_run(tmp_path):
  config = dataclasses.replace(default.get_config(), sizes=(16, 64), decay_steps=120, train_sizes=(16,),
                               partitions=("iid",), train_steps=60, log_every=20, train_seeds=(0,),
                               target_accuracy=0.5)
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  for f in ("decay.png", "rho.png", "training.png", "table.md"):
    assert (tmp_path / f).exists()
  spec = {(r["topology"], r["n"]): r for r in results["spectral"]}
  assert set(spec) == {(t, n) for t in config.topologies for n in config.sizes}
  for n in config.sizes:
    messages = {t: spec[t, n]["messages_max"] for t in config.topologies}
    assert messages == dict(ring=2, star=n - 1, grid=4, torus=4, half_random=messages["half_random"],
                            static_exponential=int(math.log2(n)), one_peer_exponential=1)
    assert n / 2 < messages["half_random"] < n
    for r in (spec[t, n] for t in config.topologies):
      assert r["bound_violation"] < 1e-12  # ||x^k - mean|| <= prod_t rho(W(t)) ||x^0 - mean||
      if r["plan_rank_one"] == 0:  # each message is one exchange round
        assert r["plan_rounds"] >= r["messages_max"]
    # a star's hub is held as two rank-one terms (its row and its column), not n - 1 rounds
    assert (spec["star", n]["plan_rounds"], spec["star", n]["plan_rank_one"]) == (0, 2)
    one_peer = spec["one_peer_exponential", n]
    assert one_peer["rho"] == pytest.approx(1.0) and one_peer["rho_period"] < 1e-12
    assert one_peer["steps_to_target"] == one_peer["period"] == int(math.log2(n))  # exact after one period
    # static W here are normal (symmetric or circulant): the measured tail rate is rho
    for t in ("torus", "static_exponential", "star"):
      assert spec[t, n]["measured_rate"] == pytest.approx(spec[t, n]["rho"], rel=1e-3)
  rho = {t: [spec[t, n]["rho"] for n in config.sizes] for t in config.topologies}
  assert rho["ring"][0] < rho["ring"][1] and rho["half_random"][1] < rho["half_random"][0]
  rows = {r["topology"]: r for r in results["training_runs"]}
  assert set(rows) == set(config.topologies) | {train.ALLREDUCE}
  for r in rows.values():
    assert 0 <= r["final_node_accuracy"] <= 1 and len(r["curve"]["step"]) == 3
  assert rows[train.ALLREDUCE]["final_consensus_distance"] < 1e-10  # all-reduce keeps the nodes equal
  assert len(results["training"]) == len(rows)
