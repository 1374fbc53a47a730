"""A few minutes on 2 CPU cores: 500 steps, three consensus steps per compressor."""

import dataclasses

from compression.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), steps=500, consensus_steps=(0.1, 0.3, 1.0), log_every=50)
