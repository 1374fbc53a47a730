"""``gossipjax train --backend sharded|mpi`` reports the simulation's numbers (float32, to 1e-5)."""

import hashlib
import json
import shutil
from importlib import metadata
from pathlib import Path

import pytest
from _launch import BIN, MEASURED, untimed
from _launch import run as run_command


ARGS = ["train", "--nodes", "8", "--steps", "50", "--log-every", "25", "--no-progress", "--checkpoint-every", "0",
        "--step-time", "0.01",
        "--algorithms", "dmsgd,gradient_tracking,diloco,noloco", "--inner-steps", "5", "--topologies",
        "one_peer_exponential,random_pairs"]


def _launch(cmd, timeout):
  """Runs ``cmd`` under a hard timeout; it must succeed."""
  res = run_command(cmd, timeout)
  assert res.returncode == 0, res.stdout[-4000:]
  return res.stdout


# The language model: a small GPT on the Python standard library's sources, split by source.
GPT_ARGS = ["train", "--model", "gpt", "--nodes", "4", "--steps", "10", "--log-every", "10", "--no-progress",
            "--checkpoint-every", "0", "--step-time", "0.01", "--context", "16", "--width", "16", "--heads", "2",
            "--layers", "1", "--batch-size", "8", "--lr", "3e-3", "--inner-steps", "5", "--algorithms",
            "d_adamw,diloco", "--topologies", "ring"]


def _code_key(args) -> str:
  """A digest of what the simulated job's numbers depend on: its arguments, the package's code, the libraries."""
  digest = hashlib.sha256(json.dumps(args).encode())
  package = Path(__file__).resolve().parents[2] / "gossipjax"
  for path in sorted(package.rglob("*.py")):
    digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
  for dist in ("jax", "jaxlib", "flax", "optax", "numpy"):
    digest.update(f"{dist}=={metadata.version(dist)}".encode())
  return digest.hexdigest()[:16]


def _simulate(args, tmp_path_factory, request):
  """The simulation's metrics, from a process of its own as the others (the tests' process runs in float64).

  ``make test`` runs the MPI test in a second pytest session: the first session's simulated job, kept in pytest's
  cache under a digest of the code and the arguments, serves both, and any change to either runs it again.
  """
  cache, key = getattr(request.config, "cache", None), f"gossipjax/cli_backends/simulated/{_code_key(args)}"
  if cache is not None and (kept := cache.get(key, None)) is not None:
    return kept
  out = tmp_path_factory.mktemp("simulate")
  _launch([BIN / "gossipjax"] + args + ["--out", str(out)], 300)
  metrics = json.loads((out / "metrics.json").read_text())
  if cache is not None:
    cache.set(key, metrics)
  return metrics


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, request):
  return _simulate(ARGS, tmp_path_factory, request)


@pytest.fixture(scope="module")
def simulated_gpt(tmp_path_factory, request):
  return _simulate(GPT_ARGS, tmp_path_factory, request)


def _only(args, algorithms, topologies=None):
  """``args`` running only ``algorithms`` (on ``topologies``): a job's runs do not depend on each other."""
  args = list(args)
  args[args.index("--algorithms") + 1] = algorithms
  if topologies:
    args[args.index("--topologies") + 1] = topologies
  return args


def _assert_same_metrics(got, want, rel=1e-5, runs=None):
  """``got`` reports ``want``'s numbers, for each of ``want``'s runs (or only those of ``runs``)."""
  assert set(got["runs"]) == set(runs or want["runs"])
  for name, run in want["runs"].items():
    if name not in got["runs"]:
      continue
    rows = got["runs"][name]["history"]
    assert [r["step"] for r in rows] == [r["step"] for r in run["history"]]
    for a, b in zip(rows, run["history"]):
      for key, value in b.items():
        if key not in MEASURED:
          assert a[key] == pytest.approx(value, rel=rel, abs=1e-6), (name, a["step"], key)


@pytest.mark.slow
def test_sharded_main_job_equals_the_simulation(simulated, tmp_path):
  _launch([BIN / "gossipjax"] + ARGS + ["--backend", "sharded", "--devices", "4", "--out", str(tmp_path)], 300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert got["config"]["devices"] == 4 and got["config"]["backend"] == "sharded"
  _assert_same_metrics(got, simulated)


@pytest.mark.slow
def test_sharded_language_model_job_equals_the_simulation(simulated_gpt, tmp_path):
  _launch([BIN / "gossipjax"] + GPT_ARGS + ["--backend", "sharded", "--devices", "4", "--out", str(tmp_path)], 300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  want = simulated_gpt["runs"]["d_adamw/ring"]["history"][-1]
  assert want["test_loss"] < 5.0 and want["tokens_per_second"] > 0 and len(want["node_test_loss"]) == 4
  assert want["sim_seconds"] > 10 * 0.01  # the steps' compute and the exchanges on the default datacenter links
  _assert_same_metrics(got, simulated_gpt)


@pytest.mark.slow
def test_nodes_of_two_devices_equal_the_simulation(simulated, tmp_path):
  """--devices-per-node 2: 4 groups of 2 devices, each node's batch split over its group's devices (a gossip run
  and a pairing run: the others place their nodes as these do)."""
  args = _only(ARGS, "gradient_tracking,noloco", "random_pairs")
  _launch([BIN / "gossipjax"] + args + ["--backend", "sharded", "--devices", "8", "--devices-per-node", "2",
                                        "--out", str(tmp_path)], 300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert got["config"]["devices"] == 8 and got["config"]["devices_per_node"] == 2  # every device the job used
  _assert_same_metrics(got, simulated, runs={"gradient_tracking/random_pairs", "noloco/random_pairs"})


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_main_job_equals_the_simulation(simulated, tmp_path):
  """2 ranks of 4 nodes, a gossip run and an outer-step run of the simulated job: every rank compiles every run's
  programs, and 4 ranks on CI's 2 cores took 2.5x as long. The backend's exchanges among 4 ranks, for every
  method, are tests/mpi/check_mpi_equality.py's and the conformance matrix's."""
  args = _only(ARGS, "dmsgd,diloco", "one_peer_exponential")
  out = _launch([BIN / "mpiexec", "-n", "2", BIN / "gossipjax"] + args + ["--backend", "mpi", "--out", str(tmp_path)],
                300)
  got = json.loads((tmp_path / "metrics.json").read_text())
  assert got["config"]["devices"] == 2 and got["config"]["backend"] == "mpi"
  assert out.count("| dmsgd/one_peer_exponential |") == 1  # only rank 0 prints the table
  _assert_same_metrics(got, simulated, runs={"dmsgd/one_peer_exponential", "diloco"})


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_language_model_job_equals_the_simulation(simulated_gpt, tmp_path):
  args = _only(GPT_ARGS, "d_adamw")  # DiLoCo's outer step under MPI: the main job's test above
  _launch([BIN / "mpiexec", "-n", "2", BIN / "gossipjax"] + args + ["--backend", "mpi", "--out", str(tmp_path)], 300)
  _assert_same_metrics(json.loads((tmp_path / "metrics.json").read_text()), simulated_gpt, runs={"d_adamw/ring"})


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_ranks_resume_from_the_newest_step_every_rank_has(tmp_path):
  """A kill while the ranks were saving step 10 left rank 1 at step 5: every rank resumes from 5."""
  cmd = [BIN / "mpiexec", "-n", "2", BIN / "gossipjax", "train", "--backend", "mpi", "--nodes", "4", "--steps", "10",
         "--log-every", "5", "--checkpoint-every", "5", "--no-progress", "--algorithms", "dpsgd", "--topologies",
         "ring", "--out", str(tmp_path)]
  _launch(cmd, 300)
  first = json.loads((tmp_path / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]
  shutil.rmtree(tmp_path / "checkpoints" / "dpsgd__ring" / "rank_1" / "10")
  (tmp_path / "metrics.json").unlink()
  _launch(cmd + ["--resume"], 300)
  assert untimed(json.loads((tmp_path / "metrics.json").read_text())["runs"]["dpsgd/ring"]["history"]) == untimed(first)
