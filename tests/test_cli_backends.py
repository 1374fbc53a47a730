"""``gossipjax train --backend sharded|mpi`` reports the simulation's numbers (float32, to 1e-5)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


ARGS = ["train", "--nodes", "8", "--steps", "50", "--log-every", "25", "--no-progress", "--checkpoint-every", "0",
        "--algorithms", "dmsgd,gradient_tracking", "--topologies", "ring,one_peer_exponential"]
BIN = Path(sys.executable).parent


def _launch(cmd, timeout):
  """Runs ``cmd`` with a hard timeout that ends its whole process group (a hang fails, not stalls CI)."""
  env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", XLA_FLAGS="", JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout} s:\n{out[-3000:]}")
  assert proc.returncode == 0, out[-4000:]
  return out


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
  """The simulation's metrics, from a process of its own as the others (the tests' process runs in float64)."""
  out = tmp_path_factory.mktemp("simulate")
  _launch([BIN / "gossipjax"] + ARGS + ["--out", str(out)], 300)
  return json.loads((out / "metrics.json").read_text())


def _assert_same_metrics(got, want):
  assert set(got["runs"]) == set(want["runs"])
  for name, run in want["runs"].items():
    rows = got["runs"][name]["history"]
    assert [r["step"] for r in rows] == [r["step"] for r in run["history"]]
    for a, b in zip(rows, run["history"]):
      for key, value in b.items():
        assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, a["step"], key)


@pytest.mark.slow
def test_sharded_main_job_equals_the_simulation(simulated, tmp_path):
  _launch([BIN / "gossipjax"] + ARGS + ["--backend", "sharded", "--devices", "4", "--out", str(tmp_path)], 300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert got["config"]["devices"] == 4 and got["config"]["backend"] == "sharded"
  _assert_same_metrics(got, simulated)


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_main_job_equals_the_simulation(simulated, tmp_path):
  out = _launch([BIN / "mpiexec", "-n", "4", BIN / "gossipjax"] + ARGS + ["--backend", "mpi", "--out", str(tmp_path)],
                300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert got["config"]["devices"] == 4 and got["config"]["backend"] == "mpi"
  assert out.count("| dmsgd/ring |") == 1  # only rank 0 prints the table
  _assert_same_metrics(got, simulated)
