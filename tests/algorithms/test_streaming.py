"""Streaming DiLoCo against a NumPy transcription of Douillard et al. (2025): fragments in turn, overlap, mixing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj

N, H, F, TAU, ALPHA, STEPS, LR, ETA, MU = 4, 4, 2, 1, 0.3, 16, 0.1, 0.7, 0.9
SIZES = {"a": 3, "b": 3}  # two leaves of equal size: fragment 0 is "a", fragment 1 is "b"


def grads(x, k):
  rng = np.random.default_rng(k)
  return {name: x[name] - (np.arange(N)[:, None] + 1.0) + 0.1 * rng.normal(size=x[name].shape) for name in SIZES}


def numpy_streaming():
  """The paper's Algorithm: fragment p syncs at t % H == (p+1)H/F - 1, applied tau steps later, merged by alpha."""
  theta = {k: np.zeros((N, d)) for k, d in SIZES.items()}
  phi = {k: np.zeros(d) for k, d in SIZES.items()}
  mom = {k: np.zeros(d) for k in SIZES for d in [SIZES[k]]}
  pending, out = {}, []
  for t in range(STEPS):
    g = grads(theta, t)
    theta = {k: theta[k] - LR * g[k] for k in SIZES}
    for p, k in enumerate(SIZES):
      sync = (p + 1) * H // F - 1
      if t % H == sync:
        pending[k] = np.mean(phi[k] - theta[k], axis=0)  # the fragment's all-reduce
      if t % H == (sync + TAU) % H and t >= sync + TAU:
        mom[k] = MU * mom[k] + pending[k]  # Nesterov SGD, as torch.optim.SGD
        phi[k] = phi[k] - ETA * (pending[k] + MU * mom[k])
        theta[k] = ALPHA * theta[k] + (1 - ALPHA) * phi[k]
    out.append({k: v.copy() for k, v in theta.items()})
  return out


def run(tx, x=None):
  x = {k: jnp.zeros((N, d)) for k, d in SIZES.items()} if x is None else x
  state, out = tx.init(x), []
  step = jax.jit(lambda x, s, g: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(g, s, x)))
  for t in range(STEPS):
    x, state = step(x, state, grads(jax.tree.map(np.asarray, x), t))
    out.append(jax.tree.map(np.asarray, x))
  return out


def make(**kw):
  return gj.streaming_diloco(optax.sgd(LR), num_fragments=F, inner_steps=H, overlap=TAU, mixing=ALPHA,
                             outer_learning_rate=ETA, outer_momentum=MU, **kw)


def test_streaming_diloco_matches_the_papers_algorithm_stacked_and_per_node():
  want = numpy_streaming()
  for tx in (make(), gj.chain(make())):
    got = run(tx)
    for g, w in zip(got, want):
      for k in SIZES:
        np.testing.assert_allclose(g[k], w[k], rtol=0, atol=1e-12)


def test_peak_bytes_per_step_are_one_fragment_of_dilocos():
  x = {k: jnp.zeros((N, d), jnp.float32) for k, d in SIZES.items()}
  streaming = gj.bytes_per_step(make(), x, 2 * H)
  diloco = gj.bytes_per_step(gj.diloco(optax.sgd(LR), inner_steps=H), x, 2 * H)
  assert streaming.max() == diloco.max() / F and streaming.sum() == diloco.sum()
  assert np.count_nonzero(streaming) == F * np.count_nonzero(diloco)


def test_sharded_equals_the_simulation():
  mesh = jax.make_mesh((4,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
  backend = gj.backend.sharded(mesh)
  x = backend.shard({k: jnp.zeros((N, d)) for k, d in SIZES.items()})
  got, want = run(make(backend=backend), x)[-1], run(make())[-1]
  for k in SIZES:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-12)


def test_one_fragment_without_overlap_or_mixing_is_diloco():
  x = {k: jnp.zeros((N, d)) for k, d in SIZES.items()}
  got = run(gj.streaming_diloco(optax.adam(LR), num_fragments=1, inner_steps=H, outer_learning_rate=ETA,
                                outer_momentum=MU))
  want = run(gj.diloco(optax.adam(LR), inner_steps=H, outer_learning_rate=ETA, outer_momentum=MU), x)
  assert np.max(np.abs(got[-1]["a"] - got[0]["a"])) > 0.1  # it moves
  for g, w in zip(got, want):
    for k in SIZES:
      np.testing.assert_allclose(g[k], w[k], rtol=0, atol=1e-12)
