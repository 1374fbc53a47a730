"""One contract over a table of every gossipjax method (optax's habit: the same checks for all).

For each method: it jits; float32 and float64 params stay in their dtype; the state keeps
its structure and dtypes from step to step (so a jitted step compiles once); it accepts
extra keyword args; it runs on a flax model's pytree of several leaves of different shapes;
it works under ``optax.inject_hyperparams`` where it has a learning rate; and the node
average is preserved under doubly stochastic W where the method promises it.
"""

from typing import Any, Callable, NamedTuple

import flax.linen as nn
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


def _method(name, factory, kwargs, preserves_average=True, static_args=()):
  return Method(name, lambda: factory(**kwargs), factory, kwargs, preserves_average, static_args)


METHODS = [
    _method("gossip_sgd", gj.gossip_sgd, dict(topology=W, beta=0.9, learning_rate=0.1)),
    _method("decentlam", gj.decentlam, dict(topology=W, beta=0.9, learning_rate=0.1)),
    _method("allreduce_sgd", gj.allreduce_sgd, dict(learning_rate=0.1, beta=0.9)),
    Method("adam+mix", lambda: optax.chain(optax.adam(1e-2), gj.mix(W)), None, {}, True),
    Method("sgd+mix_every_3", lambda: optax.chain(optax.sgd(0.1), gj.mix(W, every=3)), None, {}, True),
    _method("gradient_tracking", gj.gradient_tracking, dict(topology=W, learning_rate=0.1)),
    _method("exact_diffusion", gj.exact_diffusion, dict(topology=W, learning_rate=0.1)),
    _method("extra", gj.extra, dict(topology=W, learning_rate=0.1)),
    _method("sgp", gj.sgp, dict(topology=T.one_peer_directed_exponential(N), learning_rate=0.1, beta=0.5)),
    _method("choco_sgd-qsgd", gj.choco_sgd,
            dict(topology=W, learning_rate=0.1, compressor=gj.compress.qsgd(4), consensus_step=0.5, seed=1)),
    _method("qg_dmsgd", gj.qg_dmsgd, dict(topology=W, beta=0.9, learning_rate=0.1)),
    Method("gossip_sgd+periodic_average",
           lambda: optax.chain(gj.gossip_sgd(W, learning_rate=0.1), gj.periodic_average(2)), None, {}, True),
    _method("easgd", gj.easgd, dict(learning_rate=0.1, alpha=0.1, beta=0.5, every=2), preserves_average=False,
            static_args=("every",)),
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
  return jax.tree.structure(tree), [(jnp.shape(x), jnp.asarray(x).dtype) for x in jax.tree.leaves(tree)]


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


SHARDED_CASES = {  # one of each kind of state: mixed tuples, push weights, PRNG keys, all-reduce means
    "gradient_tracking": lambda be: gj.gradient_tracking(T.random_pairs(16, seed=0, period=4), 0.05, backend=be),
    "extra": lambda be: gj.extra(T.ring(16), 0.05, backend=be),
    "sgp": lambda be: gj.sgp(T.one_peer_directed_exponential(16), 0.05, beta=0.5, backend=be),
    "choco_sgd": lambda be: gj.choco_sgd(T.ring(16), 0.05, gj.compress.qsgd(4), 0.5, backend=be),
    "periodic_average": lambda be: optax.chain(gj.gossip_sgd(T.ring(16), learning_rate=0.05, backend=be),
                                               gj.periodic_average(3, backend=be)),
    "easgd": lambda be: gj.easgd(0.05, alpha=0.1, beta=0.5, every=2, backend=be),
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
