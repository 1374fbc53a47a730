"""The full study: ring and symmetric exponential graphs of 16 nodes, lr and lr/2, the lr and beta sweeps."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  # f_i(x) = 1/(2m) ||A_i x - b_i||^2 with b_i = A_i (x0 + heterogeneity * z_i) + noise * e_i.
  num_nodes: int = 16
  dim: int = 10
  samples_per_node: int = 50
  heterogeneity: float = 1.0
  noise: float = 0.1
  # Symmetric W only: DecentLaM and exact diffusion assume it.
  topologies: tuple[str, ...] = ("ring", "symmetric_exponential")
  algorithms: tuple[str, ...] = ("d-psgd", "dmsgd", "decentlam", "gradient_tracking", "exact_diffusion", "extra")
  learning_rate: float = 0.01  # the figure runs every algorithm at this rate and at half of it
  beta: float = 0.9
  steps: int = 30000
  # On every topology: the limiting bias of D-PSGD / DmSGD / DecentLaM at each rate (the lr^2
  # law) and of DmSGD / DecentLaM at each momentum at learning_rate (the 1/(1-beta)^2 amplification).
  lr_sweep: tuple[float, ...] = (0.04, 0.02, 0.01, 0.005, 0.0025, 0.00125)
  beta_sweep: tuple[float, ...] = (0.0, 0.5, 0.75, 0.9, 0.95, 0.98)
  # An exact method counts as converged once sum_i ||x_i - x*||^2 is below this.
  exact_tolerance: float = 1e-20
  seed: int = 0


def get_config() -> Config:
  return Config()
