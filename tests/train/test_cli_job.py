"""``gossipjax train``'s output folder belongs to one job, and --resume continues that job or says why not."""

import hashlib
import json
import os
import pathlib
import shutil

import pytest
from _launch import exact

from gossipjax import cli
from gossipjax.train import _job

TINY = ["train", "--nodes", "4", "--log-every", "5", "--checkpoint-every", "5", "--no-progress", "--step-time", "0.01",
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
  assert job["lr"] == 0.1 and job["files"] == ["checkpoints/dpsgd__ring", "job.json", "metrics.json", "plot.png"]
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
  assert exact(rows) == exact(checkpointed[1])  # rows up to 10 kept, 15 recomputed: the same numbers


def test_resume_without_the_rows_of_a_checkpoint_is_one_line(checkpointed, tmp_path, capsys):
  out, run = _copy(checkpointed, tmp_path)
  (run / "history.json").unlink()
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 1)
  assert "dpsgd/ring: cannot resume from step 15: " in err and "history.json is missing" in err, err
  assert "--overwrite" in err
  assert exact(json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]) == \
      exact(checkpointed[1])


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
  assert exact(json.loads((out / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]) == \
      exact(checkpointed[1])


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
  assert [r["step"] for r in rows] == [5, 10, 15, 20] and exact(rows[:3]) == exact(checkpointed[1])
  assert json.loads((out / "job.json").read_text())["lr"] == 0.05


def test_a_changed_options_resume_keeps_what_each_step_ran_with(tmp_path, capsys):
  out = tmp_path / "out"
  two = [a if a != "dpsgd" else "dpsgd,dmsgd" for a in TINY]
  cli.main(two + ["--steps", "10", "--out", str(out)])
  cli.main(TINY + ["--steps", "15", "--out", str(out), "--resume", "--lr", "0.05", "--allow-changed-options"])
  metrics = json.loads((out / "metrics.json").read_text())
  assert sorted(metrics["runs"]) == ["dmsgd/ring", "dpsgd/ring"]  # the run not continued keeps its results
  assert [(r["step"], r["launch"]) for r in metrics["runs"]["dpsgd/ring"]["history"]] == [(5, 0), (10, 0), (15, 1)]
  assert [r["step"] for r in metrics["runs"]["dmsgd/ring"]["history"]] == [5, 10]
  launches = metrics["config"]["launches"]
  assert [(o["algorithms"], o["lr"]) for o in launches] == [(["dpsgd", "dmsgd"], 0.1), (["dpsgd"], 0.05)]
  assert json.loads((out / "job.json").read_text())["launches"] == launches
  capsys.readouterr()
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 2)
  assert f"the job in {out} last ran with --lr 0.05 (started with --lr 0.1), not --lr 0.1; " in err, err


def test_metrics_record_the_momentum_each_run_uses(checkpointed):
  config = json.loads((checkpointed[0] / "metrics.json").read_text())["runs"]["dpsgd/ring"]["config"]
  assert config["beta"] == 0.0


def _files(folder):
  """Every path under ``folder``: a file with the SHA-256 of its bytes, a folder as such."""
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
          for p in sorted(folder.rglob("*"))}


@pytest.fixture
def refused_first(monkeypatch):
  """The job must be refused before it builds a run (and so before anything is trained or compiled)."""
  monkeypatch.setattr(cli, "_build_runs", lambda *args: pytest.fail("the job went on past the folder's refusal"))


@pytest.mark.parametrize("mode", [["--resume"], ["--overwrite"], []], ids=["resume", "overwrite", "new"])
def test_a_folder_of_the_users_own_results_is_refused_and_left_as_it_was(tmp_path, capsys, refused_first, mode):
  (tmp_path / "metrics.json").write_text('{"my": "own results"}')
  (tmp_path / "plot.png").write_bytes(b"\x89PNG my own figure")
  before = _files(tmp_path)
  err = _fails(TINY + ["--steps", "5", "--out", str(tmp_path)] + mode, capsys, 2)
  assert f"argument --out: {tmp_path} holds metrics.json, plot.png, which no gossipjax job recorded writing; " \
         "choose a new or empty --out" in err
  assert _files(tmp_path) == before  # the same bytes, and no job.lock or job.json beside them


# A user's file at any depth of a job's folder, the names the job's own files merely begin with among them.
USERS_FILES = ("checkpoints/dpsgd__ring/my_eval.txt", "checkpoints/dpsgd__ring/15/my_eval.txt",
               "checkpoints/dpsgd__ring/15/state/mine.bin", "checkpoints/dpsgd__ring/history.json.bak",
               "job.log", "metrics.json.tmpl", "plot.png.tmp.png.old")


@pytest.mark.parametrize("mode", [["--resume"], ["--overwrite"], []], ids=["resume", "overwrite", "new"])
@pytest.mark.parametrize("users", USERS_FILES)
def test_a_users_file_at_any_depth_of_a_jobs_folder_is_refused_and_kept(checkpointed, tmp_path, capsys,
                                                                       refused_first, mode, users):
  out, _ = _copy(checkpointed, tmp_path)
  assert "job.log" not in json.loads((out / "job.json").read_text())["files"]  # the job logged nothing
  (out / users).write_text("mine")
  before = _files(out)
  err = _fails(TINY + ["--steps", "20", "--out", str(out)] + mode, capsys, 2)
  assert f"argument --out: {out} holds {users}, which no gossipjax job recorded writing" in err
  assert _files(out) == before


def test_overwrite_removes_exactly_what_the_job_wrote(checkpointed, tmp_path, no_training):
  out, run = _copy(checkpointed, tmp_path)
  (run / "15" / "gossipjax_manifest.json").unlink()  # step 15 unsealed: its files are no save's any more
  job = json.loads((out / "job.json").read_text())
  (out / "job.json").write_text(json.dumps({**job, "files": [*job["files"], "job.log"]}))
  # With the step's files now unknown to the job, the folder is refused ...
  with pytest.raises(SystemExit):
    cli.main(TINY + ["--steps", "5", "--out", str(out), "--overwrite"])
  # ... and a job's folder with a file the job did write (a listed job.log) loses that file and nothing else.
  (run / "15").rename(tmp_path / "step15")
  (out / "job.log").write_text("the job's log")
  cli.main(TINY + ["--steps", "5", "--out", str(out), "--overwrite"])
  assert not (out / "job.log").exists() and not (out / "checkpoints").exists()


def test_resume_refuses_a_jobs_folder_that_also_holds_the_users_files(checkpointed, tmp_path, capsys, refused_first):
  out, _ = _copy(checkpointed, tmp_path)
  (out / "notes.txt").write_text("what I changed")
  (out / "checkpoints" / "mine.pt").write_bytes(b"my own model")
  before = _files(out)
  err = _fails(TINY + ["--steps", "20", "--out", str(out), "--resume"], capsys, 2)
  assert f"argument --out: {out} holds checkpoints/mine.pt, notes.txt, which no gossipjax job recorded writing" in err
  assert _files(out) == before


@pytest.mark.parametrize("mode", [["--resume"], ["--overwrite"]], ids=["resume", "overwrite"])
def test_a_result_file_the_user_put_in_place_of_the_jobs_is_refused_and_kept(checkpointed, tmp_path, capsys,
                                                                            refused_first, mode):
  out, _ = _copy(checkpointed, tmp_path)
  (out / "plot.png").write_bytes(b"\x89PNG the figure I edited")
  before = _files(out)
  err = _fails(TINY + ["--steps", "20", "--out", str(out)] + mode, capsys, 2)
  assert f"argument --out: {out} holds plot.png, which is not what its job wrote there (replaced since); move it " \
         "out of the folder, or choose another --out" in err
  assert _files(out) == before


def test_result_files_are_the_jobs_whenever_their_writing_is_killed(tmp_path, monkeypatch):
  folder = _job.OutputFolder(str(tmp_path))
  folder.write_options({}, list(_job.JOB_FILES))
  write = lambda text: lambda path: pathlib.Path(path).write_text(text)
  folder.write_results({"metrics.json": write("rows 1"), "plot.png": write("figure 1")})
  assert folder.changed() == []
  replace = os.replace

  def killed_before_the_plot(src, dst):
    if dst.endswith("plot.png"):
      raise KeyboardInterrupt
    replace(src, dst)

  monkeypatch.setattr(os, "replace", killed_before_the_plot)
  with pytest.raises(KeyboardInterrupt):
    folder.write_results({"metrics.json": write("rows 2"), "plot.png": write("figure 2")})
  monkeypatch.undo()
  assert (tmp_path / "metrics.json").read_text() == "rows 2" and (tmp_path / "plot.png").read_text() == "figure 1"
  assert folder.changed() == [] and folder.foreign() == []  # either version is the job's, and no temporary is left
  (tmp_path / "plot.png").write_text("the user's figure")
  assert folder.changed() == ["plot.png"]


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_resume_where_no_job_is_starts_one_and_says_so(tmp_path, capsys, no_training, where):
  out = tmp_path / "out"
  if where == "empty":
    out.mkdir()
  cli.main(TINY + ["--steps", "5", "--out", str(out), "--resume"])
  assert capsys.readouterr().err == (f"gossipjax train: warning: argument --resume: {out} holds no job yet; starting "
                                     "one, every run from step 0\n")
  assert no_training == [str(out)] and sorted(p.name for p in out.iterdir()) == ["job.json"]
  assert json.loads((out / "job.json").read_text())["files"] == ["checkpoints/dpsgd__ring", "job.json",
                                                                 "metrics.json", "plot.png"]


@pytest.mark.parametrize("end", ["success", "error", "interrupt", "refusal"])
def test_the_job_removes_its_lock_however_it_ends(tmp_path, capsys, monkeypatch, end):
  out = tmp_path / "out"

  def train_runs(args, *rest):
    assert (out / "job.lock").read_text().startswith(f"the job of pid {os.getpid()} on ")  # held while it runs
    if end == "error":
      raise _job.JobError("a disk is full")
    if end == "interrupt":
      raise KeyboardInterrupt
    return {}

  monkeypatch.setattr(cli, "_train_runs", train_runs)
  argv = TINY + ["--steps", "5", "--out", str(out)]
  if end == "success":
    cli.main(argv)
  elif end == "interrupt":
    with pytest.raises(KeyboardInterrupt):
      cli.main(argv)
  else:  # refused once the folder is claimed, where the runs are built: no hypercube has 6 nodes
    _fails(argv + (["--topologies", "hypercube", "--nodes", "6"] if end == "refusal" else []), capsys,
           2 if end == "refusal" else 1)
  assert not (out / "job.lock").exists()
  if end == "refusal":
    assert not out.exists()  # a job that never began leaves no folder it made
  else:
    assert (out / "job.json").is_file()


def test_a_lock_file_removed_while_a_job_opened_it_is_not_taken_for_the_folders(tmp_path, capsys, monkeypatch):
  lock = str(tmp_path / "job.lock")
  opened = []

  def open_then_removed(path, flags, mode=0o777):
    fd = real_open(path, flags, mode)
    if path == lock and not opened:
      opened.append(fd)
      os.remove(path)  # the job that held it ended meanwhile, removing it
    return fd

  real_open = os.open
  first = _job.OutputFolder(str(tmp_path))
  monkeypatch.setattr(os, "open", open_then_removed)
  first.claim()
  monkeypatch.undo()
  try:
    assert opened and os.path.exists(lock)  # it locked the file that is there, not the removed one
    with pytest.raises(_job.UsageError, match="is in use by the job of pid"):
      _job.OutputFolder(str(tmp_path)).claim()
  finally:
    first.release()
  assert not os.path.exists(lock)
