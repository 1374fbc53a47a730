"""A short run of the compression study: schema, exact bit counts, and learning at a fraction of the bits."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp

import gossipjax as gj
from compression import train
from compression.configs import default, quick


def test_configs():
  assert default.get_config().num_nodes == 16
  assert quick.get_config().steps < default.get_config().steps


def test_short_run(tmp_path):
  config = dataclasses.replace(default.get_config(), steps=100, log_every=50, compressors=("sign", "top_k:0.1"),
                               consensus_steps=(1.0,), partition="iid")
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert (tmp_path / "compression.png").exists() and "| choco | sign |" in (tmp_path / "results.md").read_text()
  runs = {r["compressor"]: r for r in results["runs"]}
  assert set(runs) == {"none", "sign", "top_k:0.1"}
  for r in runs.values():
    assert [h["step"] for h in r["history"]] == [50, 100]
    assert {"bits", "train_loss", "test_accuracy", "consensus_distance"} <= set(r["history"][-1])

  # bits: 16 nodes x 2 ring neighbours x steps x the size of each compressor's wire form
  one = train.MLP(config.hidden).init(jax.random.key(0), jnp.zeros((1, 64)))
  sizes = [x.size for x in jax.tree.leaves(one)]
  assert results["dense_bits_per_message"] == 32 * sum(sizes)
  messages = 16 * 2 * config.steps
  assert runs["none"]["bits"] == messages * 32 * sum(sizes)
  # sign: the packed sign bits, ceil(d / 8) bytes, and a float32 scale per layer
  assert abs(runs["sign"]["bits"] / (messages * sum(8 * math.ceil(s / 8) + 32 for s in sizes)) - 1) < 1e-6
  assert runs["sign"]["bits"] < runs["top_k:0.1"]["bits"] < runs["none"]["bits"] / 5
  # top-k: exactly the arrays that encode builds for one node's model
  top_k = gj.compress.top_k(0.1)
  wire = top_k.encode(one, jax.random.key(0))
  assert runs["top_k:0.1"]["bits"] == messages * sum(a.nbytes * 8 for a in jax.tree.leaves(wire))
  assert runs["top_k:0.1"]["bits"] == messages * float(top_k.bits(one))
  # sign-compressed gossip learns with ~1/30 of D-PSGD's bits (chance is 0.1)
  assert runs["sign"]["test_accuracy"] > 0.6 and runs["none"]["test_accuracy"] > 0.6
