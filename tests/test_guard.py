from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

N, D = 8, 3


def _grads(rng, bad):
  """Gradients for N nodes, with NaN / inf injected at the nodes in ``bad``."""
  g = rng.normal(size=(N, D))
  for j, i in enumerate(bad):
    g[i, j % D] = np.nan if j % 2 == 0 else np.inf
  return g


# Fault plan: step -> nodes whose gradient is non-finite.
FAULTS = {2: [3], 3: [3, 5], 4: [3], 7: [0], 8: [3]}


def test_gossip_sgd_skip_matches_reference():
  topo = gj.topology.one_peer_exponential(N)
  beta, lr = 0.9, 0.05
  tx = gj.guard_finite(gj.gossip_sgd(topo, beta=beta, learning_rate=lr), max_consecutive=0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D))
  state = tx.init(jnp.asarray(x))
  update = jax.jit(tx.update)
  m, xr = np.zeros((N, D)), x.copy()
  for k in range(10):
    bad = FAULTS.get(k, [])
    g = _grads(rng, bad)
    u, state = update(jnp.asarray(g), state, jnp.asarray(x))
    x = np.asarray(optax.apply_updates(jnp.asarray(x), u))
    # Reference: a skipped node keeps its momentum, adds nothing, and still mixes.
    ok = np.ones(N, bool)
    ok[bad] = False
    m = np.where(ok[:, None], beta * m + np.where(ok[:, None], g, 0), m)
    local = np.where(ok[:, None], -lr * m, 0)
    xr = topo.matrix(k) @ (xr + local)
    assert np.isfinite(x).all()
    np.testing.assert_allclose(x, xr, rtol=0, atol=1e-12)
  np.testing.assert_allclose(state.inner_state[0].trace, m, rtol=0, atol=1e-12)
  np.testing.assert_array_equal(gj.nonfinite_counts(state), np.bincount(sum(FAULTS.values(), []), minlength=N))


def test_local_optimizer_bad_node_is_frozen_and_keeps_its_state():
  tx = gj.guard_finite(optax.adam(0.1))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(N, D)))
  state = tx.init(x)
  for _ in range(3):
    u, state = tx.update(jnp.asarray(rng.normal(size=(N, D))), state, x)
    x = optax.apply_updates(x, u)
  before = state.inner_state
  g = _grads(rng, [2])
  u, state = tx.update(jnp.asarray(g), state, x)
  np.testing.assert_array_equal(u[2], np.zeros(D))  # its params do not move
  assert np.isfinite(u).all() and (np.asarray(u[np.arange(N) != 2]) != 0).all()
  np.testing.assert_array_equal(state.inner_state[0].mu[2], before[0].mu[2])  # its moments are kept
  np.testing.assert_array_equal(state.inner_state[0].nu[2], before[0].nu[2])
  assert not np.array_equal(state.inner_state[0].mu[0], before[0].mu[0])
  assert int(state.inner_state[0].count) == 4  # the shared step count advances


def test_decentlam_bad_node_frozen_all_finite():
  topo = gj.topology.ring(N)
  tx = gj.guard_finite(gj.decentlam(topo, beta=0.9, learning_rate=0.1))
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(N, D)))
  state = tx.init(x)
  for k in range(6):
    bad = [4] if k in (1, 2) else []
    u, state = tx.update(jnp.asarray(_grads(rng, bad)), state, x)
    if bad:
      np.testing.assert_array_equal(u[4], np.zeros(D))
    x = optax.apply_updates(x, u)
    assert np.isfinite(x).all() and np.isfinite(state.inner_state.momentum).all()
  np.testing.assert_array_equal(gj.nonfinite_counts(state), np.eye(N, dtype=int)[4] * 2)


def test_nan_in_one_leaf_of_a_tree_skips_the_whole_node():
  tx = gj.guard_finite(optax.sgd(1.0))
  params = {"a": jnp.zeros((N, 2)), "b": {"c": jnp.zeros((N, 2, 2))}}
  grads = {"a": jnp.ones((N, 2)), "b": {"c": jnp.ones((N, 2, 2)).at[6, 1, 0].set(jnp.inf)}}
  u, state = tx.update(grads, tx.init(params), params)
  assert (u["a"][6] == 0).all() and (u["b"]["c"][6] == 0).all() and (u["a"][:6] == -1).all()
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 0, 0, 0, 0, 1, 0]


def test_the_guarded_step_grows_linearly_with_the_number_of_leaves():
  """The per-node flag is computed once, not copied into every leaf's select: a ResNet-20 (130 leaves) step
  compiled in 26 s with the copies, 10 s without. Compiled ops per leaf stay flat from 16 to 64 leaves (they grew 3x)."""
  import re

  def compiled_ops(leaves):
    params = {f"w{i}": jnp.ones((4, 3)) for i in range(leaves)}
    tx = gj.guard_finite(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1))
    text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    return len(re.findall(r"^\s+\S+ = ", text, re.M))

  small, large = compiled_ops(16), compiled_ops(64)
  assert large < 5 * small, (small, large)  # 4x the leaves: 4x the ops (12x when the flag was copied)


def test_check_guard_raises_after_consecutive_bad_steps_naming_node_and_step():
  tx = gj.guard_finite(gj.gossip_sgd(gj.topology.ring(N), beta=0.9, learning_rate=0.1), max_consecutive=3)
  x = jnp.zeros((N, D))
  state = tx.init(x)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(3)
  # Node 5 fails at steps 0, 1 (streak broken at 2), then 3, 4, 5: the third in a row is step 5.
  plan = {0: [5], 1: [5], 3: [5, 1], 4: [5], 5: [5]}
  raised_at = None
  for k in range(8):
    u, state = update(jnp.asarray(_grads(rng, plan.get(k, []))), state, x)
    x = optax.apply_updates(x, u)
    try:
      gj.check_guard(state, step=k)
    except FloatingPointError as e:
      raised_at = k
      assert "node 5" in str(e) and "3 consecutive steps" in str(e) and "step 5" in str(e)
      break
  assert raised_at == 5
  assert gj.nonfinite_counts(state).tolist() == [0, 1, 0, 0, 0, 5, 0, 0]
  assert np.isfinite(x).all()
  with pytest.raises(FloatingPointError, match="node 13 had"):
    gj.check_guard(state, step=5, first_node=8)  # an MPI rank holding nodes 8..15


def test_check_guard_never_raises_when_disabled_and_finds_nested_state():
  tx = optax.chain(optax.clip(1.0), gj.guard_finite(optax.sgd(0.1), max_consecutive=None))
  x = jnp.zeros((N, D))
  state = tx.init(x)
  for k in range(4):
    _, state = tx.update(jnp.full((N, D), jnp.nan), state, x)
    gj.check_guard(state, step=k)
  assert gj.nonfinite_counts(state).tolist() == [4] * N
  with pytest.raises(ValueError, match="no guard_finite state"):
    gj.nonfinite_counts(optax.sgd(0.1).init(x))


def test_guard_errors_on_bad_input():
  with pytest.raises(ValueError, match="max_consecutive"):
    gj.guard_finite(optax.sgd(0.1), max_consecutive=-1)
  tx = gj.guard_finite(optax.sgd(0.1))
  with pytest.raises(ValueError, match="same leading node axis"):
    tx.init({"a": jnp.zeros((4, 2)), "b": jnp.zeros((3,))})
  with pytest.raises(ValueError, match="initialised for 4"):
    tx.update(jnp.zeros((5, 2)), tx.init(jnp.zeros((4, 2))), jnp.zeros((5, 2)))


def test_mix_every_skips_local_steps_too():
  tx = gj.guard_finite(optax.chain(optax.sgd(0.1), gj.mix(gj.topology.ring(4), every=2)))
  x = jnp.arange(8.0).reshape(4, 2)
  g = jnp.ones((4, 2)).at[0, 0].set(jnp.nan)
  u, state = tx.update(g, tx.init(x), x)  # a local step: the bad node does not move
  np.testing.assert_array_equal(u[0], [0.0, 0.0])
  np.testing.assert_allclose(u[1:], -0.1)


def test_guard_on_the_sharded_backend_equals_simulation():
  if 16 % jax.device_count():
    pytest.skip("needs a device count dividing 16")
  mesh = jax.make_mesh((jax.device_count(),), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  backend = gj.backend.sharded(mesh)
  topo = gj.topology.ring(16)
  g = np.ones((16, 3))
  g[5, 1] = np.nan
  x = np.arange(48.0).reshape(16, 3)
  outs = []
  for be in (backend, None):
    tx = gj.guard_finite(gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be))
    put = backend.shard if be is not None else jnp.asarray
    u, state = jax.jit(tx.update)(put(jnp.asarray(g)), tx.init(put(jnp.asarray(x))), put(jnp.asarray(x)))
    assert gj.nonfinite_counts(state).tolist() == [0] * 5 + [1] + [0] * 10
    outs.append(np.asarray(u))
  assert np.isfinite(outs[0]).all()
  np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-12)


NAN_AT_STEP_2 = lambda count: jnp.where(count == 2, jnp.nan, 0.05)  # a warm-up formula gone wrong at one step
NAN_LR_CASES = {
    "gossip_sgd": lambda: gj.gossip_sgd(gj.topology.ring(N), beta=0.9, learning_rate=NAN_AT_STEP_2),
    "adam+mix": lambda: optax.chain(optax.adam(NAN_AT_STEP_2), gj.mix(gj.topology.ring(N))),
    "decentlam": lambda: gj.decentlam(gj.topology.ring(N), beta=0.9, learning_rate=NAN_AT_STEP_2),
    "gradient_tracking": lambda: gj.gradient_tracking(gj.topology.ring(N), learning_rate=NAN_AT_STEP_2),
}


@pytest.mark.parametrize("name", list(NAN_LR_CASES))
def test_a_nan_learning_rate_skips_the_step_and_is_counted(name):
  """The gradients are finite, the update is not: every node skips that step, its state kept."""
  tx = gj.guard_finite(NAN_LR_CASES[name](), max_consecutive=2)
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(N, D)))
  state = tx.init(x)
  update = jax.jit(tx.update)
  for k in range(5):
    before = state.inner_state
    u, state = update(jnp.asarray(rng.normal(size=(N, D))), state, x)
    x = optax.apply_updates(x, u)
    assert np.isfinite(x).all(), f"step {k}"
    per_node = lambda s: [leaf for leaf in jax.tree.leaves(s) if leaf.ndim and leaf.shape[0] == N]
    if k == 2:
      np.testing.assert_array_equal(u, np.zeros((N, D)))
      for a, b in zip(per_node(state.inner_state), per_node(before)):
        np.testing.assert_array_equal(a, b)
    else:
      assert (np.asarray(u) != 0).any()
    gj.check_guard(state, step=k)
  assert gj.nonfinite_counts(state).tolist() == [1] * N


def test_an_overflowing_update_skips_its_node_alone_and_its_neighbours_mix_its_params():
  W = gj.topology.ring(N)
  tx = gj.guard_finite(gj.gossip_sgd(W, learning_rate=1.0))
  x = jnp.ones((N, D), jnp.float32).at[3].set(3e38)
  g = jnp.ones((N, D), jnp.float32).at[3].set(-3e38)  # finite, but x - g overflows at node 3
  u, state = jax.jit(tx.update)(g, tx.init(x), x)
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
  assert np.isfinite(u).all()
  np.testing.assert_array_equal(np.asarray(u)[3], 0)
  np.testing.assert_allclose(np.asarray(u)[[0, 1, 5, 6, 7]], -1.0, rtol=1e-6)
  # Node 3's overflowing x + u never left it: nodes 2 and 4 mixed its current params.
  sent = np.asarray(x, np.float64) - 1.0
  sent[3] = 3e38
  want = np.asarray(W.matrix()) @ sent - np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(u)[[2, 4]], want[[2, 4]], rtol=1e-6)


class _AtcState(NamedTuple):
  count: jax.Array


class _CooperatingAtcState(NamedTuple):
  count: jax.Array

  zeroes_skipped_nodes = True  # what tells gj.guard_finite to pass skip_nodes


def _custom_atc(topology, learning_rate, cooperate):
  """A user's own adapt-then-combine method, x+ = W(x - lr g), built on the public mixing contract."""
  mixer = gj.mixing.make_mixer(topology)
  state_class = _CooperatingAtcState if cooperate else _AtcState

  def update(grads, state, params, skip_nodes=None, **extra_args):
    assert (skip_nodes is not None) == cooperate  # passed only to a method whose state declares it
    grads = gj.zero_skipped(grads, skip_nodes)
    mixed = mixer.mix(jax.tree.map(lambda x, g: x - learning_rate * g, params, grads), state.count)
    return jax.tree.map(lambda m, x: m - x, mixed, params), state_class(state.count + 1)

  return optax.GradientTransformationExtraArgs(lambda params: state_class(jnp.zeros([], jnp.int32)), update)


@pytest.mark.parametrize("cooperate", [True, False])
def test_a_custom_method_cooperates_with_the_guard_through_zero_skipped(cooperate):
  topo = gj.topology.ring(6)
  tx = gj.guard_finite(_custom_atc(topo, 0.1, cooperate))
  x = jnp.arange(12.0).reshape(6, 2)
  g = jnp.ones_like(x).at[2].set(jnp.nan)
  u, state = tx.update(g, tx.init(x), x)
  new = np.asarray(x + u)
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 1, 0, 0, 0]
  if cooperate:  # node 2 took no local step and sent its current params, as under gj.mix
    want = topo.matrix(0) @ (np.asarray(x) - 0.1 * np.where(np.isnan(g), 0.0, g))
    np.testing.assert_allclose(new, want, rtol=1e-12)
  else:  # the guard zeroed node 2's gradient, then froze node 2 for the step
    want = topo.matrix(0) @ (np.asarray(x) - 0.1 * np.where(np.isnan(g), 0.0, g))
    np.testing.assert_allclose(new[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]], rtol=1e-12)
    np.testing.assert_array_equal(new[2], np.asarray(x)[2])


def _per_node_reference(tx, x, g, state=None):
  """``tx`` run on each node alone: (updates, states), one row / state per node."""
  out = [tx.update(g[i], tx.init(x[i]) if state is None else state[i], x[i]) for i in range(len(x))]
  return np.stack([np.asarray(u) for u, _ in out]), [s for _, s in out]


def test_guard_around_a_gj_chain_skips_the_nan_node_per_node():
  """gj.chain(clip, adam, mix): node 2 takes no local step but still mixes; the others are each run alone."""
  topo = gj.topology.ring(N)
  local = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  tx = gj.guard_finite(gj.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1), gj.mix(topo)))
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(N, D)))
  g = jnp.asarray(_grads(rng, [2]))
  state = tx.init(x)
  u, state = jax.jit(tx.update)(g, state, x)
  want_local, want_states = _per_node_reference(local, x, jnp.where(jnp.isfinite(g), g, 0.0))
  want_local[2] = 0.0
  np.testing.assert_allclose(np.asarray(x + u), topo.matrix(0) @ (np.asarray(x) + want_local), rtol=0, atol=1e-12)
  adam_state = state.inner_state[1]  # chain: (clip, adam, mix), adam stacked per node
  mu = np.asarray(adam_state[0].mu)
  np.testing.assert_array_equal(mu[2], np.zeros(D))  # node 2's moments are kept (zero: its first step)
  np.testing.assert_allclose(mu[0], want_states[0][1][0].mu, rtol=0, atol=1e-12)
  assert gj.nonfinite_counts(state).tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


def test_guard_around_per_node_freezes_the_nan_node_and_passes_no_mask_to_a_node():
  """gj.per_node(...): each node alone; no skip mask reaches a transform that does not mix."""
  seen = []

  def probe_update(updates, state, params=None, **extra_args):
    seen.append(sorted(extra_args))
    return updates, state

  probe = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), probe_update)
  local = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  tx = gj.guard_finite(gj.per_node(optax.chain(probe, local)))
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(N, D)))
  state = tx.init(x)
  u, state = jax.jit(tx.update)(jnp.asarray(rng.normal(size=(N, D))), state, x)
  before = state.inner_state
  g = jnp.asarray(_grads(rng, [4]))
  u, state = jax.jit(tx.update)(g, state, x)
  assert seen and all(args == [] for args in seen)
  np.testing.assert_array_equal(u[4], np.zeros(D))  # frozen
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(before)):
    if a.ndim and a.shape[0] == N:
      np.testing.assert_array_equal(a[4], b[4])  # its per-node state (Adam's moments) is kept
    else:
      assert int(a) == int(b) + 1  # the step count every node shares advances, as for stacked methods
  one = lambda s, i: jax.tree.map(lambda leaf: leaf[i] if leaf.ndim and leaf.shape[0] == N else leaf, s)
  for i in (0, 7):
    want, _ = local.update(g[i], one(before, i)[1], x[i])
    np.testing.assert_allclose(u[i], want, rtol=0, atol=1e-12)


def test_skip_nodes_is_an_immutable_value_and_nested_guards_agree():
  skip = gj.SkipNodes(jnp.array([False, True]))
  with pytest.raises(AttributeError):
    skip.handled = True
  with pytest.raises(AttributeError):
    skip.mask = jnp.array([True, True])
  assert jax.tree.leaves(skip)[0] is skip.mask  # a pytree: it can cross jit boundaries as a value
  with pytest.raises(ValueError, match="no leading node axis of 2"):
    gj.zero_skipped(jnp.ones((3,)), skip)
  topo = gj.topology.ring(N)
  inner = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
  x = jnp.asarray(np.random.default_rng(7).normal(size=(N, D)))
  g = jnp.asarray(_grads(np.random.default_rng(8), [1]))
  once = gj.guard_finite(inner)
  twice = gj.guard_finite(gj.guard_finite(inner))
  u1, _ = once.update(g, once.init(x), x)
  u2, state = jax.jit(twice.update)(g, twice.init(x), x)
  np.testing.assert_allclose(u2, u1, rtol=0, atol=1e-15)
  assert state.nonfinite_count.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
