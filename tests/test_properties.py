"""Property-based tests: topologies, compressors and checkpoint round trips over random inputs."""

import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import gossipjax as gj
from gossipjax import checkpoint as ckpt
from gossipjax import compress as C
from gossipjax import topology as T

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each shape compiles


def _assert_plans_equal_dense(topo):
  for k, plan in enumerate(topo.plans()):
    np.testing.assert_allclose(plan.dense(), topo.matrix(k), rtol=0, atol=1e-15)
    for r in plan.rounds:  # each round is one partial permutation: no node sends twice
      senders = r.src[r.weight > 0]
      assert len(set(senders.tolist())) == len(senders)


def _assert_doubly_stochastic(topo):
  for k in range(topo.period):
    w = topo.matrix(k)
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=0), 1, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-12)
    assert -1e-12 <= T.rho(topo, k) <= 1 + 1e-12
  topo.check("doubly")


FAMILIES = {
    "ring": lambda n: T.ring(n),
    "exponential": lambda n: T.exponential(n),
    "complete": lambda n: T.complete(n),
    "one_peer_exponential": lambda n: T.one_peer_exponential(max(n, 2)),
    "hypercube": lambda n: T.hypercube(2 ** (n % 6)),
    "torus": lambda n: T.torus(n % 5 + 1, n % 7 + 1),
    "grid-metropolis": lambda n: T.grid(n % 4 + 1, n % 6 + 1, weights="metropolis"),
    "star-metropolis": lambda n: T.star(n, weights="metropolis"),
}


@FAST
@given(family=st.sampled_from(sorted(FAMILIES)), n=st.integers(1, 40))
def test_families_are_doubly_stochastic_and_plan_equals_dense(family, n):
  topo = FAMILIES[family](n)
  _assert_doubly_stochastic(topo)
  _assert_plans_equal_dense(topo)


def _connected_over_a_period(topo):
  """Every node reaches every other through the union of the period's graphs."""
  union = sum(topo.matrix(k) > 0 for k in range(topo.period)) > 0
  reach = np.eye(topo.num_nodes, dtype=bool)
  for _ in range(topo.num_nodes):
    reach = reach | ((reach.astype(int) @ union.astype(int)) > 0)
  assert reach.all(), topo


@FAST
@given(n=st.integers(2, 40), seed=st.integers(0, 2**31 - 1), p=st.floats(0.05, 1.0))
def test_random_families_are_stochastic_connected_and_plans_equal_dense(n, seed, p):
  try:
    pairs = T.random_pairs(n, seed=seed, period=4)
  except ValueError as e:  # 4 random matchings can leave a small graph unconnected: refused, as documented
    assert "do not connect" in str(e)
    assume(False)
  _assert_doubly_stochastic(pairs)
  _assert_plans_equal_dense(pairs)
  try:
    er = T.erdos_renyi(n, p, seed=seed)
  except ValueError as e:  # a disconnected draw must be refused, and by name
    assert "disconnected" in str(e)
  else:
    _assert_doubly_stochastic(er)
    _assert_plans_equal_dense(er)
    _connected_over_a_period(er)


@st.composite
def adjacency(draw, symmetric=True):
  n = draw(st.integers(1, 14))
  p = draw(st.floats(0.0, 1.0))
  seed = draw(st.integers(0, 2**31 - 1))
  upper = np.random.default_rng(seed).random((n, n)) < p
  adj = np.triu(upper, 1) | np.triu(upper, 1).T if symmetric else upper
  return adj & ~np.eye(n, dtype=bool)


@FAST
@given(adj=adjacency())
def test_from_adjacency_metropolis_is_symmetric_doubly_stochastic_and_checks_connectivity(adj):
  topo = T.from_adjacency(adj, weights="metropolis")
  w = topo.matrix()
  np.testing.assert_allclose(w, w.T, atol=1e-15)
  np.testing.assert_array_equal(w * (1 - np.eye(len(adj))) > 0, adj)  # the support is the graph
  _assert_plans_equal_dense(topo)
  if T.is_strongly_connected(adj):
    _assert_doubly_stochastic(topo)
    assert T.rho(topo) < 1 - 1e-9 or len(adj) == 1  # connected: disagreement contracts
  else:
    assert T.rho(topo) == pytest.approx(1.0, abs=1e-9)  # a disconnected graph never reaches consensus
    with pytest.raises(ValueError, match="not connected"):
      topo.check("doubly")


@FAST
@given(adj=adjacency(symmetric=False))
def test_from_adjacency_uniform_is_row_stochastic_on_directed_graphs(adj):
  topo = T.from_adjacency(adj, weights="uniform")
  w = topo.matrix()
  np.testing.assert_allclose(w.sum(axis=1), 1, atol=1e-12)
  _assert_plans_equal_dense(topo)
  deg = adj.sum(axis=1)
  np.testing.assert_allclose(np.diag(w), 1 / (deg + 1), atol=1e-15)
  if T.is_strongly_connected(adj):
    topo.check("row")
  if not np.allclose(w.sum(axis=0), 1, atol=1e-6):
    with pytest.raises(ValueError, match="column .* sums to"):
      topo.check("doubly", connected=False)


@st.composite
def doubly_stochastic(draw):
  """A convex combination of permutation matrices (Birkhoff), so doubly stochastic by construction."""
  n = draw(st.integers(1, 12))
  terms = draw(st.integers(1, 4))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  weights = rng.dirichlet(np.ones(terms))
  return sum(c * np.eye(n)[rng.permutation(n)] for c in weights)


@FAST
@given(w=doubly_stochastic())
def test_from_matrix_plan_equals_dense_and_rho_in_unit_interval(w):
  topo = T.from_matrix(w)
  _assert_plans_equal_dense(topo)
  assert -1e-12 <= T.rho(topo) <= 1 + 1e-9
  topo.check("doubly", connected=False)


@FAST
@given(w=doubly_stochastic(), data=st.data())
def test_bad_entries_raise_naming_the_entry(w, data):
  n = w.shape[0]
  i, j = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
  bad = data.draw(st.sampled_from([np.nan, np.inf, -np.inf, -0.5]))
  w = w.copy()
  w[i, j] = bad
  match = rf"non-finite entry W\[{i}, {j}\]" if not np.isfinite(bad) else rf"negative weight W\[{i}, {j}\]"
  with pytest.raises(ValueError, match=match):
    T.from_matrix(w)


@FAST
@given(w=doubly_stochastic(), scale=st.floats(0.1, 3.0), data=st.data())
def test_non_stochastic_matrices_are_refused_by_algorithms(w, scale, data):
  n = w.shape[0]
  i = data.draw(st.integers(0, n - 1))
  w = w.copy()
  w[i] *= scale  # row i no longer sums to one
  assume(abs(scale * 1.0 - 1.0) > 1e-3)
  with pytest.raises(ValueError, match="must be doubly stochastic but (row|column)"):
    gj.gossip_sgd(T.from_matrix(w), learning_rate=0.1)


# Compressors.

FRACTIONS = st.sampled_from([0.01, 0.2, 0.5, 1.0])  # a few: every (size, k) pair compiles anew


@st.composite
def vectors(draw):
  d = draw(st.sampled_from([1, 7, 33]))  # a few sizes: each new shape compiles anew
  seed = draw(st.integers(0, 2**31 - 1))
  x = np.random.default_rng(seed).normal(size=d) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
  return jnp.asarray(x)


def _samples(comp, x, m):
  keys = jax.random.split(jax.random.key(0), m)
  return jax.vmap(lambda k: comp.compress(x, k))(keys)


UNBIASED = {
    "random_k": lambda f: C.random_k(f),
    "qsgd-1": lambda f: C.qsgd(1),
    "qsgd-4": lambda f: C.qsgd(4),
}


@FEW
@given(name=st.sampled_from(sorted(UNBIASED)), fraction=FRACTIONS, x=vectors())
def test_unbiased_compressors_have_the_right_mean_and_variance(name, fraction, x):
  comp = UNBIASED[name](fraction)
  assert comp.unbiased
  m = 4000
  samples = _samples(comp, x, m)
  omega = comp.omega(x.size)
  norm2 = float(jnp.sum(x * x))
  err2 = float(jnp.sum((samples.mean(axis=0) - x) ** 2))
  # E||mean - x||^2 <= omega ||x||^2 / m; 36 times that is far out in the tail.
  assert err2 <= 36 * omega * norm2 / m + 1e-20
  var = float(jnp.mean(jnp.sum((samples - x[None]) ** 2, axis=1)))
  assert var <= 1.25 * omega * norm2 + 1e-20


@FEW
@given(fraction=FRACTIONS, x=vectors())
def test_top_k_is_a_contraction_and_its_bits_are_counted(fraction, x):
  comp = C.top_k(fraction)
  y = comp.compress(x, jax.random.key(0))
  d = x.size
  k = min(d, max(1, math.ceil(fraction * d - 1e-9)))
  assert int(jnp.sum(y != 0)) <= k
  np.testing.assert_array_equal(y[y != 0], x[y != 0])  # kept entries are sent exactly
  assert float(jnp.sum((y - x) ** 2)) <= (1 - k / d) * float(jnp.sum(x * x)) * (1 + 1e-12) + 1e-30
  value_bits = x.dtype.itemsize * 8
  index_bits = 8 * (1 if d <= 256 else 2 if d <= 65536 else 4)  # the smallest unsigned int that addresses d
  assert float(comp.bits(x)) == min(k * (value_bits + index_bits), d * value_bits)
  assert float(comp.bits(x)) <= float(C.identity().bits(x)) == d * value_bits


@FEW
@given(fraction=FRACTIONS, x=vectors(), y=vectors())
def test_bits_add_up_over_the_leaves_of_a_tree(fraction, x, y):
  for comp in (C.top_k(fraction), C.random_k(fraction), C.qsgd(3), C.sign(), C.identity()):
    tree = {"a": x, "b": [y]}
    assert float(comp.bits(tree)) == pytest.approx(float(comp.bits(x)) + float(comp.bits(y)))
    sent = comp.compress(tree, jax.random.key(1))
    assert jax.tree.structure(sent) == jax.tree.structure(tree)
    assert all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(sent))


@FAST
@given(bad=st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(float("nan")),
                     st.booleans()))
def test_fractions_outside_the_unit_interval_raise(bad):
  for make in (C.top_k, C.random_k):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
      make(bad)


# Checkpoint round trips over random pytrees.

DTYPES = st.sampled_from([np.float32, np.float64, np.int32])


@st.composite
def array_leaf(draw):
  shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
  dtype = draw(DTYPES)
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  if dtype == np.int32:
    x = rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int32)
  else:
    x = (rng.normal(size=shape) * 10.0 ** rng.integers(-30, 30, size=shape)).astype(dtype)
  as_jax = draw(st.booleans())
  return jnp.asarray(x) if as_jax else x


LEAVES = st.one_of(
    array_leaf(),
    st.integers(-(2**31), 2**31 - 1),
    st.floats(allow_nan=False),
    st.integers(0, 2**31 - 1).map(lambda s: jax.random.key(s)),
)
TREES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), children, max_size=3),
    ),
    max_leaves=8,
)


def _data(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def _zeros_like(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key(12345)
  if isinstance(x, (int, float, np.generic)):
    return type(x)(0)
  return x * 0 if isinstance(x, jax.Array) else np.zeros_like(x)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREES, step=st.integers(0, 10**9))
def test_checkpoint_round_trip_of_random_pytrees(tree, step):
  with tempfile.TemporaryDirectory() as d:
    ckpt.save(d, tree, step=step)
    assert ckpt.latest_step(d) == step
    out = ckpt.restore(d, like=jax.tree.map(_zeros_like, tree))
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
    np.testing.assert_array_equal(_data(a), _data(b))
    assert _data(a).dtype == _data(b).dtype
