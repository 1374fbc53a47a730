"""A few minutes on 2 CPU cores: every size for the spectra; one seed of 1000 steps on the label-skewed split."""

import dataclasses

from topologies.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), partitions=("dirichlet",), train_steps=1000, train_seeds=(0,))
