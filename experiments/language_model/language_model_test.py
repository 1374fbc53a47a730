"""A short run of the language-model study: the configs, the bytes and seconds each transform costs, the tables."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import gossipjax as gj
from language_model import train
from language_model.configs import default, gpu, quick


def test_configs():
  full, fast, big = default.get_config(), quick.get_config(), gpu.get_config()
  assert full.node_counts == (8, 16) and full.partitions == ("iid", "by_source") and len(full.seeds) == 3
  assert set(full.methods) == set(train.LABELS) and full.fragment_split == "balanced"
  assert set(full.networks) == {"datacenter", "cross_region", "internet"} <= set(gj.NETWORKS)
  for config in (full, fast, big):
    train.check(config)
    assert config.inner_steps % config.fragments == 0 and config.overlap < config.inner_steps // config.fragments
  assert fast.steps < full.steps < big.steps and big.width > full.width and big.context > full.context


def test_bytes_and_seconds_are_what_the_transforms_cost():
  config = dataclasses.replace(default.get_config(), steps=8, inner_steps=4, fragments=2, networks=("internet",))
  n, m = 4, 1000  # two leaves of 125 float32 a node: a model of M = 1000 bytes
  params = {"a": jnp.zeros((n, 125), jnp.float32), "b": jnp.zeros((n, 125), jnp.float32)}
  comm = {name: train.communication(train.make_method(name, config, n), params, config) for name in train.LABELS}
  allreduce = 2 * (n - 1) / n * m  # what a node sends in a ring all-reduce
  assert comm["allreduce_adamw"]["bytes"].tolist() == [k * allreduce for k in range(9)]
  assert comm["d_adamw"]["bytes"][-1] == 8 * m  # one model to one peer a step
  assert comm["diloco"]["bytes"].tolist() == [0, 0, 0, 0, allreduce, allreduce, allreduce, allreduce, 2 * allreduce]
  # Balanced fragments: half the model every 2 steps, DiLoCo's total.
  assert np.diff(comm["streaming_diloco"]["bytes"]).max() == allreduce / 2
  assert comm["streaming_diloco"]["bytes"][-1] == 2 * allreduce
  assert comm["noloco"]["bytes"][-1] == 2 * m  # one model to one peer a round
  net, t = gj.NETWORKS["internet"], config.step_time
  ring = 2 * (n - 1) * (net.latency + m / n / net.bandwidth)
  assert comm["allreduce_adamw"]["internet"][-1] == pytest.approx(8 * (t + ring))
  assert comm["diloco"]["internet"][-1] == pytest.approx(8 * t + 2 * ring)


def test_quick_run(tmp_path):
  config = quick.get_config()
  results = train.train_and_evaluate(config, str(tmp_path))
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["model"] == results["model"] and saved["model"]["tokens_per_run"] == 20 * 8 * 16
  runs = {r["method"]: r for r in saved["runs"]}
  for run in runs.values():
    loss = [h["node_test_loss_mean"] for h in run["history"]]
    assert [h["step"] for h in run["history"]] == [0, 10, 20]
    assert loss[-1] < loss[0] - 0.5  # from about log(256) = 5.5 nats a byte
  last = {name: run["history"][-1] for name, run in runs.items()}
  assert last["diloco"]["consensus_distance"] < 1e-10  # just after an outer step: one model
  assert 0 < last["diloco"]["bytes_sent"] < last["allreduce_adamw"]["bytes_sent"] / 5
  assert last["diloco"]["sim_seconds"]["internet"] < last["allreduce_adamw"]["sim_seconds"]["internet"]
  md = (tmp_path / "results.md").read_text()
  assert "## 2 nodes, iid split" in md and "| DiLoCo | " in md and "| AllReduce-AdamW | " in md
  assert (tmp_path / "loss_steps_bytes.png").exists() and (tmp_path / "loss_time.png").exists()
