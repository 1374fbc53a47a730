"""The node axis sharded over 8 devices (here 8 simulated CPU devices): 2 nodes per device.

Params stay global arrays; mixing runs as ``lax.ppermute`` inside ``jax.shard_map``.

Run: python examples/sharded.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads

import jax  # noqa: E402

import _problem as p  # noqa: E402
import gossipjax as gj  # noqa: E402

gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 8 CPU devices


def main():
  mesh = jax.make_mesh((jax.device_count(),), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  backend = gj.backend.sharded(mesh, axis="nodes")
  tx = p.optimizer(backend)
  x, a, b = (backend.shard(v) for v in p.data())  # leading node axis split over the mesh
  state = tx.init(x)
  step = jax.jit(p.make_step(tx, backend))
  for _ in range(p.STEPS):
    x, state = step(x, state, a, b)
  print(f"params sharded as {x.sharding.spec} over {jax.device_count()} devices")
  p.report("sharded", x, a, b)


if __name__ == "__main__":
  main()
