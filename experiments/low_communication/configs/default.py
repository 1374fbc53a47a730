"""The full study: 16 nodes, the digits CNN, label-skewed split, 1,500 steps of every method."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  num_nodes: int = 16
  partition: str = "dirichlet"  # iid | dirichlet
  alpha: float = 0.3  # Dirichlet concentration: most nodes see two or three classes
  steps: int = 1500
  batch_size: int = 16  # per node per step
  learning_rate: float = 3e-3  # AdamW's, every method's inner or only optimizer
  weight_decay: float = 1e-4
  inner_steps: int = 20  # H of DiLoCo and NoLoCo, and the period of DSGD-PGA's all-reduce
  diloco_outer: tuple[float, float] = (0.7, 0.9)  # outer learning rate and Nesterov momentum (the paper's)
  noloco_outer: tuple[float, float] = (0.7, 0.5)  # outer learning rate and momentum (the authors' code)
  gossip_topology: str = "one_peer_exponential"  # D-PSGD's and DSGD-PGA's: one message per node per step
  methods: tuple[str, ...] = ("allreduce_adamw", "dpsgd_adamw", "dsgd_pga_adamw", "diloco", "noloco")
  log_every: int = 40  # a multiple of inner_steps: rows fall just after an outer step
  # The per-step methods spend the equal-bytes budget within a few dozen steps: a metrics row
  # every `chunk` steps up to `early_steps` places them on the budget.
  chunk: int = 4
  early_steps: int = 60
  train_eval_samples: int = 512  # the training loss is measured on the first 512 training images
  seed: int = 0


def get_config() -> Config:
  return Config()
