"""A few minutes on 2 CPU cores: 600 steps."""

import dataclasses

from low_communication.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), steps=600)
