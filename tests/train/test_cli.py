import argparse
import json
import math
import re

import pytest
from _launch import exact
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipjax import cli


@pytest.mark.slow
def test_train_writes_metrics_plot_and_table(tmp_path, capsys):
  out = tmp_path / "run"
  results = cli.main(["train", "--steps", "50", "--log-every", "25", "--nodes", "8", "--no-progress",
                      "--algorithms", "allreduce,dmsgd,decentlam", "--topologies", "ring,exponential",
                      "--out", str(out)])
  printed = capsys.readouterr().out
  metrics = json.loads((out / "metrics.json").read_text())
  assert set(metrics["runs"]) == {"allreduce", "dmsgd/ring", "dmsgd/exponential", "decentlam/ring"}
  assert "decentlam/exponential" in metrics["config"]["skipped"]
  assert "symmetric W" in metrics["config"]["skipped"]["decentlam/exponential"]
  hist = metrics["runs"]["dmsgd/ring"]["history"]
  assert [h["step"] for h in hist] == [25, 50]
  assert hist[-1]["train_loss"] < hist[0]["train_loss"] * 1.5  # it trains (or at least does not blow up)
  assert metrics["runs"]["allreduce"]["history"][-1]["consensus_distance"] < 1e-10
  assert (out / "plot.png").stat().st_size > 10_000
  seconds = [h["sim_seconds"] for h in hist]  # measured compute plus the ring's exchanges on datacenter links
  assert 0 < seconds[0] < seconds[1] and all(h["step_time"] > 0 for h in hist)
  assert "| dmsgd/ring |" in printed and "skipped decentlam/exponential" in printed
  assert results is None


BAD_OPTIONS = [
    (["--log-every", "-25"], "argument --log-every: -25 is out of range; it must be a positive integer"),
    (["--steps", "0"], "argument --steps: 0 is out of range"),
    (["--nodes", "0"], "argument --nodes: 0 is out of range; it must be an integer of at least 2"),
    (["--algorithms", "magic"], "argument --algorithms: unknown algorithm 'magic'; choose from: allreduce"),
    (["--topologies", "moebius"], "argument --topologies: unknown topology 'moebius'; choose from: ring"),
    (["--lr", "nan"], "argument --lr: nan is out of range; it must be a finite number > 0"),
    (["--lr", "-1"], "argument --lr: -1.0 is out of range"),
    (["--lr", "inf"], "argument --lr: inf is out of range"),
    (["--beta", "1"], "argument --beta: 1.0 is out of range; it must be a number in [0, 1)"),
    (["--batch-size", "x"], "argument --batch-size: 'x' is not an integer"),
    (["--algorithms", "noloco", "--topologies", "ring,exponential"], "argument --topologies: no run is left, every "
     "algorithm is skipped on ring, exponential (noloco/ring: gj.noloco: topology must pair the nodes"),
    (["--checkpoint-every", "30"], "argument --checkpoint-every: 30 must be a multiple of --log-every (25)"),
    (["--topologies", "hypercube", "--nodes", "12", "--steps", "25"], "argument --topologies: hypercube on --nodes 12"),
    (["--devices", "2"], "argument --devices: only the sharded backend takes it"),
    (["--backend", "sharded", "--devices", "3", "--nodes", "8"], "argument --nodes: 8 nodes do not split evenly over 3"),
    (["--allow-changed-options"], "argument --allow-changed-options: only with --resume"),
    (["--seed", "18446744073709551616"], "argument --seed: 18446744073709551616 is out of range; it must be an integer"),
    (["--nodes", "2000"], "argument --nodes: 2000 nodes, but the digits' training set has 1347 samples"),
    (["--out", ""], "argument --out: give a folder, not an empty string"),
    (["--resume", "--overwrite"], "argument --overwrite: not with --resume"),
    (["--average-every", "3000000000"], "argument --average-every: 3000000000 is out of range; it must be a positive "
     "integer of at most 2**31 - 1"),
    (["--inner-steps", str(2**31)], f"argument --inner-steps: {2**31} is out of range"),
    (["--outer-lr", "1e300"], "argument --outer-lr: 1e+300 is out of range; it must be a number in (0, 1000]"),
    (["--algorithms", "dmsgd,noloco", "--inner-steps", "100", "--steps", "20", "--log-every", "10"],
     "argument --inner-steps: 100 is more than --steps 20, so noloco would never end a round"),
    (["--algorithms", "streaming_diloco", "--inner-steps", "3"], "argument --fragments: streaming_diloco syncs one of "
     "4 fragments every --inner-steps / --fragments steps; give --inner-steps (3) at least --fragments"),
    (["--algorithms", "streaming_diloco", "--inner-steps", "8", "--overlap", "2"], "argument --overlap: 2 must be "
     "below --inner-steps / --fragments = 2"),
    (["--algorithms", "streaming_diloco", "--inner-steps", "10", "--fragments", "5"], "argument --fragments: 5 "
     "fragments, but the mlp's params have 4 leaves"),
    (["--mixing", "1.5"], "argument --mixing: 1.5 is out of range; it must be a number in [0, 1]"),
    (["--algorithms", "dmsgd,diloco", "--checkpoint-every", "50"], "argument --checkpoint-every: 50 must be a "
     "multiple of each run's --log-every (25 for dmsgd; 20 for diloco)"),
    (["--model", "gpt", "--partition", "by_class"], "argument --partition: by_class splits by class label; a text "
     "corpus takes iid or by_source"),
    (["--partition", "by_source"], "argument --partition: by_source splits a text corpus by file; the mlp trains on "
     "the digits"),
    (["--text", "notes.txt"], "argument --text: only --model gpt trains on text, not --model mlp"),
    (["--model", "gpt", "--text", "no/such/path"], "argument --text: "),
    (["--model", "gpt", "--width", "30", "--heads", "4"], "argument --heads: 4 does not divide --width 30"),
    (["--network", "fast"], "argument --network: "),
    (["--step-time", "-1"], "argument --step-time: -1.0 is out of range"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_options_fail_with_one_line_and_status_2(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["train", "--no-progress", "--out", str(tmp_path)] + argv)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("gossipjax train: error: ") and message in err, err
  assert "Traceback" not in err and not (tmp_path / "metrics.json").exists()


@settings(max_examples=40, deadline=None)
@given(option=st.sampled_from(["--nodes", "--steps", "--batch-size", "--log-every", "--seed", "--max-bad-steps",
                               "--checkpoint-every", "--devices"]),
       value=st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=4)))
def test_integer_options_parse_or_name_themselves(option, value):
  low = {"--nodes": 2, "--seed": 0, "--max-bad-steps": 0, "--checkpoint-every": 0}.get(option, 1)
  parser = cli.build_parser()
  try:
    args = parser.parse_args(["train", f"{option}={value}"])
  except SystemExit as e:
    assert e.code == 2
    with pytest.raises(argparse.ArgumentTypeError, match="integer"):
      parser._subparsers._group_actions[0].choices["train"]._option_string_actions[option].type(value)
  else:
    parsed = getattr(args, option[2:].replace("-", "_"))
    assert parsed == int(value) and parsed >= low


@settings(max_examples=40, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_learning_rate_parses_only_finite_positive_numbers(value):
  parser = cli.build_parser()
  ok = math.isfinite(value) and value > 0
  try:
    args = parser.parse_args(["train", f"--lr={value!r}"])
  except SystemExit as e:
    assert e.code == 2 and not ok
  else:
    assert ok and args.lr == value


@pytest.mark.slow
def test_resume_continues_bit_for_bit(tmp_path):
  # Momentum on a time-varying W, whose index resumes with the step; tests/train/test_cli_kill.py kills a job for real.
  # A given --step-time: sim_seconds is then exact as the other metrics (measured, it is this machine's timing).
  common = ["train", "--nodes", "8", "--log-every", "25", "--checkpoint-every", "25", "--no-progress", "--step-time", "0.01",
            "--algorithms", "dmsgd", "--topologies", "one_peer_exponential"]
  cli.main(common + ["--steps", "50", "--out", str(tmp_path / "straight")])
  cli.main(common + ["--steps", "25", "--out", str(tmp_path / "split")])  # "dies" at step 25
  # Mark the saved rows: a resumed run keeps them, a run that silently restarted would not.
  for hist in (tmp_path / "split" / "checkpoints").glob("*/history.json"):
    rows = json.loads(hist.read_text())
    rows[0]["marker"] = 1.0
    hist.write_text(json.dumps(rows))
  cli.main(common + ["--steps", "50", "--resume", "--out", str(tmp_path / "split")])
  straight = json.loads((tmp_path / "straight" / "metrics.json").read_text())["runs"]
  resumed = json.loads((tmp_path / "split" / "metrics.json").read_text())["runs"]
  assert set(straight) == set(resumed) == {"dmsgd/one_peer_exponential"}
  for name in straight:
    assert [h["step"] for h in resumed[name]["history"]] == [25, 50]
    assert resumed[name]["history"][0].pop("marker") == 1.0
    # the run's seconds count the part before the resume too
    assert resumed[name]["seconds"] > resumed[name]["history"][0]["wall_seconds"] > 0
    for a, b in zip(straight[name]["history"], resumed[name]["history"]):
      assert exact([a]) == exact([b])  # every metric equal as floats, not just close


@pytest.mark.slow
def test_exact_methods_run_and_static_only_ones_skip_time_varying_graphs(tmp_path):
  cli.main(["train", "--steps", "25", "--nodes", "8", "--no-progress", "--out", str(tmp_path),
            "--algorithms", "gradient_tracking,extra", "--topologies", "one_peer_exponential"])
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert set(metrics["runs"]) == {"gradient_tracking/one_peer_exponential"}
  assert "needs a static W" in metrics["config"]["skipped"]["extra/one_peer_exponential"]


@pytest.mark.slow
def test_every_algorithm_and_the_cnn_run_without_checkpoints_by_default(tmp_path):
  cli.main(["train", "--steps", "5", "--log-every", "5", "--nodes", "4", "--no-progress", "--out", str(tmp_path),
            "--model", "cnn", "--algorithms", "choco,sgp,dmsgd_pga,d_adam,easgd", "--topologies", "ring",
            "--compressor", "sign", "--consensus-step", "0.2", "--average-every", "5"])
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert set(metrics["runs"]) == {"choco/ring", "sgp/ring", "dmsgd_pga/ring", "d_adam/ring", "easgd"}
  assert metrics["runs"]["dmsgd_pga/ring"]["history"][-1]["consensus_distance"] < 1e-10  # averaged at step 5
  assert metrics["config"]["compressor"] == "sign" and metrics["config"]["model"] == "cnn"
  assert not (tmp_path / "checkpoints").exists()  # checkpoints are opt-in


def test_exact_methods_skip_a_directed_graph_saying_why():
  import gossipjax as gj

  args = cli.build_parser().parse_args(["train", "--nodes", "8", "--algorithms", "exact_diffusion,extra,dpsgd",
                                        "--topologies", "exponential"])
  runs, _, skipped = cli._build_runs(args, gj.backend.simulate())
  assert [r.name for r in runs] == ["dpsgd/exponential"]
  assert set(skipped) == {"exact_diffusion/exponential", "extra/exponential"}
  assert all("needs a symmetric W" in why and "gj.gradient_tracking" in why for why in skipped.values())
  args = cli.build_parser().parse_args(["train", "--nodes", "8", "--algorithms", "noloco,dpsgd", "--topologies",
                                        "ring,random_pairs"])
  runs, _, skipped = cli._build_runs(args, gj.backend.simulate())  # noloco runs on the pairing it is given
  assert [r.name for r in runs] == ["noloco/random_pairs", "dpsgd/ring", "dpsgd/random_pairs"]
  assert "use gj.topology.random_pairs(8)" in skipped["noloco/ring"]


def test_plot_legend_gives_each_algorithm_its_real_momentum():
  from gossipjax.train._report import _label

  assert _label({"algorithm": "dpsgd", "beta": 0.9}) == "dpsgd (β = 0)"
  assert _label({"algorithm": "dmsgd", "beta": 0.9}) == "dmsgd (β = 0.9)"
  assert _label({"algorithm": "gradient_tracking", "beta": 0.9}) == "gradient_tracking"
  assert _label({"algorithm": "noloco", "beta": 0.9, "outer_momentum": 0.5}) == "noloco (outer μ = 0.5, inner b1 = 0.9)"


@pytest.mark.slow
def test_outer_methods_log_at_round_ends_with_their_own_rate_and_a_last_row_at_steps(tmp_path, capsys):
  import gossipjax as gj

  cli.main(["train", "--steps", "6", "--log-every", "4", "--nodes", "2", "--no-progress", "--out", str(tmp_path),
            "--algorithms", "diloco", "--inner-steps", "2", "--batch-size", "4", "--x-axis", "bytes"])
  run = json.loads((tmp_path / "metrics.json").read_text())["runs"]["diloco"]
  assert [h["step"] for h in run["history"]] == [4, 6]  # a last row at --steps
  model = (64 * 64 + 64 + 64 * 10 + 10) * 4  # the MLP in float32; a ring all-reduce over 2 nodes sends it once
  counts = 3 * 4  # under the guard, the participants' counts: three float32 a node, all-reduced with each round
  assert [h["bytes_sent"] for h in run["history"]] == [2 * (model + counts), 3 * (model + counts)]  # per round
  assert all(h["consensus_distance"] < 1e-10 for h in run["history"])  # rows end rounds
  assert (run["config"]["learning_rate"], run["config"]["outer_momentum"]) == (3e-3, 0.9)
  args = cli.build_parser().parse_args(["train", "--algorithms", "noloco,dmsgd", "--inner-steps", "10"])
  cli._check_args(args)
  assert "warning" not in capsys.readouterr().err
  runs, _, _ = cli._build_runs(args, gj.backend.simulate())
  # noloco's rows every multiple of 10 nearest 25; dmsgd's every 25, as in a job of its own
  assert [(r.name, r.log_every, r.learning_rate, r.outer_momentum) for r in runs][:2] == [
      ("noloco/random_pairs", 20, 3e-3, 0.5), ("dmsgd/ring", 25, 0.1, None)]
  cli._check_args(cli.build_parser().parse_args(["train", "--algorithms", "diloco", "--log-every", "25"]))
  assert "--log-every 25 is not a multiple of --inner-steps 10" in capsys.readouterr().err


@pytest.mark.slow
def test_streaming_diloco_sends_one_fragment_at_a_time_and_a_model_a_round(tmp_path):
  cli.main(["train", "--steps", "8", "--nodes", "2", "--no-progress", "--out", str(tmp_path), "--algorithms",
            "streaming_diloco", "--inner-steps", "4", "--fragments", "2", "--overlap", "1", "--mixing", "0.5",
            "--log-every", "2", "--batch-size", "4"])
  runs = json.loads((tmp_path / "metrics.json").read_text())["runs"]
  sent = {name: [h["bytes_sent"] for h in run["history"]] for name, run in runs.items()}
  # The MLP's leaves, in order: hidden bias and kernel (fragment 0), head bias and kernel (fragment 1); float32,
  # and a ring all-reduce over 2 nodes sends each once. Fragment 0 syncs at step 1 of every 4, fragment 1 at step 3:
  # a round sends the model once, as DiLoCo's does, a fragment at a time.
  first, second = (64 + 64 * 64) * 4, (10 + 64 * 10) * 4
  counts = 3 * 4  # under the main job's guard, the participants' counts, all-reduced with each fragment's sync
  assert sent["streaming_diloco"] == [first + counts, first + second + 2 * counts, 2 * first + second + 3 * counts,
                                      2 * (first + second + 2 * counts)]
  config = runs["streaming_diloco"]["config"]
  assert (config["learning_rate"], config["outer_momentum"]) == (3e-3, 0.9)
  assert runs["streaming_diloco"]["history"][-1]["consensus_distance"] > 1e-6  # alpha = 0.5 keeps local params


@pytest.mark.slow
def test_a_runs_numbers_do_not_depend_on_the_other_runs_of_its_job(tmp_path):
  common = ["train", "--steps", "25", "--nodes", "2", "--batch-size", "4", "--no-progress", "--topologies", "ring",
            "--step-time", "0.01"]  # given, so that sim_seconds is exact as the other metrics
  cli.main(common + ["--algorithms", "dmsgd", "--out", str(tmp_path / "alone")])
  cli.main(common + ["--algorithms", "dmsgd,diloco", "--out", str(tmp_path / "with_diloco")])
  alone = json.loads((tmp_path / "alone" / "metrics.json").read_text())["runs"]
  with_diloco = json.loads((tmp_path / "with_diloco" / "metrics.json").read_text())["runs"]
  assert [h["step"] for h in with_diloco["diloco"]["history"]] == [20, 25]  # its rows end its rounds of 10 steps
  assert [h["step"] for h in alone["dmsgd/ring"]["history"]] == [25]
  assert exact(with_diloco["dmsgd/ring"]["history"]) == exact(alone["dmsgd/ring"]["history"])  # equal as floats
  assert with_diloco["dmsgd/ring"]["config"] == alone["dmsgd/ring"]["config"]


def test_help_says_each_default_once(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["train", "--help"])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  options = [" ".join(block.split()) for block in re.split(r"\n  (?=-)", text.split("\noptions:\n")[1])]
  assert len(options) > 30
  for option in options:
    assert option.count("default:") <= 1 and "(default: None)" not in option and "(default: False)" not in option, \
        option
  shown = " ".join(text.split())
  assert "(default: allreduce,dpsgd,dmsgd,decentlam)" in shown and "(default: 500)" in shown
  assert "(default: 0)" in shown  # a default of 0 is shown: --checkpoint-every


def test_plot_against_simulated_time_on_a_log_axis(tmp_path, monkeypatch):
  """--x-axis time draws each row at its sim_seconds, on a log axis; a language model's third panel is its test loss."""
  import matplotlib.figure

  from gossipjax import train

  drawn = []
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
  rows = [{"step": s, "train_loss": 4.0 / s, "consensus_distance": 0.1 / s, "test_loss": 3.0 / s,
           "test_accuracy": 0.2, "test_bits_per_token": 4.3 / s, "sim_seconds": 0.5 * s, "bytes_sent": 0.0}
          for s in (10, 20, 30)]
  train.plot(str(tmp_path / "p.png"), {"diloco": {"history": rows, "config": {"algorithm": "diloco"}}}, x="time")
  loss, _, test = drawn[0].axes
  assert list(loss.get_lines()[0].get_xdata()) == [5.0, 10.0, 15.0] and loss.get_xscale() == "symlog"
  assert list(test.get_lines()[0].get_ydata()) == [0.3, 0.15, 0.1] and "test loss" in test.get_ylabel()
  assert "simulated seconds" in loss.get_xlabel()


def test_the_readmes_commands_parse():
  """Every ``gossipjax train`` command the README shows takes options the job has, in combinations it accepts."""
  import pathlib
  import shlex

  text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text().replace("\\\n", " ")
  commands = [line.split("gossipjax train", 1)[1] for line in text.splitlines()
              if line.lstrip().startswith(".venv/bin/gossipjax train")]
  assert commands
  for command in commands:
    args = cli.build_parser().parse_args(["train", *shlex.split(command.split("#")[0])])
    cli._check_args(args)
    assert args.model in ("mlp", "cnn", "gpt")


def test_top_level_help_is_plain_text(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  text = capsys.readouterr().out
  assert "gossipjax train: compare decentralized algorithms" in text and "``" not in text


def test_help_answers_without_importing_jax_and_lists_every_registered_name():
  """`gossipjax train --help` reads `gossipjax.train.ALGORITHM_NAMES` and the others, which the registries' keys equal."""
  import subprocess
  import sys

  from gossipjax import train
  from gossipjax.train import _registry

  assert train.ALGORITHM_NAMES == tuple(train.ALGORITHMS) and train.TOPOLOGY_NAMES == tuple(train.TOPOLOGIES)
  assert train.COMPRESSOR_NAMES == tuple(_registry.COMPRESSORS)
  child = ("import sys\nfrom gossipjax import cli\ntry:\n  cli.main(['train', '--help'])\nexcept SystemExit:\n  pass\n"
           "print('loaded:', sorted(m for m in ('jax', 'flax', 'optax', 'numpy') if m in sys.modules))")
  res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
  assert res.returncode == 0, res.stderr[-2000:]
  assert "--algorithms" in res.stdout and "streaming_diloco" in res.stdout and "random_pairs" in res.stdout
  assert res.stdout.strip().splitlines()[-1] == "loaded: []"
