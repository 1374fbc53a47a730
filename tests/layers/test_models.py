"""The project's convolutional models train with ``gj.layers.conv_general_dilated``: on CPU the same numbers.

On CPU its default is the patches form, one matrix product where XLA's is a convolution: the same numbers to
float64's round-off, not to the bit.
"""

import jax
import numpy as np
import pytest
from _launch import untimed
from jax import lax

import gossipjax as gj
from gossipjax import train


@pytest.mark.slow
def test_the_main_jobs_cnn_trains_to_the_same_numbers():
  cfg = train.RunConfig(algorithm="dmsgd", num_nodes=4, steps=6, log_every=3, batch_size=8, seed=3)
  digits = gj.data.load_digits()
  data = digits._replace(x_train=digits.x_train.astype(np.float64), x_test=digits.x_test.astype(np.float64))
  runs = []
  for conv in (None, lax.conv_general_dilated):
    model = train.CNN(features=(4,), image_shape=(8, 8, 1), **({} if conv is None else {"conv_general_dilated": conv}))
    tx = train.make_algorithm("dmsgd", train.make_topology("ring", 4), 0.1, 0.9)
    state = train.init_state(cfg, data, model, tx)
    params = jax.tree.map(lambda p: p.astype(np.float64), state.params)
    runs.append(train.run(cfg, data, model, tx, state=train.TrainState(0, params, train.guarded(tx, cfg).init(params))))
  (state, history), (ref_state, ref_history) = runs
  assert train.CNN().conv_general_dilated is gj.layers.conv_general_dilated
  assert jax.tree.leaves(state.params)[0].dtype == np.float64
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  got, want = untimed(history), untimed(ref_history)  # every metric of the run
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g == pytest.approx(r, rel=1e-9, abs=1e-12)
