"""The composition contract: every optax combinator around and inside every gossipjax transform, per node.

Under `gj.chain` / `gj.nodes` each transform is written for one node and communication is a
collective over the named axis ``"nodes"``. Each case runs a combinator around (or inside) a
gossipjax transform through `gj.chain` and compares three steps with a reference: the same
combinator around the same transform called on stacked trees with shared hyperparameters
(where the combinator acts elementwise, the two must agree), or a per-node reference where
the combinator's semantics are per node (a NaN on one node, a plateau value per node).
Simulated, and sharded over 8 CPU devices with two nodes per device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

N = 16
W = gj.topology.ring(N)
MASK = {"w": True, "b": False}


def _backend(kind):
  if kind == "simulate":
    return gj.backend.simulate()
  return gj.backend.sharded(jax.make_mesh((8,), ("nodes",)))


# One factory per gossipjax transform: (backend, learning rate) -> transform.
METHODS = {
    "mix": lambda be, lr: optax.chain(optax.sgd(lr), gj.mix(W, backend=be)),
    "gossip_sgd": lambda be, lr: gj.gossip_sgd(W, beta=0.9, learning_rate=lr, backend=be),
    "gradient_tracking": lambda be, lr: gj.gradient_tracking(W, learning_rate=lr, backend=be),
    "choco_sgd": lambda be, lr: gj.choco_sgd(W, gj.compress.top_k(0.5), learning_rate=lr, consensus_step=0.5,
                                             backend=be),
    "diloco": lambda be, lr: gj.diloco(optax.sgd(lr), inner_steps=2, backend=be),
    "guard_finite": lambda be, lr: gj.guard_finite(gj.gossip_sgd(W, learning_rate=lr, backend=be)),
}

# Methods whose exchange would pass a node's NaN step on: optax.apply_if_finite around them inside
# gj.chain is refused (gj.mix sends the params' entry instead; gj.guard_finite skips the step).
UNGUARDED = {"gradient_tracking", "choco_sgd", "diloco"}

# Combinators around a transform; each acts elementwise given shared hyperparameters, so the
# transform called on stacked trees inside the same combinator is the reference.
AROUND = {
    "chain": lambda make: optax.chain(optax.identity(), make(0.1)),
    "named_chain": lambda make: optax.named_chain(("id", optax.identity()), ("method", make(0.1))),
    "masked": lambda make: optax.masked(make(0.1), MASK),
    "multi_transform": lambda make: optax.multi_transform({"gossip": make(0.1), "local": optax.sgd(0.05)},
                                                          {"w": "gossip", "b": "local"}),
    "inject_hyperparams": lambda make: optax.inject_hyperparams(lambda learning_rate: make(learning_rate))(
        learning_rate=0.1),
    "MultiSteps": lambda make: optax.MultiSteps(make(0.1), every_k_schedule=2),
    "apply_if_finite": lambda make: optax.apply_if_finite(make(0.1), 3),
    "lookahead": lambda make: optax.lookahead(make(0.1), sync_period=2, slow_step_size=0.5),
    "schedule_free": lambda make: optax.contrib.schedule_free(make(0.1), learning_rate=1.0),
}


def _params_and_grads(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=(N, 3, 2))), "b": jnp.asarray(rng.normal(size=(N, 2)))}
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params) for _ in range(3)]
  return params, grads


def _run(tx, params, grads, values=None, lookahead=False):
  """Three steps; returns the updates of each."""
  params = optax.LookaheadParams.init_synced(params) if lookahead else params
  state, out = tx.init(params), []
  step = jax.jit(lambda g, s, p, **e: tx.update(g, s, p, **e))
  for k, g in enumerate(grads):
    extra = {} if values is None else {"value": values[k]}
    u, state = step(g, state, params, **extra)
    out.append(u)
    params = optax.apply_updates(params, u)
  return out


def _close(got, want, tol=1e-12):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tol)


# Each combinator around each method on stacked trees of the simulation: the reference of both backends' cases.
_REFERENCES: dict[tuple[str, str], list] = {}


@pytest.mark.parametrize("backend", ["simulate", "sharded"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_combinator_around_every_method_equals_the_stacked_call(method, backend):
  be = _backend(backend)
  params, grads = _params_and_grads()
  for name, around in AROUND.items():
    make = lambda lr, be=be: METHODS[method](be, lr)
    mapped = gj.chain(around(make), backend=be)
    if name == "apply_if_finite" and method in UNGUARDED:
      # A skipped node would still send its NaN step: refused, pointing to gj.guard_finite.
      with pytest.raises(ValueError, match=r"optax\.apply_if_finite around a gossipjax method .* gj\.guard_finite"):
        mapped.init(params)
      continue
    look = name == "lookahead"
    if (method, name) not in _REFERENCES:  # the same for both backends: run once
      reference = around(lambda lr: METHODS[method](gj.backend.simulate(), lr))
      _REFERENCES[method, name] = _run(reference, params, grads, lookahead=look)
    try:
      _close(_run(mapped, params, grads, lookahead=look), _REFERENCES[method, name])
    except AssertionError as e:
      raise AssertionError(f"optax.{name} around gj.{method} on {backend}: {e}") from None


@pytest.mark.parametrize("method", ["gossip_sgd", "diloco"])
def test_combinators_inside_a_method_run_per_node(method):
  """optax wrappers inside a gossipjax transform (guard_finite's and diloco's inner optimizers)."""
  params, grads = _params_and_grads(1)
  inners = {
      "masked": optax.masked(optax.adam(0.1), MASK),
      "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
      "MultiSteps": optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2).gradient_transformation(),
      "clip": optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)),
  }
  for name, inner in inners.items():
    if method == "diloco":
      mapped = gj.chain(gj.diloco(inner, inner_steps=2))
      reference = gj.diloco(gj.per_node(inner), inner_steps=2)
    else:
      mapped = gj.chain(gj.guard_finite(optax.chain(inner, gj.mix(W))))
      reference = gj.guard_finite(optax.chain(gj.per_node(inner), gj.mix(W)))
    try:
      _close(_run(mapped, params, grads), _run(reference, params, grads))
    except AssertionError as e:
      raise AssertionError(f"optax.{name} inside gj.{method}: {e}") from None


def test_the_issue_lines_equal_their_per_node_references():
  rng = np.random.default_rng(2)
  n, Wn = 8, gj.topology.ring(8)
  # Kernels with n rows: a per-node run of the mix would mix a node's own rows.
  params = {"k": jnp.asarray(rng.normal(size=(n, n, 3)))}
  zero = jax.tree.map(jnp.zeros_like, params)
  tx = gj.chain(optax.clip_by_global_norm(1.0), optax.chain(optax.adam(1e-3), gj.mix(Wn)))
  u, _ = tx.update(zero, tx.init(params), params)
  want = jnp.einsum("ij,j...->i...", jnp.asarray(Wn.matrix()), params["k"]) - params["k"]
  np.testing.assert_allclose(u["k"], want, atol=1e-12)
  np.testing.assert_allclose(u["k"].mean(0), 0.0, atol=1e-12)  # the node mean is preserved

  p2 = {"w": params["k"], "b": params["k"][:, 0]}
  g2 = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), p2)
  tx = gj.chain(optax.adam(1e-3), optax.masked(gj.mix(Wn), MASK))
  u, _ = tx.update(g2, tx.init(p2), p2)
  adam = gj.per_node(optax.adam(1e-3))
  local, _ = adam.update(g2, adam.init(p2), p2)
  mixed = jnp.einsum("ij,j...->i...", jnp.asarray(Wn.matrix()), p2["w"] + local["w"]) - p2["w"]
  np.testing.assert_allclose(u["w"], mixed, atol=1e-12)
  np.testing.assert_allclose(u["b"], local["b"], atol=1e-12)

  tx = gj.chain(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), gj.mix(Wn))
  state = tx.init(p2)
  step = jax.jit(tx.update)
  _, state = step(g2, state, p2)
  state = optax.tree_utils.tree_set(state, learning_rate=jnp.asarray(0.01))
  _, state = step(g2, state, p2)
  compiled = step._cache_size()
  for lr in (0.02, 0.03):
    state = optax.tree_utils.tree_set(state, learning_rate=jnp.asarray(lr))
    _, state = step(g2, state, p2)
  assert step._cache_size() == compiled  # a new rate is data, not a new program
  # One node's state stacked over the nodes: a rate set for every node is one value per node after the step.
  np.testing.assert_allclose(optax.tree_utils.tree_get(state, "learning_rate"), np.full(n, 0.03))
  per_node = jnp.linspace(0.01, 0.08, n)
  state = optax.tree_utils.tree_set(state, learning_rate=per_node)
  _, state = step(g2, state, p2)
  np.testing.assert_allclose(optax.tree_utils.tree_get(state, "learning_rate"), per_node)

  tx = optax.inject_hyperparams(gj.choco_sgd, static_args=("key",))(
      Wn, gj.compress.top_k(0.5), learning_rate=0.1, consensus_step=0.5, key=jax.random.key(3))
  u, _ = jax.jit(tx.update)(g2, tx.init(p2), p2)
  ref = gj.choco_sgd(Wn, gj.compress.top_k(0.5), learning_rate=0.1, consensus_step=0.5, key=jax.random.key(3))
  _close(u, ref.update(g2, ref.init(p2), p2)[0])


def test_per_node_semantics_of_apply_if_finite_and_reduce_on_plateau():
  params, grads = _params_and_grads(3)
  grads[1] = jax.tree.map(lambda x: x.at[5].set(jnp.nan), grads[1])
  tx = gj.chain(optax.apply_if_finite(optax.sgd(0.1), 3), gj.mix(W))
  ups = _run(tx, params, grads)
  # Node 5 alone skips its local step at step 1; it still gossips its finite params.
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(ups))
  x1 = optax.apply_updates(params, ups[0])
  local = jax.tree.map(lambda g: -0.1 * jnp.nan_to_num(g), grads[1])
  local = jax.tree.map(lambda u: u.at[5].set(0.0), local)
  want = jax.tree.map(lambda x, u: jnp.einsum("ij,j...->i...", jnp.asarray(W.matrix()), x + u) - x, x1, local)
  _close(ups[1], want)

  values = [jnp.arange(N, dtype=float), jnp.arange(N, dtype=float) + (jnp.arange(N) % 2), jnp.full(N, 100.0)]
  plateau = optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0)
  tx = gj.chain(gj.gossip_sgd(W, learning_rate=0.1), plateau, per_node_args=("value",))
  params, grads = _params_and_grads(4)
  ups = _run(tx, params, grads, values=values)
  # Reference: the stacked method, then each node's own plateau rule on its own value.
  method, p, s = gj.gossip_sgd(W, learning_rate=0.1), params, None
  s = method.init(p)
  ps = jax.vmap(plateau.init)(p)
  for k, g in enumerate(grads):
    u, s = method.update(g, s, p)
    u, ps = jax.vmap(lambda u, st, v: plateau.update(u, st, value=v))(u, ps, values[k])
    _close(ups[k], u)
    p = optax.apply_updates(p, u)


def test_one_line_errors():
  params = {"w": jnp.zeros((N, 2))}
  with pytest.raises(TypeError, match=r"gj.chain: argument 0 .* call it, e.g. optax.adam"):
    gj.chain(optax.adam)
  tx, other = gj.chain(gj.gossip_sgd(W, learning_rate=0.1)), gj.chain(gj.gradient_tracking(W, learning_rate=0.1))
  with pytest.raises(ValueError, match="gj.chain: this state was not made by this transform's init"):
    tx.update(params, other.init(params), params)
  be = _backend("sharded")
  mixed_up = gj.chain(optax.sgd(0.1), gj.mix(W), backend=be)  # gj.mix built for the simulation
  with pytest.raises(ValueError, match=r"gj.mix was built for backend Simulate\(\) but runs inside gj.chain"):
    mixed_up.update(params, mixed_up.init(params), params)


def test_mapped_chain_on_8_devices_holds_only_the_gossip_collectives():
  be = _backend("sharded")
  tx = gj.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.chain(optax.adam(1e-3), gj.mix(W, backend=be)),
                                                             MASK), backend=be)
  params = be.shard(_params_and_grads()[0])
  text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  ops = set(re.findall(r"\b(all-reduce|all-gather|collective-permute|all-to-all)(?:-start)?\(", text))
  assert ops == {"collective-permute"}, ops


def test_guard_state_donates_and_eager_sharded_steps_compile_once():
  be = _backend("sharded")
  tx = gj.chain(optax.clip_by_global_norm(1.0), gj.guard_finite(gj.gossip_sgd(W, learning_rate=0.1, backend=be)),
                backend=be)
  params, grads = _params_and_grads(5)
  params = be.shard(params)
  # Every buffer of the state is its own, so a jitted step may donate all of it (stacked and mapped).
  stacked = gj.guard_finite(gj.gossip_sgd(W, learning_rate=0.1, backend=be))
  for form in (stacked, tx):
    jax.jit(form.update, donate_argnums=(1,))(grads[0], form.init(params), params)
  state = tx.init(params)
  u, state = jax.jit(tx.update)(grads[0], state, params)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
  for k in range(4):  # called eagerly: the mapped transform compiles its program once, not at every step
    u, state = tx.update(grads[k % 3], state, params)
  first = len(compiles)
  for k in range(4):
    u, state = tx.update(grads[k % 3], state, params)
  assert len(compiles) == first, compiles[first:]


def test_abstract_init_on_the_sharded_backend_keeps_the_placement():
  be = _backend("sharded")
  params = be.shard(_params_and_grads()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  for make in (lambda: gj.per_node(optax.adam(0.1), backend=be), lambda: gj.extra(W, learning_rate=0.1, backend=be),
               lambda: gj.exact_diffusion(W, learning_rate=0.1, backend=be),
               lambda: gj.chain(optax.adam(0.1), gj.mix(W, backend=be), backend=be)):
    state = make().init(abstract)
    for x in jax.tree.leaves(state):
      if x.ndim and x.shape[0] == N:
        assert x.sharding.spec[0] == "nodes", (make, x.sharding)


def test_node_mean_scales_before_it_sums():
  x = jnp.full((4, 3), 1e38, jnp.float32)
  assert bool(jnp.isfinite(gj.node_mean(x)).all()) and float(gj.consensus_distance(x)) == 0.0


def test_a_checkpoint_of_the_mapped_state_restores_into_the_transform_built_again(tmp_path):
  params, grads = _params_and_grads(6)

  def build():
    return gj.chain(optax.inject_hyperparams(optax.adam)(learning_rate=0.05), gj.guard_finite(gj.gossip_sgd(
        W, beta=0.9, learning_rate=0.1)))

  tx = build()
  state, p = tx.init(params), params
  for g in grads[:2]:
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
  gj.checkpoint.save(tmp_path, {"params": p, "state": state}, step=2)
  again = build()
  restored = gj.checkpoint.restore(tmp_path, {"params": params, "state": again.init(params)})
  u1, _ = tx.update(grads[2], state, p)
  u2, _ = again.update(grads[2], restored["state"], restored["params"])
  _close(u2, u1, tol=0)


EVERY_METHOD = {
    "decentlam": lambda: gj.decentlam(W, beta=0.9, learning_rate=0.1),
    "qg_dmsgd": lambda: gj.qg_dmsgd(W, beta=0.9, learning_rate=0.1),
    "exact_diffusion": lambda: gj.exact_diffusion(W, learning_rate=0.1),
    "extra": lambda: gj.extra(W, learning_rate=0.1),
    "sgp": lambda: gj.sgp(gj.topology.one_peer_directed_exponential(N), learning_rate=0.1, beta=0.5),
    "allreduce_sgd": lambda: gj.allreduce_sgd(learning_rate=0.1, beta=0.9),
    "periodic_average": lambda: optax.chain(gj.gossip_sgd(W, learning_rate=0.1), gj.periodic_average(2)),
    "easgd": lambda: gj.easgd(learning_rate=0.1, alpha=0.1, center_rate=0.5, every=2),
    "outer_optimizer": lambda: gj.outer_optimizer(optax.sgd(0.1), optax.sgd(0.7), inner_steps=2, topology=W),
    "noloco": lambda: gj.noloco(optax.sgd(0.1), gj.topology.random_pairs(N), inner_steps=2),
    "gradient_tracker": lambda: optax.chain(gj.gradient_tracker(W), optax.adam(1e-2), gj.mix(W)),
    "choco_qsgd": lambda: gj.choco_sgd(W, gj.compress.qsgd(4), learning_rate=0.1, consensus_step=0.5, key=1),
    "choco_random_k": lambda: gj.choco_sgd(gj.topology.random_pairs(N), gj.compress.random_k(0.5),
                                           learning_rate=0.1, consensus_step=0.5, key=2),
}


@pytest.mark.parametrize("name", sorted(EVERY_METHOD))
def test_every_method_inside_gj_chain_equals_its_stacked_call(name):
  params, grads = _params_and_grads(7)
  make = EVERY_METHOD[name]
  _close(_run(gj.chain(make()), params, grads), _run(make(), params, grads))
