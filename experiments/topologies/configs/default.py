"""The full study: n = 16..1024 for the spectra and gossip decay, D-PSGD on the digits at n = 16, 64."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  topologies: tuple[str, ...] = ("ring", "star", "grid", "torus", "half_random", "static_exponential",
                                 "one_peer_exponential")
  sizes: tuple[int, ...] = (16, 64, 256, 1024)  # squares, for the grid and the torus
  # Pure gossip x <- W(k) x from a random x (dim numbers per node), on the sparse plans, float64.
  decay_steps: int = 1000
  decay_dim: int = 8
  decay_target: float = 1e-3  # reported: steps until ||x - mean|| shrank by this factor
  # D-PSGD on the bundled digits (an MLP), only at these sizes: 1024 simulated learners would take too long here.
  train_sizes: tuple[int, ...] = (16, 64)
  partitions: tuple[str, ...] = ("iid", "dirichlet")
  dirichlet_alpha: float = 0.1  # strong label skew: where the topology matters
  train_steps: int = 1500
  batch_size: int = 16  # per node per step
  learning_rate: float = 0.1
  hidden: tuple[int, ...] = (64,)
  target_accuracy: float = 0.9  # of the nodes' own models, averaged over nodes, on the test set
  log_every: int = 10  # the resolution of "steps to target"
  train_seeds: tuple[int, ...] = (0, 1, 2)
  seed: int = 0  # the Erdos-Renyi graph and the gossip start


def get_config() -> Config:
  return Config()
