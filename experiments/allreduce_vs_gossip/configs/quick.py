"""A few minutes on 2 CPU cores: 30 epochs, one seed."""

import dataclasses

from allreduce_vs_gossip.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), epochs=30, seeds=(0,))
