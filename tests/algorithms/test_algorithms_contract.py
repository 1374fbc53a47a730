"""One contract over a table of every gossipjax method (optax's habit: the same checks for all).

For each method: it jits; float32, float64 and bfloat16 params stay in their dtype; the
state keeps its structure and dtypes from step to step (so a jitted step compiles once);
it accepts extra keyword args; it runs on a flax model's pytree of several leaves of
different shapes, linen or nnx; it works under ``optax.inject_hyperparams`` where it has a
learning rate; the node average is preserved under doubly stochastic W where the method
promises it; a step can donate params and state; ``jax.eval_shape`` predicts init and
update; integer leaves are left alone and None leaves stay None; and it composes with
optax's wrappers (``MultiSteps``, ``apply_if_finite``, ``masked``).
"""

import inspect
from typing import Any, Callable, NamedTuple

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

N = 8
W = T.ring(N)


class Method(NamedTuple):
  name: str
  make: Callable[[], optax.GradientTransformation]
  factory: Callable[..., optax.GradientTransformation] | None  # for inject_hyperparams (has learning_rate)
  kwargs: dict[str, Any]
  preserves_average: bool  # with zero gradients, under doubly stochastic W
  static_args: tuple[str, ...] = ()
  # How far the node average may move in 20 bfloat16 steps with zero gradients (relative). A
  # first-order method moves it by the rounding of each step; one whose state integrates past
  # steps (momentum, a correction, public copies) integrates that rounding too, even with every
  # internal sum in float32, because the params it reads are rounded.
  bf16_drift: float = 5e-3


def _method(name, factory, kwargs, preserves_average=True, static_args=(), bf16_drift=5e-3):
  return Method(name, lambda: factory(**kwargs), factory, kwargs, preserves_average, static_args, bf16_drift)


METHODS = [
    _method("gossip_sgd", gj.gossip_sgd, dict(topology=W, beta=0.9, learning_rate=0.1)),
    _method("decentlam", gj.decentlam, dict(topology=W, beta=0.9, learning_rate=0.1), bf16_drift=6e-2),
    _method("allreduce_sgd", gj.allreduce_sgd, dict(learning_rate=0.1, beta=0.9)),
    Method("adam+mix", lambda: optax.chain(optax.adam(1e-2), gj.mix(W)), None, {}, True),
    Method("sgd+mix_every_3", lambda: optax.chain(optax.sgd(0.1), gj.mix(W, every=3)), None, {}, True),
    _method("gradient_tracking", gj.gradient_tracking, dict(topology=W, learning_rate=0.1)),
    Method("gradient_tracker+adam+mix", lambda: gj.chain(gj.gradient_tracker(W), optax.adam(1e-2), gj.mix(W)),
           None, {}, True),
    _method("exact_diffusion", gj.exact_diffusion, dict(topology=W, learning_rate=0.1), bf16_drift=0.2),
    _method("extra", gj.extra, dict(topology=W, learning_rate=0.1), bf16_drift=0.15),
    _method("sgp", gj.sgp, dict(topology=T.one_peer_directed_exponential(N), learning_rate=0.1, beta=0.5)),
    _method("choco_sgd-qsgd", gj.choco_sgd,
            dict(topology=W, learning_rate=0.1, compressor=gj.compress.qsgd(4), consensus_step=0.5, seed=1),
            static_args=("key", "seed"), bf16_drift=0.1),
    _method("qg_dmsgd", gj.qg_dmsgd, dict(topology=W, beta=0.9, learning_rate=0.1), bf16_drift=2e-2),
    Method("gossip_sgd+periodic_average",
           lambda: optax.chain(gj.gossip_sgd(W, learning_rate=0.1), gj.periodic_average(2)), None, {}, True),
    _method("easgd", gj.easgd, dict(learning_rate=0.1, alpha=0.1, center_rate=0.5, every=2), preserves_average=False),
]
IDS = [m.name for m in METHODS]


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.tanh(nn.Dense(6)(x)))


def model_problem(dtype):
  """n different MLPs (four leaves: two kernels, two biases) and a per-node loss."""
  model = MLP()
  xb = jax.random.normal(jax.random.key(0), (N, 4, 3)).astype(dtype)
  params = gj.init_nodes(lambda k: model.init(k, xb[0]), jax.random.key(1), N, same_init=False)
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
  grads_fn = lambda p: jax.vmap(jax.grad(loss))(p, xb)
  return params, grads_fn


def leaf_types(tree):
  dtype = lambda x: x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype  # arrays and ShapeDtypeStructs
  return jax.tree.structure(tree), [(jnp.shape(x), dtype(x)) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_jit_dtype_state_and_extra_args_on_a_flax_model(method, dtype=jnp.float32):
  """float32 under x64 (the tests' setting) is the case a stray float64 would break;
  float64 is checked in `test_node_average_preserved_with_zero_gradients_and_float64_kept`."""
  tx = method.make()
  params, grads_fn = model_problem(dtype)
  assert len(jax.tree.leaves(params)) == 4
  state = tx.init(params)
  first = leaf_types(state)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads_fn(params), state, params, loss=jnp.asarray(1.0, dtype))
    return optax.apply_updates(params, updates), updates, state

  for _ in range(4):
    params, updates, state = step(params, state)
    assert leaf_types(state) == first
  assert step._cache_size() == 1
  assert all(x.dtype == dtype for x in jax.tree.leaves(params))
  assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_node_average_preserved_with_zero_gradients_and_float64_kept(method):
  tx = method.make()
  params, _ = model_problem(jnp.float64)
  mean0 = gj.node_mean(params)
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update(jax.tree.map(jnp.zeros_like, p), s, p))
  for _ in range(5):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  if method.preserves_average:
    for got, want in zip(jax.tree.leaves(gj.node_mean(params)), jax.tree.leaves(mean0)):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
  assert all(x.dtype == jnp.float64 for x in jax.tree.leaves((params, updates)))


@pytest.mark.parametrize("method", [m for m in METHODS if m.factory is not None], ids=lambda m: m.name)
def test_inject_hyperparams_follows_a_changed_learning_rate_without_recompiling(method):
  """Injected: 2 steps at lr, then lr halved by editing the state. Plain: the same as a schedule."""
  params, grads_fn = model_problem(jnp.float64)
  lr = method.kwargs["learning_rate"]
  injected = optax.inject_hyperparams(method.factory, static_args=method.static_args)(**method.kwargs)
  sched = optax.piecewise_constant_schedule(lr, {2: 0.5})
  plain = method.factory(**{**method.kwargs, "learning_rate": sched})
  step = jax.jit(lambda tx_update, p, s: tx_update(grads_fn(p), s, p), static_argnums=0)
  p1, s1, p2, s2 = params, injected.init(params), params, plain.init(params)
  for k in range(4):
    if k == 2:
      s1.hyperparams["learning_rate"] = jnp.asarray(0.5 * lr, s1.hyperparams["learning_rate"].dtype)
    u1, s1 = step(injected.update, p1, s1)
    u2, s2 = step(plain.update, p2, s2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
  assert step._cache_size() == 2  # one program each for injected and plain, reused every step


@pytest.mark.parametrize("method", [m for m in METHODS if "topology" in m.kwargs], ids=lambda m: m.name)
def test_wrong_node_axis_is_named(method):
  tx = method.make()
  x = {"layer": jnp.ones((N - 2, 3))}
  with pytest.raises(ValueError, match=r"\['layer'\] has a leading node axis of 6"):
    tx.update(x, tx.init(x), x)


def small_problem(dtype=jnp.float64, seed=0):
  """Two leaves of different shapes, nodes apart, and a random gradient function."""
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(1 + rng.normal(size=(N, 3)), dtype), "b": jnp.asarray(rng.normal(size=(N,)), dtype)}
  grads = lambda k: jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(100 + k).normal(size=x.shape), x.dtype),
                                 params)
  return params, grads


def run(tx, params, grads, steps, state=None):
  state = tx.init(params) if state is None else state
  for k in range(steps):
    updates, state = tx.update(grads(k), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_donated_step_and_eval_shape(method):
  """``jit(step, donate_argnums=(0, 1))``: the state holds no buffer of the params; eval_shape agrees."""
  tx = method.make()
  params, grads = small_problem()
  state = tx.init(params)
  assert leaf_types(jax.eval_shape(tx.init, params)) == leaf_types(state)
  # init on abstract params (shapes without values), as optax's own transforms take them
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert leaf_types(tx.init(abstract)) == leaf_types(state)
  shapes = jax.eval_shape(tx.update, grads(0), state, params)
  assert leaf_types(shapes) == leaf_types(tx.update(grads(0), state, params))

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  for k in range(2):
    old = params
    params, state = step(params, state, grads(k))
    assert old["w"].is_deleted()
  assert leaf_types(state) == leaf_types(shapes[1])


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_integer_leaves_left_alone_and_none_leaves_kept(method):
  """An integer leaf (a step counter, a flax RNG count) is neither mixed nor moved, as optax leaves it."""
  tx = method.make()
  params, grads = small_problem()
  params = {**params, "count": jnp.arange(N, dtype=jnp.int32) * 1000, "frozen": None}
  with_int = lambda k: {**grads(k), "count": jnp.zeros(N, jnp.int32), "frozen": None}
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  state = tx.init(params)
  for k in range(3):
    updates, state = step(params, state, with_int(k))
    params = optax.apply_updates(params, updates)
  assert params["frozen"] is None and updates["frozen"] is None
  assert params["count"].dtype == jnp.int32
  np.testing.assert_array_equal(params["count"], np.arange(N) * 1000)
  assert all(bool(jnp.isfinite(x).all()) for x in (params["w"], params["b"]))


def zero_gradient_steps(tx, params, steps=20):
  """``steps`` jitted steps of ``tx`` with zero gradients: (params, state, the last updates)."""
  zeros = jax.tree.map(jnp.zeros_like, params)

  def body(_, carry):
    params, state, _ = carry
    updates, state = tx.update(zeros, state, params)
    return optax.apply_updates(params, updates), state, updates

  return jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, body, (p, s, zeros)))(params, tx.init(params))


def average_drift(out, params):
  """How far the node average moved, relative to its size (the largest over the leaves)."""
  drift = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)
  return max(drift(np.asarray(got, np.float64), np.asarray(want, np.float64))
             for got, want in zip(jax.tree.leaves(gj.node_mean(out)), jax.tree.leaves(gj.node_mean(params))))


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_bfloat16_kept_and_node_average_preserved(method):
  """bfloat16 params stay bfloat16; with zero gradients the average moves by no more than rounding."""
  tx = method.make()
  params, _ = small_problem(jnp.bfloat16)
  out, state, _ = zero_gradient_steps(tx, params)
  assert leaf_types(state) == leaf_types(tx.init(params))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
  if method.preserves_average:
    assert average_drift(out, params) <= method.bf16_drift


def takes_state_dtype(method):
  return method.factory is not None and "state_dtype" in inspect.signature(method.factory).parameters


def test_every_method_takes_a_state_dtype():
  """As optax's ``accumulator_dtype`` / ``mu_dtype``: keyword-only, ``None`` by default."""
  for method in METHODS:
    if method.factory is not None:
      parameter = inspect.signature(method.factory).parameters.get("state_dtype")
      assert parameter is not None and parameter.kind == parameter.KEYWORD_ONLY and parameter.default is None, method.name
  with pytest.raises(ValueError, match="gj.gossip_sgd: state_dtype must be a floating-point dtype"):
    gj.gossip_sgd(W, learning_rate=0.1, state_dtype=jnp.int32)


@pytest.mark.parametrize("method", [m for m in METHODS if takes_state_dtype(m)], ids=lambda m: m.name)
def test_float32_state_for_bfloat16_params(method):
  """``state_dtype=jnp.float32``: no state in bfloat16, updates in bfloat16, and the node average
  drifts about as much as with a bfloat16 state, the params' own rounding (less, where the state
  integrates the rounding)."""
  params, _ = small_problem(jnp.bfloat16)
  tx = method.factory(**method.kwargs, state_dtype=jnp.float32)
  state = tx.init(params)
  assert not any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(state))
  shapes = {x.shape for x in jax.tree.leaves(params)}
  assert any(leaf.dtype == jnp.float32 and leaf.shape in shapes for leaf in jax.tree.leaves(state))
  out, last_state, updates = zero_gradient_steps(tx, params)
  assert leaf_types(last_state) == leaf_types(state)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((out, updates)))
  if method.preserves_average:
    wide, narrow = average_drift(out, params), average_drift(zero_gradient_steps(method.make(), params)[0], params)
    assert wide <= 1.25 * narrow, (wide, narrow)  # which roundings of the params cancel varies with the code
    if narrow > 10 * Method._field_defaults["bf16_drift"]:  # the bfloat16 state integrated the rounding
      assert wide < narrow, (wide, narrow)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_multi_steps_equals_one_step_on_the_mean_gradient(method):
  params, grads = small_problem()
  multi = optax.MultiSteps(method.make(), every_k_schedule=2, accumulator_dtype=jnp.float64)
  got, _ = run(multi, params, grads, 2)
  mean_grad = jax.tree.map(lambda a, b: (a + b) / 2, grads(0), grads(1))
  want, _ = run(method.make(), params, lambda _: mean_grad, 1)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_apply_if_finite_skips_a_nan_step_without_a_trace(method):
  params, grads = small_problem()
  guarded = optax.apply_if_finite(method.make(), max_consecutive_errors=3)
  nan_first = lambda k: jax.tree.map(lambda g: g.at[2].set(jnp.nan), grads(1)) if k == 0 else grads(k - 1)
  got, state = run(guarded, params, nan_first, 3)
  want, _ = run(method.make(), params, grads, 2)
  assert int(state.total_notfinite) == 1
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_masked_runs_on_the_masked_leaves_only(method):
  """``optax.masked``: the method sees ``w`` alone; ``b``'s update is its gradient, passed through."""
  params, grads = small_problem()
  tx = optax.masked(method.make(), {"w": True, "b": False})
  state = tx.init(params)
  updates, state = tx.update(grads(0), state, params)
  want, _ = method.make().update({"w": grads(0)["w"]}, method.make().init({"w": params["w"]}), {"w": params["w"]})
  np.testing.assert_allclose(updates["w"], want["w"], rtol=0, atol=1e-12)
  np.testing.assert_array_equal(updates["b"], grads(0)["b"])


class NnxMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(3, 4, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.tanh(self.hidden(x)))


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_flax_nnx_state_stacked_over_nodes(method):
  """An nnx model's ``nnx.Param`` state, one copy per node stacked on axis 0, trained by the method."""
  graphdef, _ = nnx.split(NnxMLP(nnx.Rngs(0)), nnx.Param)
  params = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(NnxMLP(nnx.Rngs(i)), nnx.Param) for i in range(N)])
  xb = jax.random.normal(jax.random.key(0), (N, 4, 3))
  loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
  tx = method.make()

  @jax.jit
  def step(params, state):
    losses, g = jax.vmap(jax.value_and_grad(loss))(params, xb)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, losses

  state = tx.init(params)
  start = params
  for _ in range(3):
    params, state, losses = step(params, state)
  assert isinstance(params, nnx.State) and jax.tree.structure(params) == jax.tree.structure(start)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params)) and bool(jnp.isfinite(losses).all())
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start)))
  node = nnx.merge(graphdef, jax.tree.map(lambda x: x[3], params))
  assert node(xb[3]).shape == (4, 1)


def test_inject_hyperparams_takes_every_and_follows_a_change_without_recompiling():
  """``every`` arrives as an array: read as an int when concrete, used traced under jit."""
  params, grads = small_problem()
  injected = optax.inject_hyperparams(gj.mix)(W)
  step = jax.jit(lambda p, s: injected.update(grads(0), s, p))
  state = injected.init(params)
  want, _ = gj.mix(W).update(grads(0), gj.mix(W).init(params), params)
  for _ in range(2):  # every = 1: gossip steps
    updates, state = step(params, state)
    np.testing.assert_allclose(updates["w"], want["w"], rtol=0, atol=1e-12)
  compiled = step._cache_size()
  state.hyperparams["every"] = state.hyperparams["every"] + 1
  updates, state = step(params, state)  # count 2, every 2: a local step, the update passes through
  np.testing.assert_array_equal(updates["w"], grads(0)["w"])
  updates, state = step(params, state)  # count 3, every 2: a gossip step
  np.testing.assert_allclose(updates["w"], want["w"], rtol=0, atol=1e-12)
  assert step._cache_size() == compiled
  easgd = optax.inject_hyperparams(gj.easgd)(learning_rate=0.1, every=2)
  run(easgd, params, grads, 2)
  with pytest.raises(TypeError, match=r"static_args=\('every',\)"):
    optax.inject_hyperparams(gj.mix)(W, every=2.0).init(params)
  choco = optax.inject_hyperparams(gj.choco_sgd)(W, gj.compress.qsgd(4), learning_rate=0.1, consensus_step=0.5, seed=1)
  with pytest.raises(TypeError, match=r"static_args=\('key', 'seed'\)"):
    choco.init(params)


SHARDED_CASES = {  # one of each kind of state: mixed tuples, push weights, PRNG keys, all-reduce means
    "gradient_tracking": lambda be: gj.gradient_tracking(T.random_pairs(16, seed=0, period=4), learning_rate=0.05, backend=be),
    "extra": lambda be: gj.extra(T.ring(16), learning_rate=0.05, backend=be),
    "sgp": lambda be: gj.sgp(T.one_peer_directed_exponential(16), beta=0.5, learning_rate=0.05, backend=be),
    "choco_sgd": lambda be: gj.choco_sgd(T.ring(16), gj.compress.qsgd(4), learning_rate=0.05, consensus_step=0.5, backend=be),
    "periodic_average": lambda be: optax.chain(gj.gossip_sgd(T.ring(16), learning_rate=0.05, backend=be),
                                               gj.periodic_average(3, backend=be)),
    "easgd": lambda be: gj.easgd(learning_rate=0.05, alpha=0.1, center_rate=0.5, every=2, backend=be),
}


@pytest.mark.parametrize("name", list(SHARDED_CASES))
def test_sharded_backend_equals_simulation(name):
  """The methods never see the backend: 16 nodes on 8 devices give the simulated trajectory."""
  assert jax.device_count() >= 8, "conftest sets 8 CPU devices"
  backend = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))
  rng = np.random.default_rng(0)
  a, b, x0 = rng.normal(size=(16, 6, 3)), rng.normal(size=(16, 6)) + np.arange(16)[:, None], rng.normal(size=(16, 3))

  def trajectory(tx, x, a, b):
    step = jax.jit(lambda x, s: (lambda u, s: (optax.apply_updates(x, u), s))(
        *tx.update(jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b), s, x)))
    state, out = tx.init(x), []
    for _ in range(6):
      x, state = step(x, state)
      out.append(np.asarray(x))
    return np.stack(out)

  want = trajectory(SHARDED_CASES[name](None), jnp.asarray(x0), jnp.asarray(a), jnp.asarray(b))
  got = trajectory(SHARDED_CASES[name](backend), *map(backend.shard, (x0, a, b)))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
