"""The MPI backend under ``mpiexec -n 4`` equals the simulation; a missing mpi4jax says how to install it."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _launch import environment

import gossipjax as gj

HERE = Path(__file__).parents[1]  # tests/, where the MPI scripts live in mpi/
RANKS = 4


def launch(script: Path, ranks: int, timeout: float = 240, extra_env: dict | None = None) -> subprocess.CompletedProcess:
  """``mpiexec -n ranks python script`` with a hard timeout that ends the whole process group."""
  bin_dir = Path(sys.executable).parent
  mpiexec = bin_dir / "mpiexec"
  assert mpiexec.exists(), f"no mpiexec next to {sys.executable}: install the MPI stack with `make install-mpi`"
  env = environment(**(extra_env or {}))
  proc = subprocess.Popen(
      [str(mpiexec), "-n", str(ranks), sys.executable, str(script)],
      cwd=script.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"mpiexec -n {ranks} {script.name} timed out after {timeout} s:\n{out[-4000:]}")
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_ranks_equal_simulate():
  """One launch: every algorithm x topology case, jitted and eager, 1 and 2 nodes per rank, call counts."""
  res = launch(HERE / "mpi" / "check_mpi_equality.py", RANKS)
  assert res.returncode == 0, res.stdout[-4000:]
  ok = re.findall(rf"^rank (\d+)/{RANKS}: OK", res.stdout, flags=re.MULTILINE)
  assert sorted(map(int, ok)) == list(range(RANKS)), res.stdout[-4000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_example_matches_simulate_example():
  sys.path.insert(0, str(HERE / "mpi"))
  import backend_cases as cases

  sim = subprocess.run([sys.executable, str(cases.EXAMPLES / "simulate.py")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, XLA_FLAGS=""))
  # Launched the recommended way for large messages: glibc's settings from gj.backend.mpi_launch_env.
  res = launch(cases.EXAMPLES / "mpi.py", RANKS, timeout=120, extra_env=gj.backend.mpi_launch_env)
  assert res.returncode == 0, res.stdout[-4000:]
  (want,), (got,) = cases.example_numbers(sim.stdout), cases.example_numbers(res.stdout)
  assert np.allclose(got, want, rtol=1e-5), (got, want)


def test_mpi_backend_without_mpi4jax_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "mpi4jax", None)  # makes `import mpi4jax` raise ImportError
  with pytest.raises(ImportError, match=r"make install-mpi.*CUDA_PATH"):
    gj.backend.mpi()


@pytest.mark.mpi
def test_mpi_star_and_complete_mix_with_one_allreduce():
  """Rank-one terms under ``mpiexec -n 4``: W x on every rank's block, at 16 and at 65,536 nodes."""
  res = launch(HERE / "mpi" / "check_rank_one.py", RANKS, timeout=180)
  assert res.returncode == 0, res.stdout[-4000:]
  ok = re.findall(rf"^rank (\d+)/{RANKS}: OK", res.stdout, flags=re.MULTILINE)
  assert sorted(map(int, ok)) == list(range(RANKS)), res.stdout[-4000:]


def test_the_all_reduce_mean_sends_one_message_per_bucket():
  """allreduce_sgd and DiLoCo's outer mean: one ``mpi_allreduce`` per dtype bucket, not per leaf (one rank)."""
  pytest.importorskip("mpi4jax")
  import jax
  import jax.numpy as jnp
  import optax

  tree = {f"w{i:02d}": jnp.full((2, 3 + i), float(i), jnp.float32) for i in range(16)}
  tree["h"] = jnp.ones((2, 5), jnp.bfloat16)  # averaged in float32: it joins the float32 bucket
  for cap, messages in ((gj.backend.mpi.__kwdefaults__["bucket_bytes"], 1), (1, 17)):
    be = gj.backend.mpi(bucket_bytes=cap)
    for tx in (gj.allreduce_sgd(learning_rate=0.1, backend=be),
               gj.diloco(optax.sgd(0.1), inner_steps=2, backend=be)):
      text = jax.jit(lambda p, s, tx=tx: tx.update(p, s, p)).lower(tree, tx.init(tree)).as_text()
      assert len(re.findall(r"mpi_allreduce", text)) == messages
    got, want = jax.jit(be.mean)(tree), jax.jit(gj.backend.simulate().mean)(tree)
    for k in tree:
      assert got[k].dtype == want[k].dtype
      np.testing.assert_array_equal(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64))
