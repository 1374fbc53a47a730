"""The sharded backend across 2 processes (jax.distributed, gloo on CPU) equals the simulation."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).parents[1] / "mpi" / "check_distributed.py"
PROCESSES = 2


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_simulate():
  port = free_port()
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  procs = [
      subprocess.Popen(
          [sys.executable, str(SCRIPT), str(i), str(PROCESSES), str(port)],
          cwd=SCRIPT.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          start_new_session=True,
      )
      for i in range(PROCESSES)
  ]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=240)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      os.killpg(p.pid, signal.SIGKILL)
    pytest.fail("the jax.distributed processes timed out after 240 s:\n" + "\n".join(
        (p.communicate()[0] or "")[-2000:] for p in procs))
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert f"process {i}/{PROCESSES}: OK" in out, out[-4000:]


@pytest.mark.slow
def test_multihost_example_matches_simulate_example():
  sys.path.insert(0, str(SCRIPT.parent))
  import backend_cases as cases

  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  sim = subprocess.run([sys.executable, str(cases.EXAMPLES / "simulate.py")], capture_output=True, text=True,
                       timeout=120, env=env)
  res = subprocess.run([sys.executable, str(cases.EXAMPLES / "multihost.py"), "--coordinator",
                        f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=300, env=env)
  assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
  (want,), (got,) = cases.example_numbers(sim.stdout), cases.example_numbers(res.stdout)
  assert np.allclose(got, want, rtol=1e-5), (got, want)
