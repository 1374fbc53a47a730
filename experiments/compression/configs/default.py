"""The full study: 16 nodes on a ring, CHOCO-SGD with five compressors and D-PSGD, 2,000 steps."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  num_nodes: int = 16
  topology: str = "ring"
  partition: str = "dirichlet"  # iid | dirichlet
  alpha: float = 0.3  # Dirichlet concentration when partition == "dirichlet"
  steps: int = 2000
  batch_size: int = 16  # per node per step
  learning_rate: float = 0.1
  hidden: int = 64
  # "name" or "name:argument" of a gj.compress factory
  compressors: tuple[str, ...] = ("top_k:0.1", "random_k:0.1", "sign", "qsgd:4", "threshold_mean")
  # CHOCO's consensus step eta: every compressor runs with each, the table keeps the one
  # with the lowest final training loss (selected on training data, not on the test set).
  consensus_steps: tuple[float, ...] = (0.05, 0.1, 0.3, 1.0)
  log_every: int = 100
  seed: int = 0


def get_config() -> Config:
  return Config()
