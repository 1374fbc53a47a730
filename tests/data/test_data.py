import gzip
import os
import pickle
import time

import jax
import numpy as np
import pytest

from gossipjax import data as D

LABELS = np.repeat(np.arange(10), 30)


def test_iid_partition_covers_everything_evenly():
  parts = D.partition_iid(LABELS, 7, seed=1)
  assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))
  assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_dirichlet_small_alpha_skews_and_large_alpha_does_not():
  def skew(alpha):
    parts = D.partition_dirichlet(LABELS, 10, alpha, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))
    return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])
  assert skew(0.05) > 0.6 > 0.25 > skew(1000.0)


def dirichlet_reference(labels, num_nodes, alpha, seed):
  """The partition rule written plainly: deal each class's chunks, then feed every starved
  node the last-dealt sample of the largest node (the lowest index among equals)."""
  rng = np.random.default_rng(seed)
  parts = [[] for _ in range(num_nodes)]
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    cuts = (np.cumsum(rng.dirichlet(np.full(num_nodes, alpha)))[:-1] * len(idx)).astype(int)
    for node, chunk in enumerate(np.split(idx, cuts)):
      parts[node].extend(chunk.tolist())
  for node in range(num_nodes):
    if not parts[node]:
      donor = max(range(num_nodes), key=lambda j: len(parts[j]))
      parts[node].append(parts[donor].pop())
  return [np.sort(p) for p in parts]


@pytest.mark.parametrize("num_nodes,alpha,seed", [(10, 0.05, 0), (40, 0.01, 1), (250, 0.1, 2), (299, 1.0, 3), (7, 100.0, 4)])
def test_dirichlet_matches_the_plain_rule(num_nodes, alpha, seed):
  labels = np.random.default_rng(seed).integers(0, 7, 300)
  got = D.partition_dirichlet(labels, num_nodes, alpha, seed=seed)
  want = dirichlet_reference(labels, num_nodes, alpha, seed)
  assert len(got) == num_nodes and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_dirichlet_with_many_starved_nodes_is_fast():
  # 50,000 nodes for 60,000 samples of 10 classes: most nodes get no chunk of their own
  # and are fed one by one; a scan over all nodes per starved node took minutes.
  labels = np.random.default_rng(0).integers(0, 10, 60_000)
  t0 = time.perf_counter()
  parts = D.partition_dirichlet(labels, 50_000, 0.1, seed=0)
  assert time.perf_counter() - t0 < 10.0
  assert min(map(len, parts)) == 1
  assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(60_000))


def test_by_class_gives_each_node_its_classes_only():
  parts = D.partition_by_class(LABELS, 10, classes_per_node=2, seed=0)
  for p in parts:
    assert len(np.unique(LABELS[p])) == 2
  assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))


def test_partition_errors():
  with pytest.raises(ValueError, match="only 5 samples"):
    D.partition_iid(np.arange(5), 8)
  with pytest.raises(ValueError, match="alpha must be > 0"):
    D.partition_dirichlet(LABELS, 4, 0.0)
  with pytest.raises(ValueError, match="classes_per_node"):
    D.partition_by_class(LABELS, 4, classes_per_node=11)
  for bad in (2.5, "2", True):
    with pytest.raises(ValueError, match=r"^gj\.data\.partition_by_class: classes_per_node must be an integer in"):
      D.partition_by_class(LABELS, 4, bad)
  assert len(D.partition_by_class(LABELS, 4, np.int64(2))) == 4
  with pytest.raises(ValueError, match="no data"):
    D.node_data(np.zeros((3, 2)), np.zeros(3), [np.array([0]), np.array([], int)])


def test_sampled_batches_come_from_each_nodes_own_data():
  parts = D.partition_by_class(LABELS, 5, classes_per_node=1, seed=0)
  nd = D.node_data(np.arange(len(LABELS))[:, None].astype(np.float32), LABELS, parts)
  xb, yb = jax.jit(D.sample_batches, static_argnums=2)(nd, jax.random.key(0), 64)
  assert xb.shape == (5, 64, 1) and yb.shape == (5, 64)
  for i, p in enumerate(parts):
    assert set(np.asarray(xb[i, :, 0]).astype(int).tolist()) <= set(p.tolist())
    assert len(set(np.asarray(yb[i]).tolist())) == 1
  xb2, _ = D.sample_batches(nd, jax.random.key(0), 64)
  np.testing.assert_array_equal(xb, xb2)  # same key, same batch


def test_load_digits_is_real_bundled_data():
  ds = D.load_digits()
  assert ds.x_train.shape[1] == 64 and len(ds.x_train) + len(ds.x_test) == 1797
  assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
  assert set(np.unique(ds.y_test).tolist()) == set(range(10))


def test_load_cifar10_reads_the_python_pickle_format(tmp_path):
  rng = np.random.default_rng(0)
  for name, n in [("data_batch_1", 6), ("data_batch_2", 4), ("test_batch", 3)]:
    batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
    with open(tmp_path / name, "wb") as f:
      pickle.dump(batch, f)
  ds = D.load_cifar10(str(tmp_path))
  assert ds.x_train.shape == (10, 32, 32, 3) and ds.x_test.shape == (3, 32, 32, 3)
  with open(tmp_path / "data_batch_1", "rb") as f:
    raw = pickle.load(f, encoding="bytes")
  # channel-first rows become HWC: red plane first
  np.testing.assert_allclose(ds.x_train[0, 0, 1, 0], raw[b"data"][0][1] / 255.0)
  np.testing.assert_allclose(ds.x_train[0, 0, 0, 2], raw[b"data"][0][2048] / 255.0)
  with pytest.raises(FileNotFoundError, match="CIFAR-10"):
    (tmp_path / "empty").mkdir()
    D.load_cifar10(os.fspath(tmp_path / "empty"))


def test_load_mnist_reads_idx_files(tmp_path):
  def write_idx(name, arr, zipped):
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    opener = gzip.open if zipped else open
    with opener(tmp_path / (name + (".gz" if zipped else "")), "wb") as f:
      f.write(header + arr.astype(np.uint8).tobytes())

  rng = np.random.default_rng(0)
  imgs = rng.integers(0, 256, (5, 28, 28))
  write_idx("train-images-idx3-ubyte", imgs, True)
  write_idx("train-labels-idx1-ubyte", np.arange(5), False)
  write_idx("t10k-images-idx3-ubyte", imgs[:2], False)
  write_idx("t10k-labels-idx1-ubyte", np.arange(2), True)
  ds = D.load_mnist(str(tmp_path))
  assert ds.x_train.shape == (5, 28, 28, 1) and ds.y_test.tolist() == [0, 1]
  np.testing.assert_allclose(ds.x_train[..., 0], imgs / 255.0, rtol=1e-6)


def test_node_data_checks_the_indices():
  x, y = np.zeros((5, 2)), np.arange(5)
  for parts, message in (([np.array([0, 5]), np.array([1])], r"node 0 has indices outside \[0, 5\): \[5\]"),
                         ([np.array([0]), np.array([-1, 2])], r"node 1 has indices outside \[0, 5\): \[-1\]"),
                         ([np.array([0.0, 1.7]), np.array([2])], "node 0's indices must be a 1-D integer array")):
    with pytest.raises(ValueError, match=message):
      D.node_data(x, y, parts)
  with pytest.raises(ValueError, match=r"same leading sample axis, got shapes \(5, 2\) and \(4,\)"):
    D.node_data(x, y[:4], [np.array([0])])


def _write_idx(path, arr):
  header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
  path.write_bytes(header + arr.astype(np.uint8).tobytes())


def test_load_mnist_checks_counts_and_names_the_file(tmp_path):
  for split, n in (("train", 20), ("t10k", 4)):
    _write_idx(tmp_path / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28)))
    _write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.zeros(n))
  _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(15))
  with pytest.raises(ValueError, match=r"train-images-idx3-ubyte holds 20 images but .*train-labels-idx1-ubyte 15"):
    D.load_mnist(str(tmp_path))
  _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(20))
  images = tmp_path / "t10k-images-idx3-ubyte"
  images.write_bytes(images.read_bytes()[:-100])  # a short download
  with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte holds 3036 bytes of data, but .* \(3136 bytes\): trunc"):
    D.load_mnist(str(tmp_path))


def test_load_cifar10_checks_counts_and_names_the_file(tmp_path):
  for name in ("data_batch_1", "test_batch"):
    with open(tmp_path / name, "wb") as f:
      pickle.dump({b"data": np.zeros((3, 3072), np.uint8), b"labels": [1, 2] if name == "test_batch" else [0, 1, 2]}, f)
  with pytest.raises(ValueError, match="test_batch holds 3 images but 2 labels"):
    D.load_cifar10(str(tmp_path))


@pytest.mark.parametrize("partition", [D.partition_dirichlet, D.partition_by_class])
def test_partitions_refuse_nan_and_non_integer_labels(partition):
  part = lambda labels: partition(labels, 4, 0.5) if partition is D.partition_dirichlet else partition(labels, 4, 1)
  with_nan = LABELS.astype(float)
  with_nan[7] = np.nan
  for labels, message in ((with_nan, r"labels must be integer class ids, got \[nan\]"),
                          (LABELS + 0.5, r"got \[0.5, 0.5"), (LABELS.astype(str), "got an array of <U")):
    with pytest.raises(ValueError, match=message):
      part(labels)
  assert [len(p) for p in part(LABELS.astype(float))] == [len(p) for p in part(LABELS)]  # 3.0 is class 3


def test_dirichlet_at_infinite_alpha_is_an_even_split_of_every_class():
  parts = D.partition_dirichlet(LABELS, 5, float("inf"), seed=0)
  assert [len(p) for p in parts] == [60] * 5
  assert all((np.bincount(LABELS[p], minlength=10) == 6).all() for p in parts)
  with pytest.raises(ValueError, match="alpha must be > 0"):
    D.partition_dirichlet(LABELS, 4, float("nan"))
