"""The full study: ResNet-20 at full width (16/32/64), 8 nodes, total batch 64 to 1024, 40 epochs."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  num_nodes: int = 8
  methods: tuple[str, ...] = ("pmsgd", "dmsgd", "decentlam")
  topology: str = "ring"  # symmetric: DecentLaM needs a symmetric W
  total_batches: tuple[int, ...] = (64, 256, 1024)  # summed over the nodes, per step
  epochs: float = 40.0  # the same budget of samples for every batch size
  base_learning_rate: float = 0.05  # at base_batch; linear scaling rule above it
  base_batch: int = 64
  warmup_epochs: float = 5.0  # linear warm-up, then cosine decay to 0
  beta: float = 0.9
  width: int = 16  # ResNet-20's first-stage channels (16 in He et al.)
  partition: str = "iid"
  data_dir: str | None = None  # CIFAR-10 (python-pickle format) here; None: the bundled digits
  test_examples: int = 2000  # cap on the test set evaluated every chunk (CIFAR-10 has 10,000)
  chunks: int = 10  # metric rows per run
  seeds: tuple[int, ...] = (0,)


def get_config() -> Config:
  return Config()
