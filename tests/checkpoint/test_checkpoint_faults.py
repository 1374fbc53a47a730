"""Checkpoints under faults: SIGKILL at each step of a save, concurrent writers, MPI ranks sharing a directory.

Every subprocess runs under a timeout, so a hang fails the test instead of stalling CI.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from _launch import mpiexec, run
from gossipjax import checkpoint as ckpt

HERE = pathlib.Path(__file__).parents[1]  # tests/, where the MPI scripts live in mpi/
SCRIPTS = HERE / "mpi"
sys.path.insert(0, str(SCRIPTS))
from checkpoint_kill_points import tree  # noqa: E402  (the tree the killed children save)

_LIKE = tree(0)


def _run(args, timeout, mpi_ranks=None):
  """Runs ``python args...`` (under ``mpiexec -n mpi_ranks`` if given); a run past ``timeout`` fails the test."""
  res = run([*(mpiexec(mpi_ranks) if mpi_ranks else []), sys.executable, *args], timeout)
  return res.returncode, res.stdout


def _value(directory, step):
  """The value saved as ``step``; a corrupt step fails the test (through CorruptCheckpointError)."""
  out = ckpt.restore(directory, like=_LIKE, step=step)
  value = int(out["step"])
  np.testing.assert_array_equal(out["w"], np.full(64, value, np.float32))
  return value


def _debris(directory):
  """What a directory holds besides its steps and the files that stay (the lock, the MPI owner)."""
  return sorted(p.name for p in pathlib.Path(directory).iterdir()
                if not p.name.isdigit() and p.name not in (".lock", ".mpi_rank"))


# Each case: the steps on disk before the save (step: value), then the save (step, value, keep).
_CASES = {
    "new_step": {"before": {1: 1}, "step": 2, "value": 2, "keep": None},
    "resave": {"before": {1: 1, 2: 2}, "step": 2, "value": 20, "keep": None},
    "keep_one": {"before": {1: 1, 2: 2}, "step": 3, "value": 3, "keep": 1},
}


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
  root = tmp_path_factory.mktemp("kill")
  cases = {}
  for name, case in _CASES.items():
    template = root / f"{name}-template"
    for step, value in case["before"].items():
      ckpt.save(template, tree(value), step=step)
    cases[name] = {"template": str(template), "step": case["step"], "value": case["value"], "keep": case["keep"]}
  code, out = _run([SCRIPTS / "checkpoint_kill_points.py", root, json.dumps(cases)], timeout=240)
  assert code == 0, out[-4000:]
  return root, json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("name", sorted(_CASES))
def test_sigkill_at_each_step_of_a_save_leaves_every_step_restorable(killed_saves, name):
  """Old or new, every step on disk restores; no kill loses a step that was saved before."""
  root, results = killed_saves
  case = _CASES[name]
  ends = results[name]
  assert ends.pop("full") == "exit 0"
  assert len(ends) >= 5 and all(end == "killed" for end in ends.values()), ends
  before, step, new = case["before"], case["step"], case["value"]
  for k in sorted(ends, key=int):
    d = root / name / k
    steps = ckpt.all_steps(d)
    values = {s: _value(d, s) for s in steps}
    for s, v in values.items():
      assert v in ({before.get(s), new} if s == step else {before[s]}), f"kill point {k}: {values}"
    if case["keep"] is None:
      assert set(before) <= set(steps), f"kill point {k}: step(s) {set(before) - set(steps)} lost"
    else:
      assert max(before) in steps or step in steps, f"kill point {k}: no step left ({steps})"
    # The next save clears what the killed one left behind.
    ckpt.save(d, tree(9), step=9)
    assert _debris(d) == [], f"kill point {k}"
    assert set(ckpt.all_steps(d)) == set(steps) | {9} and all(_value(d, s) == v for s, v in values.items())


def test_concurrent_writers_into_one_directory(tmp_path):
  """Two processes save into one directory at once: both finish, and every step holds one writer's tree.

  First they save different steps (even and odd), then both the same steps.
  """
  plans = {"different": [range(0, 24, 2), range(1, 24, 2)], "same": [range(12), range(12)]}
  start = tmp_path / "start"
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  procs = []
  for w in range(2):
    jobs = [str(x) for name, steps in plans.items() for x in (tmp_path / name, ",".join(map(str, steps[w])))]
    procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "checkpoint_writer.py"), str(w), str(start), *jobs],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  start.touch()
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("a checkpoint writer hung (killed after 120 s)")
  for w, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and f"writer {w} done" in out, out[-4000:]
  for name, steps in plans.items():
    d = tmp_path / name
    assert ckpt.all_steps(d) == sorted(set(steps[0]) | set(steps[1])), name
    for s in ckpt.all_steps(d):
      assert _value(d, s) in {10 * s + w for w in range(2) if s in steps[w]}, (name, s)
    assert _debris(d) == [], name


@pytest.mark.mpi
def test_mpi_ranks_sharing_a_directory_never_get_another_ranks_block(tmp_path):
  """mpiexec -n 4, one directory for all: each rank saves and restores its own block, or is refused clearly."""
  code, out = _run([SCRIPTS / "checkpoint_shared_dir.py", tmp_path / "ckpt"], timeout=180, mpi_ranks=4)
  assert code == 0, out[-4000:]
  assert "crashed" not in out, out[-4000:]
  for rank in range(4):
    lines = [line for line in out.splitlines() if line.startswith(f"rank {rank}: ")]
    assert f"rank {rank}: own save ok" in lines and f"rank {rank}: own restore got rank {rank}'s block" in lines, out
    shared = [line for line in lines if ": shared " in line]
    assert len(shared) == 2, out
    for line in shared:
      assert "block" not in line or line.endswith(f"got rank {rank}'s block"), out[-4000:]
      assert "refused" not in line or "rank_directory" in line, out[-4000:]
  assert out.count("shared save ok") == 1, out[-4000:]


def test_mpi_rank_from_the_launcher_environment(tmp_path, monkeypatch):
  """Before mpi4py starts MPI, the launcher's variables name the rank; one directory belongs to one rank."""
  monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # as if mpi4py were not imported
  monkeypatch.setenv("PMI_SIZE", "4")
  monkeypatch.setenv("PMI_RANK", "1")
  ckpt.save(tmp_path, tree(1), step=3)
  assert _value(tmp_path, 3) == 1
  monkeypatch.setenv("PMI_RANK", "2")
  with pytest.raises(ValueError, match=r"holds the checkpoints of MPI rank 1, and this is rank 2 of 4.*rank_directory"):
    ckpt.save(tmp_path, tree(2), step=4)
  with pytest.raises(ValueError, match="MPI rank 1, and this is rank 2 of 4"):
    ckpt.restore(tmp_path, like=_LIKE)
  assert ckpt.all_steps(tmp_path) == [3]
  monkeypatch.delenv("PMI_RANK")  # one process, outside MPI: every rank's checkpoint reads
  assert _value(tmp_path, 3) == 1
