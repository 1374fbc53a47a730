"""``gj.chain``: every optax transform runs per node, so one node's update is that transform on that node alone."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

N = 4
W = T.ring(N)

# optax transforms that reduce over the whole tree (or keep whole-tree state) and elementwise ones.
TRANSFORMS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.01),
    "lion": lambda: optax.lion(0.01),
    "lamb": lambda: optax.lamb(0.01),
    "lars": lambda: optax.lars(0.1),
    "adafactor": lambda: optax.adafactor(0.01, min_dim_size_to_factor=2),
    "clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1), 3),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(0.1), 2),
}


def _problem():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(N, 3, 2))), "b": jnp.asarray(rng.normal(size=(N, 2)))}
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params) for _ in range(3)]
  grads[1] = jax.tree.map(lambda g: g.at[2].set(jnp.nan), grads[1])  # node 2's second gradient is NaN
  return params, grads


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_each_node_updates_as_the_transform_alone_would_then_gossips(name):
  params, grads = _problem()
  tx = gj.chain(TRANSFORMS[name](), gj.mix(W))
  update = jax.jit(tx.update)
  state = tx.init(params)
  alone = TRANSFORMS[name]()
  node = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  node_states = [alone.init(node(params, i)) for i in range(N)]
  mixer = gj.mixing.make_mixer(W)
  steps = 3 if name == "apply_if_finite" else 1  # only apply_if_finite may see the NaN gradient
  for k in range(steps):
    u, state = update(grads[k], state, params)
    local = []
    for i in range(N):
      ui, node_states[i] = alone.update(node(grads[k], i), node_states[i], node(params, i))
      local.append(ui)
    local = jax.tree.map(lambda *xs: jnp.stack(xs), *local)
    want = jax.tree.map(lambda m, x: m - x, mixer.mix(jax.tree.map(jnp.add, params, local), k), params)
    for got, expected in zip(jax.tree.leaves(u), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    params = optax.apply_updates(params, u)
  if name == "apply_if_finite":  # the NaN stopped node 2's step only, not its neighbours'
    assert np.asarray(state[0].notfinite_count).tolist() == [0, 0, 0, 0]
    assert bool(jnp.isfinite(params["w"]).all())


def test_a_bare_optax_chain_couples_the_nodes_where_gj_chain_does_not():
  params, grads = _problem()
  bare = optax.chain(optax.apply_if_finite(optax.sgd(0.1), 3), gj.mix(W))
  per_node = gj.chain(optax.apply_if_finite(optax.sgd(0.1), 3), gj.mix(W))
  ub, _ = bare.update(grads[1], bare.init(params), params)
  up, _ = per_node.update(grads[1], per_node.init(params), params)
  # One NaN node: the bare chain skips every node's local step; gj.chain skips node 2's alone.
  gossip_only = jax.tree.map(jnp.subtract, gj.mixing.make_mixer(W).mix(params, 0), params)  # W x - x
  local = lambda u: jax.tree.map(jnp.subtract, u, gossip_only)  # W u_local
  assert float(jnp.abs(local(ub)["b"]).max()) == 0.0
  assert float(jnp.abs(local(up)["b"]).max()) > 0.0


def test_sharded_per_node_composition_has_no_all_reduce():
  k = 8
  be = gj.backend.sharded(jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))
  whole_tree = [TRANSFORMS[name]() for name in ("clip_by_global_norm", "lamb", "lars", "adafactor", "apply_if_finite",
                                                "MultiSteps", "lion", "adamw")]
  tx = gj.chain(*whole_tree, gj.mix(T.ring(2 * k), backend=be), backend=be)
  rng = np.random.default_rng(1)
  params = be.shard({"w": rng.normal(size=(2 * k, 3, 2)), "b": rng.normal(size=(2 * k, 2))})
  text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  ops = set(re.findall(r"\b(all-reduce|all-gather|collective-permute|all-to-all)(?:-start)?\(", text))
  assert ops == {"collective-permute"}, ops
