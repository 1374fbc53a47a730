"""The full study: 8 and 16 nodes, iid and by-source splits, three seeds, a 2-layer byte-level GPT, 200 steps."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  node_counts: tuple[int, ...] = (8, 16)
  partitions: tuple[str, ...] = ("iid", "by_source")  # by_source: each node reads whole packages of its own
  seeds: tuple[int, ...] = (0, 1, 2)  # each draws the partition's tie-breaks, the init and the batches
  methods: tuple[str, ...] = ("allreduce_adamw", "d_adamw", "diloco", "streaming_diloco", "noloco")
  steps: int = 200
  global_batch: int = 64  # windows a step over all the nodes: 8 a node at 8 nodes, 4 at 16
  context: int = 32  # bytes a window, and the GPT's context
  layers: int = 2
  width: int = 32
  heads: int = 4
  compute_dtype: str = "float32"  # or "bfloat16" (the params stay float32)
  max_bytes: int | None = 2_000_000  # training bytes read from the standard library, shared over its packages
  test_windows: int = 64  # held-out windows, evenly spaced over the test files
  learning_rate: float = 3e-3  # AdamW's, every method's inner or only optimizer (weight decay 1e-4)
  beta: float = 0.9  # AdamW's b1
  inner_steps: int = 20  # H of DiLoCo, Streaming DiLoCo and NoLoCo
  diloco_outer: tuple[float, float] = (0.7, 0.9)  # outer learning rate and Nesterov momentum (the paper's)
  fragments: int = 4  # Streaming DiLoCo's F: one fragment syncs every H / F = 5 steps
  fragment_split: str = "balanced"  # fragments of equal bytes, cutting leaves
  overlap: int = 1  # its tau: the inner steps a fragment's all-reduce overlaps
  mixing: float = 0.5  # its alpha: the weight of the local params in the merge
  noloco_outer: tuple[float, float] = (0.7, 0.5)  # outer learning rate and momentum (the authors' code)
  gossip_topology: str = "one_peer_exponential"  # D-AdamW's: one message per node per step
  networks: tuple[str, ...] = ("datacenter", "cross_region", "internet")  # presets of gj.NETWORKS
  step_time: float = 0.35  # seconds of compute a step on one accelerator, stated, not measured here
  log_every: int = 20  # a multiple of inner_steps: rows fall just after an outer step


def get_config() -> Config:
  return Config()
