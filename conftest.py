import importlib.util
import sys
from pathlib import Path

import pytest

# Scripts launched by the tests under mpiexec or as subprocesses: not modules to import during collection.
collect_ignore_glob = ["tests/mpi/*", "examples/*", "benchmarks/*"]

# Doctests that start MPI (as one rank): they need mpi4py and mpi4jax, as the tests marked ``mpi`` do.
_MPI_DOCTEST_FILES = ("gossipjax/backend/_mpi.py", "gossipjax/backend/_mpi_fault.py", "gossipjax/asynchrony/_mpi_async.py")

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
    if "mpi" in item.keywords or item.nodeid.startswith(_MPI_DOCTEST_FILES):
      item.add_marker(skip)
