"""About 20 minutes on 2 CPU cores: 320 steps (16 rounds of H = 20)."""

import dataclasses

from low_communication.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), steps=320)
