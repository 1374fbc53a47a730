"""A few minutes on 2 CPU cores: fewer epochs, the stale-gradient probe at 1000x."""

import dataclasses

from stragglers.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), epochs=10.0, stale_probe_slowdown=1000)
