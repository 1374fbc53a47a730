"""Every rank checks its block of nodes against the simulate backend's run of the same case.

Launched by ``tests/test_backend_mpi.py`` as ``mpiexec -n 4 python tests/mpi/check_mpi_equality.py``;
one launch covers every (algorithm, topology) case, eager and jitted, with one and two nodes
per rank, and counts the MPI calls in the traced program. Rank 0 prints one ``OK`` line per
rank; a rank with any mismatch exits non-zero. The ranks share the simulated runs: each computes
every size-th case and the others receive it.
"""

import sys


def count_calls(fn, *args) -> dict[str, int]:
  """MPI primitives in the jaxpr of ``fn`` (switch branches included)."""
  import jax

  text = str(jax.make_jaxpr(fn)(*args))
  return {p: text.count(f"{p}_mpi[") for p in ("sendrecv", "allgather", "allreduce", "alltoall", "bcast", "gather")}


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_numpy_rank_promotion", "raise")
  import backend_cases as cases

  import gossipjax as gj
  from gossipjax import topology as T

  be = gj.backend.mpi(abort_on_error=False)
  rank, size = be.rank, be.size
  errors, worst, checked = [], 0.0, 0
  if sys.excepthook is not sys.__excepthook__:
    errors.append("gj.backend.mpi(abort_on_error=False) replaced sys.excepthook")

  long = T.random_pairs(4 * size, period=256)  # 4 nodes per rank: with 3 ranks or more, the fixed exchanges
  if size >= 3 and not be.mixer(long).table.slots:
    errors.append(f"{long.name} on {size} ranks did not take the fixed exchanges")
  runs = [(name, topo, cases.STEPS, jax.jit) for name, topo in cases.cases(2 * size)]  # two nodes per rank
  runs += [("gossip_sgd", T.ring(size), cases.STEPS, jax.jit),  # one node per rank
           ("mix", T.one_peer_exponential(size), cases.STEPS, jax.jit),
           ("gossip_sgd", T.one_peer_exponential(2 * size), 3, lambda f: f),  # eager
           ("gossip_sgd", long, cases.STEPS, jax.jit)]

  # The simulation of every case, each rank computing its share: every rank compiles its own MPI
  # programs, and would otherwise compile every simulated one too.
  references = {}
  share = {i: cases.reference(name, topo, *cases.problem(topo.num_nodes), steps)
           for i, (name, topo, steps, _) in enumerate(runs) if i % size == rank}
  for part in be.comm.allgather(share):
    references.update(part)

  for i, (name, topo, steps, wrap) in enumerate(runs):
    n = topo.num_nodes
    x0, a, b = cases.problem(n)
    mine = be.node_slice(n)
    tx = cases.algorithm(name, topo, be)
    got = cases.trajectory(tx, jnp.asarray(x0[mine]), jnp.asarray(a[mine]), jnp.asarray(b[mine]), steps, wrap)
    err = float(np.max(np.abs(got - references[i][:, mine])))
    worst, checked = max(worst, err), checked + 1
    if not err <= 1e-12:
      errors.append(f"{name} on {topo.name}: max |mpi - simulate| = {err:.3g}")

  # Only neighbour exchange: one sendrecv per exchange this rank takes part in, no gathers.
  topo = T.exponential(4 * size)
  mixer = be.mixer(topo)
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
  x = jnp.ones((4, 3))
  calls = count_calls(lambda x, s: tx.update(x, s, x), x, tx.init(x))
  expected = sum(
      1 for p in mixer.plans for e in p.exchanges if e.count[rank] or e.source[rank] >= 0
  )
  if calls["sendrecv"] != expected or any(v for k, v in calls.items() if k != "sendrecv"):
    errors.append(f"gossip_sgd on {topo.name}: MPI calls {calls}, expected {expected} sendrecv only")
  tx = gj.allreduce_sgd(learning_rate=0.1, backend=be)
  calls = count_calls(lambda x, s: tx.update(x, s, x), x, tx.init(x))
  if calls["allreduce"] != 1 or calls["allgather"] or calls["sendrecv"]:
    errors.append(f"allreduce_sgd: MPI calls {calls}, expected one allreduce")

  try:
    gj.gossip_sgd(T.ring(2 * size + 1), learning_rate=0.1, backend=be)
    errors.append("a node count not divisible by the ranks was accepted")
  except ValueError as e:
    if f"multiple of {size}" not in str(e):
      errors.append(f"unhelpful error for an uneven split: {e}")

  # Rank 0 reports for all ranks in one print: lines printed by several ranks can interleave.
  reports = be.comm.gather((rank, checked, worst, errors), root=0)
  if rank == 0:
    lines = [f"rank {r}: FAIL {e}" for r, _, _, errs in reports for e in errs]
    lines += [f"rank {r}/{size}: OK {c} trajectories, max error {w:.2e}" for r, c, w, errs in reports if not errs]
    sys.stdout.write("\n".join(lines) + "\n")  # one write, so mpiexec never joins two ranks' lines
    sys.stdout.flush()
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
