"""Rank 2 raises while every other rank waits in a collective; the job must end, not hang.

Usage: mpiexec -n 4 python fault_rank_raises.py {mpi4py,mpi4jax,gossip,kill}
  mpi4py:  the others wait in ``comm.allreduce`` (mpi4py), rank 2 raises (gj.backend.mpi_abort_on_error installed).
  mpi4jax: the others wait in a jitted ``mpi4jax.allreduce``, rank 2 raises (gj.backend.mpi_abort_on_error installed).
  gossip:  the others take two gossip_sgd steps on the default ``gj.backend.mpi()`` (which installs the hook
           itself), rank 2 raises instead.
  kill:    rank 2 is killed by SIGKILL (no Python hook runs); mpiexec must end the job.
"""

import os
import signal
import sys
import time

from mpi4py import MPI

mode = sys.argv[1]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()

if mode != "kill":
  import gossipjax as gj

  if mode == "gossip":
    backend = gj.backend.mpi()  # on every rank (cloning the communicator is collective); aborts on error by default
  else:
    gj.backend.mpi_abort_on_error()

comm.Barrier()  # everyone is up: what follows is the failure, not a slow start
if rank == 2:
  time.sleep(0.5)  # let the others block first
  if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  raise RuntimeError(f"injected failure on rank {rank}")

if mode in ("mpi4py", "kill"):
  comm.allreduce(rank)
elif mode == "mpi4jax":
  import jax
  import jax.numpy as jnp
  import mpi4jax

  jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm))(jnp.ones(3)).block_until_ready()
else:
  import jax.numpy as jnp

  tx = gj.gossip_sgd(gj.topology.ring(8), beta=0.9, learning_rate=0.1, backend=backend)
  x = jnp.zeros((2, 3))
  state = tx.init(x)
  for _ in range(2):  # rank 0 is no neighbour of rank 2: it waits for it only from the second step on
    updates, state = tx.update(jnp.ones((2, 3)), state, x)
    x = x + updates
  x.block_until_ready()
print(f"rank {rank} got past the collective: the failure was not detected", flush=True)
sys.exit(0)
