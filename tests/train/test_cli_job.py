"""``gossipjax train``'s output folder belongs to one job, and --resume continues that job or says why not."""

import json
import os
import shutil

import pytest

from gossipjax import cli
from gossipjax.train import _job

TINY = ["train", "--nodes", "4", "--log-every", "5", "--checkpoint-every", "5", "--no-progress",
        "--algorithms", "dpsgd", "--topologies", "ring"]


def _fails(argv, capsys, status):
  """Runs the CLI, which must fail with ``status`` and one line on stderr; returns that line."""
  with pytest.raises(SystemExit) as exit_:
    cli.main(argv)
  err = capsys.readouterr().err
  assert exit_.value.code == status, err
  assert err.count("\n") == 1 and err.startswith("gossipjax train: error: ") and "Traceback" not in err, err
  return err


@pytest.fixture
def no_training(monkeypatch):
  """The job up to its first run: the folder is claimed and recorded, no training is done."""
  outs = []
  monkeypatch.setattr(cli, "_train_runs", lambda args, *rest: outs.append(args.out) or {})
  return outs


def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path, capsys, no_training):
  held = _job.OutputFolder(str(tmp_path))
  held.claim()
  try:
    err = _fails(TINY + ["--steps", "5", "--out", str(tmp_path)], capsys, 2)
    assert f"argument --out: {tmp_path} is in use by the job of pid {os.getpid()} on " in err
  finally:
    held.release()
  cli.main(TINY + ["--steps", "5", "--out", str(tmp_path)])  # once released, the folder is free
  assert no_training == [str(tmp_path)]


def test_a_new_job_leaves_another_jobs_folder_alone_unless_told_to_overwrite(tmp_path, capsys, no_training):
  (tmp_path / "checkpoints" / "dmsgd__ring" / "20").mkdir(parents=True)
  # a job.json of an earlier version, which records no paths: it wrote job.json, metrics.json, plot.png, checkpoints/
  (tmp_path / "job.json").write_text(json.dumps({"algorithms": ["dmsgd"], "topologies": ["ring"], "nodes": 4, "lr": 0.5}))
  err = _fails(TINY + ["--steps", "5", "--out", str(tmp_path)], capsys, 2)
  assert f"argument --out: {tmp_path} holds another job's job.json, checkpoints; continue that job with --resume" in err
  assert (tmp_path / "checkpoints" / "dmsgd__ring" / "20").is_dir()
  cli.main(TINY + ["--steps", "5", "--out", str(tmp_path), "--overwrite"])
  assert not (tmp_path / "checkpoints").exists()
  job = json.loads((tmp_path / "job.json").read_text())
  assert job["lr"] == 0.1 and job["files"] == ["checkpoints/dpsgd__ring", "job.json", "job.log", "metrics.json",
                                               "plot.png"]
  # what this job recorded is all that a next --overwrite removes: a file of the user's beside it is refused
  (tmp_path / "checkpoints" / "dpsgd__ring").mkdir(parents=True)
  (tmp_path / "checkpoints" / "mine.pt").write_text("mine")
  err = _fails(TINY + ["--steps", "5", "--out", str(tmp_path), "--overwrite"], capsys, 2)
  assert f"argument --out: {tmp_path} holds checkpoints/mine.pt, which no gossipjax job recorded writing" in err
  assert (tmp_path / "checkpoints" / "mine.pt").read_text() == "mine"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["new", "overwrite"])
def test_a_folder_no_job_wrote_is_refused_and_left_as_it_was(tmp_path, capsys, no_training, overwrite):
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "checkpoints" / "model.pt").write_text("the user's own")
  (tmp_path / "plot.png").write_text("the user's own too")
  err = _fails(TINY + ["--steps", "5", "--out", str(tmp_path)] + overwrite, capsys, 2)
  assert f"argument --out: {tmp_path} holds checkpoints, plot.png, which no gossipjax job recorded writing; " \
         "choose a new or empty --out" in err
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "model.pt", "plot.png"]  # not even job.lock
  assert no_training == []
  (tmp_path / "job.lock").write_text("the job of pid 1 on a host, started 2020-01-01 00:00:00\n")  # a killed job's
  shutil.rmtree(tmp_path / "checkpoints")
  (tmp_path / "plot.png").unlink()
  cli.main(TINY + ["--steps", "5", "--out", str(tmp_path)] + overwrite)  # only a lock: clearly ours
  assert no_training == [str(tmp_path)]


def test_without_out_every_job_gets_a_fresh_folder(tmp_path, monkeypatch, capsys, no_training):
  monkeypatch.chdir(tmp_path)
  cli.main(TINY + ["--steps", "5"])
  cli.main(TINY + ["--steps", "5"])  # `make demo` twice in a row
  first, second = no_training
  assert first != second and os.path.dirname(first) == os.path.dirname(second) == os.path.join("runs", "train")
  assert all((tmp_path / out / "job.json").is_file() for out in no_training)
  err = _fails(TINY + ["--steps", "5", "--resume"], capsys, 2)
  assert "argument --resume: give --out, the folder of the job to continue" in err


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_unusable_out_is_one_line(tmp_path, capsys, where):
  (tmp_path / "f").write_text("")
  out = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
  err = _fails(TINY + ["--steps", "5", "--out", str(out)], capsys, 2)
  assert "argument --out: " in err and ("is a file, not a folder" if where == "file" else "Not a directory") in err


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
  """A finished job of 15 steps, checkpointed at steps 10 and 15 (keep 2), and its metrics rows."""
  out = tmp_path_factory.mktemp("job") / "out"
  cli.main(TINY + ["--steps", "15", "--out", str(out)])
  return out, json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]


def _copy(checkpointed, tmp_path):
  out = tmp_path / "out"
  shutil.copytree(checkpointed[0], out)
  return out, out / "checkpoints" / "dpsgd__ring"


def test_orbaxs_background_errors_go_to_the_jobs_log_and_the_terminal_gets_one_line(checkpointed, tmp_path, capsys,
                                                                                    caplog, monkeypatch):
  """A write that fails inside orbax's threads (here a file-size limit, as a full disk) logs tracebacks through absl."""
  import resource
  import signal

  from gossipjax.checkpoint import _checkpoint

  out, run = _copy(checkpointed, tmp_path)
  write_step = _checkpoint._write_step

  def small_files(*args):
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, limits[1]))  # orbax writes 62 kB, the log less
    try:
      return write_step(*args)
    finally:
      resource.setrlimit(resource.RLIMIT_FSIZE, limits)
      signal.signal(signal.SIGXFSZ, handler)

  monkeypatch.setattr(_checkpoint, "_write_step", small_files)
  capsys.readouterr()
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 1)
  assert "dpsgd/ring: could not save the checkpoint of step 20" in err and f"(details in {out / 'job.log'})" in err
  assert not [r for r in caplog.records if r.name == "absl"], "orbax's records reached the terminal"
  log = (out / "job.log").read_text()
  assert "Traceback" in log and "OUT_OF_RANGE" in log and "the job failed: dpsgd/ring" in log
  assert "job.log" in json.loads((out / "job.json").read_text())["files"]


def test_resume_skips_a_corrupt_newest_step_with_one_warning(checkpointed, tmp_path, capsys):
  out, run = _copy(checkpointed, tmp_path)
  (run / "15" / "gossipjax_manifest.json").write_text("{")  # a torn write
  capsys.readouterr()
  cli.main(TINY + ["--steps", "15", "--out", str(out), "--resume"])
  err = capsys.readouterr().err
  assert err.count("warning") == 1 and "dpsgd/ring: skipping step 15, which does not restore intact" in err, err
  assert "resuming from step 10" in err
  rows = json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]
  assert [r["step"] for r in rows] == [5, 10, 15]
  assert rows == checkpointed[1]  # rows up to 10 kept, 15 recomputed: the same numbers


def test_resume_without_the_rows_of_a_checkpoint_is_one_line(checkpointed, tmp_path, capsys):
  out, run = _copy(checkpointed, tmp_path)
  (run / "history.json").unlink()
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 1)
  assert "dpsgd/ring: cannot resume from step 15: " in err and "history.json is missing" in err, err
  assert "--overwrite" in err
  assert json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"] == checkpointed[1]


def test_resume_applies_max_bad_steps_and_refuses_fewer_steps(checkpointed, tmp_path, capsys, monkeypatch):
  import gossipjax.train

  out, _ = _copy(checkpointed, tmp_path)
  err = _fails(TINY + ["--steps", "10", "--out", str(out), "--resume"], capsys, 2)
  assert "argument --steps: 10 is below step 15, where dpsgd/ring was checkpointed in" in err
  started = []

  def record(cfg, dataset, model, tx, state, **kwargs):
    started.append(state)
    raise KeyboardInterrupt  # stop before training

  monkeypatch.setattr(gossipjax.train, "timed_run", record)
  with pytest.raises(KeyboardInterrupt):
    cli.main(TINY + ["--steps", "20", "--out", str(out), "--resume", "--max-bad-steps", "3"])
  assert started[0].step == 15 and int(started[0].opt_state.max_consecutive) == 3


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_the_previous_step(checkpointed, tmp_path, capsys,
                                                                                   monkeypatch):
  import orbax.checkpoint as ocp

  from gossipjax import checkpoint

  out, run = _copy(checkpointed, tmp_path)

  def disk_full(self, directory, *args, **kwargs):  # how tensorstore reports it
    raise ValueError("OUT_OF_RANGE: Error writing local file: No space left on device")

  monkeypatch.setattr(ocp.Checkpointer, "save", disk_full)
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 1)
  assert "dpsgd/ring: could not save the checkpoint of step 20 in" in err and "No space left on device" in err, err
  assert "the previous checkpoint is intact" in err
  monkeypatch.undo()
  assert checkpoint.all_steps(run) == [10, 15] and not [p for p in run.iterdir() if p.name.startswith(".tmp")]
  cli.main(TINY + ["--steps", "15", "--out", str(out), "--resume"])  # step 15 restores: nothing left to train
  assert "warning" not in capsys.readouterr().err
  assert json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"] == checkpointed[1]


def test_resume_refuses_changed_options_unless_allowed(checkpointed, tmp_path, capsys):
  out, _ = _copy(checkpointed, tmp_path)
  for changed, shown in ((["--lr", "0.05"], "--lr 0.1, not --lr 0.05"), (["--seed", "3"], "--seed 0, not --seed 3"),
                         (["--nodes", "8"], "--nodes 4, not --nodes 8"),
                         (["--topologies", "exponential"], "--topologies ring, not --topologies exponential"),
                         (["--algorithms", "dmsgd"], "--algorithms dpsgd, not --algorithms dmsgd")):
    err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"] + changed, capsys, 2)
    assert f"argument --resume: the job in {out} was started with" in err and shown in err, err
    assert "--allow-changed-options" in err
  cli.main(TINY + ["--steps", "20", "--out", str(out), "--resume", "--lr", "0.05", "--allow-changed-options"])
  rows = json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]
  assert [r["step"] for r in rows] == [5, 10, 15, 20] and rows[:3] == checkpointed[1]
  assert json.loads((out / "job.json").read_text())["lr"] == 0.05


def test_metrics_record_the_momentum_each_run_uses(checkpointed):
  config = json.loads((checkpointed[0] / "metrics.json").read_text())["runs"]["dpsgd/ring"]["config"]
  assert config["beta"] == 0.0
