"""Run under ``mpiexec -n 3``: rank 1's gradient raises at its third step while the others train for a minute.

The job must end within seconds (rank 1 aborts it), not after the others' time budget, nor hang
at the final barrier. Nothing here calls ``gj.backend.mpi_abort_on_error``.
"""

import time

import numpy as np
from mpi4py import MPI

from gossipjax.asynchrony import mpi_adpsgd

rank = MPI.COMM_WORLD.Get_rank()


def grad(x, step):
  time.sleep(0.002)
  if rank == 1 and step == 2:
    raise RuntimeError("injected failure in grad_fn on rank 1")
  return x


mpi_adpsgd(grad, np.ones(4), learning_rate=0.1, time_budget=60.0)
print(f"rank {rank} finished its time budget: the failure was not detected", flush=True)
