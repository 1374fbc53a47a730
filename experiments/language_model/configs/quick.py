"""Seconds on 2 CPU cores: 2 nodes, a 1-layer GPT of width 16, 20 steps of AllReduce-AdamW and DiLoCo."""

import dataclasses

from language_model.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), node_counts=(2,), partitions=("iid",), seeds=(0,),
                             methods=("allreduce_adamw", "diloco"), steps=20, global_batch=8, context=16,
                             layers=1, width=16, heads=2, max_bytes=200_000, test_windows=16, inner_steps=10,
                             fragments=2, log_every=10)
