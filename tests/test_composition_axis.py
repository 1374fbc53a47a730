"""A collective under `gj.chain` runs over the node axis and nothing else, at the topology's node count.

A ``jax.vmap`` inside a node (a scanned model's layer axis) around `gj.node_mean` or `gj.mix`
maps the collective over that axis, as it maps any JAX function: each layer's mean over the
nodes, each layer's gossip round. Params whose node count is not the topology's are refused
inside the mapping as on stacked trees. The per-node arguments that a `gj.nodes` declares
inside another mapping reach each node as its own entry. Each against a per-node reference,
simulated and sharded over 8 CPU devices (one node per device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

N, LAYERS = 8, 3
W = gj.topology.ring(N)
BACKENDS = ["simulate", "sharded"]
DTYPES = [jnp.float32, jnp.float64]


def _backend(kind):
  if kind == "simulate":
    return gj.backend.simulate()
  return gj.backend.sharded(jax.make_mesh((N,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))


def _tol(dtype):
  return 1e-5 if dtype == jnp.float32 else 1e-12


def _layered(fn):
  """A one-node transform whose update is ``jax.vmap(fn)`` over the leading (layer) axis of u and x."""

  def update(updates, state, params=None):
    return jax.vmap(fn)(updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _gossip_on(backend):
  """One node's ``W(x + u) - x`` over ring(N): `gj.mix` called for one node."""
  tx = gj.mix(W, backend=backend)
  return lambda updates, params: tx.update(updates, tx.init(params), params)[0]


_gossip = _gossip_on(gj.backend.simulate())


def _mixed(x, u):
  """The reference: ``W(x + u) - x`` with the dense W on the node axis, each layer alone."""
  dense = np.asarray(W.matrix(0), np.float64)
  return np.einsum("ij,j...->i...", dense, np.asarray(x + u, np.float64)) - np.asarray(x, np.float64)


def _step(tx, *args, **extra):
  """``tx.update`` with the update as one array (the params here are one array)."""
  u, state = tx.update(*args, **extra)
  return jnp.asarray(u), state


def _data(dtype, shape=(N, LAYERS, 2)):
  x = jnp.arange(np.prod(shape), dtype=dtype).reshape(shape)
  return x, jnp.cos(x).astype(dtype)


# -- item 1: a jax.vmap inside a node is not the node axis ----------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_node_mean_under_a_vmap_inside_a_node_is_each_layers_mean_over_the_nodes(backend, dtype):
  x, _ = _data(dtype)
  tx = gj.chain(_layered(lambda u, p: gj.node_mean(u)), backend=_backend(backend))
  u, _ = _step(tx, x, tx.init(x), x)
  assert u.dtype == dtype and u.shape == x.shape
  want = np.broadcast_to(np.asarray(x, np.float64).mean(axis=0), x.shape)  # node by node: each layer's mean
  np.testing.assert_allclose(np.asarray(u, np.float64), want, atol=_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mix_under_a_vmap_inside_a_node_gossips_each_layer_over_the_nodes(backend, dtype):
  x, g = _data(dtype)
  be = _backend(backend)
  tx = gj.chain(_layered(_gossip_on(be)), backend=be)
  u, _ = _step(tx, g, tx.init(x), x)
  assert u.dtype == dtype
  np.testing.assert_allclose(np.asarray(u, np.float64), _mixed(x, g), atol=_tol(dtype) * 100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nested_and_non_leading_vmaps_inside_a_node_map_the_collective_over_their_axes(dtype):
  x, g = _data(dtype, (N, LAYERS, 2, 4))
  twice = lambda u, p: jax.vmap(jax.vmap(_gossip))(u, p)  # layers, then the axis of 2
  tx = gj.chain(_layered(twice))
  u, _ = _step(tx, g, tx.init(x), x)
  np.testing.assert_allclose(np.asarray(u, np.float64), _mixed(x, g), atol=_tol(dtype) * 100)

  # vmapped over one node's last axis (in_axes=-1, out_axes=-1), the params shared by its slices
  def columns(u, p):
    return jax.vmap(lambda uc: _gossip(uc, p[..., 0]), in_axes=-1, out_axes=-1)(u)

  tx = gj.chain(_layered(columns))
  u, _ = _step(tx, g, tx.init(x), x)
  x0 = np.broadcast_to(np.asarray(x)[..., :1], x.shape)
  np.testing.assert_allclose(np.asarray(u, np.float64), _mixed(x0, np.asarray(g)), atol=_tol(dtype) * 100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_method_under_a_vmap_inside_a_node_equals_the_method_on_each_layer(dtype):
  x, g = _data(dtype)
  method = gj.gossip_sgd(W, learning_rate=0.1)

  def layered_method():
    def init(params):
      return jax.vmap(method.init)(params)

    def update(updates, state, params=None):
      return jax.vmap(method.update)(updates, state, params)

    return optax.GradientTransformation(init, update)

  tx = gj.chain(layered_method())
  state, ref_states = tx.init(x), [method.init(x[:, layer]) for layer in range(LAYERS)]
  for _ in range(2):
    u, state = _step(tx, g, state, x)
    for layer in range(LAYERS):  # the stacked method on each layer's node-stacked slice
      want, ref_states[layer] = _step(method, g[:, layer], ref_states[layer], x[:, layer])
      np.testing.assert_allclose(np.asarray(u[:, layer]), np.asarray(want), atol=_tol(dtype))


# -- item 2: the node count is checked inside the mapping ---------------------------------------------


METHODS = {
    "mix": lambda: (optax.sgd(0.1), gj.mix(gj.topology.ring(4))),
    "gossip_sgd": lambda: (gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1),),
    "gradient_tracking": lambda: (gj.gradient_tracking(gj.topology.ring(4), learning_rate=0.1),),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_params_with_another_node_count_than_the_topology_are_refused_inside_the_mapping(method, dtype):
  x = jnp.ones((3, 2), dtype)
  stacked = optax.chain(*METHODS[method]())
  with pytest.raises(ValueError, match="expects 4 nodes") as on_stacked:
    stacked.update(x, stacked.init(x), x)
  tx = gj.chain(*METHODS[method]())
  with pytest.raises(ValueError, match="expects 4 nodes") as mapped:
    tx.update(x, tx.init(x), x)
  assert "leading node axis of 3" in str(mapped.value) and "leading node axis of 3" in str(on_stacked.value)


def test_a_rank_sized_block_is_not_refused():
  x = jnp.ones((4, 2))
  tx = gj.chain(optax.sgd(0.1), gj.mix(gj.topology.ring(4)))
  u, _ = _step(tx, x, tx.init(x), x)
  np.testing.assert_allclose(np.asarray(u), -0.1)


# -- item 5: the per-node arguments an inner gj.nodes declares compose -------------------------------


def _record():
  """Keeps the extra argument ``value`` it is given, broadcast to 4 entries: what each node received."""

  def init(params):
    return {"seen": jnp.zeros((4,), jax.tree.leaves(params)[0].dtype)}

  def update(updates, state, params=None, **extra_args):
    del params
    return updates, {"seen": jnp.broadcast_to(extra_args["value"], (4,)).astype(state["seen"].dtype)}

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_inner_gj_nodes_declaration_reaches_each_node_under_an_outer_chain(backend, dtype):
  be = _backend(backend)
  x = jnp.zeros((N, 2), dtype)
  value = jnp.arange(N, dtype=dtype)
  forms = {
      "chain(nodes)": gj.chain(gj.nodes(_record(), per_node_args=("value",), backend=be), backend=be),
      "nodes(chain)": gj.nodes(gj.chain(_record(), per_node_args=("value",), backend=be), backend=be),
      "chain(chain)": gj.chain(optax.identity(), gj.chain(_record(), per_node_args=("value",), backend=be),
                               backend=be),
  }
  want = np.repeat(np.arange(N)[:, None], 4, axis=1)  # node i's row: its own value, four times
  for form, tx in forms.items():
    _, state = tx.update(x, tx.init(x), x, value=value)
    (seen,) = [leaf for leaf in jax.tree.leaves(state) if leaf.shape == (N, 4)]
    np.testing.assert_array_equal(np.asarray(seen), want, err_msg=form)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_on_plateau_declared_inside_equals_each_nodes_own_run(backend, dtype):
  be = _backend(backend)
  plateau = lambda: optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0, accumulation_size=1)
  tx = gj.chain(optax.sgd(0.1), gj.nodes(plateau(), per_node_args=("value",), backend=be), backend=be)
  x = jnp.ones((N, 2), dtype)
  g = jnp.ones((N, 2), dtype)
  losses = [jnp.asarray(np.where(np.arange(N) % 2, 1.0, 1.0 - 0.1 * k), dtype) for k in range(4)]  # odd: a plateau

  ref = optax.chain(optax.sgd(0.1), plateau())
  ref_states = [ref.init(x[i]) for i in range(N)]
  state, u = tx.init(x), g
  for loss in losses:
    u, state = _step(tx, g, state, x, value=loss)
    for i in range(N):
      want, ref_states[i] = _step(ref, g[i], ref_states[i], x[i], value=loss[i])
      np.testing.assert_allclose(np.asarray(u[i]), np.asarray(want), rtol=_tol(dtype), err_msg=f"node {i}")
  assert not np.allclose(np.asarray(u[0]), np.asarray(u[1]))  # the plateau nodes' scale has dropped
