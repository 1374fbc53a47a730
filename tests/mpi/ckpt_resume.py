"""Checkpoint and resume under MPI: every rank saves and restores its own block of nodes.

Usage: mpiexec -n 2 python ckpt_resume.py {first,resume} CKPT_DIR OUT_DIR
  first:  trains 12 steps, saving the whole state at step 6; writes the final state.
  resume: restores the newest step every rank has, trains to step 12; writes the final state.
The two final states must be equal bit for bit.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj

jax.config.update("jax_enable_x64", True)
mode, ckpt_dir, out_dir = sys.argv[1:4]
N, STEPS, SAVE_AT = 8, 12, 6

backend = gj.backend.mpi()
comm, rank = backend.comm, backend.rank
mine = backend.node_slice(N)
rng = np.random.default_rng(0)
inputs = rng.normal(size=(128, 5))
targets = inputs @ rng.normal(size=5) + 0.1 * rng.normal(size=128)
parts = gj.data.partition_iid(np.zeros(128, int), N, seed=0)
data = gj.data.node_data(inputs, targets, parts[mine])
tx = gj.guard_finite(gj.gossip_sgd(gj.topology.one_peer_exponential(N), beta=0.9,
                                   learning_rate=optax.cosine_decay_schedule(0.05, 20), backend=backend))


def init(seed):
  params = gj.init_nodes(lambda k: jax.random.normal(k, (5,)), jax.random.key(seed), N, same_init=False)[mine]
  key = jax.random.fold_in(jax.random.key(seed + 1), rank)
  return {"params": params, "opt": tx.init(params), "key": key, "step": jnp.asarray(0, jnp.int32)}


@jax.jit
def step(state):
  key, sub = jax.random.split(state["key"])
  xb, yb = gj.data.sample_batches(data, sub, 4)
  grads = jax.vmap(jax.grad(lambda w, x, y: jnp.mean((x @ w - y) ** 2)))(state["params"], xb, yb)
  updates, opt = tx.update(grads, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "key": key, "step": state["step"] + 1}


directory = gj.checkpoint.rank_directory(ckpt_dir, rank)
if mode == "first":
  state = init(0)
  while int(state["step"]) < STEPS:
    state = step(state)
    if int(state["step"]) == SAVE_AT:
      gj.checkpoint.save(directory, state, step=SAVE_AT)
else:
  start = gj.checkpoint.latest_step(directory, comm=comm)
  assert start == SAVE_AT, start
  state = gj.checkpoint.restore(directory, like=init(99), step=start)
  assert int(state["step"]) == SAVE_AT
  while int(state["step"]) < STEPS:
    state = step(state)

leaves = jax.tree.leaves(jax.tree.map(lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key) else x, state))
np.savez(f"{out_dir}/{mode}_rank{rank}.npz", *[np.asarray(x) for x in leaves])
sys.stdout.write(f"rank {rank}/{backend.size}: {mode} done at step {int(state['step'])}\n")  # one write
sys.stdout.flush()
