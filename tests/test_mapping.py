"""The node mapping follows from its inputs: cached helpers, a state layout fixed by init, declared extra args."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import gossipjax as gj

N = 4
W = gj.topology.ring(N)
WM = np.asarray(W.matrix())
MIXER = gj.mixing.make_mixer(W)
# Module-level helpers whose traces JAX caches: used on stacked trees and inside gj.nodes alike.
MIX_JITTED = jax.jit(lambda t: MIXER.mix(t, 0))


def _mix_twice(t):
  return lax.scan(lambda c, _: (MIXER.mix(c, 0), None), t, length=2)[0]


def _gossip_with(helper):
  """A one-node transform: u' = helper(x + u) - x, the gossip written with a user's helper."""

  def update(updates, state, params):
    return jax.tree.map(lambda m, p: m - p, helper(jax.tree.map(jnp.add, params, updates)), params), state

  return gj.nodes(optax.GradientTransformation(lambda p: optax.EmptyState(), update))


def test_a_cached_jitted_helper_and_a_scanned_mix_work_inside_the_mapping():
  rng = np.random.default_rng(0)
  # One node's leaf is (4, 2): the same aval as the stacked tree the helper is first called on, so
  # only the bound node axis tells the two traces apart.
  stacked = jnp.asarray(rng.normal(size=(N, 2)))
  np.testing.assert_allclose(MIX_JITTED(stacked), WM @ stacked, atol=1e-12)
  x = jnp.asarray(rng.normal(size=(N, N, 2)))
  zero = jnp.zeros_like(x)
  want = np.einsum("ij,jab->iab", WM, x) - x
  for helper, w in ((MIX_JITTED, want), (_mix_twice, np.einsum("ij,jab->iab", WM @ WM, x) - x)):
    tx = _gossip_with(helper)
    for call in (tx.update, jax.jit(tx.update)):
      for _ in range(2):  # called twice: the cached trace is reused, nothing escapes
        u, _ = call(zero, tx.init(x), x)
        np.testing.assert_allclose(u, w, atol=1e-12)
  np.testing.assert_allclose(MIX_JITTED(stacked), WM @ stacked, atol=1e-12)  # and on stacked trees again


def _params_grads(seed, steps=3):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=(N, 3, 2))), "b": jnp.asarray(rng.normal(size=(N, 2)))}
  grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params) for _ in range(steps)]
  return params, grads


@pytest.mark.parametrize("name", ["reduce_on_plateau", "momo"])
def test_the_state_layout_is_fixed_by_init(name, tmp_path):
  inner = {"reduce_on_plateau": lambda: optax.chain(optax.adam(0.1), optax.contrib.reduce_on_plateau(patience=0)),
           "momo": lambda: optax.contrib.momo(learning_rate=0.1)}[name]
  tx = gj.chain(inner(), gj.mix(W), per_node_args=("value",))
  params, grads = _params_grads(1)
  values = [jnp.arange(N, dtype=float) * (k + 1) for k in range(3)]
  state = tx.init(params)
  shapes = jax.tree.map(jnp.shape, state)

  @jax.jit
  def step(p, s, g, v):
    u, s = tx.update(g, s, p, value=v)
    return optax.apply_updates(p, u), s

  p, s = params, state
  for g, v in zip(grads, values):
    p, s = step(p, s, g, v)
    assert jax.tree.map(jnp.shape, s) == shapes
  assert step._cache_size() == 1  # one program for every step

  def body(carry, gv):
    return step(*carry, *gv), None

  (p2, s2), _ = lax.scan(body, (params, state), (jax.tree.map(lambda *x: jnp.stack(x), *grads), jnp.stack(values)))
  for a, b in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((p, s))):
    np.testing.assert_allclose(a, b, atol=1e-12)
  gj.checkpoint.save(tmp_path, {"params": p, "state": s}, step=3)
  restored = gj.checkpoint.restore(tmp_path, {"params": params, "state": tx.init(params)})
  for a, b in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(s)):
    np.testing.assert_array_equal(a, b)


def _scale_by(w_name):
  def update(updates, state, params=None, **extra):
    return jax.tree.map(lambda u: u * extra[w_name], updates), state

  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_an_extra_argument_is_shared_unless_declared_per_node():
  u = jnp.ones((N, N))
  w = jnp.arange(1.0, N + 1)  # a per-coordinate weight shared by every node, n entries long
  stacked, _ = _scale_by("w").update(u, optax.EmptyState(), None, w=w[None, :])
  tx = gj.chain(_scale_by("w"))
  mapped, _ = tx.update(u, tx.init(u), None, w=w)
  np.testing.assert_array_equal(mapped, stacked)  # every node scaled coordinate by coordinate
  np.testing.assert_array_equal(mapped[1], [1.0, 2.0, 3.0, 4.0])
  tx = gj.chain(_scale_by("w"), per_node_args=("w",))  # now one weight per node
  mapped, _ = tx.update(u, tx.init(u), None, w=w)
  np.testing.assert_array_equal(mapped[:, 0], [1.0, 2.0, 3.0, 4.0])
  with pytest.raises(ValueError, match=r"gj.chain: the extra argument w is one value per node, so it needs a "
                                       r"leading axis of 4"):
    tx.update(u, tx.init(u), None, w=jnp.ones(3))


def test_lbfgs_with_its_value_fn_equals_a_run_per_node():
  rng = np.random.default_rng(2)
  center = jnp.asarray(rng.normal(size=3))

  def loss(x):
    return jnp.sum((x - center) ** 2 * jnp.arange(1.0, 4.0)) + 0.1 * jnp.sum((x - center) ** 4)

  x0 = jnp.asarray(rng.normal(size=(N, 3)))
  tx = gj.chain(optax.lbfgs(), per_node_args=("value", "grad"))

  @jax.jit
  def step(x, s):
    value, grad = jax.vmap(jax.value_and_grad(loss))(x)
    u, s = tx.update(grad, s, x, value=value, grad=grad, value_fn=loss)
    return optax.apply_updates(x, u), s

  x, s = x0, tx.init(x0)
  for _ in range(4):
    x, s = step(x, s)
  one = optax.lbfgs()
  for i in range(N):
    xi, si = x0[i], one.init(x0[i])
    for _ in range(4):
      value, grad = jax.value_and_grad(loss)(xi)
      u, si = one.update(grad, si, xi, value=value, grad=grad, value_fn=loss)
      xi = optax.apply_updates(xi, u)
    np.testing.assert_allclose(x[i], xi, rtol=0, atol=1e-12)


def test_a_gated_node_keeps_the_shared_gossip_schedule():
  params, _ = _params_grads(3)
  zero = jax.tree.map(jnp.zeros_like, params)
  nan = jax.tree.map(lambda g: g.at[1].set(jnp.nan), zero)
  tx = gj.chain(optax.apply_if_finite(optax.chain(optax.sgd(0.1), gj.mix(W, every=2)), 3))
  state, p = tx.init(params), params
  mean = gj.node_mean(params)
  for g in [nan, zero, zero, zero, nan, zero, zero]:  # NaNs on the local (odd-count) steps only
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
  counts = [x for x in jax.tree.leaves(state) if x.dtype == jnp.int32 and x.ndim == 0]
  assert counts and all(int(c) == 7 for c in counts if int(c) > 3), counts  # the mix's count: one for all nodes
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(p))
  for a, b in zip(jax.tree.leaves(gj.node_mean(p)), jax.tree.leaves(mean)):
    np.testing.assert_allclose(a, b, atol=1e-12)  # with zero gradients the node mean never moves


def test_guard_finite_inside_the_mapping_keeps_a_skipped_nodes_whole_state():
  params, grads = _params_grads(4, steps=4)
  grads[1] = jax.tree.map(lambda g: g.at[1].set(jnp.nan), grads[1])
  adam = optax.adam(0.1)
  tx = gj.chain(gj.guard_finite(gj.per_node(adam)), gj.mix(W))
  state, p = tx.init(params), params
  # Reference: node by node, a NaN step leaves the node's Adam state (its count included) as it was.
  ref_p = params
  ref_s = [adam.init(jax.tree.map(lambda x: x[i], params)) for i in range(N)]
  for g in grads:
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
    local = []
    for i in range(N):
      gi, xi = jax.tree.map(lambda x: x[i], g), jax.tree.map(lambda x: x[i], ref_p)
      if all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(gi)):
        ui, ref_s[i] = adam.update(gi, ref_s[i], xi)
      else:
        ui = jax.tree.map(jnp.zeros_like, gi)
      local.append(ui)
    half = jax.tree.map(lambda x, *us: x + jnp.stack(us), ref_p, *local)
    ref_p = jax.tree.map(lambda h: jnp.einsum("ij,j...->i...", WM, h), half)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_gj_per_node_maps_a_local_transform_and_refuses_a_gossip():
  g = jnp.ones((N, 2))
  tx = gj.per_node(optax.chain(optax.sgd(0.1), gj.mix(W)))
  with pytest.raises(ValueError, match=r"gj.mix communicates with the other nodes, but runs inside gj.per_node, "
                                       r"which maps a local transform"):
    tx.update(g, tx.init(g), g)


def test_init_and_update_trace_the_one_node_transform_once():
  traces = {"init": 0, "update": 0}

  def init(params):
    traces["init"] += 1
    return optax.adam(0.1).init(params)

  def update(updates, state, params=None):
    traces["update"] += 1
    return optax.adam(0.1).update(updates, state, params)

  tx = gj.chain(optax.GradientTransformation(init, update), gj.mix(W))
  params, grads = _params_grads(5)
  state = tx.init(params)
  assert traces["init"] == 2  # the layout (abstract) and the state itself
  state = tx.init(params)
  assert traces["init"] == 2  # the layout and the compiled init are known
  step = jax.jit(tx.update)
  for g in grads:
    _, state = step(g, state, params)
  assert traces["update"] == 1
  for g in grads:  # eagerly: one compiled program, reused
    _, state = tx.update(g, state, params)
  assert traces["update"] == 2


def test_the_participation_mask_has_one_entry_per_node_in_both_forms():
  params, grads = _params_grads(6, steps=4)
  ups = [[True, False, True, True], [True, True, False, True], [False, True, True, True], [True] * N]
  bare, mapped = gj.diloco(optax.sgd(0.1), inner_steps=2), gj.chain(gj.diloco(optax.sgd(0.1), inner_steps=2))
  outs = []
  for tx, as_list in ((bare, True), (mapped, True), (mapped, False)):
    state, p, out = tx.init(params), params, []
    for g, up in zip(grads, ups):
      u, state = tx.update(g, state, p, up=up if as_list else jnp.asarray(up))
      p = optax.apply_updates(p, u)
      out.append(u)
    outs.append(out)
  for other in outs[1:]:
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(outs[0])):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
  with pytest.raises(ValueError, match=r"^gj\.chain: up must be a bool array with one entry per node, of shape \(4,\), "
                                       r"got bool of shape \(\)$"):
    mapped.update(grads[0], mapped.init(params), params, up=True)


@pytest.mark.parametrize("up", [jnp.ones((N, 2), bool), jnp.ones(N - 1, bool), jnp.ones(N), jnp.asarray(True)],
                         ids=["one-row-per-node", "too-few", "float", "scalar"])
def test_gj_chain_refuses_the_up_masks_the_bare_method_refuses_in_its_words(up):
  params, grads = _params_grads(6, steps=1)
  bare, mapped = gj.diloco(optax.sgd(0.1), inner_steps=2), gj.chain(gj.diloco(optax.sgd(0.1), inner_steps=2))
  messages = []
  for tx, name in ((bare, "gj.diloco"), (mapped, "gj.chain")):
    with pytest.raises(ValueError) as e:
      tx.update(grads[0], tx.init(params), params, up=up)
    assert str(e.value).startswith(f"{name}: up must be a bool array with one entry per node, of shape ({N},), got ")
    messages.append(str(e.value).removeprefix(f"{name}: "))
  assert messages[0] == messages[1]


def test_a_gated_nodes_nan_never_reaches_its_neighbours():
  params, grads = _params_grads(7, steps=1)
  nan = jax.tree.map(lambda g: g.at[1].set(jnp.nan), grads[0])
  gated = gj.chain(optax.apply_if_finite(gj.gossip_sgd(W, beta=0.9, learning_rate=0.1), 3))
  guarded = gj.chain(gj.guard_finite(gj.gossip_sgd(W, beta=0.9, learning_rate=0.1)))
  u, _ = gated.update(nan, gated.init(params), params)
  v, _ = guarded.update(nan, guarded.init(params), params)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
    assert bool(jnp.isfinite(a).all())
    np.testing.assert_array_equal(a[1], 0.0)  # the gated node skips its step
    # Its neighbours mixed its current params, as under gj.guard_finite.
    np.testing.assert_allclose(a[np.r_[0, 2, 3]], b[np.r_[0, 2, 3]], rtol=0, atol=1e-12)


def _to_the_mean(mean):
  """A one-node transform that moves each node to ``mean(params)``: u = mean(x) - x."""
  return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (mean(p) - p, s))


def test_the_collective_over_all_nodes_is_gj_node_mean_and_a_raw_one_is_refused_by_name():
  """One meaning of the node axis: gj.node_mean is the mean over all nodes on the simulation and 8 devices.

  The pmapped backend (tests/backend/test_backend_pmapped.py) and MPI ranks (tests/mpi/check_rank_one.py)
  check the same; a raw lax.pmean over "nodes" is refused there too.
  """
  x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 3)))
  mesh = jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Explicit,))
  for backend in (gj.backend.simulate(), gj.backend.sharded(mesh), gj.backend.hierarchical(2)):
    x = backend.shard(x) if hasattr(backend, "shard") else x
    tx = gj.chain(_to_the_mean(gj.node_mean), backend=backend)
    for call in (lambda v: v + tx.update(v, tx.init(v), v)[0], jax.jit(lambda v: v + tx.update(v, tx.init(v), v)[0])):
      np.testing.assert_allclose(call(x), np.broadcast_to(x.mean(axis=0), x.shape), rtol=0, atol=1e-14)
    raw = gj.chain(_to_the_mean(lambda p: lax.pmean(p, "nodes")), backend=backend)
    with pytest.raises(ValueError, match=r"gj\.chain: a collective over an axis that is not bound.*gj\.node_mean"):
      raw.update(x, raw.init(x), x)
  with pytest.raises(ValueError, match=r"gj\.node_mean communicates .* gj\.per_node"):
    local = gj.per_node(_to_the_mean(gj.node_mean))
    local.update(x, local.init(x), x)
  with pytest.raises(TypeError, match=r"gj\.node_mean inside gj\.chain: leaf \['k'\] has dtype int32"):
    ints = gj.chain(optax.GradientTransformation(lambda p: optax.EmptyState(),
                                                 lambda u, s, p=None: (gj.node_mean(u), s)))
    ints.update({"k": jnp.ones((4, 2), jnp.int32)}, ints.init({"k": jnp.ones((4, 2), jnp.int32)}))


_STATIC = ("inner", "inner_steps", "num_fragments", "overlap", "key", "every", "compressor")
# Each method with the hyperparameter set per node, and the rest of its arguments.
_METHODS = {
    "gossip_sgd": (gj.gossip_sgd, "learning_rate", dict(topology=W, beta=0.5, learning_rate=0.1)),
    "allreduce_sgd": (gj.allreduce_sgd, "beta", dict(beta=0.5, learning_rate=0.1)),
    "decentlam": (gj.decentlam, "learning_rate", dict(topology=W, beta=0.5, learning_rate=0.1)),
    "qg_dmsgd": (gj.qg_dmsgd, "beta", dict(topology=W, beta=0.5, learning_rate=0.1)),
    "sgp": (gj.sgp, "learning_rate", dict(topology=gj.topology.exponential(N), learning_rate=0.1)),
    "gradient_tracking": (gj.gradient_tracking, "learning_rate", dict(topology=W, learning_rate=0.1)),
    "exact_diffusion": (gj.exact_diffusion, "learning_rate", dict(topology=W, learning_rate=0.1)),
    "extra": (gj.extra, "learning_rate", dict(topology=W, learning_rate=0.1)),
    "easgd": (gj.easgd, "alpha", dict(learning_rate=0.1, alpha=0.05)),
    "choco_sgd": (gj.choco_sgd, "consensus_step", dict(topology=W, compressor=gj.compress.top_k(1),
                                                       learning_rate=0.1, consensus_step=0.5)),
    "diloco": (gj.diloco, "outer_learning_rate", dict(inner=optax.sgd(0.1), inner_steps=2)),
    "noloco": (gj.noloco, "outer_learning_rate", dict(inner=optax.sgd(0.1), topology=gj.topology.random_pairs(N), inner_steps=2)),
    "streaming_diloco": (gj.streaming_diloco, "outer_learning_rate",
                         dict(inner=optax.sgd(0.1), num_fragments=2, inner_steps=2)),
}


@pytest.mark.parametrize("name", list(_METHODS))
def test_a_hyperparameter_per_node_is_one_contract_stacked_and_inside_gj_chain(name):
  """optax.inject_hyperparams(method) takes one value per node bare on stacked trees as inside gj.chain."""
  factory, hp, kwargs = _METHODS[name]
  rng = np.random.default_rng(5)
  x = {"w": jnp.asarray(rng.normal(size=(N, 2, 3))), "b": jnp.asarray(rng.normal(size=(N, 3)))}
  grads = [jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape)), x) for _ in range(3)]
  values = jnp.linspace(0.3, 0.9, N) * (0.2 if hp == "learning_rate" else 1.0)
  static = tuple(k for k in _STATIC + ("seed",) if k in inspect.signature(factory).parameters)
  injected = lambda **v: optax.inject_hyperparams(factory, static_args=static)(**{**kwargs, **v})

  def run(tx, state, jit):
    update = jax.jit(tx.update) if jit else tx.update
    p = x
    for g in grads:
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
    return p

  chained = gj.chain(injected())
  state = optax.tree_utils.tree_set(chained.init(x), **{hp: values})
  want = run(chained, state, jit=False)
  bare = injected(**{hp: values})
  got = run(bare, bare.init(x), jit=True)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12), got, want)
  # The values are each node's own: all of them at the first node's value differs.
  same = run(chained, optax.tree_utils.tree_set(chained.init(x), **{hp: jnp.full(N, values[0])}), jit=False)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(want))) > 1e-6
  with pytest.raises(ValueError, match=rf"gj\.{name}: {hp} has 3 values, one per node, but the updates have {N} nodes"):
    bad = injected(**{hp: values[:3]})
    bad.update(grads[0], bad.init(x), x)


def test_a_learning_rate_per_node_on_stacked_trees_is_each_nodes_own():
  """D-PSGD with rate gamma_i at node i: x + u = W (x - gamma g), row by row."""
  x, g = jnp.asarray(np.random.default_rng(6).normal(size=(2, N, 3)))
  rates = jnp.array([0.1, 0.2, 0.3, 0.4])
  tx = gj.gossip_sgd(W, learning_rate=rates)
  u, _ = tx.update(g, tx.init(x), x)
  np.testing.assert_allclose(x + u, WM @ (x - rates[:, None] * g), rtol=0, atol=1e-12)
  # Injected, the method is rebuilt at every update; eager steps still compile once.
  tx = optax.inject_hyperparams(gj.gossip_sgd)(W, learning_rate=rates)
  state, compiles = tx.init(x), []
  listener = lambda event, _secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
  u, state = tx.update(g, state, x)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for _ in range(3):
      u, state = tx.update(g, state, x)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not compiles, compiles


def test_a_per_node_gate_around_an_exchange_that_would_pass_a_nan_on_is_refused():
  """optax.apply_if_finite inside gj.chain: gj.mix keeps a skipped node's NaN home; every other method is refused.

  Without the refusal a NaN on node 1 reached node 0 and node 2 for each of these methods.
  """
  x = {"w": jnp.ones((N, 2, 3)), "b": jnp.ones((N, 3))}
  for name, (factory, _, kwargs) in _METHODS.items():
    gated = gj.chain(optax.apply_if_finite(factory(**kwargs), 3))
    if name == "gossip_sgd":
      gated.init(x)
      continue
    with pytest.raises(ValueError, match=r"gj\.chain: optax\.apply_if_finite around a gossipjax method whose exchange "
                                         r"would pass a skipped node's NaN to its neighbours \(\w+State\); put the "
                                         r"method under gj\.guard_finite instead"):
      gated.init(x)
    # Under gj.guard_finite the node's step is skipped for every method: accepted, also under the gate.
    gj.chain(optax.apply_if_finite(gj.guard_finite(factory(**kwargs)), 3)).init(x)
  gj.chain(optax.apply_if_finite(optax.chain(optax.adam(0.1), gj.mix(W)), 3)).init(x)


@pytest.mark.parametrize("make", [lambda: optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1)),
                                  lambda: optax.polyak_sgd(max_learning_rate=0.5)],
                         ids=["reduce_on_plateau", "polyak_sgd"])
def test_multisteps_passes_the_extra_arguments_on_under_gj_nodes(make):
  """optax.MultiSteps is not an optax transform but passes ``value=`` on: gj.nodes keeps it, as gj.chain does."""
  rng = np.random.default_rng(5)
  x0 = jnp.asarray(rng.normal(size=(3, 2)))
  grads = [jnp.asarray(rng.normal(size=(3, 2))) for _ in range(3)]
  tx = gj.nodes(optax.MultiSteps(make(), 2), per_node_args=("value",))
  x, s = x0, tx.init(x0)
  for g in grads:
    u, s = tx.update(g, s, x, value=jnp.sum(x**2, axis=1))
    x = optax.apply_updates(x, u)
  one = optax.MultiSteps(make(), 2)
  one_update = jax.jit(one.update)
  for i in range(3):
    xi, si = x0[i], one.init(x0[i])
    for g in grads:
      u, si = one_update(g[i], si, xi, value=jnp.sum(xi**2))
      xi = optax.apply_updates(xi, u)
    np.testing.assert_allclose(x[i], xi, rtol=0, atol=1e-12)


def test_a_state_that_changes_structure_in_update_is_named_in_one_line():
  """optax.monitor's measurements are {} after init and hold a value after update: vmap could not stack them."""
  x = jnp.ones((3, 2))
  tx = gj.nodes(optax.chain(optax.sgd(0.1), optax.monitor({"norm": optax.tree.norm})))
  with pytest.raises(ValueError, match=r"^gj\.nodes: the transform whose state is MonitorState changes its state's "
                                       r"structure in update \(at \.measurements: .*\); a transform mapped over nodes "
                                       r"must keep its state's structure from step to step") as err:
    tx.update(x, tx.init(x), x)
  assert "\n" not in str(err.value)


def test_a_type_error_in_the_users_own_init_is_the_users():
  """Only a state that cannot be stacked is reported as such; an error the user's init raises comes out as it is."""

  def init(params):
    raise TypeError("my init wants a dict")

  mine = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  x = jnp.ones((N, 2))
  for tx in (gj.nodes(mine), gj.chain(optax.sgd(0.1), mine), gj.per_node(mine), gj.diloco(mine, inner_steps=2)):
    with pytest.raises(TypeError, match=r"^my init wants a dict$"):
      tx.init(x)
  labelled = optax.GradientTransformation(lambda p: {"name": "adam"}, lambda u, s, p=None: (u, s))
  with pytest.raises(TypeError, match=r"^gj\.nodes: the state of this transform cannot be stacked over nodes"):
    gj.nodes(labelled).init(x)


def test_a_failed_update_names_an_undeclared_extra_argument_with_one_value_per_node():
  """reduce_on_plateau's lax.cond fails on a value of shape (n,) that every node got whole: one line says why."""
  x = jnp.ones((N, 3))
  tx = gj.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau())
  with pytest.raises(ValueError, match=r'^gj\.chain: the update failed \(.*\); the extra argument value \(shape '
                                       r'\(4,\)\), whose leading axis is the node count, is not declared per node, so '
                                       r'every node got it whole; if it holds one value per node, declare it: '
                                       r'`per_node_args=\("value",\)`$'):
    tx.update(x, tx.init(x), x, value=jnp.arange(4.0))
  tx = gj.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(), per_node_args=("value",))
  tx.update(x, tx.init(x), x, value=jnp.arange(4.0))
