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
