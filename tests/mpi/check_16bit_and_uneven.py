"""16-bit params and uneven blocks under ``mpiexec -n 2``.

Launched by ``tests/backend/test_mpi_16bit_and_uneven.py``. Rank 0 prints one ``OK`` line
per rank; a rank with a mismatch exits non-zero.

* bfloat16 and float16 params: gossip_sgd, choco_sgd, diloco and noloco on 4 nodes (2 a
  rank) equal the simulate backend run in the same dtype on each rank.
* Uneven blocks (rank 0 holds 2 nodes, rank 1 holds 3): the all-reduce mean weights every
  node once, so ``mean``, periodic_average, allreduce_sgd, diloco and easgd give every node
  the mean of all 5 nodes.
* Partial participation: diloco, noloco and their compressed forms (random_k, qsgd) with nodes down at inner and outer steps (the
  ``up`` mask, each rank passing its block's) equal the simulation in float32, on 4 nodes
  (2 a rank) and, for diloco, on the uneven blocks.
"""

import sys


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  jax.config.update("jax_numpy_rank_promotion", "raise")
  import backend_cases as cases

  import gossipjax as gj
  from gossipjax import topology as T

  be = gj.backend.mpi()
  errors, worst = [], 0.0

  # 16-bit params: each rank's block equals the simulation in the same dtype.
  n = 2 * be.size
  methods = {
      "gossip_sgd": lambda be: gj.gossip_sgd(T.ring(n), beta=0.9, learning_rate=0.05, backend=be),
      "gossip_sgd_exponential": lambda be: gj.gossip_sgd(T.one_peer_exponential(n), learning_rate=0.05, backend=be),
      "choco_sgd": lambda be: gj.choco_sgd(T.ring(n), gj.compress.top_k(0.5), learning_rate=0.05,
                                           consensus_step=0.5, backend=be),
      "diloco": lambda be: gj.diloco(optax.sgd(0.05), inner_steps=2, backend=be),
      "noloco": lambda be: gj.noloco(optax.sgd(0.05), T.random_pairs(n, seed=1, period=4), inner_steps=2,
                                     backend=be),
  }
  x0, a, b = cases.problem(n)
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  mine = be.node_slice(n)

  def run(tx, x, a, b, steps=4):
    def step(x, state):  # gradients in float32 from the 16-bit params, rounded to their dtype
      g = cases.grads(x.astype(jnp.float32), a, b).astype(x.dtype)
      u, state = tx.update(g, state, x)
      return optax.apply_updates(x, u), state

    step = jax.jit(step)
    state, out = jax.jit(tx.init)(x), []
    for _ in range(steps):
      x, state = step(x, state)
      out.append(np.asarray(x.astype(jnp.float32)))
    return np.stack(out)

  for dtype, ulp in ((jnp.bfloat16, 2.0 ** -8), (jnp.float16, 2.0 ** -11)):
    x = jnp.asarray(x0, dtype)
    for name, make in methods.items():
      try:
        want = run(make(None), x, a32, b32)[:, mine]
        got = run(make(be), x[mine], a32[mine], b32[mine])
      except Exception as e:  # noqa: BLE001 -- reported, and the rank exits non-zero
        errors.append(f"{name} {jnp.dtype(dtype).name}: {type(e).__name__}: {str(e)[:300]}")
        continue
      err = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0)))
      worst = max(worst, err)
      if err > ulp:  # at most one rounding of the 16-bit result apart
        errors.append(f"{name} {jnp.dtype(dtype).name}: max relative |mpi - simulate| = {err:.3g}")

  # Uneven blocks: rank 0 holds nodes [1, 2], rank 1 holds [1, 2, 2]; the mean of the 5 is 1.6.
  if be.size == 2:
    x = jnp.asarray([[1.0], [2.0]] if be.rank == 0 else [[1.0], [2.0], [2.0]], jnp.float32)
    zero = jnp.zeros_like(x)

    def stepped(tx, grads):
      updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(x), x)
      return jnp.asarray(optax.apply_updates(x, updates))

    found = {
        "mean": jax.jit(be.mean)(x),
        "periodic_average": stepped(gj.periodic_average(1, backend=be), zero),
        "allreduce_sgd": x - stepped(gj.allreduce_sgd(learning_rate=1.0, backend=be), x),
        "diloco": stepped(gj.diloco(optax.sgd(0.1), inner_steps=1, outer_learning_rate=1.0, outer_momentum=0.0,
                                    nesterov=False, backend=be), zero),
        "easgd": jax.jit(gj.easgd(learning_rate=0.1, backend=be).init)(x).center,
    }
    for name, value in found.items():
      if not np.allclose(np.asarray(value), 1.6, rtol=1e-6):
        errors.append(f"uneven blocks, {name}: {np.asarray(value).ravel().tolist()}, not the mean 1.6 of the 5 nodes")

  # Partial participation: each rank passes its block's part of the up mask.
  def run_up(tx, x, a, b, ups):
    step = jax.jit(lambda x, s, up: (lambda u, s: (x + u, s))(*tx.update(cases.grads(x, a, b), s, x, up=up)))
    state, out = jax.jit(tx.init)(x), []
    for up in ups:
      x, state = step(x, state, jnp.asarray(up))
      out.append(np.asarray(x))
    return np.stack(out)

  outer = {
      "diloco": lambda be: gj.diloco(optax.adam(0.05), inner_steps=2, backend=be),
      "noloco": lambda be: gj.noloco(optax.adam(0.05), T.random_pairs(n, seed=1, period=4), inner_steps=2,
                                     backend=be),
      # An all-gather of the compact messages and of the keys that random_k's receivers redraw indices from.
      "diloco_random_k": lambda be: gj.diloco(optax.adam(0.05), inner_steps=2, compressor=gj.compress.random_k(0.5),
                                              backend=be),
      "noloco_qsgd": lambda be: gj.noloco(optax.adam(0.05), T.random_pairs(n, seed=1, period=4), inner_steps=2,
                                          compressor=gj.compress.qsgd(7), backend=be),
  }
  blocks = [(n, mine)] + ([(5, slice(0, 2) if be.rank == 0 else slice(2, 5))] if be.size == 2 else [])
  for total, block in blocks:
    ups = np.ones((6, total), bool)
    ups[1, 1] = ups[2:4, total - 1] = ups[5, 0] = False  # down at outer steps 1, 3 and 5, and at inner step 2
    x5, a5, b5 = (np.asarray(v, np.float32) for v in cases.problem(total))
    x5 = np.tile(x5[:1], (total, 1))
    for name, make in outer.items():
      if total != n and name != "diloco":
        continue  # a pairing, and an all-gather, need equal blocks
      try:
        want = run_up(make(None), jnp.asarray(x5), a5, b5, ups)[:, block]
        got = run_up(make(be), jnp.asarray(x5[block]), a5[block], b5[block], ups[:, block])
      except Exception as e:  # noqa: BLE001 -- reported, and the rank exits non-zero
        errors.append(f"partial participation, {name} on {total} nodes: {type(e).__name__}: {str(e)[:300]}")
        continue
      if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        errors.append(f"partial participation, {name} on {total} nodes: max |mpi - simulate| = "
                      f"{np.max(np.abs(got - want)):.3g}")

  reports = be.comm.gather((be.rank, worst, errors), root=0)
  if be.rank == 0:
    lines = [f"rank {r}: FAIL {e}" for r, _, errs in reports for e in errs]
    lines += [f"rank {r}/{be.size}: OK max 16-bit error {w:.2e}" for r, w, errs in reports if not errs]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
