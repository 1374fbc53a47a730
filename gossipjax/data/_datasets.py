"""Data sets that need no network: scikit-learn's bundled digits, local CIFAR-10 / MNIST files."""

from __future__ import annotations

import gzip
import os
import pickle
from typing import Any, NamedTuple

import numpy as np

from gossipjax._extras import require_train_extra


class Dataset(NamedTuple):
  """A labelled data set, split into training and test parts (what the ``load_*`` functions return).

  Attributes:
    x_train: training inputs, (N, ...) with the sample axis first: float32 images, or int32 (N, T) windows
      of tokens for text.
    y_train: int32 training labels, (N,), or for text int32 (N, T) next tokens.
    x_test: test inputs, (M, ...), as ``x_train``.
    y_test: int32 test labels, (M,), or for text (M, T).
    num_classes: how many classes the labels range over (labels are 0 .. num_classes - 1); 256 for bytes.
    sources: for text, int32 (N,): where each training window comes from, an index into
      `gj.data.text_sources`'s sorted names (for `partition_by_source`); ``None`` for the other sets.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  sources: np.ndarray | None = None


def load_digits(test_fraction: float = 0.25, seed: int = 0, flat: bool = True) -> Dataset:
  """The 1,797 8x8 handwritten digits bundled with scikit-learn, scaled to [0, 1].

  Args:
    test_fraction: share held out for testing (stratified split).
    seed: shuffling seed.
    flat: (N, 64) when True, else images (N, 8, 8, 1).

  Returns:
    A `Dataset` with 10 classes: 1,347 training and 450 test samples at the default
    ``test_fraction``, float32 inputs in [0, 1] and int32 labels.

  Example:
    >>> import gossipjax as gj
    >>> ds = gj.data.load_digits()
    >>> ds.x_train.shape, ds.x_test.shape, ds.num_classes
    ((1347, 64), (450, 64), 10)
    >>> gj.data.load_digits(flat=False).x_train.shape
    (1347, 8, 8, 1)

  References:
    Alpaydin, Kaynak (1998), Optical Recognition of Handwritten Digits, UCI Machine Learning
    Repository.
  """
  require_train_extra("gj.data.load_digits", "sklearn")
  from sklearn.datasets import load_digits as sk_load_digits

  d: Any = sk_load_digits()  # a Bunch: scikit-learn has no annotations to say so
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

  Args:
    data_dir: the directory holding the batches (``cifar-10-batches-py`` once extracted).

  Returns:
    A `Dataset` with 10 classes: 50,000 training and 10,000 test images for the full set.

  Raises:
    FileNotFoundError: ``data_dir`` holds no training batch or no ``test_batch``.
    ValueError: a batch is not in that format (no ``b"data"`` of rows of 3,072 bytes, or
      another number of labels than images, or a label outside 0-9); the message names the file.

  Example:
    Two blank images in the same format stand in for the real files here:

    >>> import os, pickle, tempfile
    >>> import numpy as np, gossipjax as gj
    >>> data_dir = tempfile.mkdtemp()
    >>> batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 5]}
    >>> for name in ("data_batch_1", "test_batch"):
    ...   with open(os.path.join(data_dir, name), "wb") as f:
    ...     pickle.dump(batch, f)
    >>> ds = gj.data.load_cifar10(data_dir)
    >>> ds.x_train.shape, ds.y_test.tolist()
    ((2, 32, 32, 3), [3, 5])

  References:
    Krizhevsky (2009), Learning Multiple Layers of Features from Tiny Images, technical
    report, University of Toronto.
  """
  def read(name):
    path = os.path.join(data_dir, name)
    try:
      with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
      raw, labels = np.asarray(d[b"data"], np.uint8), np.asarray(d[b"labels"], np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
      raise ValueError(f"gj.data.load_cifar10: {path} is not a CIFAR-10 batch ({type(e).__name__}: {e})") from None
    if raw.ndim != 2 or raw.shape[1] != 3072:
      raise ValueError(f"gj.data.load_cifar10: {path} holds data of shape {raw.shape}, not rows of 3072 bytes")
    _check_labels(path, len(raw), labels, "gj.data.load_cifar10")
    x = raw.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x.astype(np.float32) / 255.0, labels.astype(np.int32)

  train_files = sorted(f for f in os.listdir(data_dir) if f.startswith("data_batch_"))
  if not train_files or not os.path.exists(os.path.join(data_dir, "test_batch")):
    raise FileNotFoundError(
        f"{data_dir} does not hold CIFAR-10 in python-pickle format (data_batch_1..5 and test_batch)")
  parts = [read(f) for f in train_files]
  x_test, y_test = read("test_batch")
  return Dataset(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test, 10)


def load_mnist(data_dir: str) -> Dataset:
  """MNIST from a local directory of the four standard IDX files (gzipped or not).

  Reads ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``
  and ``t10k-labels-idx1-ubyte``, each optionally with a ``.gz`` suffix.

  Args:
    data_dir: the directory holding the four files.

  Returns:
    A `Dataset` with 10 classes and float32 images (N, 28, 28, 1) in [0, 1]: 60,000
    training and 10,000 test images for the full set.

  Raises:
    FileNotFoundError: one of the four files is missing.
    ValueError: a file is not an IDX file of unsigned bytes of the sizes its header gives
      (a truncated download, say), images are not 28 x 28, a split has another number of
      labels than images, or a label is outside 0-9; the message names the file.

  Example:
    Two blank images in the IDX format stand in for the real files here:

    >>> import os, tempfile
    >>> import numpy as np, gossipjax as gj
    >>> data_dir = tempfile.mkdtemp()
    >>> def idx(array):  # magic number (0, 0, uint8, ndim), then the dimensions big-endian
    ...   dims = b"".join(d.to_bytes(4, "big") for d in array.shape)
    ...   return bytes([0, 0, 8, array.ndim]) + dims + array.tobytes()
    >>> images, labels = np.zeros((2, 28, 28), np.uint8), np.array([7, 1], np.uint8)
    >>> for split in ("train", "t10k"):
    ...   with open(os.path.join(data_dir, f"{split}-images-idx3-ubyte"), "wb") as f:
    ...     _ = f.write(idx(images))
    ...   with open(os.path.join(data_dir, f"{split}-labels-idx1-ubyte"), "wb") as f:
    ...     _ = f.write(idx(labels))
    >>> ds = gj.data.load_mnist(data_dir)
    >>> ds.x_train.shape, ds.y_train.tolist()
    ((2, 28, 28, 1), [7, 1])

  References:
    LeCun, Bottou, Bengio, Haffner (1998), Gradient-Based Learning Applied to Document
    Recognition, Proceedings of the IEEE.
  """
  def read_idx(stem, ndim):
    for name in (stem, stem + ".gz"):
      path = os.path.join(data_dir, name)
      if os.path.exists(path):
        try:
          with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
        except (OSError, EOFError) as e:  # a damaged gzip stream
          raise ValueError(f"gj.data.load_mnist: {path} cannot be read: {e}") from None
        return path, _idx_array(path, raw, ndim)
    raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")

  splits = []
  for split in ("train", "t10k"):
    images_path, images = read_idx(f"{split}-images-idx3-ubyte", 3)
    labels_path, labels = read_idx(f"{split}-labels-idx1-ubyte", 1)
    if images.shape[1:] != (28, 28):
      raise ValueError(f"gj.data.load_mnist: {images_path} holds images of {images.shape[1:]}, not 28 x 28")
    if len(labels) != len(images):
      raise ValueError(f"gj.data.load_mnist: {images_path} holds {len(images)} images but {labels_path} "
                       f"{len(labels)} labels")
    _check_labels(labels_path, len(images), labels, "gj.data.load_mnist")
    splits.append((images.astype(np.float32)[..., None] / 255.0, labels.astype(np.int32)))
  (x_train, y_train), (x_test, y_test) = splits
  return Dataset(x_train, y_train, x_test, y_test, 10)


def _idx_array(path: str, raw: bytes, ndim: int) -> np.ndarray:
  """The array of an IDX file of unsigned bytes with ``ndim`` dimensions; ``ValueError`` naming ``path`` otherwise."""
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 8 or raw[3] != ndim:
    raise ValueError(f"gj.data.load_mnist: {path} is not an IDX file of unsigned bytes with {ndim} dimension(s) "
                     f"(its header starts {raw[:4].hex() or 'empty'})")
  if len(raw) < 4 + 4 * ndim:
    raise ValueError(f"gj.data.load_mnist: {path} is truncated: {len(raw)} bytes end inside its header")
  dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
  want, got = int(np.prod(dims)), len(raw) - 4 - 4 * ndim
  if got != want:
    raise ValueError(f"gj.data.load_mnist: {path} holds {got} bytes of data, but its header gives {dims} "
                     f"({want} bytes){': truncated' if got < want else ''}")
  return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _check_labels(path: str, count: int, labels: np.ndarray, name: str) -> None:
  if labels.ndim != 1 or len(labels) != count:
    raise ValueError(f"{name}: {path} holds {count} images but {labels.size} labels")
  if len(labels) and (labels.min() < 0 or labels.max() > 9):
    raise ValueError(f"{name}: {path} holds labels outside 0-9 (from {labels.min()} to {labels.max()})")
