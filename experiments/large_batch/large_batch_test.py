"""The large-batch study: ResNet-20's shape, and one very short epoch on tiny CIFAR-10 files."""

import dataclasses
import json
import pickle

import jax
import jax.numpy as jnp
import numpy as np

from large_batch import train
from large_batch.configs import default, quick
from large_batch.models import ResNet20


def test_configs():
  assert default.get_config().width == 16 and quick.get_config().width < 16
  assert quick.get_config().epochs < default.get_config().epochs


def test_resnet20_shape():
  variables = jax.eval_shape(ResNet20().init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  kernels = [x.shape for x in jax.tree.leaves(variables) if x.ndim >= 2]
  assert sum(k[:2] == (3, 3) for k in kernels) == 19  # 1 + 3 stages x 3 blocks x 2 convolutions
  assert sum(len(k) == 2 for k in kernels) == 1  # the classifier: 20 weight layers
  assert sum(k[:2] == (1, 1) for k in kernels) == 2  # projection shortcuts into stages 2 and 3
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables))
  assert 0.26e6 < params < 0.28e6  # He et al.: 0.27M
  out = jax.eval_shape(ResNet20(width=4).apply, jax.eval_shape(ResNet20(width=4).init, jax.random.key(0),
                                                                  jnp.zeros((1, 8, 8, 1))), jnp.zeros((5, 8, 8, 1)))
  assert out.shape == (5, 10)  # the digits go through as 8x8x1


def _write_cifar(directory, rng, files=("data_batch_1", "data_batch_2", "test_batch"), per_file=20):
  for name in files:
    d = {b"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
         b"labels": rng.integers(0, 10, per_file).tolist()}
    with open(directory / name, "wb") as f:
      pickle.dump(d, f)


def test_one_short_epoch_on_cifar_files(tmp_path):
  _write_cifar(tmp_path, np.random.default_rng(0))
  config = dataclasses.replace(default.get_config(), data_dir=str(tmp_path), num_nodes=4, width=4,
                               total_batches=(8,), epochs=0.4, warmup_epochs=0.1, chunks=1,
                               methods=("decentlam",))  # one method: compiling a 32x32 ResNet-20 dominates
  train.train_and_evaluate(config, str(tmp_path / "out"))
  results = json.loads((tmp_path / "out" / "results.json").read_text())
  assert results["dataset"] == "cifar10" and (tmp_path / "out" / "large_batch.png").exists()
  assert "| decentlam |" in (tmp_path / "out" / "results.md").read_text()
  (r,) = results["runs"]
  assert r["diverged"] is None and r["steps"] == 2 and r["epochs"] == 2 * 8 / 40  # 40 training images
  assert np.isfinite(r["train_loss"]) and 0 <= r["test_accuracy"] <= 1
  assert r["peak_learning_rate"] == config.base_learning_rate * 8 / config.base_batch  # linear scaling
  # the nodes start equal and take their own gradients: gossip leaves them apart, not identical
  assert 0 < r["consensus_distance"] < 1
