"""Rank 2 leaves mid-run while the other ranks wait for it in a gossip exchange; the job must end, not hang.

Usage: mpiexec -n 4 python fault_rank_exits.py {exit,return}
  exit:    rank 2 calls ``sys.exit(1)`` before its second gossip step: a failure, which ends the job
           within seconds (the exit timeout keeps its default of a minute).
  return:  rank 2's ``main`` returns before its second gossip step, so the script ends with status 0;
           every rank waits at most ``EXIT_TIMEOUT`` seconds at exit for the others.
"""

import sys

import jax.numpy as jnp

import gossipjax as gj

EXIT_TIMEOUT = 3.0


def main(mode: str) -> None:
  backend = gj.backend.mpi(abort_on_error=True)  # on every rank: installs the hooks with their defaults
  if mode == "return":
    gj.backend.mpi_abort_on_error(backend.comm, exit_timeout=EXIT_TIMEOUT)  # a short wait keeps the test fast
  rank = backend.rank
  tx = gj.gossip_sgd(gj.topology.ring(8), beta=0.9, learning_rate=0.1, backend=backend)
  x = jnp.zeros((2, 3))
  state = tx.init(x)
  for step in range(4):
    if rank == 2 and step == 1:
      if mode == "exit":
        sys.exit(1)
      return
    updates, state = tx.update(jnp.ones((2, 3)), state, x)
    x = (x + updates).block_until_ready()
  print(f"rank {rank} got past the exchange: the early exit was not detected", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
