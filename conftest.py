import fcntl
import importlib.util
import os
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


# The modules that take longest, longest first. ``make test`` hands whole modules to its two pytest-xdist workers
# in collection order (``--no-loadscope-reorder``): a long module taken last would leave one worker running it
# alone at the end, so these are taken first and the short ones fill in around them.
_LONGEST_FIRST = (
    "tests/test_docs.py", "tests/test_composition.py", "tests/backend/test_backend_cluster.py",
    "tests/asynchrony/test_async_sim.py", "tests/algorithms/test_algorithms_contract.py", "tests/train/test_cli.py",
    "tests/train/test_cli_backends.py", "tests/backend/test_node_parallel.py", "tests/backend/test_backend_sharded.py",
    "tests/test_mapping.py", "tests/test_conformance.py", "tests/train/test_resume_sharded.py",
    "tests/test_performance.py", "tests/algorithms/test_outer_compressed.py",
    "tests/algorithms/test_choco_time_varying.py", "experiments/large_batch/large_batch_test.py",
)


def pytest_collection_modifyitems(config, items):
  """Puts the longest modules first (see ``_LONGEST_FIRST``); skips the tests marked ``mpi`` (they launch
  ``mpiexec``) when the MPI stack is not installed, saying how to get it."""
  rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
  reason = _mpi_missing()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=reason)
  for item in items:
    if "mpi" in item.keywords or item.nodeid.startswith(_MPI_DOCTEST_FILES):
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mpi_launches_run_alone(request, tmp_path_factory):
  """Under pytest-xdist (``make test`` runs 2 workers), a test marked ``mpi`` runs while no other test does.

  Its ranks busy-wait for each other, so a second launch, or any other test, on the same 2 cores would slow
  every rank down. The other tests share the lock; a turnstile lets a waiting MPI test in before new ones.
  """
  if "PYTEST_XDIST_WORKER" not in os.environ:
    yield
    return
  shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this run
  with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "mpi.lock", "a") as lock:
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    fcntl.flock(lock, fcntl.LOCK_EX if "mpi" in request.node.keywords else fcntl.LOCK_SH)
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
