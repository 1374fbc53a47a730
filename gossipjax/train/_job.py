"""The main job's output folder and checkpoints: one job per folder, and rows that match their checkpoint.

An output folder belongs to one job. The job holds ``job.lock`` (``flock``, released by the
kernel when the process ends, kill -9 included) for its whole life, and the lock file names
the holder, so a second job is refused with one line that says who holds it. The job removes
the lock file when it ends, however it ends (only kill -9 leaves it, for the next job to take).

``job.json`` records every path the job writes, and the SHA-256 of each result file
(`RESULT_FILES`) it wrote, so that a file a user has put in their place is never taken for
the job's: such a folder is refused, and nothing in it is touched.

Each run checkpoints into ``checkpoints/<run>/`` (under MPI, one ``rank_<k>/`` per rank):
the training state through `gj.checkpoint` and the metrics rows in ``history.json``. The
rows are written first, then the state, so the rows on disk always reach the newest saved
step; a resume from step K keeps the rows up to K, each once. The newest step that restores
intact (on every rank) is the one resumed: a corrupt newest step costs one warning line.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import socket
import sys
from typing import Any, Callable

try:
  import fcntl
except ImportError:  # Windows: no lock, the folder checks still apply
  fcntl = None

#: What a job writes into its output folder besides each run's `run_folder` (and ``job.log``, recorded when the
#: job first writes it). ``job.json`` records every path the job writes, and ``--overwrite`` removes those and
#: nothing else.
JOB_FILES = ("job.json", "metrics.json", "plot.png")
#: The files a job replaces whole when it ends; ``job.json`` records the SHA-256 of what it wrote there.
RESULT_FILES = ("metrics.json", "plot.png")
#: What a job of an earlier version wrote; its ``job.json`` records no paths.
EARLIER_JOB_FILES = ("job.json", "metrics.json", "plot.png", "checkpoints")
LOCK = "job.lock"
LOG = "job.log"
HISTORY = "history.json"


def run_folder(run: str) -> str:
  """The folder of a run's checkpoints, relative to the output folder (``/``-separated, as job.json records it)."""
  return "checkpoints/" + run.replace("/", "__")


class UsageError(Exception):
  """A choice of options the job cannot run with (exit status 2); the message names the option."""

  quiet: bool = False  # raised on every MPI rank, said once: True on the others


class JobError(Exception):
  """A failure while the job runs (exit status 1), such as a full disk or an unusable checkpoint."""

  quiet: bool = False  # raised on every MPI rank, said once: True on the others


def fresh_folder(root: str) -> str:
  """A new folder ``root/<date>_<time>`` (``-2``, ``-3``, ... when that one exists), created here."""
  stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
  os.makedirs(root, exist_ok=True)
  for k in range(1, 1000):
    path = os.path.join(root, stamp if k == 1 else f"{stamp}-{k}")
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      continue
  raise JobError(f"could not make a fresh folder under {root}: pass --out")


class OutputFolder:
  """A job's output folder, held through ``job.lock`` from `claim` to `release`."""

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = None
    self._created = False

  def claim(self) -> None:
    """Creates the folder if needed and takes its lock; `UsageError` names the job that holds it."""
    if not self.path:
      raise UsageError("argument --out: give a folder, not an empty string")
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise UsageError(f"argument --out: {self.path} is a file, not a folder")
    lock = os.path.join(self.path, LOCK)
    created = not os.path.isdir(self.path)
    while True:
      try:
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise UsageError(f"argument --out: cannot use {self.path} as the output folder: {e.strerror or e}") from None
      if fcntl is not None:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          holder = os.read(fd, 4096).decode(errors="replace").strip() or "another job"
          os.close(fd)
          raise UsageError(f"argument --out: {self.path} is in use by {holder}; wait for it to end or choose "
                           "another --out") from None
        except OSError:
          pass  # a file system without flock: run unlocked rather than not at all
      if _same_file(fd, lock):
        break
      os.close(fd)  # the job before us removed the file we opened after we opened it: lock the one that is there
    started = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, _LOCK_HEAD + f"{os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
    self._fd, self._created = fd, created

  def release(self) -> None:
    """Removes the lock file and gives the lock back, and the folder when `claim` made it and it is left empty.

    The file is removed while it is locked, and `claim` locks only the file that is at the path
    when it holds the lock, so two jobs never hold two lock files of one folder.
    """
    if self._fd is not None:
      with contextlib.suppress(OSError):
        os.remove(os.path.join(self.path, LOCK))
      os.close(self._fd)
      self._fd = None
      if self._created:
        with contextlib.suppress(OSError):
          os.rmdir(self.path)  # only where it is empty: a job that refused to start leaves no folder behind

  def _job(self) -> dict[str, Any] | None:
    """job.json as a dict, or ``None`` where there is none that reads as one."""
    try:
      with open(os.path.join(self.path, "job.json")) as f:
        job = json.load(f)
    except (OSError, ValueError):
      return None
    return job if isinstance(job, dict) else None

  def recorded(self) -> list[str] | None:
    """The paths that the folder's job recorded in job.json as its own; ``None`` without such a record.

    A job.json of an earlier version, which records no paths, stands for `EARLIER_JOB_FILES`.
    """
    options = self._job()
    if options is None:
      return None
    files = options.get("files")
    if isinstance(files, list) and all(isinstance(p, str) and p and ".." not in p.split("/") for p in files):
      return files
    if files is None and {"algorithms", "topologies", "nodes"} <= options.keys():
      return list(EARLIER_JOB_FILES)
    return None

  def outputs(self) -> list[str]:
    """The recorded paths of the folder's job that exist (another job's, for a fresh run)."""
    return [p for p in self.recorded() or [] if os.path.lexists(os.path.join(self.path, p))]

  def foreign(self) -> list[str]:
    """What the folder holds that no job recorded writing, at any depth (its lock aside).

    A recorded file stands for itself and the temporary files the job writes it through
    (`temporaries`); a recorded run folder for the files its runs wrote there: the rows
    (``history.json``) and what `gj.checkpoint.save` wrote (`gj.checkpoint.foreign_files`
    lists the rest), in per-rank folders ``rank_<k>/`` under MPI.
    """
    if not os.path.isdir(self.path):
      return []
    recorded = self.recorded() or []
    ours = lambda rel: rel in recorded or any(is_temporary(rel, p) for p in recorded + ["job.json"])  # job.json.tmp: a killed first write
    runs = {p for p in recorded if p.startswith("checkpoints/")}
    if "checkpoints" in recorded and os.path.isdir(os.path.join(self.path, "checkpoints")):  # an earlier version's job
      runs |= {f"checkpoints/{n}" for n in os.listdir(os.path.join(self.path, "checkpoints"))}
      recorded = [p for p in recorded if p != "checkpoints"] + sorted(runs)
    found: list[str] = []

    def walk(rel: str) -> None:
      for name in sorted(os.listdir(os.path.join(self.path, rel))):
        child = f"{rel}/{name}" if rel else name
        path = os.path.join(self.path, child)
        if child == LOCK and _is_lock_file(path):
          continue
        if child in runs and os.path.isdir(path) and not os.path.islink(path):
          found.extend(f"{child}/{r}" for r in _run_foreign(path))
        elif ours(child) and child not in runs:
          continue
        elif any(p.startswith(child + "/") for p in recorded) and os.path.isdir(path) and not os.path.islink(path):
          walk(child)  # a folder (checkpoints/) that holds recorded paths: what else is in it?
        else:
          found.append(child)

    walk("")
    return found

  def changed(self) -> list[str]:
    """The folder's result files (`RESULT_FILES`) that do not hold what its job wrote: a user's file put there.

    A job.json of an earlier version records no SHA-256: its files are taken as its job's.
    """
    job = self._job()
    digests = job.get("digests") if job is not None else None
    if not isinstance(digests, dict):
      return []
    recorded = self.recorded() or []
    found = []
    for name in RESULT_FILES:
      path = os.path.join(self.path, name)
      if name in recorded and os.path.lexists(path):
        if os.path.islink(path) or not os.path.isfile(path) or _sha256(path) not in digests.get(name, []):
          found.append(name)
    return found

  def clear(self) -> None:
    """Removes exactly what the folder's job recorded writing, and the folders that leaves empty; nothing else.

    Of a run folder, that is its rows and what `gj.checkpoint.save` wrote (`gj.checkpoint.remove`);
    a file of anyone else's stays where it is, at any depth.
    """
    recorded = self.recorded() or []
    earlier = os.path.join(self.path, "checkpoints")
    if "checkpoints" in recorded and os.path.isdir(earlier):  # an earlier version's job: each folder in it a run's
      recorded = [p for p in recorded if p != "checkpoints"] + [f"checkpoints/{n}" for n in sorted(os.listdir(earlier))]
    for rel in recorded:
      path = os.path.join(self.path, *rel.split("/"))
      if rel.startswith("checkpoints/") and os.path.isdir(path) and not os.path.islink(path):
        _clear_run(path)
        continue
      folder, name = os.path.split(path)
      for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        target = os.path.join(folder, entry)
        if (entry == name or is_temporary(entry, name)) and (os.path.islink(target) or os.path.isfile(target)):
          os.remove(target)
    for rel in sorted({os.path.dirname(p) for p in recorded if "/" in p}, key=len, reverse=True):
      with contextlib.suppress(OSError):
        os.rmdir(os.path.join(self.path, *rel.split("/")))  # only where it is empty

  def record(self, path: str) -> None:
    """Adds ``path`` to the paths job.json records (before the job first writes it)."""
    job = self._job()
    files = self.recorded()
    if job is None or files is None or path in files:
      return
    write_json(os.path.join(self.path, "job.json"), {**job, "files": sorted({*files, path})})

  def read_options(self) -> dict[str, Any] | None:
    """The options recorded by the job that wrote the folder, or ``None``."""
    path = os.path.join(self.path, "job.json")
    if not os.path.exists(path):
      return None
    try:
      with open(path) as f:
        return json.load(f)
    except ValueError as e:
      raise JobError(f"{path} is unreadable ({e}): the folder's job cannot be checked; choose another --out") from None

  def write_options(self, options: dict[str, Any], files: list[str], resume: bool = False) -> int:
    """Records the job's options and every path it writes (with those an earlier job of the folder recorded).

    job.json keeps the options at its top level (what a next ``--resume`` is compared with) and
    ``launches``: the options of every launch of the job that ran with other options than the
    one before (``--resume --allow-changed-options``), in order. The result files there now
    are the job's (`foreign` and `changed` found nothing else): their SHA-256 are recorded
    with them.

    Args:
      options: this launch's options.
      files: the paths this launch writes.
      resume: whether this launch continues the folder's job (else it is a new job's first).

    Returns:
      The index in ``launches`` of this launch's options: what each metrics row it makes records.
    """
    launches = self.launches() if resume else []
    if not launches or launches[-1] != options:
      launches.append(options)
    files = sorted(set(self.recorded() or []) | set(files) | {"job.json"})
    digests = {name: [_sha256(os.path.join(self.path, name))] for name in RESULT_FILES
               if os.path.isfile(os.path.join(self.path, name))}
    write_json(os.path.join(self.path, "job.json"),
               {**options, "launches": launches, "files": files, "digests": digests})
    return len(launches) - 1

  def launches(self) -> list[dict[str, Any]]:
    """The options of each launch of the folder's job, the first first (one, for a job.json that records none)."""
    job = self._job()
    if job is None:
      return []
    launches = job.get("launches")
    if isinstance(launches, list) and all(isinstance(o, dict) for o in launches) and launches:
      return launches
    return [{k: v for k, v in job.items() if k not in ("files", "digests", "launches")}]

  def results(self) -> dict[str, Any]:
    """The runs of the metrics.json the folder's job wrote (`changed` found it the job's), or ``{}``."""
    if "metrics.json" not in (self.recorded() or []) or self.changed():
      return {}
    try:
      with open(os.path.join(self.path, "metrics.json")) as f:
        runs = json.load(f).get("runs")
    except (OSError, ValueError, AttributeError):
      return {}
    return runs if isinstance(runs, dict) else {}

  def write_results(self, writers: dict[str, Callable[[str], None]]) -> None:
    """Writes the result files, each by ``writers[name](path)`` into a temporary file renamed over it.

    job.json accepts the new SHA-256 beside the old one before the renames and keeps only the
    new one after them, so that whenever the job is killed, what is on disk is what job.json
    says the job wrote.
    """
    job = self._job()
    record = job is not None  # a folder without a job.json (a caller of its own) records nothing
    job = job or {}
    digests = job.get("digests")
    old: dict[str, list[str]] = digests if isinstance(digests, dict) else {}
    tmps = {name: os.path.join(self.path, name + ".tmp" + os.path.splitext(name)[1]) for name in writers}
    try:
      for name, write in writers.items():
        write(tmps[name])
      new = {name: _sha256(tmp) for name, tmp in tmps.items()}
      job_json = os.path.join(self.path, "job.json")
      if record:
        write_json(job_json, {**job, "digests": {**old, **{k: sorted({*old.get(k, []), h}) for k, h in new.items()}}})
      for name, tmp in tmps.items():
        os.replace(tmp, os.path.join(self.path, name))
      if record:
        write_json(job_json, {**job, "digests": {**old, **{k: [h] for k, h in new.items()}}})
    finally:
      for tmp in tmps.values():
        with contextlib.suppress(OSError):
          os.remove(tmp)


def temporaries(rel: str) -> list[str]:
  """The temporary files the job writes ``rel`` through, by their exact names (`write_json`'s, `write_results`')."""
  ext = os.path.splitext(rel)[1]
  return [f"{rel}.tmp", f"{rel}.tmp{ext}"] if ext else [f"{rel}.tmp"]


def is_temporary(name: str, rel: str) -> bool:
  """Whether ``name`` is one of the temporary files of ``rel``: `temporaries`, or `write_metrics`' own (``.tmp-<pid>``)."""
  tmps = temporaries(rel)
  return name in tmps or any(re.fullmatch(re.escape(t) + r"\.tmp-[0-9]+", name) for t in tmps)


_RANK_FOLDER = re.compile(r"rank_[0-9]+")


def _run_foreign(path: str) -> list[str]:
  """What a run folder (or one rank's folder in it) holds that its runs did not write, relative to it."""
  from gossipjax import checkpoint

  found = []
  ranks = sorted(n for n in os.listdir(path) if _RANK_FOLDER.fullmatch(n) and os.path.isdir(os.path.join(path, n))
                 and not os.path.islink(os.path.join(path, n)))
  for rel in checkpoint.foreign_files(path):
    head = rel.split("/")[0]
    if rel in [HISTORY, *temporaries(HISTORY)] or head in ranks:
      continue
    found.append(rel)
  for rank in ranks:
    found += [f"{rank}/{rel}" for rel in _run_foreign(os.path.join(path, rank))]
  return found


def _clear_run(path: str) -> None:
  """Removes what a run wrote into its folder (rows, checkpoints; per rank under MPI), and the folders left empty."""
  from gossipjax import checkpoint

  for name in os.listdir(path):
    child = os.path.join(path, name)
    if _RANK_FOLDER.fullmatch(name) and os.path.isdir(child) and not os.path.islink(child):
      _clear_run(child)
  for name in [HISTORY, *temporaries(HISTORY)]:
    target = os.path.join(path, name)
    if os.path.islink(target) or os.path.isfile(target):
      os.remove(target)
  checkpoint.remove(path)
  with contextlib.suppress(OSError):
    os.rmdir(path)


def _same_file(fd: int, path: str) -> bool:
  """Whether the open file ``fd`` is the file at ``path``."""
  try:
    here, there = os.fstat(fd), os.stat(path)
  except OSError:
    return False
  return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


_LOCK_HEAD = b"the job of pid "


def _is_lock_file(path: str) -> bool:
  """Whether ``path`` is a job's lock file (what `OutputFolder.claim` writes there), not a user's file of that name."""
  try:
    with open(path, "rb") as f:
      head = f.read(len(_LOCK_HEAD))
  except OSError:
    return False
  return _LOCK_HEAD.startswith(head)  # empty, or a line claim began to write


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def write_json(path: str, value: Any) -> None:
  """Writes ``value`` as JSON through a temporary file renamed over ``path``: readers see the old or the new file.

  The temporary file has a fixed name: the folder's one job is its only writer, and what a
  killed write leaves is overwritten by the next.
  """
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(value, f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


class JobLog:
  """While the job runs, the libraries' log records go to ``OUT/job.log``, not to the terminal.

  orbax reports a failed background write (a full disk) through absl's logger, tracebacks
  and all, before the save raises; the job then ends with one line that points here. A
  failure with a cause, or after such records, adds its own traceback. Where the folder is
  not on this host (another MPI host), the records stay where they were going.

  Args:
    folder: the output folder.
    on_first: called once, before the first record is written (the main job records the
      file in job.json there, so that a job that logs nothing never claims a job.log).

  Attributes:
    path: the log file.
    records: how many records this job wrote there.
  """

  LOGGERS = ("absl", "gossipjax.train")

  def __init__(self, folder: str, on_first: Callable[[], None] | None = None):
    self.path = os.path.join(folder, LOG)
    self.records = 0
    self._on_first = on_first  # job.json records job.log before its first record is written
    self._handler: logging.Handler | None = None
    self._saved: list[tuple[logging.Logger, bool]] = []

  def _count(self, record: logging.LogRecord) -> bool:
    del record
    if not self.records and self._on_first is not None:
      self._on_first()
    self.records += 1
    return True

  def __enter__(self) -> "JobLog":
    if not os.path.isdir(os.path.dirname(self.path) or "."):
      return self
    self._handler = logging.FileHandler(self.path, delay=True)
    self._handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(levelname)s %(name)s: %(message)s"))
    self._handler.addFilter(self._count)
    for name in self.LOGGERS:
      logger = logging.getLogger(name)
      self._saved.append((logger, logger.propagate))
      logger.addHandler(self._handler)
      logger.propagate = False
    return self

  def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
    if self._handler is None:
      return
    if isinstance(error, Exception) and (self.records or error.__cause__ is not None):
      logging.getLogger("gossipjax.train").error("the job failed: %s", error, exc_info=(kind, error, tb))
    for logger, propagate in self._saved:
      logger.removeHandler(self._handler)
      logger.propagate = propagate
    self._handler.close()
    self._handler, self._saved = None, []


def warn(message: str) -> None:
  sys.stderr.write(f"gossipjax train: warning: {message}\n")
  sys.stderr.flush()


class RunCheckpoints:
  """One run's checkpoints: the training state through gj.checkpoint, its metrics rows beside it.

  Args:
    directory: this process's checkpoint directory of the run.
    every: steps between checkpoints (0: none).
    placement: where the nodes live (`Placement`).
    name: the run's name, for messages.
    comm: the MPI communicator of the job, or ``None``.
    is_main: whether this process prints the job's warnings.
  """

  def __init__(self, directory: str, every: int, placement: Any, name: str, comm: Any = None, is_main: bool = True):
    self.directory, self.every, self.placement = directory, every, placement
    self.name, self.comm, self.is_main = name, comm, is_main

  def save(self, state: Any, rows: list[dict[str, Any]]) -> None:
    """Saves the rows, then the state at ``state.step`` when it is a checkpoint step."""
    from gossipjax import checkpoint

    if not self.every or state.step % self.every:
      return
    try:
      os.makedirs(self.directory, exist_ok=True)
      write_json(os.path.join(self.directory, HISTORY), rows)  # first: the rows always reach the newest step
      checkpoint.save(self.directory, {"step": state.step, "params": state.params, "opt_state": state.opt_state},
                      step=state.step, keep=2)
    except OSError as e:
      raise JobError(f"{self.name}: could not save the checkpoint of step {state.step} in {self.directory}: "
                     f"{e.strerror or e}; the previous checkpoint is intact") from e

  def _rows(self, step: int) -> list[dict[str, Any]]:
    """The rows up to ``step``, each once.

    Raises `CorruptCheckpointError` when they stop short of ``step`` (an older step may
    still do), `JobError` when the rows file is missing or unreadable (no step can).
    """
    from gossipjax.checkpoint import CorruptCheckpointError

    path = os.path.join(self.directory, HISTORY)
    try:
      with open(path) as f:
        rows = [r for r in json.load(f) if r["step"] <= step]
    except FileNotFoundError:
      raise JobError(f"{path} is missing: the metrics rows of the checkpoints are gone; start again with "
                     "--overwrite") from None
    except (ValueError, KeyError, TypeError) as e:
      raise JobError(f"{path} is unreadable ({type(e).__name__}: {e}); start again with --overwrite") from None
    steps = [r["step"] for r in rows]
    if step and (not steps or steps[-1] != step or steps != sorted(set(steps))):
      raise CorruptCheckpointError(f"{path} does not hold the metrics rows up to step {step}")
    return rows

  def _gather(self, value: Any) -> list[Any]:
    return self.comm.allgather(value) if self.comm is not None else [value]

  def restore(self, fresh: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The newest step that restores intact, with its rows, on every process; ``(None, [])`` without one.

    A step that is corrupt (on any rank) is skipped with a warning; `JobError` when steps
    exist and none is intact, or when a step holds another tree (other options).
    """
    from gossipjax import checkpoint
    from gossipjax.train._loop import TrainState

    like = {"step": 0, "params": fresh.params, "opt_state": fresh.opt_state}
    skipped = []
    step = checkpoint.latest_step(self.directory, self.comm)
    while step is not None:
      tree, rows, problem, fatal = None, [], None, None
      try:
        tree = checkpoint.restore(self.directory, like=like, step=step)
        rows = self._rows(step)
      except checkpoint.CorruptCheckpointError as e:
        problem = str(e)
      except (JobError, ValueError, OSError) as e:
        fatal = str(e)
      problems = self._gather((problem, fatal))
      fatal_ones = [(rank, f) for rank, (_, f) in enumerate(problems) if f]
      if fatal_ones:
        rank, message = fatal_ones[0]
        where = f" (rank {rank})" if self.comm is not None else ""
        raise JobError(f"{self.name}: cannot resume from step {step}{where}: {message}")
      bad = [(rank, p) for rank, (p, _) in enumerate(problems) if p]
      if not bad:
        assert tree is not None  # no problem on any rank: this one restored the step
        placed = self.placement.like({"params": tree["params"], "opt_state": tree["opt_state"]},
                                     {"params": fresh.params, "opt_state": fresh.opt_state})
        return TrainState(int(tree["step"]), placed["params"], placed["opt_state"]), rows
      older = checkpoint.latest_step(self.directory, self.comm, before=step)
      rank, message = bad[0]
      where = f" on rank {rank}" if self.comm is not None else ""
      skipped.append(str(step))
      if self.is_main:
        then = f"resuming from step {older}" if older is not None else "no older step"
        warn(f"{self.name}: skipping step {step}, which does not restore intact{where} ({message}); {then}")
      step = older
    if skipped:
      raise JobError(f"{self.name}: no checkpoint in {self.directory} restores intact (steps "
                     f"{', '.join(skipped)}); start again with --overwrite")
    return None, []
