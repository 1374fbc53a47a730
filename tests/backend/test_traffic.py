"""gj.bytes_per_step: what each method sends per node and step, the same stacked, per node and sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from gossipjax import topology as T

N, D = 8, 50
M = D * 4  # one node's float32 model, in bytes
RING = 2 * (N - 1) / N * M  # a ring all-reduce of one model, per node


def params(dtype=jnp.float32):
  return jnp.zeros((N, D), dtype)


def test_each_method_counts_what_it_sends():
  x = params()
  ring, pairs = T.ring(N), T.random_pairs(N)
  np.testing.assert_allclose(gj.bytes_per_step(gj.allreduce_sgd(0.0, learning_rate=0.1), x, 2), [RING, RING])
  np.testing.assert_allclose(gj.bytes_per_step(gj.gossip_sgd(ring, learning_rate=0.1), x), [2 * M])
  np.testing.assert_allclose(gj.bytes_per_step(gj.gossip_sgd(T.one_peer_exponential(N), learning_rate=0.1), x), [M])
  np.testing.assert_allclose(gj.bytes_per_step(gj.diloco(optax.adamw(1e-3), inner_steps=3), x, 6),
                             [0, 0, RING, 0, 0, RING])
  np.testing.assert_allclose(gj.bytes_per_step(gj.noloco(optax.adamw(1e-3), pairs, inner_steps=2), x, 4),
                             [0, M, 0, M])
  # CHOCO-SGD sends top_k's compact form: 10% of the values (float32) and their indices (uint8 for 50 entries).
  choco = gj.choco_sgd(ring, gj.compress.top_k(0.1), learning_rate=0.1, consensus_step=0.3)
  np.testing.assert_allclose(gj.bytes_per_step(choco, x), [2 * 5 * (4 + 1)])
  # 16-bit leaves are averaged in float32: the all-reduce moves 4 bytes a value.
  np.testing.assert_allclose(gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=1), params(jnp.bfloat16)),
                             [RING])


def test_per_node_and_sharded_count_as_the_stacked_transform():
  x = params()
  stacked = gj.bytes_per_step(gj.diloco(optax.adamw(1e-3), inner_steps=2), x, 4)
  chained = gj.bytes_per_step(gj.chain(gj.diloco(optax.adamw(1e-3), inner_steps=2)), x, 4)
  np.testing.assert_array_equal(stacked, chained)
  mesh = jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  backend = gj.backend.sharded(mesh)
  placed = backend.shard(x)
  for tx, sim in [(lambda b: gj.diloco(optax.adamw(1e-3), inner_steps=2, backend=b), stacked),
                  (lambda b: gj.gossip_sgd(T.ring(N), learning_rate=0.1, backend=b), [2 * M] * 4)]:
    np.testing.assert_array_equal(gj.bytes_per_step(tx(backend), placed, 4), sim)


def test_nothing_is_counted_outside_a_count():
  from gossipjax.backend._traffic import Traffic, counting

  traffic = Traffic()
  tx = gj.allreduce_sgd(0.0, learning_rate=0.1)
  step = jax.jit(lambda x, s: tx.update(x, s, x))
  x = params()
  step(x, tx.init(x))  # traced outside: no callback in the program
  with counting(traffic):
    step(x, tx.init(x))
  jax.effects_barrier()
  assert traffic.total == 0.0
