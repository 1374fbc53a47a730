"""A few minutes on 2 CPU cores: a narrower ResNet-20 (8/16/32 channels), 10 epochs."""

import dataclasses

from large_batch.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), width=8, epochs=10.0, warmup_epochs=2.0)
