"""Ranks that build different topologies get an error naming the ranks, on every rank, when the mixer is built.

Usage: mpiexec -n 4 python fault_topologies_differ.py
Two disagreements, each caught on every rank: ``ring(4)`` on rank 1 against ``exponential(4)`` on
the others (same n, different graph), and ``ring(20)`` on rank 1 against ``ring(16)`` (same family,
different n). Rank 0 prints every rank's errors. The ranks then finish together, rank 0 a second
after the others, and the job must exit 0: a staggered but complete finish is no early exit.
"""

import sys
import time

import gossipjax as gj
from gossipjax import topology as T

EXIT_TIMEOUT = 3.0


def main() -> None:
  backend = gj.backend.mpi()
  gj.backend.mpi_abort_on_error(backend.comm, exit_timeout=EXIT_TIMEOUT)
  rank = backend.rank
  cases = [(T.ring(4), T.exponential(4)), (T.ring(20), T.ring(16))]
  errors = []
  for odd, usual in cases:
    try:
      gj.gossip_sgd(odd if rank == 1 else usual, beta=0.9, learning_rate=0.1, backend=backend)
      errors.append("accepted")
    except ValueError as e:
      errors.append(str(e))
  gathered = backend.comm.gather(errors, root=0)
  if rank == 0:
    for r, errs in enumerate(gathered):
      for e in errs:
        print(f"rank {r}: {e}", flush=True)
    time.sleep(1.0)
  sys.stdout.write(f"rank {rank} finished\n")  # one write: under PYTHONUNBUFFERED, print writes the newline apart
  sys.stdout.flush()


if __name__ == "__main__":
  main()
