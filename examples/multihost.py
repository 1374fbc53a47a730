"""The sharded backend across processes (hosts) with ``jax.distributed``; here 2 processes on one machine.

Each process owns 2 CPU devices; the mesh spans all 4, so the ppermutes cross processes
(gloo collectives on CPU; NCCL or the TPU runtime on accelerators, with no code change).

Run (launches both processes):  python examples/multihost.py
One process per host by hand:   python examples/multihost.py --process-id I --num-processes 2 --coordinator HOST:PORT
"""

import argparse
import os
import subprocess
import sys


def worker(process_id, num_processes, coordinator):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # 2 CPU devices per process
  import jax

  import gossipjax as gj

  gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 2 CPU devices
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)

  import numpy as np

  import _problem as p

  mesh = jax.make_mesh((jax.device_count(),), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  backend = gj.backend.sharded(mesh)
  tx = p.optimizer(backend)
  x, a, b = (backend.shard(v) for v in p.data())  # every process passes the full arrays
  state = jax.jit(tx.init)(x)
  step = jax.jit(p.make_step(tx, backend))
  for _ in range(p.STEPS):
    x, state = step(x, state, a, b)
  # Gather the global params to every process (for printing only; training never gathers).
  full = jax.jit(lambda v: v, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(x)
  if process_id == 0:
    _, a_all, b_all = p.data()
    p.report(f"{num_processes} procs", np.asarray(full), a_all, b_all)
  jax.distributed.shutdown()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, default=None)
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument("--coordinator", default="127.0.0.1:12355")
  args = parser.parse_args()
  if args.process_id is not None:
    return worker(args.process_id, args.num_processes, args.coordinator)
  procs = [
      subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--num-processes",
                        str(args.num_processes), "--coordinator", args.coordinator])
      for i in range(args.num_processes)
  ]
  try:
    codes = [proc.wait(timeout=300) for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  sys.exit(max(codes))


if __name__ == "__main__":
  main()
