"""The full study: 16 and 64 nodes, three seeds, the digits CNN, label-skewed split, 600 steps of every method."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  node_counts: tuple[int, ...] = (16, 64)
  seeds: tuple[int, ...] = (0, 1, 2)  # each draws the train/test split, the partition, the init and the batches
  partition: str = "dirichlet"  # iid | dirichlet
  alpha: float = 0.3  # Dirichlet concentration: most nodes see two or three classes
  steps: int = 600
  global_batch: int = 256  # per step over all the nodes: 16 a node at 16 nodes, 4 at 64
  features: tuple[int, ...] = (8, 16)  # the CNN's channels
  learning_rate: float = 3e-3  # AdamW's, every method's inner or only optimizer
  weight_decay: float = 1e-4
  inner_steps: int = 20  # H of DiLoCo and NoLoCo, and the period of DSGD-PGA's all-reduce
  diloco_outer: tuple[float, float] = (0.7, 0.9)  # outer learning rate and Nesterov momentum (the paper's)
  fragments: int = 4  # Streaming DiLoCo's F: one fragment syncs every H / F = 5 steps
  overlap: int = 1  # its tau: the inner steps a fragment's all-reduce overlaps
  mixing: float = 0.5  # its alpha: the weight of the local params in the merge
  qsgd_levels: int = 7  # compressed DiLoCo: QSGD's levels per sign, a 4-bit code (sent as int8)
  noloco_outer: tuple[float, float] = (0.7, 0.5)  # outer learning rate and momentum (the authors' code)
  gossip_topology: str = "one_peer_exponential"  # D-PSGD's and DSGD-PGA's: one message per node per step
  methods: tuple[str, ...] = ("allreduce_adamw", "dpsgd_adamw", "dsgd_pga_adamw", "diloco", "streaming_diloco",
                              "streaming_diloco_sync", "diloco_qsgd", "noloco")
  log_every: int = 40  # a multiple of inner_steps: rows fall just after an outer step
  # The per-step methods spend the equal-bytes budget within a few dozen steps: a metrics row
  # every `chunk` steps up to `early_steps` places them on the budget.
  chunk: int = 4
  early_steps: int = 40
  train_eval_samples: int = 128  # the training loss is measured on the first 128 training images


def get_config() -> Config:
  return Config()
