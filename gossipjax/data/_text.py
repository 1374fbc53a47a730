"""Byte-level text corpora that need no download: the Python standard library's source, or a user's own text.

A corpus is cut into windows of ``context`` bytes, within each file and with stride ``context``; a window's
targets are the same bytes shifted by one (the next byte), so a `Dataset` of text has int32 (N, T) inputs and
targets over a vocabulary of 256 and trains with the same loop as the image sets.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from gossipjax.data._datasets import Dataset

# Folders of the standard library that are not its own modules' source, or are tests.
_STDLIB_SKIP = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_TEST_EVERY = 10  # a file is a test file when crc32(its relative path) % 10 == 0: about a tenth


class _Segment(NamedTuple):
  """Bytes ``[start, start + length)`` of one file, from one source."""

  path: Path
  start: int
  length: int
  source: int


def load_python_stdlib(*, context: int = 64, max_bytes: int | None = 4_000_000,
                       test_windows: int = 256) -> Dataset:
  """The ``.py`` source of the running Python's standard library, as next-byte windows.

  Every Python installation ships it (``sysconfig.get_paths()["stdlib"]``), so it is real text that needs no
  network: on CPython 3.11 about 600 files and 11 MB outside the ``site-packages``, ``test``/``tests``,
  ``idlelib``, ``lib2to3`` and ``__pycache__`` folders. A file's source is its top-level package (``email``,
  ``asyncio``, ``json``) or, for a top-level module, the module's name: data held in different places, for
  `partition_by_source`. An iid split instead is ``partition_iid(np.arange(len(ds.x_train)), num_nodes)``.

  Train and test are split by file, by a fixed rule: a file (its path relative to the standard library's
  folder, with ``/``) is a test file when ``zlib.crc32(path.encode()) % 10 == 0``.

  Args:
    context: the window length T in bytes; files shorter than T + 1 bytes hold no window.
    max_bytes: at most this many training bytes are read (``None``: all), shared fairly over the sources
      so that a cap keeps every source: each source takes the same quota of bytes (a source smaller than
      the quota, all of its bytes), the largest quota that keeps the total within ``max_bytes``; a source's
      files are taken in sorted order, the last one cut to fit.
    test_windows: how many test windows, evenly spaced over all the test files' windows (all of them
      when there are fewer).

  Returns:
    A `Dataset` of int32 (N, T) windows of bytes and their next bytes, ``num_classes=256``, and
    ``sources``: each training window's source, an index into ``text_sources()``.

  Raises:
    ValueError: ``context``, ``max_bytes`` or ``test_windows`` is not a positive integer.

  Example:
    >>> import numpy as np, gossipjax as gj
    >>> ds = gj.data.load_python_stdlib(context=32, max_bytes=100_000, test_windows=8)
    >>> ds.x_train.shape[1], ds.x_test.shape, ds.num_classes
    (32, (8, 32), 256)
    >>> bool((ds.x_train[:, 1:] == ds.y_train[:, :-1]).all())  # targets are the next bytes
    True
    >>> len(np.unique(ds.sources)) > 100  # the cap keeps every package and module
    True
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(_stdlib_files(root))
  return _load(root, files, _stdlib_source, by_position=False, context=context, max_bytes=max_bytes,
               test_windows=test_windows, name="gj.data.load_python_stdlib")


def load_text(path: str | os.PathLike, *, context: int = 64, max_bytes: int | None = None,
              test_windows: int = 256) -> Dataset:
  """A user's own text, a file or a folder, as next-byte windows.

  A folder: every file under it (recursively, in sorted order, hidden files and folders left out) is read as
  bytes; a file's source is the top-level entry of the folder it lies under, and train and test are split by
  file with `load_python_stdlib`'s rule (``zlib.crc32(relative_path.encode()) % 10 == 0`` is test). A folder
  too small for that rule to give both parts a window is split like a single file, each file's last 10% of
  bytes being test. A single file: its last 10% of bytes is the test part, and it is one source, which
  `partition_by_source` splits into contiguous blocks over the nodes.

  Args:
    path: a text file, or a folder of them.
    context: the window length T in bytes; files shorter than T + 1 bytes hold no window.
    max_bytes: at most this many training bytes are read (``None``: all), shared over the sources as
      `load_python_stdlib` shares them (the same quota for each).
    test_windows: how many test windows, evenly spaced over all the test windows (all of them when there
      are fewer).

  Returns:
    A `Dataset` of int32 (N, T) windows of bytes and their next bytes, ``num_classes=256``, and
    ``sources``: each training window's source, an index into ``text_sources(path)``.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: ``path`` holds no bytes, or too few for a training and a test window of T + 1 bytes; or
      ``context``, ``max_bytes`` or ``test_windows`` is not a positive integer.

  Example:
    >>> import os, tempfile, gossipjax as gj
    >>> path = os.path.join(tempfile.mkdtemp(), "poem.txt")
    >>> with open(path, "w") as f:
    ...   _ = f.write("the quick brown fox jumps over the lazy dog. " * 100)
    >>> ds = gj.data.load_text(path, context=16, test_windows=4)
    >>> ds.x_train.shape, ds.x_test.shape, gj.data.text_sources(path)
    ((253, 16), (4, 16), ['poem.txt'])
    >>> bytes(ds.x_train[0].astype("uint8")).decode()
    'the quick brown '
  """
  name = "gj.data.load_text"
  root = Path(path)
  if not root.exists():
    raise FileNotFoundError(f"{name}: {os.fspath(path)} does not exist")
  if root.is_file():
    return _load(root.parent, [root.name], lambda relative: relative, by_position=True, context=context,
                 max_bytes=max_bytes, test_windows=test_windows, name=name, shown=root)
  files = sorted(_folder_files(root))
  if not files:
    raise ValueError(f"{name}: {os.fspath(path)} holds no file")
  return _load(root, files, _top_level, by_position=False, context=context, max_bytes=max_bytes,
               test_windows=test_windows, name=name, shown=root)


def text_sources(path: str | os.PathLike | None = None) -> list[str]:
  """The names of a text corpus's sources, sorted: a `Dataset`'s ``sources`` ids index this list.

  Args:
    path: what `load_text` was given; ``None`` for `load_python_stdlib`'s corpus.

  Returns:
    The sorted source names: top-level packages and modules of the standard library, the top-level entries
    of a folder, or a single file's name.

  Raises:
    FileNotFoundError: ``path`` does not exist.

  Example:
    >>> import gossipjax as gj
    >>> {"asyncio", "email", "json"} <= set(gj.data.text_sources())
    True
  """
  if path is None:
    return sorted({_stdlib_source(f) for f in _stdlib_files(Path(sysconfig.get_paths()["stdlib"]))})
  root = Path(path)
  if not root.exists():
    raise FileNotFoundError(f"gj.data.text_sources: {os.fspath(path)} does not exist")
  if root.is_file():
    return [root.name]
  return sorted({_top_level(f) for f in _folder_files(root)})


def _stdlib_files(root: Path) -> list[str]:
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
    base = Path(folder).relative_to(root)
    files += [(base / n).as_posix() for n in names if n.endswith(".py")]
  return files


def _folder_files(root: Path) -> list[str]:
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    base = Path(folder).relative_to(root)
    files += [(base / n).as_posix() for n in names if not n.startswith(".") and (Path(folder) / n).is_file()]
  return files


def _stdlib_source(relative: str) -> str:
  return relative.split("/", 1)[0].removesuffix(".py")  # a package's folder, or a top-level module's name


def _top_level(relative: str) -> str:
  return relative.split("/", 1)[0]


def _is_test_file(relative: str) -> bool:
  return zlib.crc32(relative.encode()) % _TEST_EVERY == 0


def _load(root: Path, files: list[str], source_of: Callable[[str], str], *, by_position: bool, context: int, max_bytes: int | None,
          test_windows: int, name: str, shown: Path | None = None) -> Dataset:
  _positive(name, context=context, test_windows=test_windows)
  if max_bytes is not None:
    _positive(name, max_bytes=max_bytes)
  shown = root if shown is None else shown
  names = sorted({source_of(f) for f in files})
  ids = {s: i for i, s in enumerate(names)}
  sizes = [(root / f).stat().st_size for f in files]
  if sum(sizes) == 0:
    raise ValueError(f"{name}: {shown} holds no bytes")
  whole = [_Segment(root / f, 0, size, ids[source_of(f)]) for f, size in zip(files, sizes)]
  train = [s for s, f in zip(whole, files) if not _is_test_file(f)]
  test = [s for s, f in zip(whole, files) if _is_test_file(f)]
  if by_position or not _windows_in(train, context) or not _windows_in(test, context):
    train, test = [], []
    for s in whole:  # the last tenth of each file's bytes is test
      cut = s.length - s.length // _TEST_EVERY
      train.append(s._replace(length=cut))
      test.append(s._replace(start=cut, length=s.length - cut))
  for part, segments in (("training", train), ("test", test)):
    if not _windows_in(segments, context):
      raise ValueError(f"{name}: {shown} has too few bytes for one {part} window of context + 1 = {context + 1} "
                       f"bytes ({sum(sizes)} bytes in all); give more text or a smaller context")
  x_train, y_train, sources = _train_windows(_capped(train, context, max_bytes), context)
  x_test, y_test = _test_windows(test, context, test_windows)
  return Dataset(x_train, y_train, x_test, y_test, 256, sources)


def _positive(name: str, **values) -> None:
  for key, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")


def _count(length: int, context: int) -> int:
  """Windows of ``context`` bytes (and the byte after each) in ``length`` bytes, stride ``context``."""
  return max(length - 1, 0) // context


def _windows_in(segments: list[_Segment], context: int) -> int:
  return sum(_count(s.length, context) for s in segments)


def _capped(segments: list[_Segment], context: int, max_bytes: int | None) -> list[_Segment]:
  """The segments that hold a window, at most ``max_bytes`` bytes of them shared fairly over the sources.

  Water-filling: each source may take the same quota, sources smaller than it are taken whole, and the
  quota is the largest that keeps the total within ``max_bytes``. A source's segments are taken in path
  order, the last one cut to fit.
  """
  segments = [s for s in segments if _count(s.length, context)]
  if max_bytes is None:
    return segments
  totals: dict[int, int] = {}
  for s in segments:
    totals[s.source] = totals.get(s.source, 0) + s.length
  quota, left = 0, max_bytes
  for j, size in enumerate(sorted(totals.values())):
    quota = left // (len(totals) - j)
    if size > quota:
      break
    left -= size
  else:
    return segments
  taken, kept = dict.fromkeys(totals, 0), []
  for s in segments:
    length = min(s.length, quota - taken[s.source])
    if length > 0:
      kept.append(s._replace(length=length))
      taken[s.source] += length
  return kept


def _read(segment: _Segment) -> np.ndarray:
  with open(segment.path, "rb") as f:
    f.seek(segment.start)
    return np.frombuffer(f.read(segment.length), np.uint8)


def _train_windows(segments: list[_Segment], context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  xs, ys, sources = [], [], []
  for s in segments:
    data = _read(s)
    k = _count(len(data), context)
    xs.append(data[: k * context].reshape(k, context))
    ys.append(data[1: k * context + 1].reshape(k, context))
    sources.append(np.full(k, s.source, np.int32))
  return (np.concatenate(xs).astype(np.int32), np.concatenate(ys).astype(np.int32),
          np.concatenate(sources))


def _test_windows(segments: list[_Segment], context: int, count: int) -> tuple[np.ndarray, np.ndarray]:
  """``count`` windows evenly spaced over all the segments' windows, read one by one."""
  counts = np.array([_count(s.length, context) for s in segments])
  total = int(counts.sum())
  chosen = np.arange(min(count, total)) * total // min(count, total)
  owner = np.searchsorted(np.cumsum(counts), chosen, side="right")
  first = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rows = []
  for window, i in zip(chosen, owner):
    s = segments[i]
    offset = s.start + (int(window) - int(first[i])) * context
    rows.append(_read(_Segment(s.path, offset, context + 1, s.source)))
  data = np.stack(rows).astype(np.int32)
  return data[:, :-1], data[:, 1:]
