"""One process of a multi-process ``jax.distributed`` run of the sharded backend (CPU, gloo collectives).

Launched twice by ``tests/test_backend_distributed.py``:
``python tests/mpi/check_distributed.py PROCESS_ID NUM_PROCESSES PORT``. Each process owns 2 CPU
devices; the mesh spans all of them, so the ppermutes cross processes. Each process checks
the shards it holds against a simulate-backend run it computes itself, prints one ``OK``
line and exits non-zero on any mismatch.
"""

import os
import sys

LOCAL_DEVICES = 2


def main(process_id: int, num_processes: int, port: int) -> int:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
  import jax

  import gossipjax as gj

  gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 2 CPU devices
  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)

  import numpy as np

  import backend_cases as cases
  from gossipjax import topology as T

  k = jax.device_count()
  mesh = jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  be = gj.backend.sharded(mesh)
  n = 2 * k  # two nodes per device, k / num_processes devices per process
  errors, worst, checked = [], 0.0, 0
  runs = [(name, topo) for name, topo in cases.cases(n) if name in ("gossip_sgd", "decentlam")]
  runs += [("allreduce_sgd", T.ring(n)), ("mix", T.one_peer_exponential(n))]
  for name, topo in runs:
    x0, a, b = cases.problem(n)
    want = cases.reference(name, topo, x0, a, b)
    tx = cases.algorithm(name, topo, be)
    step = jax.jit(cases.make_step(tx))
    x, state = be.shard(x0), jax.jit(tx.init)(be.shard(x0))
    a_s, b_s = be.shard(a), be.shard(b)
    for t in range(cases.STEPS):
      x, state = step(x, state, a_s, b_s)
      for shard in x.addressable_shards:
        err = float(np.max(np.abs(np.asarray(shard.data) - want[t][shard.index])))
        worst, checked = max(worst, err), checked + 1
        if not err <= 1e-12:
          errors.append(f"{name} on {topo.name}, step {t}, rows {shard.index[0]}: error {err:.3g}")
  for e in errors[:20]:
    print(f"process {process_id}: FAIL {e}", flush=True)
  if not errors:
    print(f"process {process_id}/{num_processes}: OK {len(runs)} runs, {checked} shards, {k} devices, "
          f"max error {worst:.2e}", flush=True)
  jax.distributed.shutdown()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
