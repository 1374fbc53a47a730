"""MPI jobs that fail fast: an uncaught exception on one rank aborts every rank."""

from __future__ import annotations

import sys
import time
from typing import Any

_installed: dict[str, Any] = {}

# After the traceback is written and before the abort: mpiexec's proxies forward a rank's
# output through pipes, and an abort that tears them down at once can drop what they have
# not yet passed on (the user would see half a traceback, or none).
_FORWARD_GRACE_S = 0.5


def abort_on_error(comm: Any = None, errorcode: int = 1) -> None:
  """Makes an uncaught exception on this rank abort the whole MPI job.

  Without it, a rank that raises exits (or blocks in ``MPI_Finalize``) while the other
  ranks wait forever in their next collective or receive: the job hangs until a wall-clock
  limit. With it, the exception's traceback is printed as usual, then a line naming the rank
  (``gossipjax: uncaught exception on rank 2 of 4: MPI_Abort(1) ends every rank``), and half
  a second later, so that ``mpiexec`` has forwarded that output, ``comm.Abort(errorcode)``
  tells ``mpiexec`` to kill every rank: the job ends with a non-zero status within seconds.
  (This is what ``python -m mpi4py script.py`` does; this function gives it to scripts
  launched as ``mpiexec python script.py``.)

  It hooks ``sys.excepthook`` (uncaught exceptions of the main thread). Calling it again
  replaces the communicator. It does nothing without mpi4py or on a communicator of one
  process (nobody can be left waiting), so it is safe in tests and notebooks.

  Args:
    comm: the mpi4py communicator to abort (default ``MPI.COMM_WORLD``).
    errorcode: the exit status ``mpiexec`` reports.
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
  _installed["comm"], _installed["errorcode"] = comm, errorcode
  if not first:
    return
  previous = sys.excepthook

  def abort() -> None:
    comm_, code = _installed["comm"], _installed["errorcode"]
    try:  # said here too: the MPI library's own abort message can be lost with the job's pipes
      sys.stderr.write(f"gossipjax: uncaught exception on rank {comm_.Get_rank()} of {comm_.Get_size()}: "
                       f"MPI_Abort({code}) ends every rank\n")
    except Exception:
      pass
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # a closed stream must not stop the abort
        pass
    time.sleep(_FORWARD_GRACE_S)
    comm_.Abort(code)

  def hook(kind, value, tb):
    try:
      previous(kind, value, tb)
    finally:
      abort()

  sys.excepthook = hook
