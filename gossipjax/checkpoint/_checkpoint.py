"""``save`` / ``restore``: orbax writes the arrays; a checksummed manifest seals each step.

Layout of a checkpoint directory::

    directory/
      100/                       # one directory per saved step
        state/                   # written by orbax (StandardCheckpointHandler)
        gossipjax_manifest.json  # leaf paths, shapes, dtypes, PRNG impls, SHA-256 of every file
      200/
      .tmp-300-<id>/             # a save in progress (or one that was killed): never read
      .old-200-<id>/             # the version of step 200 that a save is replacing
      .del-<id>/                 # being removed
      .lock                      # saves hold it shared; the one that gets it alone clears debris
      .mpi_rank                  # under MPI: the rank whose checkpoints these are

Why a manifest of our own: orbax's temporary-directory-and-rename makes a save atomic, but
nothing in the stored arrays is checksummed, so a flipped byte in a chunk comes back as
silently wrong numbers. The manifest is written last, inside the temporary directory, and
the directory is renamed into place only after it is on disk. That rename is the commit,
as orbax's own finalize is: a reader never sees a partial step.

Replacing a step cannot be one rename (POSIX renames a directory only onto a missing or empty
one), so the old version is first renamed aside to ``.old-<step>-<id>`` and stands for the
step until the new one is in place: a kill at any point leaves the old or the new version.
Anything a save removes is first renamed to ``.del-<id>``, so a kill mid-removal never leaves
a step with part of its files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import pathlib
import shutil
import uuid
from typing import Any, Iterable, Iterator

try:
  import fcntl
except ImportError:  # Windows
  fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

from gossipjax._extras import require_train_extra
from gossipjax.checkpoint._ranks import _OWNER, _claim, _mpi_rank, _rank_refusal

_MANIFEST = "gossipjax_manifest.json"
_STATE = "state"
_FORMAT = 1
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_DEL_PREFIX = ".del-"
_LOCK = ".lock"


class CorruptCheckpointError(RuntimeError):
  """A checkpoint on disk is truncated, modified or unreadable.

  `restore` raises it when a step's manifest is missing, does not match its own checksum, or
  a file does not match the size or SHA-256 the manifest recorded, instead of returning
  silently wrong numbers. The other saved steps stay usable.

  Example:
    >>> import tempfile, jax.numpy as jnp, gossipjax as gj
    >>> d = tempfile.mkdtemp()
    >>> step_dir = gj.checkpoint.save(d, {"w": jnp.arange(4.0)}, step=1)
    >>> manifest = step_dir / "gossipjax_manifest.json"
    >>> _ = manifest.write_text(manifest.read_text()[:-10])  # a truncated write
    >>> try:
    ...   gj.checkpoint.restore(d, like={"w": jnp.zeros(4)})
    ... except gj.checkpoint.CorruptCheckpointError as e:
    ...   print("corrupt:", "unreadable" in str(e))
    corrupt: True
  """


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_spec(path: str, x: Any) -> dict[str, Any]:
  """Shape, dtype and (for typed PRNG keys) the key implementation of one leaf."""
  if _is_key(x):
    impl = None if isinstance(x, jax.ShapeDtypeStruct) else str(jax.random.key_impl(x))
    return {"path": path, "shape": list(x.shape), "dtype": "key", "key_impl": impl}
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return {"path": path, "shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
  if isinstance(x, (bool, int, float, complex)):
    a = np.asarray(x)
    return {"path": path, "shape": [], "dtype": a.dtype.name}
  raise TypeError(
      f"gj.checkpoint.save: the leaf at {path or '<root>'} is a {type(x).__name__}; only arrays, numbers and "
      "PRNG keys can be checkpointed (keep configuration such as strings out of the state tree)"
  )


def _flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(p), x) for p, x in leaves], treedef


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _files(root: pathlib.Path) -> Iterable[pathlib.Path]:
  for dirpath, _, filenames in os.walk(root):
    for name in filenames:
      p = pathlib.Path(dirpath) / name
      if p.name != _MANIFEST or p.parent != root:
        yield p


def _body_digest(body: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _check_step(step: Any) -> int:
  if isinstance(step, (jax.Array, np.ndarray)) and step.ndim == 0 and jnp.issubdtype(step.dtype, jnp.integer):
    step = int(step)  # a step counter taken from the state
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"gj.checkpoint: step must be a non-negative integer, got {step!r}")
  return int(step)


def _flock(fd: int, operation: int) -> bool | None:
  """``flock``: True once taken, False if another process holds it, None where the file system has no flock."""
  if fcntl is None:
    return None
  try:
    fcntl.flock(fd, operation)
  except BlockingIOError:
    return False
  except OSError:
    return None
  return True


@contextlib.contextmanager
def _saving(directory: pathlib.Path) -> Iterator[None]:
  """Holds ``directory/.lock`` shared for one save; the save that gets it alone first clears debris.

  Only a save that runs alone may remove what other saves left (their ``.tmp-`` directories
  may still be written). flock is released when its process dies, kill -9 included, so the
  debris of killed saves goes at the next save that finds none running. Without flock
  (Windows, a file system mounted without it) debris stays rather than risk a live save.
  """
  if fcntl is None:
    yield
    return
  fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    alone = _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if alone:
      _clear_debris(directory)
    if alone is not None:
      _flock(fd, fcntl.LOCK_SH)
    yield
  finally:
    os.close(fd)


def _remove(path: pathlib.Path, successor: pathlib.Path | None = None) -> None:
  """Removes what saves wrote at ``path``, out of the readers' view first; gone already is fine.

  A step that holds only what its save wrote is renamed to ``.del-<id>``, then deleted. One
  that holds files of someone else's is emptied of its own files where it is, its manifest
  last (a kill midway leaves a step that fails its checksums, never a file of theirs gone);
  when the step has a new version, ``successor``, their files move back into it.
  """
  others = _others_files(path) if path.is_dir() and not path.is_symlink() else []
  if others:
    _delete(path)
    for rel in others:
      if successor is None:
        break
      target = successor / rel
      if not os.path.lexists(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
          os.rename(path / rel, target)
    for dirpath, _, _ in sorted(os.walk(path), key=lambda w: len(w[0]), reverse=True):
      with contextlib.suppress(OSError):
        os.rmdir(dirpath)  # only where it is empty
    return
  trash = path.parent / f"{_DEL_PREFIX}{uuid.uuid4().hex}"
  try:
    os.rename(path, trash)
  except FileNotFoundError:
    return
  _delete(trash)


def _written(step_dir: pathlib.Path) -> set[str]:
  """The files a save wrote in ``step_dir``, relative to it: its manifest and what the manifest lists.

  A step whose manifest exists but does not read (a torn write, damage) is taken to hold what
  every save writes: the manifest and orbax's ``state/`` folder. A folder without a manifest
  holds nothing of a save's.
  """
  try:
    return {*_read_manifest(step_dir)["files"], _MANIFEST}
  except (CorruptCheckpointError, OSError):
    if not (step_dir / _MANIFEST).is_file():
      return set()
    return {_MANIFEST} | {f"{_STATE}/{rel}" for rel in _entries(step_dir / _STATE)}


def _own_whole(path: pathlib.Path) -> bool:
  """Whether everything under ``path`` is the checkpoints' own: a save's temporary or deleted directory."""
  return path.name.startswith((_TMP_PREFIX, _DEL_PREFIX))


def _others_files(step_dir: pathlib.Path) -> list[str]:
  """What ``step_dir`` holds (files and links, relative paths) that its save did not write."""
  if _own_whole(step_dir):
    return []
  written = _written(step_dir)
  return sorted(rel for rel in _entries(step_dir) if rel not in written)


def _entries(root: pathlib.Path) -> list[str]:
  """Every file and link under ``root`` (links not followed), as ``/``-separated paths relative to it."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    here = pathlib.Path(dirpath)
    for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
      found.append((here / name).relative_to(root).as_posix())
  return found


def _delete(path: pathlib.Path) -> None:
  """Deletes what saves wrote at ``path``: the whole of a temporary or deleted directory; of a step, the files
  its manifest lists, the manifest last, and the folders left empty. Anyone else's files stay, with their folders."""
  if not path.is_dir() or path.is_symlink():
    path.unlink(missing_ok=True)
    return
  others = _others_files(path)
  if not others:
    shutil.rmtree(path, ignore_errors=True)
    return
  written = _written(path)
  for rel in sorted(written - {_MANIFEST}) + [_MANIFEST]:
    with contextlib.suppress(OSError):
      (path / rel).unlink()
  for dirpath, _, _ in sorted(os.walk(path), key=lambda w: len(w[0]), reverse=True):
    with contextlib.suppress(OSError):
      os.rmdir(dirpath)  # only where it is empty


def _is_own_entry(name: str) -> bool:
  """Whether a name directly in a checkpoint directory is one that saves write (a step, a save's debris, the lock)."""
  return name.isdigit() or name.startswith((_TMP_PREFIX, _DEL_PREFIX, _OLD_PREFIX)) or name in (_LOCK, _OWNER)


def foreign_files(directory: str | os.PathLike) -> list[str]:
  """What a checkpoint directory holds that no `save` wrote: files and links, as paths relative to it.

  A save writes its steps (the files each step's manifest lists, and the manifest), the
  temporary and old versions of steps being written or replaced, and the directory's lock
  and owner files. Anything else (an evaluation of one's own next to the steps, a file put
  inside a step) is listed here, and `save`, its rotation of old steps and `remove` leave it
  where it is.

  Args:
    directory: a checkpoint directory (a missing one holds nothing).

  Returns:
    The sorted relative paths, ``/``-separated.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, gossipjax as gj
    >>> d = tempfile.mkdtemp()
    >>> _ = gj.checkpoint.save(d, {"w": jnp.ones(2)}, step=1)
    >>> open(os.path.join(d, "1", "notes.txt"), "w").close()
    >>> gj.checkpoint.foreign_files(d)
    ['1/notes.txt']
  """
  root = pathlib.Path(directory)
  if not root.is_dir():
    return []
  found = []
  for p in sorted(root.iterdir()):
    whole_dir = p.is_dir() and not p.is_symlink()
    if whole_dir and _is_own_entry(p.name) and p.name not in (_LOCK, _OWNER):
      found += [f"{p.name}/{rel}" for rel in _others_files(p)]
    elif not whole_dir and p.name in (_LOCK, _OWNER):
      continue
    else:  # a name saves never write, or a file or link where they write a directory
      found += [f"{p.name}/{rel}" for rel in _entries(p)] if whole_dir and _entries(p) else [p.name]
  return found


def remove(directory: str | os.PathLike) -> None:
  """Deletes every step and file that saves wrote in ``directory``, and the directory where that leaves it empty.

  Files of anyone else's (`foreign_files`) stay, with the folders that hold them.

  Args:
    directory: a checkpoint directory; a missing one is fine.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, gossipjax as gj
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = gj.checkpoint.save(d, {"w": jnp.ones(2)}, step=1)
    >>> gj.checkpoint.remove(d)
    >>> os.path.exists(d)
    False
  """
  root = pathlib.Path(directory)
  if not root.is_dir():
    return
  for p in sorted(root.iterdir()):
    whole_dir = p.is_dir() and not p.is_symlink()
    if whole_dir and _is_own_entry(p.name) and p.name not in (_LOCK, _OWNER):
      _remove(p)
    elif not whole_dir and p.name in (_LOCK, _OWNER):
      p.unlink()
  with contextlib.suppress(OSError):
    root.rmdir()  # only where it is empty


def _clear_debris(directory: pathlib.Path) -> None:
  """Removes what killed saves left; an old version that still stands for its step goes back in place."""
  standing = set(_sealed_steps(directory).values())
  for p in directory.iterdir():
    if p.name.startswith((_TMP_PREFIX, _DEL_PREFIX)):
      _delete(p)
    elif p.name.startswith(_OLD_PREFIX):
      if p in standing:
        with contextlib.suppress(OSError):  # something else holds the step's name: the old version still stands
          os.rename(p, directory / str(_old_step(p.name)))
      else:
        _delete(p)


def _put_in_place(tmp: pathlib.Path, final: pathlib.Path) -> list[pathlib.Path]:
  """Renames the sealed ``tmp`` to ``final``; returns the versions of the step it moved aside to do so."""
  aside = []
  while True:
    try:
      os.rename(tmp, final)
      return aside
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
    # A version of the step is there (a concurrent save of the same step may have put it there
    # since the last try): until the rename above, it stands for the step under its .old- name.
    old = final.parent / f"{_OLD_PREFIX}{final.name}-{uuid.uuid4().hex}"
    with contextlib.suppress(FileNotFoundError):
      os.rename(final, old)
      aside.append(old)


def save(directory: str | os.PathLike, tree: Any, step: int, *, keep: int | None = None) -> pathlib.Path:
  """Saves ``tree`` as step ``step`` of the checkpoint directory ``directory``.

  The step is written to a temporary directory, sealed with a manifest (leaf paths, shapes,
  dtypes and the SHA-256 of every file) and renamed into place, so a crash mid-save leaves
  the steps saved before intact. Saving a step that exists replaces it; a kill mid-save
  leaves the old or the new version. Several processes may save into one directory at once.

  A write that fails (a full disk, a lost mount) removes its own temporary files and
  raises ``OSError``; the steps saved before stay as they were.

  Args:
    directory: the checkpoint directory (created if missing). Under MPI, give each rank its
      own, ``gj.checkpoint.rank_directory(path, comm.rank)``: a save into a directory that
      another rank saves into raises ValueError.
    tree: any pytree of arrays (jax or NumPy), Python numbers and typed PRNG keys
      (``jax.random.key``): params, optimizer states, step counters, data positions.
    step: the training step this state belongs to (the sub-directory name).
    keep: keep only the newest ``keep`` steps (``None``: keep all).

  Returns:
    The directory of the saved step.

  Raises:
    ValueError: ``step`` would not be among the newest ``keep`` steps (it would be
      deleted at once), or, under MPI, another rank saves into ``directory``.
    OSError: the step could not be written.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = gj.checkpoint.save(d, {"w": jnp.ones((4, 2))}, step=10)
    >>> gj.checkpoint.restore(d, like={"w": jnp.zeros((4, 2))})["w"].sum().item()
    8.0
  """
  require_train_extra("gj.checkpoint.save", "orbax")
  import orbax.checkpoint as ocp

  step = _check_step(step)
  if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
    raise ValueError(f"gj.checkpoint.save: keep must be a positive integer or None, got {keep!r}")
  directory = pathlib.Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)

  leaves, treedef = _flatten(tree)
  specs = [_leaf_spec(p, x) for p, x in leaves]
  arrays = {}
  for i, (_, x) in enumerate(leaves):
    if _is_key(x):
      x = jax.random.key_data(x)
    elif not isinstance(x, jax.Array):
      x = np.asarray(x)
    if x.size:  # orbax refuses empty arrays; the manifest's shape and dtype are all they hold
      arrays[str(i)] = x

  mpi = _mpi_rank()
  with _saving(directory):
    _claim(directory, mpi)
    if keep is not None:
      newest = sorted(set(all_steps(directory)) | {step})[-keep:]
      if step not in newest:
        raise ValueError(f"gj.checkpoint.save: step {step} is older than the newest {keep} step(s) in {directory} "
                         f"({', '.join(map(str, newest))}); with keep={keep} it would be deleted at once. Save into "
                         "a directory of its own, or restore from there and continue with newer steps")
    tmp = directory / f"{_TMP_PREFIX}{step}-{uuid.uuid4().hex}"
    try:
      tmp.mkdir()
      _write_step(tmp, arrays, step, treedef, specs, mpi, ocp)
    except Exception as e:  # a kill (KeyboardInterrupt, SIGKILL) leaves the debris to the next save instead
      _delete(tmp)
      if isinstance(e, OSError):
        raise
      # tensorstore reports a full disk as a ValueError (OUT_OF_RANGE): name it a write failure.
      raise OSError(f"gj.checkpoint.save: writing step {step} to {directory} failed ({type(e).__name__}: {e}); "
                    "the steps saved before are intact") from e

    final = directory / str(step)
    aside = _put_in_place(tmp, final)
    _fsync_dir(directory)
    for old in aside:
      _remove(old, successor=final)
    if keep is not None:
      for s in all_steps(directory)[:-keep]:
        for version in (directory / str(s), *directory.glob(f"{_OLD_PREFIX}{s}-*")):
          _remove(version)
  return final


def _write_step(tmp: pathlib.Path, arrays: dict[str, Any], step: int, treedef: Any, specs: list[dict[str, Any]],
                mpi: tuple[int, int] | None, ocp: Any) -> None:
  """Writes the arrays, then the manifest that seals them, into the temporary directory ``tmp``."""
  if arrays:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      ckptr.save(tmp / _STATE, args=ocp.args.StandardSave(arrays))
  files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(_files(tmp))}
  body = {"format": _FORMAT, "step": step, "treedef": str(treedef), "leaves": specs, "files": files}
  if mpi is not None:
    body["mpi_rank"] = mpi[0]
  with open(tmp / _MANIFEST, "w") as f:
    json.dump({"body": body, "sha256": _body_digest(body)}, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  _fsync_dir(tmp)


def _old_step(name: str) -> int | None:
  """The step of an old version's directory name, ``.old-<step>-<id>``."""
  head = name[len(_OLD_PREFIX):].split("-")[0] if name.startswith(_OLD_PREFIX) else ""
  return int(head) if head.isdigit() else None


def _sealed_steps(directory: pathlib.Path) -> dict[int, pathlib.Path]:
  """Each saved step and the directory that holds it: ``<step>/``, else an old version being replaced."""
  found: dict[int, pathlib.Path] = {}
  if not directory.is_dir():
    return found
  olds = []
  for p in directory.iterdir():
    if p.name.isdigit():
      if (p / _MANIFEST).is_file():
        found[int(p.name)] = p
    elif _old_step(p.name) is not None:
      olds.append(p)
  for p in sorted(olds):
    step = _old_step(p.name)
    if step is not None and step not in found and (p / _MANIFEST).is_file():
      found[step] = p
  return found


def all_steps(directory: str | os.PathLike) -> list[int]:
  """The steps saved (sealed by their manifest) in ``directory``, in increasing order.

  A save in progress or killed before its manifest was written is not listed.

  Args:
    directory: the checkpoint directory given to `save`.

  Returns:
    The saved steps as a sorted list of ints; empty when there is none (or no directory).

  Example:
    >>> import tempfile, jax.numpy as jnp, gossipjax as gj
    >>> d = tempfile.mkdtemp()
    >>> for step in (30, 10, 20):
    ...   _ = gj.checkpoint.save(d, {"w": jnp.zeros(2)}, step=step)
    >>> gj.checkpoint.all_steps(d)
    [10, 20, 30]
  """
  return sorted(_sealed_steps(pathlib.Path(directory)))


def latest_step(directory: str | os.PathLike, comm: Any = None, *, before: int | None = None) -> int | None:
  """The newest saved step in ``directory``, or ``None`` when there is none.

  Args:
    directory: the checkpoint directory.
    comm: an mpi4py communicator. Each rank passes its own directory and gets the newest
      step that *every* rank has saved (a crash can leave one rank a step ahead), the same
      on all ranks.
    before: only steps below this one count: the next candidate when the newest step
      turned out to be corrupt (`restore` raised `CorruptCheckpointError`).

  Returns:
    The step as an int, or ``None`` when ``directory`` holds no saved step (with ``comm``:
    when no step is saved on every rank).

  Example:
    >>> import tempfile, jax.numpy as jnp, gossipjax as gj
    >>> d = tempfile.mkdtemp()
    >>> print(gj.checkpoint.latest_step(d))
    None
    >>> for step in (10, 20):
    ...   _ = gj.checkpoint.save(d, {"w": jnp.zeros(2)}, step=step)
    >>> gj.checkpoint.latest_step(d)
    20
    >>> gj.checkpoint.latest_step(d, before=20)
    10
  """
  steps = all_steps(directory)
  if before is not None:
    steps = [s for s in steps if s < before]
  if comm is None:
    return steps[-1] if steps else None
  common = set.intersection(*(set(s) for s in comm.allgather(steps)))
  return max(common) if common else None


def _read_manifest(step_dir: pathlib.Path) -> dict[str, Any]:
  path = step_dir / _MANIFEST
  if not path.is_file():
    raise CorruptCheckpointError(f"{step_dir} has no {_MANIFEST}: it is not a complete gossipjax checkpoint")
  try:
    with open(path) as f:
      data = json.load(f)
    body, digest = data["body"], data["sha256"]
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"the manifest {path} is unreadable (truncated or modified): {e}") from e
  if _body_digest(body) != digest:
    raise CorruptCheckpointError(f"the manifest {path} does not match its own checksum: it was modified")
  if body.get("format") != _FORMAT:
    raise CorruptCheckpointError(f"{path}: unknown checkpoint format {body.get('format')!r}")
  return body


def _verify_files(step_dir: pathlib.Path, files: dict[str, Any]) -> None:
  for rel, expect in files.items():
    p = step_dir / rel
    if not p.is_file():
      raise CorruptCheckpointError(f"checkpoint {step_dir} is incomplete: {rel} is missing")
    size = p.stat().st_size
    if size != expect["size"]:
      raise CorruptCheckpointError(
          f"checkpoint {step_dir} is corrupted: {rel} has {size} bytes, {expect['size']} were written (truncated?)")
    if _sha256(p) != expect["sha256"]:
      raise CorruptCheckpointError(f"checkpoint {step_dir} is corrupted: the SHA-256 of {rel} does not match")


def _check_like(step_dir: pathlib.Path, body: dict[str, Any], leaves: list[tuple[str, Any]], treedef: Any) -> None:
  stored = body["leaves"]
  stored_paths = [s["path"] for s in stored]
  like_paths = [p for p, _ in leaves]
  if stored_paths != like_paths:
    missing = [p for p in stored_paths if p not in like_paths]
    extra = [p for p in like_paths if p not in stored_paths]
    detail = []
    if missing:
      detail.append(f"in the checkpoint but not in like: {', '.join(missing[:5])}")
    if extra:
      detail.append(f"in like but not in the checkpoint: {', '.join(extra[:5])}")
    if not detail:
      detail.append("the same leaves in a different order")
    raise ValueError(f"checkpoint {step_dir} holds a different tree than like ({'; '.join(detail)})")
  if body["treedef"] != str(treedef):
    raise ValueError(f"checkpoint {step_dir} holds a tree of different node types than like:\n"
                     f"  saved: {body['treedef']}\n  like:  {treedef}")
  for s, (p, x) in zip(stored, leaves):
    want = _leaf_spec(p, x)
    if want.get("key_impl") and s.get("key_impl") != want["key_impl"]:
      raise ValueError(f"checkpoint {step_dir}: leaf {p} is a {s.get('key_impl')} PRNG key but like has a "
                       f"{want['key_impl']} key")
    if s["shape"] != want["shape"] or s["dtype"] != want["dtype"]:
      raise ValueError(f"checkpoint {step_dir}: leaf {p or '<root>'} was saved as {s['dtype']}{tuple(s['shape'])} "
                       f"but like has {want['dtype']}{tuple(want['shape'])}")


def _like_typed(value: Any, like: Any) -> Any:
  """``value`` (restored) in the container type of the ``like`` leaf: jax, NumPy or a Python number."""
  if isinstance(like, bool):
    return bool(value)
  if isinstance(like, (int, float, complex)):
    return type(like)(np.asarray(value).item())
  if isinstance(like, np.generic):
    return like.dtype.type(np.asarray(value))
  if isinstance(like, np.ndarray):
    return np.array(value, dtype=like.dtype)
  if isinstance(like, jax.Array) and like.ndim == 0 and like.weak_type:
    return jax.lax.full_like(like, np.asarray(value))  # keeps the weak type, so promotion is unchanged
  if isinstance(like, jax.Array) and not like.committed:
    return jax.device_put(value)  # uncommitted, as like: a jitted step sees the arguments it was compiled for
  if isinstance(like, jax.Array) and like.is_fully_addressable:
    return jax.device_put(value, like.sharding)
  return jnp.asarray(value)


def _restores_to_host(like: Any) -> bool:
  """Whether a leaf is read into a NumPy array: any leaf but a committed jax array or a placed abstract one.

  An uncommitted ``like`` (what ``jnp.zeros``, ``tx.init`` and a jitted step of uncommitted
  arguments return) must come back uncommitted: a committed array is another argument type to
  ``jax.jit``, and the first step after the restore would compile again.
  """
  if isinstance(like, jax.ShapeDtypeStruct):
    return like.sharding is None
  return not (isinstance(like, jax.Array) and like.committed)


def _placed_key(key: jax.Array, like: Any) -> jax.Array:
  """A restored PRNG key array placed as the ``like`` leaf is (uncommitted unless like is placed)."""
  sharding = None
  if isinstance(like, jax.Array) and like.committed and like.is_fully_addressable:
    sharding = like.sharding
  elif isinstance(like, jax.ShapeDtypeStruct):
    sharding = like.sharding
  return key if sharding is None else jax.device_put(key, sharding)


def restore(directory: str | os.PathLike, like: Any, step: int | None = None, *, verify: bool = True) -> Any:
  """Restores the tree saved at ``step`` (default: the newest) with the structure of ``like``.

  Args:
    directory: the checkpoint directory given to `save`.
    like: a tree of the same structure, shapes and dtypes (e.g. the freshly initialised
      training state); restored leaves take the type of its leaves (jax array on the same
      sharding, NumPy array or Python number). ``jax.ShapeDtypeStruct`` leaves give jax arrays.
    step: which step to restore (default: the newest one).
    verify: check the SHA-256 of every file against the manifest first.

  Returns:
    The restored tree, bit for bit the one saved. Jax arrays are placed as the ``like``
    leaves are: on their sharding when committed, and uncommitted (on the default device)
    when ``like``'s are, as those of a fresh ``tx.init``, so the next call of a jitted step
    runs the program it compiled before the restore instead of compiling again.

  Raises:
    FileNotFoundError: no checkpoint (or not that step) in ``directory``.
    CorruptCheckpointError: the step on disk is truncated, modified or unreadable.
    ValueError: ``like`` has another structure, shape or dtype than the saved tree, or, under
      MPI, the step holds another rank's nodes.

  Example:
    A typed PRNG key and a Python step counter come back as they were saved:

    >>> import tempfile, jax, jax.numpy as jnp, gossipjax as gj
    >>> d = tempfile.mkdtemp()
    >>> for step in (1, 2):
    ...   state = {"w": jnp.full((2, 3), float(step)), "key": jax.random.key(step), "step": step}
    ...   _ = gj.checkpoint.save(d, state, step=step)
    >>> like = {"w": jnp.zeros((2, 3)), "key": jax.random.key(0), "step": 0}
    >>> back = gj.checkpoint.restore(d, like, step=1)
    >>> back["w"].tolist(), back["step"]
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 1)
    >>> bool((jax.random.key_data(back["key"]) == jax.random.key_data(jax.random.key(1))).all())
    True
    >>> gj.checkpoint.restore(d, like)["step"]  # the newest step
    2
  """
  require_train_extra("gj.checkpoint.restore", "orbax")
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {directory}")
  step = _check_step(step)
  step_dir = _sealed_steps(directory).get(step, directory / str(step))
  if not step_dir.is_dir():
    raise FileNotFoundError(f"no checkpoint of step {step} in {directory} (saved steps: {all_steps(directory)})")
  body = _read_manifest(step_dir)
  mpi = _mpi_rank()
  if mpi is not None and body.get("mpi_rank", mpi[0]) != mpi[0]:
    raise ValueError(_rank_refusal(step_dir, body["mpi_rank"], mpi))
  leaves, treedef = _flatten(like)
  _check_like(step_dir, body, leaves, treedef)
  if verify:
    _verify_files(step_dir, body["files"])

  abstract, empty = {}, {}
  for i, (s, (_, x)) in enumerate(zip(body["leaves"], leaves)):
    if s["dtype"] == "key":  # its data, read to the host and placed as a key afterwards
      shape = tuple(s["shape"]) + jax.random.key_data(jax.random.key(0, impl=s["key_impl"])).shape
      dtype, host = jnp.dtype(jnp.uint32), True
    else:
      shape, dtype, host = tuple(s["shape"]), jnp.dtype(s["dtype"]), _restores_to_host(x)
    if math.prod(shape):
      abstract[str(i)] = np.empty(shape, dtype) if host else jax.ShapeDtypeStruct(shape, dtype, sharding=x.sharding)
    else:
      empty[str(i)] = np.zeros(shape, dtype)
  arrays: dict[str, Any] = dict(empty)
  if abstract:
    try:
      with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        arrays.update(ckptr.restore(step_dir / _STATE, args=ocp.args.StandardRestore(abstract)))
    except Exception as e:  # orbax / tensorstore raise many types on damaged data
      raise CorruptCheckpointError(f"checkpoint {step_dir} could not be read: {type(e).__name__}: {e}") from e

  out = []
  for i, (s, (_, x)) in enumerate(zip(body["leaves"], leaves)):
    value = arrays[str(i)]
    if s["dtype"] == "key":
      out.append(_placed_key(jax.random.wrap_key_data(jax.device_put(value), impl=s["key_impl"]), x))
    elif isinstance(x, jax.ShapeDtypeStruct):
      out.append(jax.device_put(value) if isinstance(value, np.ndarray) else value)
    else:
      out.append(_like_typed(value, x))
  return jax.tree_util.tree_unflatten(treedef, out)
