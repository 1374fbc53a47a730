"""AD-PSGD across real MPI processes: one-sided windows, atomic pair averages, no barrier.

Every rank exposes its model in an MPI window (``MPI.Win.Allocate``). A rank that finishes
a gradient locks its own window and one peer's (exclusive locks, always taken in rank
order so that two ranks can never wait on each other), reads both models, writes the pair
average to the peer and ``average - lr * gradient`` to itself, and unlocks: the pair
average is atomic, so no update is lost even when several ranks pick the same peer. No
rank ever waits for a slow rank except for the few microseconds a lock on it is held.

Passive-target RMA needs the target to make MPI progress, and a rank busy computing (or
sleeping) makes none; so each rank runs a small progress thread that polls MPI while the
main thread computes (this needs ``MPI_THREAD_MULTIPLE``, mpi4py's default level), the
role the communication threads play in the paper's implementation.

Shutdown cannot hang: every rank stops after a wall-clock budget or a step cap, releases
its locks, and enters a final barrier; the progress threads keep serving the lock requests
of ranks still finishing their last step until everyone has arrived. A rank whose gradient
function raises cannot reach that barrier with the others' models consistent, and they
would wait for it: it prints its traceback and aborts the whole job (``MPI_Abort``).
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from gossipjax.backend._mpi_fault import abort_job


class MPIAsyncResult(NamedTuple):
  """What one rank ends with.

  Attributes:
    params: the rank's final model (flat float64 vector).
    steps: gradients this rank applied.
    averages: pair averages this rank started.
    wall_time: seconds from the start barrier to leaving the training loop.
  """

  params: np.ndarray
  steps: int
  averages: int
  wall_time: float


def mpi_adpsgd(
    grad_fn: Callable[[np.ndarray, int], np.ndarray],
    x0: np.ndarray,
    *,
    learning_rate: float,
    comm: Any = None,
    time_budget: float | None = None,
    max_steps: int | None = None,
    peers: Sequence[int] | None = None,
    seed: int = 0,
    poll_interval: float = 5e-4,
) -> MPIAsyncResult:
  r"""Runs asynchronous decentralized SGD (AD-PSGD; Lian et al. 2018) on this MPI rank.

  Rank i loops: read :math:`\hat x_i = x_i`; compute :math:`g = \nabla F_i(\hat x_i)`
  (slow ranks take long; peers keep averaging into :math:`x_i` meanwhile); pick a peer j;
  atomically

  .. math::
    x_j \leftarrow \tfrac12 (x_i + x_j), \qquad
    x_i \leftarrow \tfrac12 (x_i + x_j) - \gamma g.

  With ``learning_rate = 0`` the sum of the models over ranks is invariant (a lost
  update would break it), which the tests check.

  Args:
    grad_fn: ``grad_fn(x, step) -> gradient`` on this rank's data (numpy in and out;
      wrap a jitted JAX gradient with ``jax.flatten_util.ravel_pytree`` for a model).
    x0: this rank's initial model, a flat float vector (the same size on every rank).
    learning_rate: gamma.
    comm: the communicator (default ``MPI.COMM_WORLD``).
    time_budget: seconds of training (wall clock) per rank.
    max_steps: or a cap on this rank's gradients; at least one of the two is required.
    peers: ranks this one may pick (default: all others); uniform choice.
    seed: seed of the peer choice (the rank is folded in).
    poll_interval: seconds between polls of the progress thread.

  Returns:
    This rank's `MPIAsyncResult`.

  Raises:
    ValueError: neither ``time_budget`` nor ``max_steps`` is given.
    RuntimeError: MPI was initialized without ``MPI_THREAD_MULTIPLE``.

  When ``grad_fn`` raises on one rank of several, that rank prints the traceback and ends
  the whole job with ``MPI_Abort(1)`` within a second, whether or not the script called
  ``gj.backend.mpi_abort_on_error``: the other ranks would otherwise wait for it at the
  final barrier. On a single process the exception propagates as usual.

  Example:
    Each rank of ``mpiexec -n 4 python train.py`` calls it with its own gradient. Run
    alone (one rank, no peer), it is plain SGD: 4 steps on ``F(x) = |x|^2 / 2``.

    >>> import numpy as np, gossipjax as gj
    >>> result = gj.asynchrony.mpi_adpsgd(lambda x, step: x, np.ones(3), learning_rate=0.5, max_steps=4)
    >>> result.params.tolist(), result.steps, result.averages
    ([0.0625, 0.0625, 0.0625], 4, 0)

  References:
    Lian, Zhang, Zhang, Liu (2018), Asynchronous Decentralized Parallel Stochastic Gradient
    Descent, ICML.
  """
  from mpi4py import MPI

  if time_budget is None and max_steps is None:
    raise ValueError("mpi_adpsgd: give a time_budget or max_steps, so that the run ends")
  if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    raise RuntimeError("mpi_adpsgd needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple')")
  comm = comm or MPI.COMM_WORLD
  rank, size = comm.Get_rank(), comm.Get_size()
  x0 = np.ascontiguousarray(x0, np.float64).ravel()
  d = x0.size
  peers = [p for p in (range(size) if peers is None else peers) if p != rank]
  rng = np.random.default_rng([seed, rank])

  win = MPI.Win.Allocate(d * 8, 8, comm=comm)
  progress_comm = comm.Dup()
  stop = threading.Event()

  def progress():
    while not stop.is_set():
      progress_comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
      time.sleep(poll_interval)

  win.Lock(rank, MPI.LOCK_EXCLUSIVE)
  win.Put(x0, rank)
  win.Unlock(rank)
  thread = threading.Thread(target=progress, daemon=True)
  thread.start()
  comm.Barrier()

  x_self, x_peer, read = np.empty(d), np.empty(d), np.empty(d)
  steps = averages = 0
  start = time.perf_counter()
  try:
    while (max_steps is None or steps < max_steps) and (
        time_budget is None or time.perf_counter() - start < time_budget):
      win.Lock(rank, MPI.LOCK_SHARED)
      win.Get(read, rank)
      win.Unlock(rank)
      g = np.asarray(grad_fn(read.copy(), steps), np.float64).ravel()
      if peers:
        j = int(rng.choice(peers))
        first, second = sorted((rank, j))
        # Lock in rank order; each Get is flushed before the next lock so that a lazily
        # acquired lock is really held in that order.
        win.Lock(first, MPI.LOCK_EXCLUSIVE)
        win.Get(x_self if first == rank else x_peer, first)
        win.Flush(first)
        win.Lock(second, MPI.LOCK_EXCLUSIVE)
        win.Get(x_self if second == rank else x_peer, second)
        win.Flush(second)
        avg = 0.5 * (x_self + x_peer)
        x_new = avg - learning_rate * g
        win.Put(avg, j)
        win.Put(x_new, rank)
        win.Unlock(second)
        win.Unlock(first)
        averages += 1
      else:
        win.Lock(rank, MPI.LOCK_EXCLUSIVE)
        win.Get(x_self, rank)
        win.Flush(rank)
        win.Put(x_self - learning_rate * g, rank)
        win.Unlock(rank)
      steps += 1
    wall = time.perf_counter() - start
  except BaseException:
    if size == 1:
      stop.set()
      thread.join()
      raise
    traceback.print_exc()
    abort_job(comm, f"mpi_adpsgd: an exception on rank {rank} of {size}")
    raise  # MPI_Abort does not return; were it to, the exception still ends this rank
  # Every rank reaches this barrier after releasing its locks; the progress threads
  # keep answering the others until all have arrived.
  comm.Barrier()
  stop.set()
  thread.join()
  final = np.empty(d)
  win.Lock(rank, MPI.LOCK_SHARED)
  win.Get(final, rank)
  win.Unlock(rank)
  comm.Barrier()
  win.Free()
  progress_comm.Free()
  return MPIAsyncResult(final, steps, averages, wall)
