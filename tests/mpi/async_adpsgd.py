"""Run under ``mpiexec -n 4``: AD-PSGD over MPI windows with rank 3 slowed by a sleep.

Phase 1 (learning rate 0): pure asynchronous pair averaging; the sum of the models over
ranks must be conserved (a lost update would change it). Phase 2: a least-squares problem
with different data per rank; rank 3 sleeps 50x longer per gradient than the others.
Rank 0 writes both phases' per-rank results to the JSON path given as argv[1].
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from gossipjax.asynchrony import mpi_adpsgd

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SLOW, D = size - 1, 20
FAST_SLEEP, SLOW_SLEEP = 0.002, 0.1


def sleeper(grad):
  def fn(x, step):
    time.sleep(SLOW_SLEEP if rank == SLOW else FAST_SLEEP)
    return grad(x)
  return fn


# Phase 1: conservation of the sum under concurrent pair averages.
x0 = np.random.default_rng(rank).normal(size=D) + 10.0 * rank
r1 = mpi_adpsgd(sleeper(lambda x: np.ones_like(x)), x0, learning_rate=0.0, time_budget=1.0, seed=1)

# Phase 2: f_i(x) = 0.5 ||x - b_i||^2, minimized on average at mean(b).
b = np.random.default_rng(100 + rank).normal(size=D) * 3.0
r2 = mpi_adpsgd(sleeper(lambda x: x - b), np.zeros(D), learning_rate=0.05, time_budget=2.0, seed=2)

out = comm.gather(dict(x0=x0.tolist(), p1=r1.params.tolist(), s1=r1.steps, b=b.tolist(),
                       p2=r2.params.tolist(), s2=r2.steps, w2=r2.wall_time), root=0)
if rank == 0:
  with open(sys.argv[1], "w") as f:
    json.dump(out, f)
