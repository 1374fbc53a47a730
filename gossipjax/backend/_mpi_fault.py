"""MPI jobs that fail fast instead of hanging.

A rank that raises, or that leaves while the others still wait for its messages, aborts
every rank; ranks that built different topologies are told which ranks differ.
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any


_installed: dict[str, Any] = {}

# After the traceback is written and before the abort: mpiexec's proxies forward a rank's
# output through pipes, and an abort that tears them down at once can drop what they have
# not yet passed on (the user would see half a traceback, or none).
_FORWARD_GRACE_S = 0.5

EXIT_TIMEOUT_S = 60.0
# A rank that exits with a non-zero status has failed: the others get this long to reach their own
# exit (they often fail together, each saying why), then the job is aborted.
FAILED_EXIT_WAIT_S = 1.0
_EXIT_POLL_S = 0.01


def abort_on_error(comm: Any = None, errorcode: int = 1, exit_timeout: float | None = EXIT_TIMEOUT_S) -> None:
  """Makes an uncaught exception on this rank, or its early exit, abort the whole MPI job.

  Without it, a rank that raises, calls ``sys.exit`` or returns from its main function
  exits (or blocks in ``MPI_Finalize``) while the other ranks wait forever in their next
  collective or receive: the job hangs until a wall-clock limit. With it:

  - An uncaught exception prints its traceback as usual, then a line naming the rank
    (``gossipjax: uncaught exception on rank 2 of 4: MPI_Abort(1) ends every rank``), and
    half a second later, so that ``mpiexec`` has forwarded that output,
    ``comm.Abort(errorcode)`` tells ``mpiexec`` to kill every rank: the job ends with a
    non-zero status within seconds. (This is what ``python -m mpi4py script.py`` does;
    this function gives it to scripts launched as ``mpiexec python script.py``.)
  - A rank that exits with a non-zero status (``sys.exit(1)``) has failed: it waits a
    second for the other ranks to reach their exit (ranks that fail together then end as
    they are, each with its own message), then aborts the job with that status
    (``gossipjax: rank 2 of 4 exited with status 1 while other ranks still run``).
  - A rank that exits with status 0 waits up to ``exit_timeout`` seconds for every rank of
    ``comm`` to reach its own exit (a non-blocking barrier on a communicator of its own, so
    it never matches a collective of the program). A job whose ranks all finish exits as
    before; if a rank leaves while the others are still running, it aborts the job with
    ``errorcode`` when the time is up. A program whose ranks legitimately finish far apart
    (rank 0 alone writes results for minutes, say) should end with ``comm.Barrier()`` on
    every rank, or pass a longer ``exit_timeout``.

  It hooks ``sys.excepthook`` (uncaught exceptions of the main thread) and ``sys.exit``
  (to learn the exit status), and registers an ``atexit`` function. A ``SystemExit`` raised
  directly, not through ``sys.exit``, counts as status 0. Call it on every rank of ``comm``: it duplicates the communicator,
  a collective. Calling it again replaces the communicator and the settings. It does
  nothing without mpi4py or on a communicator of one process (nobody can be left
  waiting), so it is safe in tests and notebooks.

  Args:
    comm: the mpi4py communicator to abort (default ``MPI.COMM_WORLD``).
    errorcode: the exit status ``mpiexec`` reports.
    exit_timeout: how long a rank waits at exit for the others, in seconds; ``None``
      does not wait (an early exit then leaves the others waiting).

  Example:
    The first lines of a script meant for ``mpiexec -n 4 python train.py``; run as one
    process, the call does nothing:

    >>> import gossipjax as gj
    >>> gj.backend.mpi_abort_on_error()
  """
  if comm is None:
    try:
      from mpi4py import MPI
    except ImportError:
      return
    comm = MPI.COMM_WORLD
  if comm.Get_size() == 1:
    return
  first = not _installed
  previous_exit_comm = _installed.get("exit_comm")
  _installed.update(comm=comm, errorcode=errorcode, exit_timeout=exit_timeout,
                    exit_comm=None if exit_timeout is None else comm.Dup())
  if previous_exit_comm is not None:
    previous_exit_comm.Free()
  if not first:
    return
  previous = sys.excepthook

  def hook(kind, value, tb):
    try:
      previous(kind, value, tb)
    finally:
      comm_ = _installed["comm"]
      _abort(f"uncaught exception on rank {comm_.Get_rank()} of {comm_.Get_size()}")

  sys.excepthook = hook
  previous_exit = sys.exit

  def exit_(status=None):
    _installed["exit_status"] = status
    previous_exit(status)

  sys.exit = exit_
  # Registered after mpi4py's import, so it runs before mpi4py finalizes MPI.
  atexit.register(_exit_together)


def _abort(reason: str, code: int | None = None) -> None:
  """Says why on stderr, gives ``mpiexec`` time to forward the output, then aborts every rank."""
  abort_job(_installed["comm"], reason, _installed["errorcode"] if code is None else code)


def abort_job(comm: Any, reason: str, errorcode: int = 1) -> None:
  """Ends every rank of ``comm``'s job: says why on stderr, lets ``mpiexec`` forward it, then ``comm.Abort``.

  For code that knows the other ranks can no longer finish (they wait for this rank's
  messages): ``gj.asynchrony.mpi_adpsgd`` calls it when its gradient function raises.

  Args:
    comm: an mpi4py communicator of the job.
    reason: what happened, one line (``uncaught exception on rank 2 of 4``).
    errorcode: the exit status ``mpiexec`` reports.
  """
  try:  # said here too: the MPI library's own abort message can be lost with the job's pipes
    sys.stderr.write(f"gossipjax: {reason}: MPI_Abort({errorcode}) ends every rank\n")
  except Exception:
    pass
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # a closed stream must not stop the abort
      pass
  time.sleep(_FORWARD_GRACE_S)
  comm.Abort(errorcode)


def _exit_together() -> None:
  """Waits for every rank to reach its exit; aborts the job when one leaves the others behind.

  The ranks left behind are inside an MPI call that no Python code can interrupt, so
  the rank that leaves is the one that can end the job.
  """
  exit_comm, timeout = _installed.get("exit_comm"), _installed.get("exit_timeout")
  if exit_comm is None or timeout is None:
    return
  from mpi4py import MPI

  if MPI.Is_finalized():  # the program finalized MPI itself: nothing can wait or abort
    return
  status = _exit_code(_installed.get("exit_status"))
  request = exit_comm.Ibarrier()
  deadline = time.monotonic() + (min(timeout, FAILED_EXIT_WAIT_S) if status else timeout)
  while not request.Test():
    if time.monotonic() >= deadline:
      where = f"rank {exit_comm.Get_rank()} of {exit_comm.Get_size()}"
      if status:
        _abort(f"{where} exited with status {status} while other ranks still run", status)
      _abort(f"{where} is exiting, but not every rank reached "
             f"its exit within {timeout:g} s (a rank that returns or calls sys.exit early leaves the others "
             "waiting; if they were only busy, end every rank with comm.Barrier(), or raise exit_timeout "
             "of gj.backend.mpi_abort_on_error)")
    time.sleep(_EXIT_POLL_S)


def _exit_code(status: Any) -> int:
  """The process exit status of ``sys.exit(status)``: 0 for None, the int, else 1 (a message)."""
  if status is None:
    return 0
  if isinstance(status, int):
    return status & 0xFF
  return 1


def check_same_topology(comm: Any, topology: Any) -> None:
  """Raises ``ValueError`` on every rank of ``comm`` unless all of them built the same topology.

  Ranks whose plans differ exchange different messages: the job hangs, or (same offsets,
  other weights or node count) runs to a wrong result with exit status 0. Every rank
  gathers every rank's fingerprint of the node count and the sparse plans (rank-one terms included), so each one raises
  the same message, naming the ranks of each topology, and the job ends, not hangs. A
  collective: call it on every rank of ``comm``, once per mixer.

  Args:
    comm: the mpi4py communicator the mixer exchanges over.
    topology: this rank's ``gj.topology.Topology``.
  """
  if comm.Get_size() == 1:
    return
  everyone = comm.allgather((topology.fingerprint(), topology.name, topology.num_nodes))
  groups: dict[tuple[str, str, int], list[int]] = {}
  for rank, key in enumerate(everyone):
    groups.setdefault(key, []).append(rank)
  if len(groups) == 1:
    return
  names = [name for _, name, _ in groups]
  described = []
  for (digest, name, n), ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1])):
    same_name = f" (weights {digest[:8]})" if names.count(name) > 1 else ""
    described.append(f"{name} with n={n}{same_name} on {'ranks' if len(ranks) > 1 else 'rank'} {_ranks(ranks)}")
  raise ValueError(f"the MPI ranks built different topologies for one mixer: {'; '.join(described)}. "
                   "Their exchanges would not match (a hung job or wrong numbers): build the same "
                   "topology on every rank")


def _ranks(ranks: list[int]) -> str:
  """``0, 2, 3`` or ``0, 4-9``: runs of three or more as ranges, so a large job's list stays short."""
  parts, start = [], 0
  while start < len(ranks):
    end = start
    while end + 1 < len(ranks) and ranks[end + 1] == ranks[end] + 1:
      end += 1
    if end - start >= 2:
      parts.append(f"{ranks[start]}-{ranks[end]}")
    else:
      parts.extend(str(r) for r in ranks[start:end + 1])
    start = end + 1
  return ", ".join(parts)
