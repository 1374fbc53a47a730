"""One gossip round over MPI: gossipjax's mpi backend against raw mpi4py ``Sendrecv`` of the same buffers.

Each rank holds one node of ``--floats`` float32 values on a ring (weights 1/3: self, left,
right). Timed, per repetition, after a barrier, the slowest rank counting:

- ``gossipjax``: the jitted ``gj.backend.mpi().mixer(ring).mix(x)``: two ``mpi4jax.sendrecv``
  and the weighted sum, as the optimizers run it;
- ``mpi4py``: two ``comm.Sendrecv`` into preallocated NumPy buffers (the communication alone);
- ``mpi4py + sum``: the same plus the NumPy weighted sum, i.e. the same gossip round by hand;
- ``mpi4py + in-place sum``: the same round with every NumPy operation writing into a
  preallocated buffer (no allocation at all): the least a round that must also sum can cost;
- ``mpi4jax sendrecv``: the two jitted ``mpi4jax.sendrecv`` alone, to split the round's time
  between communication and the weighted sum.

Run: ``mpiexec -n 4 python benchmarks/mpi_gossip.py`` (``--floats``, ``--reps``, ``--json PATH``).
The goal is a ratio gossipjax / mpi4py within 1.1x.
"""

import argparse
import json
import sys
import time


def timed(fns: dict, comm, reps: int) -> dict:
  """Median over ``reps`` of the slowest rank's wall time for each ``fn()``.

  The functions take turns within each repetition, so a change in machine load (the ranks
  may share cores) hits all of them alike.
  """
  import numpy as np
  from mpi4py import MPI

  for fn in fns.values():
    fn()  # warm-up: compilation, first touch of the buffers
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      comm.Barrier()
      t0 = time.perf_counter()
      fn()
      times[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
  return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--floats", type=int, default=4 * 2**20, help="float32 values per node (default 4M)")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--json", default=None, help="also write the results to this file (rank 0)")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  import gossipjax as gj

  be = gj.backend.mpi()
  comm, rank, size = be.comm, be.rank, be.size
  topo = gj.topology.ring(size)
  w = topo.matrix()
  left, right = (rank - 1) % size, (rank + 1) % size

  x_np = np.random.default_rng(rank).standard_normal((1, args.floats), dtype=np.float32)
  x = jnp.asarray(x_np)
  mix = jax.jit(be.mixer(topo).mix)

  got = np.asarray(mix(x))
  from_left, from_right = np.empty_like(x_np), np.empty_like(x_np)

  def raw_exchange():
    comm.Sendrecv(x_np, dest=right, sendtag=1, recvbuf=from_left, source=left, recvtag=1)
    comm.Sendrecv(x_np, dest=left, sendtag=2, recvbuf=from_right, source=right, recvtag=2)

  def raw_round():
    raw_exchange()
    return w[rank, rank] * x_np + w[rank, left] * from_left + w[rank, right] * from_right

  acc = np.empty_like(x_np)
  w_self, w_left, w_right = (np.float32(w[rank, j]) for j in (rank, left, right))

  def raw_round_in_place():  # the same round with no allocation: the best a hand-written round does
    raw_exchange()
    np.multiply(x_np, w_self, out=acc)
    np.multiply(from_left, w_left, out=from_left)
    np.add(acc, from_left, out=acc)
    np.multiply(from_right, w_right, out=from_right)
    np.add(acc, from_right, out=acc)
    return acc

  np.testing.assert_allclose(got, raw_round(), rtol=1e-6, atol=1e-6)  # the same round
  np.testing.assert_allclose(got, raw_round_in_place(), rtol=1e-6, atol=1e-6)

  import mpi4jax

  @jax.jit
  def jax_exchange(x):  # the two sendrecvs the backend emits for a ring, without the weighted sum
    a = mpi4jax.sendrecv(x, x, source=left, dest=right, sendtag=1, recvtag=1, comm=comm)
    b = mpi4jax.sendrecv(x, x, source=right, dest=left, sendtag=2, recvtag=2, comm=comm)
    return a, b

  t = timed({
      "gj": lambda: mix(x).block_until_ready(),
      "raw": raw_exchange,
      "raw_sum": raw_round,
      "raw_sum_in_place": raw_round_in_place,
      "jax_exchange": lambda: jax.block_until_ready(jax_exchange(x)),
  }, comm, args.reps)
  t_gj, t_raw, t_raw_sum, t_jx = t["gj"], t["raw"], t["raw_sum"], t["jax_exchange"]
  t_best = t["raw_sum_in_place"]
  result = {
      "ranks": size,
      "floats_per_node": args.floats,
      "megabytes_per_message": args.floats * 4 / 2**20,
      "reps": args.reps,
      "gossipjax_s": t_gj,
      "mpi4py_sendrecv_s": t_raw,
      "mpi4py_sendrecv_plus_sum_s": t_raw_sum,
      "mpi4py_sendrecv_plus_in_place_sum_s": t_best,
      "mpi4jax_sendrecv_s": t_jx,
      "ratio_vs_sendrecv": t_gj / t_raw,
      "ratio_vs_sendrecv_plus_sum": t_gj / t_raw_sum,
      "ratio_vs_sendrecv_plus_in_place_sum": t_gj / t_best,
      "in_place_round_vs_sendrecv": t_best / t_raw,
  }
  if rank == 0:
    print(f"gossip round on ring({size}), {args.floats} float32 per node, median of {args.reps} (slowest rank):")
    print(f"  gossipjax mpi backend        {t_gj * 1e3:8.2f} ms")
    print(f"  mpi4py Sendrecv x2           {t_raw * 1e3:8.2f} ms   ratio {t_gj / t_raw:.2f}x")
    print(f"  mpi4py Sendrecv x2 + sum     {t_raw_sum * 1e3:8.2f} ms   ratio {t_gj / t_raw_sum:.2f}x")
    print(f"  mpi4py Sendrecv x2 + in-place sum {t_best * 1e3:5.2f} ms   ratio {t_gj / t_best:.2f}x "
          f"(this hand-written round is itself {t_best / t_raw:.2f}x the bare Sendrecv)")
    print(f"  mpi4jax sendrecv x2 (jit)    {t_jx * 1e3:8.2f} ms   (the exchange alone, inside JAX)")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
