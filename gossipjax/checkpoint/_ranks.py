"""Which MPI rank a checkpoint directory belongs to: each rank saves its own block of nodes on its own."""

from __future__ import annotations

import os
import pathlib
import sys
import uuid
from typing import Any

import jax

_OWNER = ".mpi_rank"
_STAGED_PREFIX = ".tmp-"  # staged like a save in progress, so a killed claim is cleared as debris


def _mpi_rank() -> tuple[int, int] | None:
  """``(rank, size)`` when this process is one of several MPI ranks that each run their own JAX, else None.

  Such ranks save independently (each holds its own block of nodes), unlike the processes of
  a multi-controller JAX job (``jax.distributed``), which orbax coordinates. The rank is read
  from mpi4py once the program has started MPI, else from the launcher's environment.
  """
  if jax.process_count() > 1:
    return None
  mpi = sys.modules.get("mpi4py.MPI")
  if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
    rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
  else:
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
      if rank_var in os.environ and size_var in os.environ:
        rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
        break
    else:
      return None
  return (rank, size) if size > 1 else None


def _rank_refusal(where: Any, owner: int, mpi: tuple[int, int]) -> str:
  return (f"gj.checkpoint: {where} holds the checkpoints of MPI rank {owner}, and this is rank {mpi[0]} of {mpi[1]}; "
          "ranks that share a checkpoint directory would overwrite and restore each other's nodes. Give each rank "
          "its own directory: gj.checkpoint.rank_directory(path, rank)")


def _claim(directory: pathlib.Path, mpi: tuple[int, int] | None) -> None:
  """Under MPI, records this rank as the owner of ``directory``; raises ValueError if another rank owns it."""
  if mpi is None:
    return
  owner = directory / _OWNER
  staged = directory / f"{_STAGED_PREFIX}rank-{uuid.uuid4().hex}"
  staged.write_text(str(mpi[0]))
  try:
    os.link(staged, owner)  # atomic: of ranks racing for the directory, one wins
  except FileExistsError:
    pass
  finally:
    staged.unlink()
  holder = int(owner.read_text())
  if holder != mpi[0]:
    raise ValueError(_rank_refusal(directory, holder, mpi))


def rank_directory(directory: str | os.PathLike, rank: int) -> pathlib.Path:
  """``directory/rank_<rank>``: where one MPI rank keeps the checkpoints of its own nodes.

  Each MPI rank holds its own block of nodes and saves them on its own, so ranks must not
  share a checkpoint directory (`save` refuses a directory another rank saves into).

  Args:
    directory: the checkpoint directory shared by the run.
    rank: this process's MPI rank (``comm.rank``).

  Returns:
    The rank's own directory, as a ``pathlib.Path`` (not created here; `save` creates it).

  Example:
    >>> import gossipjax as gj
    >>> gj.checkpoint.rank_directory("runs/ckpt", 3).as_posix()
    'runs/ckpt/rank_3'
  """
  return pathlib.Path(directory) / f"rank_{int(rank)}"
