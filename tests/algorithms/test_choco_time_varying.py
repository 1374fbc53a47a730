"""CHOCO-SGD on a time-varying graph sends its compact messages, and the permutes carry the bytes it reports."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
_ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "u16": 2, "s16": 2, "u8": 1, "s8": 1, "u32": 4, "s32": 4}


def _moved(compiled_text: str) -> tuple[int, int]:
  """Bytes every collective-permute of a compiled program moves (its result times its sending pairs), and their count."""
  total = count = 0
  for line in compiled_text.split("\n"):
    found = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute\(.*source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if found:
      dtype, dims, pairs = found.groups()
      size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
      total += size * _ITEMSIZE[dtype] * len(re.findall(r"\{\d+,\d+\}", pairs))
      count += 1
  return total, count


def _union_out_degree(topo: T.Topology) -> np.ndarray:
  union = topo.union_graph().tocoo()
  off = union.row != union.col
  return np.bincount(union.col[off], minlength=topo.num_nodes)


def _run(tx, x, steps, scale=0.1):
  state = tx.init(x)
  step = jax.jit(lambda p, s: tx.update(jax.tree.map(lambda v: scale * v, p), s, p))
  for _ in range(steps):
    u, state = step(x, state)
    x = optax.apply_updates(x, u)
  return x, state


@pytest.mark.parametrize("compressor", [gj.compress.top_k(0.1), gj.compress.random_k(0.2), gj.compress.qsgd(4),
                                        gj.compress.sign()], ids=lambda c: type(c).__name__)
def test_the_compact_form_is_the_same_algorithm_as_sending_the_public_copies(compressor):
  topo = T.random_pairs(8)
  rng = np.random.default_rng(0)
  x0 = {"w": rng.normal(size=(8, 30)), "b": rng.normal(size=(8, 3, 2))}
  make = lambda mode: gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5, seed=2, time_varying=mode)
  (compact, cs), (dense, ds) = _run(make("compact"), x0, 20), _run(make("dense"), x0, 20)
  for a, b in zip(jax.tree.leaves(compact), jax.tree.leaves(dense)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
  # A copy of x_hat_j per round of the union graph (random_pairs(8) meets all 7 others in a period).
  assert len(cs.neighbour_copies) == 7 and ds.neighbour_copies == ()
  assert float(cs.message_bits[0]) < float(ds.message_bits[0]) / 4


@pytest.mark.parametrize("topo", [T.random_pairs(8), T.one_peer_exponential(8)], ids=lambda t: t.name)
def test_on_a_changing_graph_the_permutes_carry_the_bytes_reported(topo):
  be = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(AUTO,)))  # one node per device
  compressor = gj.compress.top_k(0.01)
  tx = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5, backend=be)
  sim = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5)
  x0 = np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32)
  x = be.shard(x0)
  moved, permutes = _moved(jax.jit(lambda p, s: tx.update(0.1 * p, s, p)).lower(x, tx.init(x)).compile().as_text())
  (x, state), (y, sim_state) = _run(tx, x, 3), _run(sim, x0, 3)
  np.testing.assert_allclose(x, y, rtol=0, atol=2e-6)  # float32
  np.testing.assert_array_equal(state.message_bits, sim_state.message_bits)
  message = float(sim_state.message_bits[0]) / 8
  assert message == 10 * 4 + 10 * 2  # 10 float32 values and their uint16 indices
  # Each node sends q_i to every node that receives from it at some step of the period, every step.
  sent = message * _union_out_degree(topo)
  assert permutes == 2 * len(sim_state.neighbour_copies)  # a round: values and indices, one bucket each
  assert moved == sent.sum()
  np.testing.assert_allclose(gj.bytes_per_step(sim, x0, steps=2), [sent.mean()] * 2)
  # The dense form sends the public copy (4,000 bytes) to the one neighbour of each step.
  dense = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5, time_varying="dense")
  dense_bytes = gj.bytes_per_step(dense, x0)
  np.testing.assert_allclose(dense_bytes, [4000.0])
  assert sent.max() < dense_bytes[0] / 5  # 7 compact messages against one dense row


def test_several_nodes_a_device_send_every_union_round_in_one_exchange_per_device_pair():
  be = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(AUTO,)))  # 4 nodes per device
  topo = T.random_pairs(32, period=16)
  make = lambda backend: gj.choco_sgd(topo, gj.compress.top_k(0.05), learning_rate=0.1, consensus_step=0.5,
                                      backend=backend)
  tx, sim = make(be), make(None)
  x0 = np.random.default_rng(3).normal(size=(32, 200))
  x = be.shard(x0)
  moved, permutes = _moved(jax.jit(lambda p, s: tx.update(0.1 * p, s, p)).lower(x, tx.init(x)).compile().as_text())
  (x, state), (y, sim_state) = _run(tx, x, 3), _run(sim, x0, 3)
  np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
  for c, d in zip(jax.tree.leaves(state.neighbour_copies), jax.tree.leaves(sim_state.neighbour_copies)):
    np.testing.assert_allclose(c, d, rtol=0, atol=1e-12)
  # The union graph's rounds share their exchanges: at most one per ordered pair of devices (7 a
  # device), each a bucket of values and one of indices, where a round at a time took 150 permutes.
  rounds = len(sim_state.neighbour_copies)
  assert rounds > 7 and permutes <= 2 * 7, (rounds, permutes)
  # What crosses is the compact form: a node's message once to each other device that holds one of
  # its union out-neighbours, up to the padding of each exchange to its longest message.
  union = topo.union_graph().tocoo()
  crossing = {(j, i // 4) for i, j in zip(union.row, union.col) if i // 4 != j // 4}
  sent = float(sim_state.message_bits[0]) / 8 * len(crossing)
  assert sent <= moved <= 1.5 * sent, (moved, sent)


def test_two_nodes_a_device_equal_the_simulation_on_an_explicit_mesh():
  be = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(EXPLICIT,)))
  topo = T.one_peer_exponential(16)  # some rounds stay inside a device, some cross
  rng = np.random.default_rng(1)
  host = {"w": rng.normal(size=(16, 40)), "b": rng.normal(size=(16, 4))}
  # random_k: a receiver rebuilds the indices from the sender's global node index and the step.
  tx = gj.choco_sgd(topo, gj.compress.random_k(0.25), learning_rate=0.1, consensus_step=0.5, seed=1, backend=be)
  sim = gj.choco_sgd(topo, gj.compress.random_k(0.25), learning_rate=0.1, consensus_step=0.5, seed=1)
  (x, state), (y, sim_state) = _run(tx, be.shard(host), 4), _run(sim, host, 4)
  for k in host:
    np.testing.assert_allclose(x[k], y[k], rtol=0, atol=1e-12)
  for c, d in zip(jax.tree.leaves(state.neighbour_copies), jax.tree.leaves(sim_state.neighbour_copies)):
    np.testing.assert_allclose(c, d, rtol=0, atol=1e-12)
  assert x["w"].sharding.is_equivalent_to(be.sharding, 2)


def test_inside_gj_chain_equals_the_stacked_call():
  topo = T.one_peer_exponential(8)
  x0 = np.random.default_rng(2).normal(size=(8, 12))
  make = lambda: gj.choco_sgd(topo, gj.compress.qsgd(4), learning_rate=0.1, consensus_step=0.5, seed=3)
  (x, _), (y, _) = _run(gj.chain(make()), jnp.asarray(x0), 5), _run(make(), jnp.asarray(x0), 5)
  np.testing.assert_allclose(x, y, rtol=0, atol=1e-13)


def test_an_unknown_time_varying_form_is_refused():
  with pytest.raises(ValueError, match=r"^gj\.choco_sgd: time_varying must be 'compact'"):
    gj.choco_sgd(T.random_pairs(4), gj.compress.sign(), learning_rate=0.1, consensus_step=0.5, time_varying="sparse")
