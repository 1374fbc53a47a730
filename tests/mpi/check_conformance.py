"""The conformance matrix under ``mpiexec -n 2``: every method, float32 and bfloat16, fresh and restored.

Launched by ``tests/test_conformance.py``. The ranks share the simulation of all 8 nodes (each
runs half the methods), then each runs its own block of 4 nodes on ``gj.backend.mpi()`` (cases
in ``conformance_cases.py``), saving and restoring its own checkpoint. Rank 0 prints
every failure of every rank, then one ``OK`` line per rank without one; a rank with a
failure exits non-zero.
"""

import sys


def main() -> int:
  import jax
  import jax.numpy as jnp

  jax.config.update("jax_enable_x64", True)  # as tests/conftest.py: the cases' dtypes are all explicit
  jax.config.update("jax_numpy_rank_promotion", "raise")
  import conformance_cases as cc

  import gossipjax as gj

  be = gj.backend.mpi()
  mine = be.node_slice(cc.N)
  block = lambda tree: jax.tree.map(lambda v: jnp.asarray(v[mine]), tree)  # noqa: E731
  h = cc.Harness("mpi", be, cc.N, place=block, place_data=block, held=mine,
                 directory=lambda d: str(gj.checkpoint.rank_directory(d, be.rank)))
  # The simulation of all 8 nodes, each rank running its share of the methods.
  names = list(cc.methods(cc.N))[be.rank::be.size]
  simulation = {}
  for part in be.comm.allgather(cc.run_all(cc.Harness("simulate", gj.backend.simulate(), cc.N), names)):
    simulation.update(part)
  errors = cc.check(f"mpi({be.size} ranks)", cc.run_all(h), simulation, mine)

  reports = be.comm.gather((be.rank, errors), root=0)
  if be.rank == 0:
    lines = [f"rank {r}: FAIL {e}" for r, errs in reports for e in errs]
    lines += [f"rank {r}/{be.size}: OK" for r, errs in reports if not errs]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
