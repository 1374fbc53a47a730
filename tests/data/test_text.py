"""Byte-level text corpora (the standard library's source, a user's own files) and the by-source partition."""

import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gossipjax as gj
from gossipjax.data import _text

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def stdlib():
  return gj.data.load_python_stdlib(context=32, max_bytes=300_000, test_windows=64)


def _sources(ds: gj.data.Dataset) -> np.ndarray:
  assert ds.sources is not None
  return ds.sources


def _windows_of(path: Path, context: int) -> list[bytes]:
  data = path.read_bytes()
  return [data[i: i + context] for i in range(0, (len(data) - 1) // context * context, context)]


def test_the_stdlib_is_split_by_file_on_crc32_of_the_relative_path():
  files = sorted(_text._stdlib_files(STDLIB))
  assert len(files) > 300 and all(f.endswith(".py") for f in files)
  parts = set()
  for f in files:
    parts |= set(f.split("/")[:-1])
  assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
  test = {f for f in files if _text._is_test_file(f)}
  assert test == {f for f in files if zlib.crc32(f.encode()) % 10 == 0}
  assert 0.05 < len(test) / len(files) < 0.15
  # The windows of the test part come from test files only, and the training windows from the others.
  ds = gj.data.load_python_stdlib(context=32, max_bytes=None, test_windows=32)
  test_windows, train_windows = set(), set()
  for f in files:
    (test_windows if f in test else train_windows).update(_windows_of(STDLIB / f, 32))
  got_test = {bytes(w.astype(np.uint8)) for w in ds.x_test}
  got_train = {bytes(w.astype(np.uint8)) for w in ds.x_train[::97]}
  assert got_test <= test_windows and got_train <= train_windows


def test_windows_are_int32_with_next_byte_targets(stdlib):
  for x, y in ((stdlib.x_train, stdlib.y_train), (stdlib.x_test, stdlib.y_test)):
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape and x.shape[1] == 32
    assert x.min() >= 0 and x.max() < 256
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  assert stdlib.x_test.shape == (64, 32) and stdlib.num_classes == 256
  names = gj.data.text_sources()
  assert _sources(stdlib).dtype == np.int32 and _sources(stdlib).shape == (len(stdlib.x_train),)
  assert _sources(stdlib).min() >= 0 and _sources(stdlib).max() < len(names)
  assert names == sorted(names) and {"asyncio", "email", "json", "os"} <= set(names)
  # A window of the json package lies in a file of the json package.
  json_rows = stdlib.x_train[_sources(stdlib) == names.index("json")]
  json_windows = {w for p in (STDLIB / "json").glob("*.py") for w in _windows_of(p, 32)}
  assert len(json_rows) and all(bytes(w.astype(np.uint8)) in json_windows for w in json_rows)


def test_max_bytes_is_respected_and_keeps_every_source(stdlib):
  # Bytes read: the windows, and the last target of each file's; a few bytes short of a window per file are left.
  assert 0.8 * 300_000 < stdlib.x_train.size < 300_000
  full = gj.data.load_python_stdlib(context=32, max_bytes=None, test_windows=64)
  assert len(np.unique(_sources(stdlib))) == len(np.unique(_sources(full))) > 100
  assert len(full.x_train) > 2 * len(stdlib.x_train)
  np.testing.assert_array_equal(full.x_test, stdlib.x_test)  # the cap is on the training part only
  # Deterministic: the same call gives the same windows.
  again = gj.data.load_python_stdlib(context=32, max_bytes=300_000, test_windows=64)
  np.testing.assert_array_equal(again.x_train, stdlib.x_train)


def test_by_source_partition_keeps_sources_whole_balances_and_covers(stdlib):
  sources = _sources(stdlib)
  for num_nodes in (3, 8, 40):
    parts = gj.data.partition_by_source(sources, num_nodes, seed=1)
    assert len(parts) == num_nodes and all(len(p) for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(sources)))
    held = [set(np.unique(sources[p]).tolist()) for p in parts]
    for i in range(num_nodes):
      for j in range(i):
        assert not held[i] & held[j]
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= np.bincount(sources).max()


def test_by_source_partition_with_fewer_sources_than_nodes_cuts_contiguous_pieces():
  sources = np.repeat([4, 1, 7], [50, 20, 5])
  parts = gj.data.partition_by_source(sources, 6)
  assert sorted(np.unique(sources[p]).tolist() for p in parts) == [[1], [1], [4], [4], [4], [7]]
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(sources)))
  for p in parts:
    assert len(np.unique(sources[p])) == 1 and np.all(np.diff(p) == 1)  # one run of one source
  assert sorted(len(p) for p in parts) == [5, 10, 10, 16, 17, 17]
  assert [len(p) for p in gj.data.partition_by_source(np.zeros(7, int), 7)] == [1] * 7


def test_by_source_partition_refuses_bad_arguments():
  with pytest.raises(ValueError, match="num_nodes must be a positive integer, got 0"):
    gj.data.partition_by_source(np.zeros(4, int), 0)
  with pytest.raises(ValueError, match="cannot give each of 5 nodes a sample: only 4"):
    gj.data.partition_by_source(np.zeros(4, int), 5)
  with pytest.raises(ValueError, match="must be 1-D"):
    gj.data.partition_by_source(np.zeros((2, 2), int), 2)


def test_iid_over_text_windows_is_partition_iid_of_their_indices(stdlib):
  parts = gj.data.partition_iid(np.arange(len(stdlib.x_train)), 4)
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(stdlib.x_train)))
  data = gj.data.node_data(stdlib.x_train, stdlib.y_train, gj.data.partition_by_source(_sources(stdlib), 4))
  assert data.inputs.shape == stdlib.x_train.shape and data.num_nodes == 4


def _write(path: Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(text.encode())


def test_a_users_folder(tmp_path):
  # Enough files that the crc32 rule puts some in each part.
  for i in range(30):
    _write(tmp_path / ("alpha" if i % 3 else "beta") / f"doc{i}.txt", f"document {i:02d} says hello. " * 20)
  _write(tmp_path / "intro.txt", "a file at the top level. " * 20)
  _write(tmp_path / ".hidden" / "skip.txt", "not read " * 50)
  _write(tmp_path / "tiny.txt", "short")  # shorter than a window: holds none
  ds = gj.data.load_text(tmp_path, context=16, test_windows=1000)
  names = gj.data.text_sources(tmp_path)
  assert names == ["alpha", "beta", "intro.txt", "tiny.txt"]
  assert {names[s] for s in np.unique(_sources(ds))} == {"alpha", "beta", "intro.txt"}
  np.testing.assert_array_equal(ds.x_train[:, 1:], ds.y_train[:, :-1])
  files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.txt") if ".hidden" not in p.parts)
  test = [f for f in files if zlib.crc32(f.encode()) % 10 == 0]
  assert test and len(test) < len(files)
  want_test = sorted(w for f in test for w in _windows_of(tmp_path / f, 16))
  assert sorted(bytes(w.astype(np.uint8)) for w in ds.x_test) == want_test  # all test windows, as asked
  assert b"not read" not in b"".join(bytes(w.astype(np.uint8)) for w in ds.x_train)


def test_a_small_folder_is_split_by_position(tmp_path):
  _write(tmp_path / "a.txt", "x" * 200)  # crc32("a.txt") % 10 != 0: the rule alone would leave no test file
  assert zlib.crc32(b"a.txt") % 10 != 0
  ds = gj.data.load_text(tmp_path, context=8)
  assert len(ds.x_train) == (180 - 1) // 8 and len(ds.x_test) == (20 - 1) // 8


def test_a_single_file_tests_on_its_last_tenth(tmp_path):
  text = "".join(f"line {i:04d}\n" for i in range(400)).encode()  # 4,400 bytes
  path = tmp_path / "corpus.txt"
  path.write_bytes(text)
  ds = gj.data.load_text(path, context=10, test_windows=5)
  cut = len(text) - len(text) // 10
  assert len(ds.x_train) == (cut - 1) // 10 and ds.x_test.shape == (5, 10)
  assert bytes(ds.x_train.ravel().astype(np.uint8)) == text[: len(ds.x_train) * 10]
  all_test = [text[cut + 10 * i: cut + 10 * i + 10] for i in range((len(text) - cut - 1) // 10)]
  got = [bytes(w.astype(np.uint8)) for w in ds.x_test]
  assert got == [all_test[i] for i in np.arange(5) * len(all_test) // 5]  # evenly spaced, in order
  assert gj.data.text_sources(path) == ["corpus.txt"] and set(_sources(ds).tolist()) == {0}
  capped = gj.data.load_text(path, context=10, max_bytes=101)
  np.testing.assert_array_equal(capped.x_train, ds.x_train[:10])


def test_bad_paths_and_arguments_are_refused(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
    gj.data.load_text(missing)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    gj.data.text_sources(missing)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match=f"{empty} holds no file"):
    gj.data.load_text(empty)
  (empty / "blank.txt").write_bytes(b"")
  with pytest.raises(ValueError, match=f"{empty} holds no bytes"):
    gj.data.load_text(empty)
  (empty / "blank.txt").write_bytes(b"abc" * 5)
  with pytest.raises(ValueError, match="too few bytes for one training window of context \\+ 1 = 65 bytes"):
    gj.data.load_text(empty)
  bad: dict[str, Any] = {"context": 0, "max_bytes": -1, "test_windows": 1.5}
  for key, value in bad.items():
    with pytest.raises(ValueError, match=f"{key} must be a positive integer"):
      gj.data.load_text(empty / "blank.txt", **{key: value})
