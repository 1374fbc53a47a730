"""kill -9 and Ctrl-C of ``gossipjax train`` at random moments around its checkpoint writes, then --resume.

The resumed job must end with the metrics of an uninterrupted run, every row exactly once.
Ctrl-C (SIGINT to the process group, as a terminal sends it) must end the process within
10 s with exit status 130 and one line that says how to continue.
Every process runs under a timeout, so a hang fails the test instead of stalling CI.
"""

import json
import os
import random
import signal
import subprocess
import time

import pytest

from _launch import BIN, environment, exact

ARGS = ["train", "--nodes", "4", "--steps", "100", "--log-every", "5", "--checkpoint-every", "5", "--no-progress",
        "--step-time", "0.01",
        "--algorithms", "dpsgd", "--topologies", "ring"]
TIMEOUT = 120  # seconds per process; a healthy one takes a few


def _start(out, *extra, env):
  return subprocess.Popen([str(BIN / "gossipjax"), *ARGS, "--out", str(out), *extra], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc):
  try:
    out = proc.communicate(timeout=TIMEOUT)[0]
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"gossipjax train hung (killed after {TIMEOUT} s):\n{proc.communicate()[0][-4000:]}")
  return proc.returncode, out


def _mtime(path):
  try:
    return path.stat().st_mtime_ns
  except FileNotFoundError:
    return None


def _rows(out):
  return json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]


@pytest.mark.slow
def test_interrupts_around_checkpoint_writes_then_resume_equal_an_uninterrupted_run(tmp_path):
  # One compilation shared by every process (the test's time goes to the kills, not to XLA).
  env = environment(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  straight = _start(tmp_path / "straight", env=env)
  out = tmp_path / "killed"
  history = out / "checkpoints" / "dpsgd__ring" / "history.json"
  rng = random.Random(0)  # the delays; where they land varies with the machine
  # 100 steps: room for four kills after a resume even where a step takes a millisecond.
  killed = 0
  for attempt in range(4):
    sig = (signal.SIGINT, signal.SIGKILL)[attempt % 2]  # Ctrl-C, then kill -9, in turn
    before = _mtime(history)
    proc = _start(out, *(["--resume"] if attempt else []), env=env)
    deadline = time.monotonic() + TIMEOUT
    # The rows are written just before each checkpoint: a kill shortly after lands in or around a save.
    while proc.poll() is None and _mtime(history) == before and time.monotonic() < deadline:
      time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.4))
    if proc.poll() is None:
      os.killpg(proc.pid, sig)
      sent = time.monotonic()
      killed += 1
      code, log = _finish(proc)
      if sig == signal.SIGINT:
        assert time.monotonic() - sent < 10, log[-4000:]
        assert code == 130 and log.count("\n") == 1, log[-4000:]
        assert log.startswith("gossipjax train: interrupted ") and "add --resume to the same command" in log, log
      else:
        assert code == -signal.SIGKILL, log[-4000:]
    else:
      code, log = _finish(proc)
      assert code == 0, log[-4000:]
  code, log = _finish(_start(out, "--resume", env=env))
  assert code == 0, log[-4000:]
  code, log = _finish(straight)
  assert code == 0, log[-4000:]
  assert killed >= 3, f"only {killed} of 4 runs were killed before they finished"
  rows = _rows(out)
  assert [r["step"] for r in rows] == list(range(5, 105, 5))
  assert exact(rows) == exact(_rows(tmp_path / "straight"))  # every metric equal as floats, every row once


# Ctrl-C where the command line's own thread does not hear it first, each in a process that installs the
# interruption as `gossipjax.cli.main` does; the main thread must unwind and the process end in one line.
_SCRIPT = """
import os, signal, sys, threading, time
from gossipjax._interrupt import Interruption
started = threading.Event()
def early():  # a thread an import started before the command line blocked SIGINT: it still takes the signal
  started.set()
  threading.Event().wait()
thread = threading.Thread(target=early, daemon=True)
thread.start()
started.wait()
def spin(seconds=20):
  end = time.monotonic() + seconds
  while time.monotonic() < end:  # Python code: it unwinds at once
    pass
def slow_hook(unraisable):  # the hook the interruption hands other ignored errors to; Ctrl-C comes inside it
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(0.3)
  spin(0.3)
asked = []  # how often the interruption asked to be raised again once out of the hook: once
def again_after(self, ask=Interruption._again_after):
  asked.append(1)
  ask(self)
Interruption._again_after = again_after
if sys.argv[1] == "inside_the_hook":
  sys.unraisablehook = slow_hook
interruption = Interruption(lambda: "interrupted at step 7")
assert interruption.install()
class Failing:
  def __del__(self):
    raise ValueError("ignored")
class Collected:
  def __del__(self):  # Python ignores what a __del__ (or a garbage-collection callback) raises
    os.kill(os.getpid(), signal.SIGINT)
    spin()
try:
  try:
    if sys.argv[1] == "early_thread":
      signal.pthread_kill(thread.ident, signal.SIGINT)
    elif sys.argv[1] == "inside_the_hook":
      Failing()
    else:
      Collected()
    spin()
  finally:
    print("unwound" if len(asked) <= 1 else f"unwound, asked {len(asked)} times", flush=True)
except KeyboardInterrupt:
  assert interruption.fired
  interruption.exit()
"""


@pytest.mark.parametrize("where", ["early_thread", "ignored_by_python", "inside_the_hook"])
def test_ctrl_c_wherever_python_meets_it_is_one_line_and_status_130(where):
  started = time.monotonic()
  proc = subprocess.run([str(BIN / "python"), "-c", _SCRIPT, where], capture_output=True, text=True, timeout=60,
                        env=environment())
  assert time.monotonic() - started < 15, proc
  assert proc.returncode == 130 and proc.stderr == "interrupted at step 7\n", proc
  assert proc.stdout == "unwound\n", proc  # the main thread ran its finally blocks first
