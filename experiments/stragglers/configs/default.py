"""The full study: 16 learners, one slowed 1x..10000x, 30 epochs per run."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  num_nodes: int = 16
  slowdowns: tuple[float, ...] = (1, 2, 10, 100, 1000, 10000)
  methods: tuple[str, ...] = ("ad-psgd", "d-psgd", "allreduce")
  epochs: float = 30.0
  batch_size: int = 8  # per learner per gradient (the single learner of the baseline too)
  learning_rate: float = 0.1
  hidden: int = 64
  # Simulated time: a normal gradient takes base_time * lognormal(jitter); one model over a
  # link takes latency + transfer seconds (a fast interconnect: a few % of a gradient).
  base_time: float = 1.0
  jitter: float = 0.1
  latency: float = 0.002
  transfer: float = 0.03
  dpsgd_topology: str = "ring"
  events_per_chunk: int = 512
  # AD-PSGD with this straggler runs on until its first (very stale) gradient lands, to
  # show what that gradient does to the model; None skips the probe.
  stale_probe_slowdown: float | None = 10000
  seed: int = 0


def get_config() -> Config:
  return Config()
