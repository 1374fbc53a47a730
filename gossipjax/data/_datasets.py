"""Data sets that need no network: scikit-learn's bundled digits, local CIFAR-10 / MNIST files."""

from __future__ import annotations

import gzip
import os
import pickle
from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


def load_digits(test_fraction: float = 0.25, seed: int = 0, flat: bool = True) -> Dataset:
  """The 1,797 8x8 handwritten digits bundled with scikit-learn, scaled to [0, 1].

  Args:
    test_fraction: share held out for testing (stratified split).
    seed: shuffling seed.
    flat: (N, 64) when True, else images (N, 8, 8, 1).
  """
  from sklearn.datasets import load_digits as sk_load_digits

  d = sk_load_digits()
  x = (d.images / 16.0).astype(np.float32)
  x = x.reshape(len(x), -1) if flat else x[..., None]
  y = d.target.astype(np.int32)
  rng = np.random.default_rng(seed)
  test = np.zeros(len(y), bool)
  for c in np.unique(y):
    idx = rng.permutation(np.flatnonzero(y == c))
    test[idx[: int(round(test_fraction * len(idx)))]] = True
  return Dataset(x[~test], y[~test], x[test], y[test], 10)


def load_cifar10(data_dir: str) -> Dataset:
  """CIFAR-10 from a local directory in the standard python-pickle format.

  Expects ``data_batch_1`` ... ``data_batch_5`` (any that exist are used) and
  ``test_batch``, each a pickle with ``b"data"`` (N, 3072) uint8 and ``b"labels"``.
  Images come back as float32 (N, 32, 32, 3) in [0, 1].
  """
  def read(name):
    path = os.path.join(data_dir, name)
    with open(path, "rb") as f:
      d = pickle.load(f, encoding="bytes")
    x = np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x.astype(np.float32) / 255.0, np.asarray(d[b"labels"], np.int32)

  train_files = sorted(f for f in os.listdir(data_dir) if f.startswith("data_batch_"))
  if not train_files or not os.path.exists(os.path.join(data_dir, "test_batch")):
    raise FileNotFoundError(
        f"{data_dir} does not hold CIFAR-10 in python-pickle format (data_batch_1..5 and test_batch)")
  parts = [read(f) for f in train_files]
  x_test, y_test = read("test_batch")
  return Dataset(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test, 10)


def load_mnist(data_dir: str) -> Dataset:
  """MNIST from a local directory of the four standard IDX files (gzipped or not)."""
  def read_idx(stem):
    for name in (stem, stem + ".gz"):
      path = os.path.join(data_dir, name)
      if os.path.exists(path):
        with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
          raw = f.read()
        ndim = raw[3]
        dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
        return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)
    raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")

  x_train = read_idx("train-images-idx3-ubyte").astype(np.float32)[..., None] / 255.0
  x_test = read_idx("t10k-images-idx3-ubyte").astype(np.float32)[..., None] / 255.0
  y_train = read_idx("train-labels-idx1-ubyte").astype(np.int32)
  y_test = read_idx("t10k-labels-idx1-ubyte").astype(np.int32)
  return Dataset(x_train, y_train, x_test, y_test, 10)
