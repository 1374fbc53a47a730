"""MPI jobs never hang: a rank that raises or dies ends the whole job within seconds."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HANG_LIMIT = 90  # seconds; a healthy abort takes a few


def launch(args: list[str], ranks: int, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
  """``mpiexec -n ranks python args...``; a run past ``timeout`` is killed (process group) and fails the test."""
  bin_dir = Path(sys.executable).parent
  mpiexec = bin_dir / "mpiexec"
  assert mpiexec.exists(), f"no mpiexec next to {sys.executable}: install the MPI stack with `make install-mpi`"
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", XLA_FLAGS="", JAX_PLATFORMS="cpu")
  start = time.monotonic()
  proc = subprocess.Popen([str(mpiexec), "-n", str(ranks), sys.executable, *args], cwd=HERE, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"mpiexec -n {ranks} {' '.join(args)} hung (killed after {timeout} s):\n{out[-4000:]}")
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["mpi4py", "mpi4jax", "gossip", "kill"])
def test_a_failing_rank_ends_the_job(mode):
  """Rank 2 of 4 raises (or is killed) while ranks 0, 1, 3 wait for it in a collective."""
  res, elapsed = launch([str(HERE / "mpi" / "fault_rank_raises.py"), mode], ranks=4, timeout=HANG_LIMIT)
  assert res.returncode != 0, res.stdout[-3000:]
  assert "got past the collective" not in res.stdout
  if mode != "kill":
    assert "RuntimeError: injected failure on rank 2" in res.stdout, res.stdout[-3000:]
    assert "gossipjax: uncaught exception on rank 2 of 4: MPI_Abort(1) ends every rank" in res.stdout, res.stdout[-3000:]
  assert elapsed < HANG_LIMIT


def test_abort_on_error_is_a_no_op_in_a_single_process():
  import gossipjax as gj

  hook = sys.excepthook
  gj.abort_on_error()
  assert sys.excepthook is hook
