"""``benchmarks/resnet20_gpu.py`` runs on CPU at its smoke size: every precision, the XLA form, torch when there."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks import resnet20_gpu  # noqa: E402


@pytest.mark.slow
def test_the_gpu_benchmark_runs_each_precision_at_its_smoke_size():
  r = resnet20_gpu.run(quick=True, force=True)
  assert set(r["step_s_by_precision"]) == {"float32", "float32_highest", "bfloat16"}
  assert all(t > 0 for t in r["step_s_by_precision"].values()) and r["xla_weight_grad_step_s"] > 0
  if importlib.util.find_spec("torch") is None:
    assert r["torch"].startswith("skipped: torch is not installed") and r["torch_over_gossipjax"] == {}
  else:
    assert set(r["torch_over_gossipjax"]) == {"float32", "float32_highest", "bfloat16"}
  lines = resnet20_gpu.table(r)
  assert lines[1].startswith("| precision | gossipjax | torch.func.vmap (BatchNorm: per-batch statistics)")
  assert len([line for line in lines if line.startswith("| float32")]) == 2
