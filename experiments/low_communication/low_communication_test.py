"""A short run of the low-communication study: schema, the bytes each transform sends, the equal-bytes tables."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np

from low_communication import train
from low_communication.configs import default, quick


def test_configs():
  config, fast = default.get_config(), quick.get_config()
  assert fast.steps < config.steps and config.node_counts == (16, 64) and len(config.seeds) >= 3
  assert config.log_every % config.inner_steps == 0 and config.log_every % config.chunk == 0
  assert all(config.global_batch % n == 0 for n in config.node_counts)
  assert set(config.methods) == set(train.LABELS)


def test_bytes_are_what_the_transforms_send():
  config = dataclasses.replace(default.get_config(), inner_steps=4, fragments=2)
  n, m = 4, 1000  # two leaves of 125 float32 a node: a model of M = 1000 bytes
  params = {"a": jnp.zeros((n, 125), jnp.float32), "b": jnp.zeros((n, 125), jnp.float32)}
  sent = {name: train.bytes_sent(train.make_method(name, config, n, seed=0), params, 8)
          for name in ("diloco", "streaming_diloco", "diloco_qsgd", "noloco")}
  allreduce = 2 * (n - 1) / n * m  # a ring all-reduce
  assert sent["diloco"].tolist() == [0, 0, 0, 0, allreduce, allreduce, allreduce, allreduce, 2 * allreduce]
  # Streaming: one fragment (half the model) at steps 1 and 3 of every 4; the same total as DiLoCo's.
  assert np.diff(sent["streaming_diloco"]).max() == allreduce / 2 and sent["streaming_diloco"][-1] == 2 * allreduce
  assert sent["noloco"][-1] == 2 * m  # one model to one peer a round
  # QSGD's int8 levels and a float32 norm per piece: about a quarter of DiLoCo's bytes.
  assert 0.25 <= sent["diloco_qsgd"][-1] / sent["diloco"][-1] < 0.3


def test_short_run(tmp_path):
  config = dataclasses.replace(default.get_config(), node_counts=(2,), seeds=(0, 1), steps=8, inner_steps=4,
                               fragments=2, log_every=8, chunk=4, early_steps=4, global_batch=8, features=(2,),
                               train_eval_samples=16, methods=("dpsgd_adamw", "diloco"))
  train.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  runs = {(r["method"], r["seed"]): r for r in results["runs"]}
  assert [h["step"] for h in runs["dpsgd_adamw", 0]["history"]] == [0, 4, 8]  # per-step methods: early rows too
  assert [h["step"] for h in runs["diloco", 1]["history"]] == [0, 8]
  m = runs["diloco", 0]["model_bytes"]
  assert runs["diloco", 0]["history"][-1]["bytes_per_node"] == 2 * m  # two rounds; over 2 nodes a ring sends M once
  assert runs["diloco", 0]["history"][-1]["consensus_distance"] < 1e-10  # just after an outer step: one model
  assert results["budget_bytes_per_node"] == {"2": 2 * m}
  summary = {(r["method"], r["at"]): r for r in results["summary"]}
  accs = [runs["diloco", s]["history"][-1]["test_accuracy"] for s in (0, 1)]
  assert summary["diloco", "end"]["test_accuracy"] == [np.mean(accs), np.std(accs)]
  md = (tmp_path / "results.md").read_text()
  assert "## 2 nodes" in md and "| D-PSGD + AdamW | 0 |" in md  # D-PSGD's first message exceeds the budget
  assert "| DiLoCo | 8 | " in md and (tmp_path / "low_communication.png").exists()
