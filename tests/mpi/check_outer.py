"""DiLoCo, NoLoCo and Streaming DiLoCo under ``mpiexec -n 2``: each rank's block of nodes equals a simulate run
it computes itself.

Launched by ``tests/algorithms/test_outer.py``; rank 0 prints one ``OK`` line per rank, and
a rank with a mismatch, or with an MPI call outside the outer step (for Streaming DiLoCo: outside
a fragment's sync, one cond per fragment), exits non-zero. Streaming DiLoCo also runs with nodes
down (each rank passes its block of ``up``; a node rejoins from a participant on the other rank)
with compressed fragments (the reduce-scatter's all-to-all and all-gather between the ranks), and with
fragments balanced by bytes (pieces of a leaf).
"""

import sys


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_numpy_rank_promotion", "raise")
  import backend_cases as cases

  import gossipjax as gj
  from gossipjax import topology as T

  def by_column(tx, width=1):
    """``tx`` over the columns of the (nodes, D) params as leaves of ``width`` columns: Streaming DiLoCo fragments
    leaves."""
    split = lambda x: [x[:, j:j + width] for j in range(0, x.shape[1], width)]

    def update(u, state, params=None, **extra):
      u, state = tx.update(split(u), state, split(params), **extra)
      return jnp.concatenate(u, axis=1), state

    return optax.GradientTransformationExtraArgs(lambda x: tx.init(split(x)), update)

  be = gj.backend.mpi()
  n, steps = 2 * be.size, 7
  methods = {
      "diloco": lambda be: gj.diloco(optax.adam(0.05), inner_steps=3, backend=be),
      "noloco": lambda be: gj.noloco(optax.adam(0.05), T.random_pairs(n, seed=1, period=4), inner_steps=3,
                                     backend=be),
      # Fragments [x0, x1] and [x2] sync at steps 1 and 3 of every 4, each applied a step later.
      "streaming_diloco": lambda be: by_column(gj.streaming_diloco(optax.adam(0.05), num_fragments=2, inner_steps=4,
                                                                   overlap=1, mixing=0.3, backend=be)),
  }
  # Nodes down at fragment 0's sync (1) and landing (2), at fragment 1's sync (3) and landing (4): at step 5
  # nodes 1 (rank 0) and 2 (rank 1) rejoin fragment 0 from the participants' outer params.
  up = np.ones((steps, n), bool)
  up[1, 1] = up[2, 2] = up[3, 0] = up[4, 3] = False
  methods["streaming_diloco_up"] = lambda be: by_column(gj.streaming_diloco(
      optax.adam(0.05), num_fragments=2, inner_steps=4, overlap=1, mixing=0.3, backend=be))
  # Compressed with the default reduce-scatter: two fragments of 8 columns, top-1 of each piece of 2 entries.
  methods["streaming_diloco_top_k"] = lambda be: by_column(gj.streaming_diloco(
      optax.adam(0.05), num_fragments=2, inner_steps=4, overlap=1, mixing=0.3, backend=be,
      compressor=gj.compress.top_k(0.5)), width=8)
  # Balanced by bytes, the one (nodes, 3) leaf is cut into [x0, x1] and [x2]: each sync all-reduces a piece of it.
  methods["streaming_diloco_balanced"] = lambda be: gj.streaming_diloco(
      optax.adam(0.05), num_fragments=2, fragment_split="balanced", inner_steps=4, overlap=1, mixing=0.3, backend=be)
  fragments = {"streaming_diloco": 2, "streaming_diloco_up": 2, "streaming_diloco_top_k": 2,
               "streaming_diloco_balanced": 2}
  narrow = cases.problem(n)
  rng = np.random.default_rng(7)
  wide = (rng.normal(size=(n, 16)), rng.normal(size=(n, 6, 16)), rng.normal(size=(n, 6)) + np.arange(n)[:, None])

  def with_up(tx, x, a, b, up):
    step = jax.jit(lambda x, s, up: (lambda u, s: (x + u, s))(*tx.update(cases.grads(x, a, b), s, x, up=up)))
    state, out = tx.init(x), []
    for k in range(steps):
      x, state = step(x, state, up[k])
      out.append(np.asarray(x))
    return np.stack(out)

  mine = be.node_slice(n)
  errors, worst = [], 0.0
  for name, make in methods.items():
    x0, a, b = wide if name == "streaming_diloco_top_k" else narrow
    if name == "streaming_diloco_up":
      want = with_up(make(None), x0, a, b, jnp.asarray(up))[:, mine]
      got = with_up(make(be), x0[mine], a[mine], b[mine], jnp.asarray(up[:, mine]))
    else:
      want = cases.trajectory(make(None), x0, a, b, steps)[:, mine]
      got = cases.trajectory(make(be), x0[mine], a[mine], b[mine], steps)
    worst = max(worst, float(np.max(np.abs(got - want))))
    if not np.allclose(got, want, rtol=0, atol=1e-12):
      errors.append(f"{name}: max |mpi - simulate| = {np.max(np.abs(got - want)):.3g}")
    # The MPI calls sit in the outer step's branch (the inner branch is the identity); Streaming
    # DiLoCo's in each fragment's sync, a cond of its own, each with the same calls (one all-reduce).
    tx = make(be)
    x = x0[mine]
    extra = {"up": jnp.asarray(up[0, mine])} if name == "streaming_diloco_up" else {}
    jaxpr = jax.make_jaxpr(lambda g, s, x: tx.update(g, s, x, **extra))(x, tx.init(x), x)
    per_cond = [c for c in (str(e).count("_mpi[") for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond") if c]
    total = str(jaxpr).count("_mpi[")
    if not (0 < sum(per_cond) == total and len(per_cond) == fragments.get(name, 1) and len(set(per_cond)) == 1):
      errors.append(f"{name}: {total} MPI calls, {per_cond} of them in the conds with any, expected "
                    f"{fragments.get(name, 1)} such conds")

  reports = be.comm.gather((be.rank, worst, errors), root=0)
  if be.rank == 0:
    lines = [f"rank {r}: FAIL {e}" for r, _, errs in reports for e in errs]
    lines += [f"rank {r}/{be.size}: OK max error {w:.2e}" for r, w, errs in reports if not errs]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
