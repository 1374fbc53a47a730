"""``gossipjax train --resume`` equals the run that was never stopped, on the sharded backend too."""

import json

import jax
import numpy as np
import pytest
from _launch import untimed

from gossipjax import cli
from gossipjax.train import _job

BASE = ["train", "--nodes", "4", "--log-every", "3", "--checkpoint-every", "3", "--no-progress", "--topologies",
        "ring", "--algorithms", "dmsgd,diloco", "--inner-steps", "2", "--seed", "3"]


@pytest.fixture
def saved(monkeypatch):
  """The params of every checkpoint the job saves, as host arrays, by (run, step)."""
  params = {}
  save = _job.RunCheckpoints.save

  def recording(self, state, rows):
    save(self, state, rows)
    params[self.name, state.step] = jax.tree.map(np.asarray, state.params)

  monkeypatch.setattr(_job.RunCheckpoints, "save", recording)
  return params


def _job_rows(out, steps, backend, resume=False):
  cli.main(BASE + ["--steps", str(steps), "--out", str(out)] + backend + (["--resume"] if resume else []))
  return {name: run["history"] for name, run in json.loads((out / "metrics.json").read_text())["runs"].items()}


@pytest.mark.parametrize("backend", [
    ["--backend", "sharded", "--devices", "2"],
    ["--backend", "sharded", "--devices", "4", "--devices-per-node", "2"],
    ["--backend", "simulate"],
], ids=["sharded", "nodes-of-2-devices", "simulate"])
def test_resume_after_a_clean_stop_equals_the_uninterrupted_run(tmp_path, backend, saved, capsys):
  """6 steps straight, against 3 steps, a clean stop and --resume to 6 (DiLoCo stops mid-round)."""
  want = _job_rows(tmp_path / "straight", 6, backend)
  want_params = {name: saved.pop((name, 6)) for name in want}
  _job_rows(tmp_path / "stopped", 3, backend)
  got = _job_rows(tmp_path / "stopped", 6, backend, resume=True)
  capsys.readouterr()
  assert set(got) == set(want) == {"dmsgd/ring", "diloco"}, set(got)
  for name in want:
    assert [r["step"] for r in got[name]] == [r["step"] for r in want[name]] == [3, 6]
    assert untimed(got[name]) == untimed(want[name]), name  # every metric of the run equal as floats
    jax.tree.map(np.testing.assert_array_equal, saved[name, 6], want_params[name])
