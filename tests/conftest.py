import os

# 8 CPU devices for the sharded and pmapped backends; XLA reads this when jax first loads.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax

# float64 so that trajectories can be compared to NumPy references at round-off, and
# rank promotion raises so that a (nodes,) vs (nodes, d) broadcast slip fails loudly.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

import importlib.util
import sys
from pathlib import Path

import pytest

# Test modules in the subfolders import the shared helpers (``_launch``) from here.
sys.path.insert(0, str(Path(__file__).parent))


def _mpi_missing() -> str | None:
  """Why the MPI tests cannot run here, or ``None`` when mpi4py, mpi4jax and mpiexec are all installed."""
  missing = [m for m in ("mpi4py", "mpi4jax") if importlib.util.find_spec(m) is None]
  if not (Path(sys.executable).parent / "mpiexec").exists():
    missing.append("mpiexec")
  if not missing:
    return None
  return (f"the MPI tests need {', '.join(missing)}: run `make install-mpi` (or `make test`, which installs "
          "the MPI stack first) to run them")


def pytest_collection_modifyitems(config, items):
  """Skips the tests marked ``mpi`` (they launch ``mpiexec``) when the MPI stack is not installed, saying how to get it."""
  reason = _mpi_missing()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=reason)
  for item in items:
    if "mpi" in item.keywords:
      item.add_marker(skip)
