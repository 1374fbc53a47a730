"""Inputs are checked where they enter, with errors that say what is wrong."""

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
    (jnp.ones(8), TypeError, r"learning_rate must be a scalar number, got float64 of shape \(8,\)"),
])
def test_bad_learning_rates_raise(name, lr, error, match):
  with pytest.raises(error, match=match) as e:
    CORE[name](learning_rate=lr)
  assert f"gj.{name}" in str(e.value)


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
    gj.decentlam(RING, learning_rate=0.1).update(jnp.ones(()), gj.decentlam(RING).init(jnp.ones(())), jnp.ones(()))


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
