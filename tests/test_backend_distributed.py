"""The sharded backend across 2 processes (jax.distributed, gloo on CPU) equals the simulation."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "mpi" / "check_distributed.py"
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
