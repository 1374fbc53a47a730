"""Star and complete (rank-one terms: one MPI allreduce per mix) equal their dense W on every rank.

Launched by ``tests/test_backend_mpi.py`` as ``mpiexec -n 4 python tests/mpi/check_rank_one.py``.
Each rank mixes its block and compares it with its rows of ``W @ x``; also counts the MPI calls
of one mix (one allreduce, no sendrecv) and mixes a 65,536-node star and complete graph. Inside
``gj.chain``, ``gj.node_mean`` is the mean over every rank's nodes and a raw ``lax.pmean`` over
``"nodes"`` is refused by name.
Rank 0 prints one ``OK`` line per rank; a rank with any mismatch exits non-zero.
"""

import sys
import time


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  jax.config.update("jax_enable_x64", True)
  import gossipjax as gj
  from gossipjax import topology as T

  be = gj.backend.mpi()
  rank, size = be.rank, be.size
  errors = []
  x = np.random.default_rng(0).normal(size=(4 * size, 3))
  mine = be.node_slice(4 * size)
  for topo in (T.star(4 * size), T.star(4 * size, "metropolis"), T.complete(4 * size)):
    mixer = be.mixer(topo)
    want = (topo.matrix() @ x)[mine]
    for wrap in (jax.jit, lambda f: f):
      got = np.asarray(wrap(lambda v: mixer.mix(v))(jnp.asarray(x[mine])))
      err = float(np.max(np.abs(got - want)))
      if not err <= 1e-13:
        errors.append(f"{topo.name}: max |mpi - W x| = {err:.3g}")
    text = str(jax.make_jaxpr(lambda v: mixer.mix(v))(jnp.asarray(x[mine])))
    calls = {p: text.count(f"{p}_mpi[") for p in ("sendrecv", "allreduce", "allgather")}
    if calls != {"sendrecv": 0, "allreduce": 1, "allgather": 0}:
      errors.append(f"{topo.name}: MPI calls {calls}, expected one allreduce")

  # Inside gj.chain: gj.node_mean averages over every rank's nodes; a raw pmean over "nodes" is refused.
  import optax
  from jax import lax

  to_mean = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (gj.node_mean(p) - p, s))
  tx = gj.chain(to_mean, backend=be)
  block = jnp.asarray(x[mine])
  for wrap in (jax.jit, lambda f: f):
    got = np.asarray(wrap(lambda v: v + tx.update(v, tx.init(v), v)[0])(block))
    err = float(np.max(np.abs(got - x.mean(axis=0))))
    if not err <= 1e-13:
      errors.append(f"gj.node_mean inside gj.chain: max |got - mean over all nodes| = {err:.3g}")
  raw = gj.chain(optax.GradientTransformation(lambda p: optax.EmptyState(),
                                              lambda u, s, p=None: (lax.pmean(u, "nodes"), s)), backend=be)
  try:
    raw.update(block, raw.init(block), block)
    errors.append("a raw lax.pmean over 'nodes' inside gj.chain was not refused")
  except ValueError as e:
    if "gj.node_mean" not in str(e):
      errors.append(f"the refusal of a raw lax.pmean does not name gj.node_mean: {e}")

  n, d = 65_536, 100
  for topo in (T.star(n, "metropolis"), T.complete(n)):
    start = time.perf_counter()
    mixer = be.mixer(topo.check("doubly"))
    block = np.random.default_rng(rank).normal(size=(n // size, d)).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: mixer.mix(v))(jnp.asarray(block)))
    seconds = time.perf_counter() - start
    total = be.comm.allreduce(block.astype(np.float64).sum(axis=0))
    if topo.name.startswith("complete"):
      want = np.broadcast_to(total / n, block.shape)
    else:  # Metropolis star: every weight 1/n; the hub keeps 1/n, every leaf 1 - 1/n
      hub = be.comm.bcast(block[0] if rank == 0 else None, root=0)
      want = (1 - 1 / n) * block + hub / n
      if rank == 0:
        want[0] = total / n
    err = float(np.max(np.abs(got - want)))
    if not err <= 1e-4 or seconds > 30:
      errors.append(f"{topo.name}: max error {err:.3g}, {seconds:.1f} s to build, check and mix")

  reports = be.comm.gather((rank, errors), root=0)
  if rank == 0:
    lines = [f"rank {r}/{size}: " + ("OK" if not e else "FAILED " + "; ".join(e)) for r, e in reports]
    print("\n".join(lines), flush=True)
  be.comm.Barrier()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
