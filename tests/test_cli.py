import json

import pytest

from gossipjax import cli


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
  assert "| dmsgd/ring |" in printed and "skipped decentlam/exponential" in printed
  assert results is None


def test_bad_arguments_fail_clearly(tmp_path):
  with pytest.raises(SystemExit, match="multiple of --log-every"):
    cli.main(["train", "--steps", "30", "--log-every", "25", "--out", str(tmp_path)])
  with pytest.raises(ValueError, match="unknown topology 'moebius'"):
    cli.main(["train", "--topologies", "moebius", "--steps", "25", "--out", str(tmp_path)])
  with pytest.raises(ValueError, match="unknown algorithm"):
    cli.main(["train", "--algorithms", "magic", "--steps", "25", "--out", str(tmp_path)])


def test_resume_continues_bit_for_bit(tmp_path):
  common = ["train", "--nodes", "8", "--log-every", "25", "--checkpoint-every", "25", "--no-progress",
            "--algorithms", "dmsgd,decentlam", "--topologies", "one_peer_exponential,ring"]
  cli.main(common + ["--steps", "100", "--out", str(tmp_path / "straight")])
  cli.main(common + ["--steps", "50", "--out", str(tmp_path / "split")])  # "dies" at step 50
  # Mark the saved rows: a resumed run keeps them, a run that silently restarted would not.
  for hist in (tmp_path / "split" / "checkpoints").glob("*/history.json"):
    rows = json.loads(hist.read_text())
    rows[0]["marker"] = 1.0
    hist.write_text(json.dumps(rows))
  cli.main(common + ["--steps", "100", "--resume", "--out", str(tmp_path / "split")])
  straight = json.loads((tmp_path / "straight" / "metrics.json").read_text())["runs"]
  resumed = json.loads((tmp_path / "split" / "metrics.json").read_text())["runs"]
  assert set(straight) == set(resumed) == {"dmsgd/one_peer_exponential", "dmsgd/ring", "decentlam/ring"}
  for name in straight:
    assert [h["step"] for h in resumed[name]["history"]] == [25, 50, 75, 100]
    assert resumed[name]["history"][0].pop("marker") == 1.0
    for a, b in zip(straight[name]["history"], resumed[name]["history"]):
      assert a == b  # every metric equal as floats, not just close


def test_exact_methods_run_and_static_only_ones_skip_time_varying_graphs(tmp_path):
  cli.main(["train", "--steps", "25", "--nodes", "8", "--no-progress", "--out", str(tmp_path),
            "--algorithms", "gradient_tracking,extra", "--topologies", "one_peer_exponential"])
  metrics = json.loads((tmp_path / "metrics.json").read_text())
  assert set(metrics["runs"]) == {"gradient_tracking/one_peer_exponential"}
  assert "needs a static W" in metrics["config"]["skipped"]["extra/one_peer_exponential"]
