"""Inputs are checked where they enter, with errors that say what is wrong."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

RING = T.ring(8)
CORE = {
    "gossip_sgd": lambda **kw: gj.gossip_sgd(RING, **kw),
    "decentlam": lambda **kw: gj.decentlam(RING, **kw),
    "allreduce_sgd": lambda **kw: gj.allreduce_sgd(**kw),
}


@pytest.mark.parametrize("name", sorted(CORE))
@pytest.mark.parametrize("lr, error, match", [
    (float("nan"), ValueError, "learning_rate must be finite, got nan"),
    (float("inf"), ValueError, "learning_rate must be finite, got inf"),
    (-0.1, ValueError, "learning_rate must be non-negative, got -0.1"),
    (np.float32(-1), ValueError, "non-negative"),
    ("0.1", TypeError, "learning_rate must be a float or an optax schedule"),
    (None, TypeError, "learning_rate must be a float or an optax schedule"),
    (True, TypeError, "learning_rate must be a float"),
    # One value per node, shape (n,), is a per-node rate; any other array is refused.
    (jnp.ones((8, 1)), TypeError, r"learning_rate must be a scalar number, got float64 of shape \(8, 1\)"),
])
def test_bad_learning_rates_raise(name, lr, error, match):
  with pytest.raises(error, match=match) as e:
    CORE[name](learning_rate=lr)
  assert f"gj.{name}" in str(e.value)


EVERY_LEARNING_RATE = {
    **CORE,
    "qg_dmsgd": lambda **kw: gj.qg_dmsgd(RING, **kw),
    "gradient_tracking": lambda **kw: gj.gradient_tracking(RING, **kw),
    "exact_diffusion": lambda **kw: gj.exact_diffusion(RING, **kw),
    "extra": lambda **kw: gj.extra(RING, **kw),
    "sgp": lambda **kw: gj.sgp(RING, **kw),
    "choco_sgd": lambda **kw: gj.choco_sgd(RING, gj.compress.sign(), consensus_step=0.5, **kw),
    "easgd": lambda **kw: gj.easgd(**kw),
}


@pytest.mark.parametrize("name", sorted(EVERY_LEARNING_RATE))
@pytest.mark.parametrize("shape", [(3,), (8, 1)])
def test_a_schedule_that_returns_an_array_is_refused(name, shape):
  with pytest.raises(ValueError, match=rf"gj.{name}: learning_rate is a schedule that returns an array of shape "
                                       rf"\({shape[0]},(?: {shape[-1]})?\); it must return one number per step"):
    EVERY_LEARNING_RATE[name](learning_rate=lambda count: jnp.full(shape, 0.1))
  EVERY_LEARNING_RATE[name](learning_rate=lambda count: 0.1 * 0.9 ** count)  # a scalar schedule is fine


@pytest.mark.parametrize("name", sorted(CORE))
@pytest.mark.parametrize("beta", [1.0, -0.1, float("nan"), 1.5])
def test_bad_momentum_raises(name, beta):
  with pytest.raises(ValueError, match=r"beta \(the momentum\) must be in \[0, 1\)"):
    CORE[name](beta=beta, learning_rate=0.1)


@pytest.mark.parametrize("name", sorted(CORE))
def test_good_learning_rates_are_accepted(name):
  for lr in (0.0, 0.1, 1, np.float32(0.01), jnp.asarray(0.05), optax.linear_schedule(0.1, 0.0, 10)):
    tx = CORE[name](learning_rate=lr)
    x = jnp.ones((8, 2))
    u, _ = tx.update(jnp.ones((8, 2)), tx.init(x), x)
    assert jnp.isfinite(u).all()


def test_injected_learning_rate_under_jit_is_accepted():
  tx = optax.inject_hyperparams(gj.gossip_sgd, static_args=("topology",))(topology=RING, learning_rate=0.1, beta=0.9)
  x = jnp.ones((8, 2))
  state = tx.init(x)
  u, state = jax.jit(tx.update)(jnp.ones((8, 2)), state, x)
  assert jnp.isfinite(u).all()


@pytest.mark.parametrize("w, match", [
    ([np.eye(4) * 0.5 + np.roll(np.eye(4), 1, 1) * 0.5, np.full((4, 4), np.nan)], r"non-finite entry W\[0, 0\] = nan at step 1"),
    ([np.eye(4), np.eye(4)], "not connected \\(over one period of 2 step"),
    ([np.full((4, 4), 0.25), np.eye(4) * 0.9], "at step 1: W must be doubly stochastic but row 0 sums to 0.9"),
])
def test_time_varying_matrices_name_the_bad_step(w, match):
  with pytest.raises(ValueError, match=match):
    gj.gossip_sgd(T.from_matrix(w), learning_rate=0.1)


def test_node_axis_mismatch_is_named():
  tx = gj.guard_finite(gj.gossip_sgd(RING, learning_rate=0.1))
  x = {"w": jnp.ones((6, 2))}
  with pytest.raises(ValueError, match=r"\['w'\] has a leading node axis of 6, but ring\(8\) expects 8"):
    tx.update(x, tx.init(x), x)
  with pytest.raises(ValueError, match=r"has no node axis \(a scalar\)"):
    tx = gj.decentlam(RING, learning_rate=0.1)
    tx.update(jnp.ones(()), tx.init(jnp.ones(())), jnp.ones(()))


def test_empty_node_in_a_partition_is_refused():
  with pytest.raises(ValueError, match=r"node\(s\) \[1\] have no data"):
    gj.data.node_data(np.zeros((4, 2)), np.zeros(4), [np.array([0, 1]), np.array([], int), np.array([2, 3])])
  with pytest.raises(ValueError, match="cannot give each of 5 nodes a sample"):
    gj.data.partition_iid(np.zeros(3, int), 5)


def test_compressor_fractions_outside_unit_interval_raise():
  for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"):
    for make in (gj.compress.top_k, gj.compress.random_k):
      with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\]"):
        make(bad)


ALL_ALGORITHMS = {
    "gossip_sgd": lambda **kw: gj.gossip_sgd(RING, **kw),
    "sgp": lambda **kw: gj.sgp(RING, **kw),
    "allreduce_sgd": lambda **kw: gj.allreduce_sgd(**kw),
    "decentlam": lambda **kw: gj.decentlam(RING, **kw),
    "qg_dmsgd": lambda **kw: gj.qg_dmsgd(RING, **kw),
    "gradient_tracking": lambda **kw: gj.gradient_tracking(RING, **kw),
    "exact_diffusion": lambda **kw: gj.exact_diffusion(RING, **kw),
    "extra": lambda **kw: gj.extra(RING, **kw),
    "choco_sgd": lambda **kw: gj.choco_sgd(RING, gj.compress.top_k(0.5), consensus_step=0.5, **kw),
    "easgd": lambda **kw: gj.easgd(**kw),
}


@pytest.mark.parametrize("name", sorted(ALL_ALGORITHMS))
def test_learning_rate_is_required(name):
  with pytest.raises(TypeError, match="learning_rate"):
    ALL_ALGORITHMS[name]()


@pytest.mark.parametrize("fn", [gj.gossip_sgd, gj.sgp, gj.decentlam, gj.qg_dmsgd])
def test_a_second_positional_number_is_beta_and_learning_rate_is_keyword_only(fn):
  # gj.gossip_sgd(W, 0.01) must not read as a learning rate (nor silently train at a default one).
  with pytest.raises(TypeError, match="learning_rate"):
    fn(RING, 0.01)
  with pytest.raises(TypeError):
    fn(RING, 0.9, 0.01)


def test_momentum_methods_share_their_signature_and_default():
  import inspect
  for fn in (gj.gossip_sgd, gj.sgp, gj.decentlam, gj.qg_dmsgd, gj.allreduce_sgd):
    params = inspect.signature(fn).parameters
    assert params["beta"].default == 0.0, fn.__name__
    assert params["beta"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, fn.__name__
    assert params["learning_rate"].kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
    assert params["learning_rate"].default is inspect.Parameter.empty, fn.__name__
  assert "beta" not in inspect.signature(gj.easgd).parameters  # the center's rate is center_rate


@pytest.mark.parametrize("make, match", [
    (lambda: gj.gossip_sgd(RING, beta=1.5, learning_rate=0.1), r"^gj\.gossip_sgd: beta"),
    (lambda: gj.easgd(learning_rate=0.1, center_rate=2.0), r"^gj\.easgd: center_rate must be in"),
    (lambda: gj.mix(RING, every=0), r"^gj\.mix: every must be a positive integer"),
    (lambda: gj.choco_sgd(RING, gj.compress.sign(), learning_rate=0.1, consensus_step=0.0),
     r"^gj\.choco_sgd: consensus_step must be in \(0, 1\], got 0.0$"),
    (lambda: gj.extra(T.random_pairs(8, seed=0), learning_rate=0.1), r"^gj\.extra: needs a static W"),
])
def test_errors_start_with_the_public_name(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("make, name", [
    (lambda p: gj.diloco(optax.sgd(0.1), inner_steps=p), r"gj\.diloco: inner_steps"),
    (lambda p: gj.mix(RING, every=p), r"gj\.mix: every"),
    (lambda p: gj.periodic_average(p), r"gj\.periodic_average: every"),
    (lambda p: gj.easgd(learning_rate=0.1, every=p), r"gj\.easgd: every"),
])
def test_a_period_past_int32_is_refused_at_construction(make, name):
  """The step counter is an int32: a period of 2**31 would raise OverflowError at the first step."""
  for period in (2**31, np.int64(3_000_000_000)):
    with pytest.raises(ValueError, match=f"^{name} must be at most 2\\*\\*31 - 1 = 2147483647"):
      make(period)
  x = jnp.ones((8, 2))
  tx = make(2**31 - 1)
  tx.update(x, tx.init(x), x)  # the largest period runs


def _directed_graph():
  adjacency = np.zeros((6, 6), bool)
  adjacency[np.arange(6), (np.arange(6) + 1) % 6] = True  # a directed ring with two chords
  adjacency[0, 3] = adjacency[2, 5] = True
  return T.from_adjacency(adjacency)


@pytest.mark.parametrize("name, make", [
    ("mix", lambda W: gj.mix(W)),
    ("gossip_sgd", lambda W: gj.gossip_sgd(W, learning_rate=0.1)),
    ("decentlam", lambda W: gj.decentlam(W, learning_rate=0.1)),
    ("qg_dmsgd", lambda W: gj.qg_dmsgd(W, learning_rate=0.1)),
    ("gradient_tracking", lambda W: gj.gradient_tracking(W, learning_rate=0.1)),
    ("gradient_tracker", lambda W: gj.gradient_tracker(W)),
    ("exact_diffusion", lambda W: gj.exact_diffusion(W, learning_rate=0.1)),
    ("choco_sgd", lambda W: gj.choco_sgd(W, gj.compress.sign(), learning_rate=0.1, consensus_step=0.5)),
    ("outer_optimizer", lambda W: gj.outer_optimizer(optax.sgd(0.1), optax.sgd(1.0), inner_steps=2, topology=W)),
    ("sgp", lambda W: gj.sgp(W, learning_rate=0.1)),
])
def test_a_refused_topology_is_named_by_the_transform(name, make):
  """The topology's own check says what is wrong; the transform built on it says who asked."""
  kind = "column" if name == "sgp" else "doubly"
  with pytest.raises(ValueError, match=rf"^gj\.{name}: graph\(6\): W must be {kind} stochastic but column 5"):
    make(_directed_graph())


@pytest.mark.parametrize("make", [gj.exact_diffusion, gj.extra], ids=lambda f: f.__name__)
@pytest.mark.parametrize("topology", [T.exponential(8), T.one_peer_directed_exponential(8).matrices[0]],
                         ids=["exponential", "directed_matrix"])
def test_exact_methods_refuse_a_directed_w(make, topology):
  with pytest.raises(ValueError, match=rf"^gj\.{make.__name__}: needs a symmetric W, but .* is directed.*"
                                       r"exponential\(n, symmetric=True\).*gj\.gradient_tracking"):
    make(topology, learning_rate=0.01)
  make(T.exponential(8, symmetric=True), learning_rate=0.01)


@pytest.mark.parametrize("make", [lambda: gj.allreduce_sgd(learning_rate=0.1), lambda: gj.periodic_average(2),
                                  lambda: gj.easgd(learning_rate=0.1)], ids=["allreduce_sgd", "periodic_average", "easgd"])
def test_a_scalar_leaf_is_named_where_nodes_are_averaged(make):
  tx = make()
  x = {"w": jnp.ones((4, 2)), "s": jnp.asarray(1.0)}
  with pytest.raises(ValueError, match=r"params\['s'\] is a scalar, with no node axis to average over"):
    tx.init(x)
  fine = {"w": jnp.ones((4, 2)), "count": jnp.zeros((), jnp.int32)}  # a non-float scalar is left alone
  tx.update(fine, tx.init(fine), fine)


def _streaming(**kw):
  return gj.streaming_diloco(optax.sgd(0.1), **{"num_fragments": 2, "inner_steps": 4, **kw})


# Every integer and float hyperparameter of the algorithms: (transform, argument, a value in range
# given as a Python number, values out of range, the range as the docstring states it).
HYPERPARAMETERS = [
    ("mix", lambda **kw: gj.mix(RING, **kw), "every", 2, [0, -3], "a positive integer"),
    ("periodic_average", lambda **kw: gj.periodic_average(**kw), "every", 2, [0, -3], "a positive integer"),
    ("easgd", lambda **kw: gj.easgd(learning_rate=0.1, **kw), "every", 2, [0], "a positive integer"),
    ("diloco", lambda **kw: gj.diloco(optax.sgd(0.1), **kw), "inner_steps", 2, [0], "a positive integer"),
    ("noloco", lambda **kw: gj.noloco(optax.sgd(0.1), T.random_pairs(8, seed=0), **kw), "inner_steps", 2, [0],
     "a positive integer"),
    ("outer_optimizer", lambda **kw: gj.outer_optimizer(optax.sgd(0.1), optax.sgd(1.0), **kw), "inner_steps", 2, [0],
     "a positive integer"),
    ("streaming_diloco", _streaming, "num_fragments", 2, [0, -1], "a positive integer"),
    ("streaming_diloco", _streaming, "inner_steps", 4, [1], "at least num_fragments (2)"),
    ("streaming_diloco", _streaming, "overlap", 1, [2, -1], "[0, inner_steps / num_fragments) = [0, 2)"),
    *[(name, lambda make=EVERY_LEARNING_RATE[name], **kw: make(learning_rate=0.1, **kw), "beta", 0.5,
       [1.0, -0.25, float("nan")], "[0, 1)") for name in ("gossip_sgd", "decentlam", "qg_dmsgd", "allreduce_sgd", "sgp")],
    ("gossip_sgd", lambda **kw: gj.gossip_sgd(RING, learning_rate=0.1, **kw), "beta", 0, [1], "[0, 1)"),
    ("qg_dmsgd", lambda **kw: gj.qg_dmsgd(RING, learning_rate=0.1, **kw), "mu", 0.25, [1.5, -0.25], "[0, 1]"),
    ("choco_sgd", lambda **kw: gj.choco_sgd(RING, gj.compress.sign(), learning_rate=0.1, **kw), "consensus_step", 1,
     [0, 1.5], "(0, 1]"),
    ("easgd", lambda **kw: gj.easgd(learning_rate=0.1, **kw), "alpha", 0.5, [1.5, -0.25], "[0, 1]"),
    ("easgd", lambda **kw: gj.easgd(learning_rate=0.1, **kw), "center_rate", 0.5, [1.5, -0.25], "[0, 1]"),
    ("streaming_diloco", _streaming, "mixing", 0.5, [1.5, -0.25], "[0, 1]"),
    *[(name, make, "outer_momentum", 0.5, [1.0, 1.5, -0.25], "[0, 1)") for name, make in (
        ("diloco", lambda **kw: gj.diloco(optax.sgd(0.1), inner_steps=2, **kw)),
        ("noloco", lambda **kw: gj.noloco(optax.sgd(0.1), T.random_pairs(8, seed=0), inner_steps=2, **kw)),
        ("streaming_diloco", _streaming))],
]
_IDS = [f"{name}-{arg}-{good}" for name, _, arg, good, _, _ in HYPERPARAMETERS]


def _as_numpy(value):
  return np.int64(value) if isinstance(value, int) else np.float32(value)


@pytest.mark.parametrize("name, make, arg, good, bad, allowed", HYPERPARAMETERS, ids=_IDS)
def test_hyperparameters_take_numpy_scalars_and_refuse_out_of_range_with_the_documented_range(
    name, make, arg, good, bad, allowed):
  x = {"a": jnp.arange(16.0).reshape(8, 2), "b": jnp.ones((8, 3))}
  steps = []
  for value in (good, _as_numpy(good)):  # a NumPy scalar is taken wherever the Python number is: the same transform
    tx = make(**{arg: value})
    steps.append(jax.eval_shape(lambda p, tx=tx: tx.update(p, tx.init(p), p), x))  # traced, not compiled: cheap
  assert jax.tree.structure(steps[0]) == jax.tree.structure(steps[1])
  assert jax.tree.leaves(steps[0]) == jax.tree.leaves(steps[1])
  for value in bad + [_as_numpy(v) for v in bad if not np.isnan(v)]:
    with pytest.raises(ValueError) as e:
      make(**{arg: value})
    message = str(e.value)
    assert message.startswith(f"gj.{name}: {arg}"), message
    assert allowed in message and "got" in message, message


# The hyperparameters a method also takes one value per node (an array of shape (n,)).
_PER_NODE = {"beta", "consensus_step", "alpha", "center_rate", "mixing", "outer_momentum"}
_PER_NODE_RANGES = [row for row in HYPERPARAMETERS if row[2] in _PER_NODE]


@pytest.mark.parametrize("name, make, arg, good, bad, allowed", _PER_NODE_RANGES,
                         ids=[f"{name}-{arg}-{good}" for name, _, arg, good, _, _ in _PER_NODE_RANGES])
def test_a_per_node_hyperparameter_is_checked_entry_by_entry_naming_the_node(name, make, arg, good, bad, allowed):
  make(**{arg: jnp.full(8, float(good))})  # every entry in range: taken
  for value in bad:
    with pytest.raises(ValueError) as e:
      make(**{arg: jnp.full(8, float(good)).at[3].set(value)})
    message = str(e.value)
    assert message.startswith(f"gj.{name}: {arg}") and allowed in message, message
    assert message.endswith(f"got {float(value)} at node 3"), message


@pytest.mark.parametrize("name", sorted(EVERY_LEARNING_RATE))
@pytest.mark.parametrize("lr, match", [
    (-0.1, "learning_rate must be non-negative, got -0.1 at node 5 (a negative rate ascends the loss)"),
    (float("nan"), "learning_rate must be finite, got nan at node 5"),
])
def test_a_per_node_learning_rate_is_checked_entry_by_entry(name, lr, match):
  with pytest.raises(ValueError, match=rf"^gj\.{name}: {re.escape(match)}$"):
    EVERY_LEARNING_RATE[name](learning_rate=jnp.full(8, 0.1).at[5].set(lr))


def test_per_node_outer_rates_are_checked_entry_by_entry():
  with pytest.raises(ValueError, match=r"^gj\.diloco: outer_momentum must be in \[0, 1\), got 1\.2 at node 0$"):
    gj.diloco(optax.sgd(0.1), inner_steps=2, outer_momentum=jnp.full(4, 1.2))
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: outer_learning_rate must be non-negative, got -1\.0 "
                                       r"at node 2"):
    _streaming(outer_learning_rate=jnp.array([0.7, 0.7, -1.0, 0.7]))


def test_per_node_values_set_under_inject_hyperparams_are_checked_where_they_are_concrete():
  x = jnp.zeros((8, 2))
  betas = jnp.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 1.5, 0.9])
  injected = optax.inject_hyperparams(gj.gossip_sgd)
  message = r"^gj\.gossip_sgd: beta \(the momentum\) must be in \[0, 1\), got 1\.5 at node 6$"
  with pytest.raises(ValueError, match=message):
    injected(RING, beta=betas, learning_rate=0.1).init(x)  # given per node: checked at init
  tx = injected(RING, beta=0.9, learning_rate=0.1)
  state = optax.tree_utils.tree_set(tx.init(x), beta=betas)  # set per node: checked at the next (eager) update
  with pytest.raises(ValueError, match=message):
    tx.update(x, state, x)
  with pytest.raises(ValueError, match=r"^gj\.gossip_sgd: beta \(the momentum\) must be in \[0, 1\), got 1\.5$"):
    tx.update(x, optax.tree_utils.tree_set(tx.init(x), beta=1.5), x)  # as a scalar set the same way
  good = optax.tree_utils.tree_set(tx.init(x), beta=jnp.linspace(0.0, 0.9, 8))
  assert jax.tree.leaves(tx.update(x, good, x)[0])[0].shape == (8, 2)


def test_the_overlap_bound_is_inner_steps_over_num_fragments_unfloored():
  gj.streaming_diloco(optax.sgd(0.1), num_fragments=3, inner_steps=10, overlap=3)  # 3 < 10 / 3
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: overlap must be an integer in "
                                       r"\[0, inner_steps / num_fragments\) = \[0, 10/3 = 3\.33\), got 4$"):
    gj.streaming_diloco(optax.sgd(0.1), num_fragments=3, inner_steps=10, overlap=4)
