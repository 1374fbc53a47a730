"""The same transform called inside ``jax.pmap``: each of 8 devices holds a block of 2 nodes.

Run: python examples/pmapped.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads

import jax  # noqa: E402

import _problem as p  # noqa: E402
import gossipjax as gj  # noqa: E402

gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 8 CPU devices


def main():
  k = jax.device_count()
  backend = gj.backend.pmapped(axis_name="devices")
  tx = p.optimizer(backend)
  # (n, ...) -> (devices, n / devices, ...): device d holds nodes d*B ... d*B + B - 1.
  x, a, b = (v.reshape((k, -1) + v.shape[1:]) for v in p.data())
  state = jax.pmap(tx.init)(x)
  step = jax.pmap(p.make_step(tx, backend), axis_name="devices")
  for _ in range(p.STEPS):
    x, state = step(x, state, a, b)
  print(f"params in blocks of {x.shape[1]} nodes on {len(x.sharding.device_set)} devices")
  unblock = lambda v: v.reshape((-1,) + v.shape[2:])
  p.report("pmapped", unblock(x), unblock(a), unblock(b))


if __name__ == "__main__":
  main()
