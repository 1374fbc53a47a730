"""``gj.train.GPT``: shapes and dtypes, the causal mask, per-node gradients under vmap, and its compiled step.

XLA:CPU takes seconds to compile even this small model, so the tests share one init and one compiled step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gossipjax import train

NODES = 3


def _gpt(dtype=jnp.float32) -> train.GPT:
  return train.GPT(context=8, width=16, num_heads=2, num_layers=1, dtype=dtype)  # no dimension is 3 but the nodes'


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=shape), jnp.int32)


@pytest.fixture(scope="module")
def init():
  """Params of one model by seed, float32, from one compiled init."""
  init = jax.jit(_gpt().init)
  return lambda seed=0: init(jax.random.key(seed), _tokens((2, 8)))


@pytest.fixture(scope="module")
def apply():
  return {dtype: jax.jit(_gpt(dtype).apply) for dtype in (jnp.float32, jnp.bfloat16)}


def test_logits_are_float32_of_batch_length_vocab_and_params_stay_float32(init, apply):
  params = init()
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  for dtype, length in ((jnp.float32, 8), (jnp.float32, 3), (jnp.bfloat16, 8)):
    logits = apply[dtype](params, _tokens((2, length)))
    assert logits.shape == (2, length, 256) and logits.dtype == jnp.float32


def test_a_sequence_longer_than_the_context_is_refused(init):
  with pytest.raises(ValueError, match="the input has 9 tokens, more than the model's context of 8"):
    _gpt().apply(init(), _tokens((1, 9)))


def test_changing_a_token_changes_no_earlier_logit(init, apply):
  params, tokens = init(), _tokens((2, 8))
  before = apply[jnp.float32](params, tokens)
  for t in (0, 3, 7):
    after = apply[jnp.float32](params, tokens.at[:, t].set((tokens[:, t] + 1) % 256))
    np.testing.assert_array_equal(before[:, :t], after[:, :t])
    assert np.all(np.abs(before[:, t:] - after[:, t:]).max(axis=-1) > 0)  # position t and every later one see it


def test_bfloat16_compute_gives_a_finite_loss_near_float32s(init, apply):
  params, x, y = init(), _tokens((2, 8), 1), _tokens((2, 8), 2)
  loss = {dtype: optax.softmax_cross_entropy_with_integer_labels(apply[dtype](params, x), y).mean()
          for dtype in apply}
  assert np.isfinite(loss[jnp.bfloat16])
  np.testing.assert_allclose(loss[jnp.bfloat16], loss[jnp.float32], rtol=2e-2)
  np.testing.assert_allclose(loss[jnp.float32], np.log(256), rtol=0.05)  # the tied head starts with small logits


@pytest.fixture(scope="module")
def step(init):
  """The per-node gradient of the training loop's loss over 3 differently initialised nodes, compiled, in float64."""
  model = _gpt(jnp.float64)
  nodes = [jax.tree.map(lambda p: p.astype(jnp.float64), init(seed)) for seed in range(NODES)]
  params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *nodes)
  x, y = _tokens((NODES, 2, 8), 1), _tokens((NODES, 2, 8), 2)
  loss = lambda p, x, y: train.cross_entropy(model.apply, p, x, y)
  compiled = jax.jit(jax.vmap(jax.grad(loss))).lower(params, x, y).compile()
  return compiled, jax.jit(jax.grad(loss)), nodes, params, x, y


def test_vmapped_gradient_over_nodes_equals_a_loop_over_nodes_in_float64(step):
  compiled, grad, nodes, params, x, y = step
  got = compiled(params, x, y)
  for node in range(NODES):
    want = grad(nodes[node], x[node], y[node])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.dtype == w.dtype == jnp.float64
      np.testing.assert_allclose(g[node], w, rtol=0, atol=1e-12)
  first = jax.tree.leaves(got)[0]
  assert np.abs(first[0] - first[1]).max() > 1e-6  # the nodes' gradients differ: each used its own params


def _ops(text, name):
  return [line for line in text.splitlines() if re.search(rf"= \S+ {name}\(", line)]


def test_the_compiled_per_node_step_is_dot_products_batched_over_the_nodes(step):
  text = step[0].as_text()
  dots = _ops(text, "dot")
  # Forward, input and weight gradients of a block's 4 dense layers and 2 einsums, the embedding and the head.
  assert len(dots) >= 15, len(dots)
  for dot in dots:
    shape = re.search(r"= [a-z0-9]+\[([0-9,]*)\]", dot)
    batch = re.search(r"lhs_batch_dims=\{([0-9,]*)\}", dot)
    # The node axis leads the result and is a batch dimension of the product: one kernel for all nodes.
    assert shape and batch and batch.group(1).split(",")[0] == "0" and shape.group(1).split(",")[0] == str(NODES), dot
  assert not _ops(text, "convolution")
  # The token lookup is a one-hot product and attention is einsums, so the model gathers and scatters
  # nothing; the loss's label pick (optax's take_along_axis) is all there is, a scatter-add in its gradient.
  picks = _ops(text, "gather") + _ops(text, "scatter")
  assert all("take_along_axis" in line for line in picks), picks
