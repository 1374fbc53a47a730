"""Subprocesses for the tests (python, ``mpiexec``, the CLI), each under a hard timeout.

A run past its timeout is killed with its whole process group and fails the test, so a
hang (a rank waiting forever, a deadlocked save) fails CI instead of stalling it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

BIN = Path(sys.executable).parent  # the venv's bin: python, gossipjax, and the mpich wheel's mpiexec
MPIEXEC = BIN / "mpiexec"


# MPICH's settings for more ranks than cores (its own CI's, for mpiexec -n 3 to 5 on 2 cores): a rank that waits
# yields its core after one poll instead of spinning, so the ranks still compiling get the cores. They change
# when a rank waits, never what it computes.
OVERSUBSCRIBED_MPICH = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                        "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}


def environment(**extra: str) -> dict[str, str]:
  """The tests' environment for a child: the venv's bin first on PATH, CPU JAX with one device, and MPICH
  set for more ranks than cores (``mpiexec -n 4`` on CI's 2)."""
  return {**os.environ, **OVERSUBSCRIBED_MPICH, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
          "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", **extra}


def mpiexec(ranks: int) -> list[str]:
  """``[mpiexec, -n, ranks]``, the prefix of an MPI launch."""
  assert MPIEXEC.exists(), f"no mpiexec next to {sys.executable}: install the MPI stack with `make install-mpi`"
  return [str(MPIEXEC), "-n", str(ranks)]


def run(cmd: Sequence[object], timeout: float, cwd: Path | str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """Runs ``cmd`` (stdout and stderr together, in ``.stdout``); past ``timeout`` s it is killed and the test fails.

  The result carries ``.seconds``, the wall time of the run.
  """
  args = [str(c) for c in cmd]
  start = time.monotonic()
  proc = subprocess.Popen(args, cwd=cwd, env=env or environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"{' '.join(a if len(a) < 80 else '...' + a[-60:] for a in args)} hung "
                f"(killed after {timeout} s):\n{out[-4000:]}")
  result = subprocess.CompletedProcess(args, proc.returncode, out, "")
  result.seconds = time.monotonic() - start
  return result


# What a metrics row measures of this machine (its wall clock, its throughput), not of the run: left out where
# rows are compared exactly.
MEASURED = ("wall_seconds", "tokens_per_second")
# And what follows from a step time measured here (none given).
TIMED = ("step_time", "sim_seconds")


def exact(rows):
  """Metrics rows without their measurements of the machine, to compare runs as floats."""
  return [{k: v for k, v in row.items() if k not in MEASURED} for row in rows]


def untimed(rows):
  """Metrics rows without the machine's measurements and the simulated clock built on its measured step time."""
  return [{k: v for k, v in row.items() if k not in MEASURED + TIMED} for row in rows]
