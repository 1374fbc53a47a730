"""Kills ``gj.checkpoint.save`` with SIGKILL at each of its filesystem steps, one forked child per step.

Usage: python checkpoint_kill_points.py ROOT CASES_JSON

CASES_JSON maps a case name to ``{"template": DIR, "step": S, "value": V, "keep": K}``. For each
case, a first child saves ``tree(V)`` as step S of a copy of DIR and counts the kill points of
the save (its filesystem calls: creating, renaming, removing, opening for writing, fsync; see
`_count_calls`). Then, for every k below that count, ROOT/<case>/<k> is a fresh copy of DIR in
which a child ran the same save and killed itself (SIGKILL, so no cleanup or ``finally`` runs)
at kill point k. ROOT/results.json holds, per case, how each child ended.

The parent imports JAX but never starts its runtime (the trees are NumPy arrays), so forking it
is safe.
"""

import builtins
import json
import os
import shutil
import signal
import sys

import numpy as np
import orbax.checkpoint  # noqa: F401  (imported once here rather than in every child)

import gossipjax as gj
from gossipjax.checkpoint import _checkpoint

_OS_CALLS = ("mkdir", "rename", "replace", "link", "unlink", "remove", "rmdir", "fsync")


def tree(value):
  return {"w": np.full((64,), value, np.float32), "step": np.int32(value)}


def _count_calls(kill_at):
  """Wraps the filesystem calls; the ``kill_at``-th kill point kills the process. Returns the point counter.

  Every call that the checkpoint module makes is a kill point (just before it). A run of calls
  made elsewhere (inside ``shutil.rmtree`` or orbax) is one step of the save: its kill point
  lies after the run's first call, so that a removal or an orbax write is killed half done.
  """
  points, foreign_run = [0], [0]

  def point():
    caller = sys._getframe(2).f_globals.get("__name__")
    if caller == _checkpoint.__name__:
      foreign_run[0] = 0
    else:
      foreign_run[0] += 1
      if foreign_run[0] != 2:
        return
    if points[0] == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
    points[0] += 1

  def wrap(fn):
    def call(*args, **kwargs):
      point()
      return fn(*args, **kwargs)
    return call

  for name in _OS_CALLS:
    setattr(os, name, wrap(getattr(os, name)))
  shutil.rmtree = wrap(shutil.rmtree)
  open_ = builtins.open

  def opening(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
      point()
    return open_(file, mode, *args, **kwargs)

  builtins.open = opening
  return points


def _child(directory, case, kill_at, count_file):
  t = tree(case["value"])
  points = _count_calls(kill_at)
  gj.checkpoint.save(directory, t, step=case["step"], keep=case["keep"])
  n = points[0]
  with open(count_file, "w") as f:
    f.write(str(n))


def _run(directory, case, kill_at, count_file=None):
  shutil.copytree(case["template"], directory)
  pid = os.fork()
  if pid == 0:
    code = 0
    try:
      _child(directory, case, kill_at, count_file or os.devnull)
    except BaseException as e:  # reported to the parent, which fails the case
      print(f"child {directory}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
      code = 1
    os._exit(code)
  _, status = os.waitpid(pid, 0)
  if os.WIFSIGNALED(status):
    return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
  return f"exit {os.WEXITSTATUS(status)}"


def main():
  root, cases = sys.argv[1], json.loads(sys.argv[2])
  results = {}
  for name, case in cases.items():
    count_file = os.path.join(root, f"{name}.count")
    first = _run(os.path.join(root, name, "full"), case, None, count_file)
    if first != "exit 0":
      results[name] = {"full": first}
      continue
    with open(count_file) as f:
      n = int(f.read())
    results[name] = {"full": first, **{str(k): _run(os.path.join(root, name, str(k)), case, k) for k in range(n)}}
  with open(os.path.join(root, "results.json"), "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
