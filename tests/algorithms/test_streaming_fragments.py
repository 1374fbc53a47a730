"""Streaming DiLoCo's fragments balanced by bytes (``fragment_split="balanced"``) against the layer split.

The balanced split puts the float leaves end to end and cuts them into F ranges of equal
bytes, at the entry nearest each k/F of the total; the layer split keeps whole leaves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import cli, train

N, LR, ETA, MU, TAU, ALPHA = 4, 0.1, 0.7, 0.9, 1, 0.3
SHAPES = {"a": (3,), "b": (2, 3), "c": (1,)}  # 10 entries a node, in this order
OFFSETS = {"a": 0, "b": 3, "c": 9}


def as_tree(flat):
  return {k: flat[:, OFFSETS[k]:OFFSETS[k] + int(np.prod(s))].reshape((flat.shape[0],) + s) for k, s in SHAPES.items()}


def as_flat(tree):
  return np.concatenate([np.asarray(tree[k]).reshape(N, -1) for k in SHAPES], axis=1)


def grads(flat, t):
  rng = np.random.default_rng(t)
  return flat - (np.arange(N)[:, None] + 1.0) + 0.1 * rng.normal(size=flat.shape)


def numpy_streaming(ranges, h, steps):
  """The paper's algorithm on each node's entries end to end; fragment p is the entries ``ranges[p]``."""
  f = len(ranges)
  theta, phi, mom, pending, out = np.zeros((N, 10)), np.zeros(10), np.zeros(10), np.zeros(10), []
  for t in range(steps):
    theta = theta - LR * grads(theta, t)
    for p, (lo, hi) in enumerate(ranges):
      sync, part = (p + 1) * h // f - 1, slice(lo, hi)
      if t % h == sync:
        pending[part] = np.mean(phi[part] - theta[:, part], axis=0)  # the fragment's all-reduce
      if t % h == (sync + TAU) % h and t >= sync + TAU:
        mom[part] = MU * mom[part] + pending[part]  # Nesterov SGD, as torch.optim.SGD
        phi[part] = phi[part] - ETA * (pending[part] + MU * mom[part])
        theta[:, part] = ALPHA * theta[:, part] + (1 - ALPHA) * phi[part]
    out.append(theta.copy())
  return np.stack(out)


def run(tx, steps, place=lambda tree: tree):
  x = place(as_tree(jnp.zeros((N, 10))))
  step = jax.jit(lambda x, s, g: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(g, s, x)))
  state, out = tx.init(x), []
  for t in range(steps):
    x, state = step(x, state, place(as_tree(jnp.asarray(grads(as_flat(x), t)))))
    out.append(as_flat(x))
  return np.stack(out)


def test_balanced_fragments_match_the_papers_algorithm_on_equal_ranges_of_entries():
  h = 6
  make = lambda **kw: gj.streaming_diloco(optax.sgd(LR), num_fragments=3, fragment_split="balanced", inner_steps=h,
                                          overlap=TAU, mixing=ALPHA, outer_learning_rate=ETA, outer_momentum=MU, **kw)
  # 10 entries in 3: cuts at the entries nearest 10/3 and 20/3, so "b" is cut between fragments 1 and 2.
  want = numpy_streaming([(0, 3), (3, 7), (7, 10)], h, 3 * h)
  np.testing.assert_allclose(run(make(), 3 * h), want, rtol=0, atol=1e-12)
  np.testing.assert_allclose(run(gj.chain(make()), 3 * h), want, rtol=0, atol=1e-12)
  mesh = jax.make_mesh((2,), ("nodes",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
  be = gj.backend.sharded(mesh)
  got = run(make(backend=be), 3 * h, be.shard)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  # The layer split of the same model is another method: "b" (6 of the 10 entries) syncs whole.
  assert np.abs(want - numpy_streaming([(0, 3), (3, 9), (9, 10)], h, 3 * h)).max() > 1e-3


def test_balanced_split_equals_the_layer_split_of_the_model_cut_at_its_boundaries_with_nodes_down_and_qsgd():
  """Cut at 5 of 10 entries: fragments [a, b[:2]] and [b[2:], c], the layer split of a model with b in two leaves."""
  h, steps = 4, 12
  up = np.random.default_rng(1).uniform(size=(steps, N)) > 0.3
  cut = {"a": (3,), "b0": (2,), "b1": (4,), "c": (1,)}

  def trajectory(tx, tree_of):
    x = tree_of(jnp.zeros((N, 10)))
    step = jax.jit(lambda x, s, g, up: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(g, s, x, up=up)))
    state, out = tx.init(x), []
    for t in range(steps):
      flat = np.concatenate([np.asarray(v).reshape(N, -1) for v in jax.tree.leaves(x)], axis=1)
      x, state = step(x, state, tree_of(jnp.asarray(grads(flat, t))), jnp.asarray(up[t]))
      out.append(np.concatenate([np.asarray(v).reshape(N, -1) for v in jax.tree.leaves(x)], axis=1))
    return np.stack(out), state

  def pieces(flat):
    starts = np.cumsum([0] + [s[0] for s in cut.values()])
    return {k: flat[:, a:b] for k, a, b in zip(cut, starts[:-1], starts[1:])}

  make = lambda split: gj.streaming_diloco(optax.adam(LR), num_fragments=2, fragment_split=split, inner_steps=h,
                                          overlap=TAU, mixing=ALPHA, compressor=gj.compress.qsgd(7), key=3)
  got, state = trajectory(make("balanced"), as_tree)
  want, _ = trajectory(make("layers"), pieces)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  assert np.abs(np.asarray(state.residual["b"])).max() > 1e-3  # the compressor dropped something
  assert not up.all()


def test_peak_bytes_of_the_main_jobs_mlp():
  """Both splits as the main job builds them (8 nodes, F = 4): the layer split's peak is the hidden kernel's."""
  n, f, h = 8, 4, 4
  shapes = jax.eval_shape(train.MLP(hidden=(64,), num_classes=10).init, jax.random.key(0), jnp.zeros((1, 64)))
  x = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), shapes)
  diloco = gj.bytes_per_step(gj.diloco(optax.adamw(1e-3), inner_steps=h), x, steps=h)
  sent = {}
  for split in ("layers", "balanced"):
    args = cli.build_parser().parse_args(["train", "--algorithms", "streaming_diloco", "--nodes", str(n),
                                          "--fragments", str(f), "--inner-steps", str(h), "--overlap", "0",
                                          "--fragment-split", split])
    _, (tx,), _ = cli._build_runs(args, None)
    sent[split] = gj.bytes_per_step(tx, x, steps=h)
    assert sent[split].sum() == diloco.sum() and np.count_nonzero(sent[split]) == f  # a model a round, F syncs
  ring = 2 * (n - 1) / n  # a ring all-reduce sends this many times the bytes a node holds
  assert sent["layers"].max() == ring * 64 * 64 * 4 > 0.8 * diloco.max()
  assert sent["balanced"].max() <= 1.3 * diloco.max() / f
  assert sent["balanced"].max() - sent["balanced"].min() <= ring * 4  # within one float32 entry


def test_balanced_split_takes_more_fragments_than_leaves_and_bad_values_name_the_argument():
  x = {"w": jnp.zeros((2, 6), jnp.float32)}
  tx = gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=2, fragment_split="balanced")
  assert gj.bytes_per_step(tx, x, steps=2).tolist() == [12.0, 12.0]  # 3 float32 a fragment, over 2 nodes
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: num_fragments=2 needs at least as many float leaves"):
    gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=2).init(x)
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: num_fragments=7 needs at least as many float "
                                       r"entries a node, but the params have 6"):
    gj.streaming_diloco(optax.sgd(0.1), num_fragments=7, inner_steps=7, fragment_split="balanced").init(x)
  with pytest.raises(ValueError, match=r"^gj\.streaming_diloco: fragment_split must be 'layers' or 'balanced', "
                                       r"got 'rows'"):
    gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, fragment_split="rows")
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["train", "--fragment-split", "rows"])
