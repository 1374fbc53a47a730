"""One block of nodes per MPI rank (4 nodes each on 4 ranks); mixing is ``mpi4jax.sendrecv``.

Run: mpiexec -n 4 python examples/mpi.py      (MPI stack: `make install-mpi`)
For large models, launch with glibc's settings from ``gj.backend.mpi_launch_env`` (see the README):
  $(python -c "import gossipjax as gj; print(gj.backend.mpi_launch_prefix())") mpiexec -n 4 python examples/mpi.py
"""

import jax
import numpy as np

import _problem as p
import gossipjax as gj


def main():
  # COMM_WORLD; abort_on_error: one rank failing ends the job instead of hanging it.
  backend = gj.backend.mpi()  # a failing rank ends the job; ImportError with install steps without mpi4jax
  mine = backend.node_slice(p.NUM_NODES)  # rank r holds nodes r*B ... r*B + B - 1
  tx = p.optimizer(backend)
  x, a, b = (v[mine] for v in p.data())
  state = tx.init(x)
  step = jax.jit(p.make_step(tx, backend))
  for _ in range(p.STEPS):
    x, state = step(x, state, a, b)
  blocks = backend.comm.gather(np.asarray(x), root=0)  # only to print the global numbers
  if backend.rank == 0:
    _, a_all, b_all = p.data()
    p.report(f"mpi x{backend.size}", np.concatenate(blocks), a_all, b_all)


if __name__ == "__main__":
  main()
