"""MPI ranks that checkpoint their own blocks of nodes into one shared directory.

Usage: mpiexec -n 4 python checkpoint_shared_dir.py DIRECTORY

Every rank saves its block (all entries equal to its rank) as step 5 of DIRECTORY, then
restores step 5; then the same with one directory per rank (``gj.checkpoint.rank_directory``),
which must work. Rank 0 prints one line per rank and operation (gathered, so that the ranks'
lines do not interleave):
``rank R: {shared,own} save ok | save refused: MESSAGE | save crashed: ERROR`` and
``rank R: {shared,own} restore got rank Q's block | restore refused: MESSAGE | restore crashed: ERROR``.
"""

import sys

import jax.numpy as jnp
from mpi4py import MPI

import gossipjax as gj

comm = MPI.COMM_WORLD
rank = comm.rank
shared = sys.argv[1]


def block(value):
  return {"params": jnp.full((2, 5), value, jnp.float32), "step": jnp.asarray(5, jnp.int32)}


def save_and_restore(directory, label):
  lines = []
  try:
    gj.checkpoint.save(directory, block(rank), step=5)
    lines.append(f"rank {rank}: {label} save ok")
  except ValueError as e:
    lines.append(f"rank {rank}: {label} save refused: {e}")
  except Exception as e:  # reported: the test fails on it
    lines.append(f"rank {rank}: {label} save crashed: {type(e).__name__}: {e}")
  comm.Barrier()
  try:
    got = gj.checkpoint.restore(directory, like=block(-1), step=5)["params"]
    lines.append(f"rank {rank}: {label} restore got rank {int(got[0, 0])}'s block")
  except ValueError as e:
    lines.append(f"rank {rank}: {label} restore refused: {e}")
  except Exception as e:  # reported: the test fails on it
    lines.append(f"rank {rank}: {label} restore crashed: {type(e).__name__}: {e}")
  return lines


lines = save_and_restore(shared, "shared") + save_and_restore(gj.checkpoint.rank_directory(shared, rank), "own")
for rank_lines in comm.gather(lines) or []:
  print("\n".join(line.replace("\n", " ") for line in rank_lines), flush=True)
