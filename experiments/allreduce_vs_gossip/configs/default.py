"""The full study: 16 learners, 100 epochs, three seeds (mean and spread in the table)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  num_nodes: int = 16
  methods: tuple[str, ...] = ("allreduce", "d-psgd", "ad-psgd")
  epochs: int = 100
  batch_size: int = 8  # per learner per gradient, the same for all three methods
  learning_rate: float = 0.1
  hidden: int = 64
  # iid | dirichlet (Zhang, Lian, Zhang and Liu, "Decentralized Distributed Deep Learning", give every
  # learner the same distribution)
  partition: str = "iid"
  alpha: float = 0.5
  topology: str = "ring"  # D-PSGD's W and AD-PSGD's peers (the paper's ring-like graph)
  jitter: float = 0.2  # spread of compute times: the order of AD-PSGD's events
  seeds: tuple[int, ...] = (0, 1, 2)


def get_config() -> Config:
  return Config()
