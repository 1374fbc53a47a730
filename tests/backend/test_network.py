"""gj.time_per_step and gj.simulated_seconds: each pattern's seconds against the hand computation.

The figures are chosen so that a slip fails: n = 8 nodes (n and n - 1 differ by 1/7), a
bandwidth of 1000 bytes/s written as 8kbit (bits vs bytes differ by 8), and latency and
transfer of one message of the same order (0.01 s and 0.2 s).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T
from gossipjax.backend._traffic import Exchange, Traffic, counting, each_step

N, D = 8, 50
M = D * 4  # one node's float32 model, in bytes
BANDWIDTH, LATENCY = 1000.0, 0.01  # bytes per second, seconds
NET = gj.network("8kbit,10ms")
MESSAGE = LATENCY + M / BANDWIDTH  # one model over one link: 0.21 s
RING_ALLREDUCE = 2 * (N - 1) * (LATENCY + M / (N * BANDWIDTH))  # 14 * 0.035 = 0.49 s


def params():
  return jnp.zeros((N, D), jnp.float32)


def test_the_parsed_network_is_the_one_written():
  assert NET == gj.Network(bandwidth=BANDWIDTH, latency=LATENCY)
  assert gj.network("1e3,0.01") == NET  # bare numbers: bytes per second, seconds
  assert gj.network("1kB/s, 10000us") == NET
  assert gj.network("1Gbps,50ms", parallel=False) == gj.Network(1.25e8, 0.05, parallel=False)
  assert gj.network("2GB,1s").bandwidth == 2e9
  assert gj.network("cross_region") == gj.NETWORKS["cross_region"] == gj.Network(0.79e9 / 8, 0.067)
  assert gj.network("datacenter", parallel=False).parallel is False
  assert gj.NETWORKS["infiniband"].bandwidth == 50e9  # 400 Gbit/s
  assert list(gj.NETWORKS) == ["infiniband", "datacenter", "regional", "cross_region", "internet"]


@pytest.mark.parametrize("spec", ["", "lan", "1Gbit", "1Gbit,", "1Gbit,5ms,2", "10G,5ms", "1Gbyte,5ms", "x,5ms",
                                  "1Gbit,5min", "0,5ms", "1Gbit,-1", None])
def test_a_bad_network_string_is_refused_in_one_line_naming_the_forms(spec):
  with pytest.raises(ValueError, match="gj.network: expected a preset") as e:
    gj.network(spec)
  message = str(e.value)
  assert "\n" not in message and "cross_region" in message and "BANDWIDTH,LATENCY" in message
  assert "Gbit" in message and "ms" in message and repr(spec) in message


def test_a_network_checks_its_figures():
  with pytest.raises(ValueError, match="bandwidth must be > 0"):
    gj.Network(bandwidth=0.0, latency=0.0)
  with pytest.raises(ValueError, match="latency must be finite"):
    gj.Network(bandwidth=1.0, latency=float("inf"))
  assert gj.Network(bandwidth=float("inf"), latency=0.0).bandwidth == float("inf")
  with pytest.raises(ValueError, match="step_time"):
    gj.time_per_step(gj.allreduce_sgd(learning_rate=0.1), params(), NET, step_time=-1.0)


def test_gossip_on_a_ring_is_one_message_time_in_parallel_and_two_in_sequence():
  tx = gj.gossip_sgd(T.ring(N), learning_rate=0.1)
  sequential = gj.Network(BANDWIDTH, LATENCY, parallel=False)
  np.testing.assert_allclose(gj.time_per_step(tx, params(), NET, 0.5, steps=2), [0.5 + MESSAGE] * 2)
  np.testing.assert_allclose(gj.time_per_step(tx, params(), sequential, 0.5), [0.5 + 2 * MESSAGE])
  np.testing.assert_allclose([0.5 + MESSAGE, 0.5 + 2 * MESSAGE], [0.71, 0.92])


def test_one_peer_exponential_sends_one_message_either_way():
  tx = gj.gossip_sgd(T.one_peer_exponential(N), learning_rate=0.1)
  for parallel in (True, False):
    net = gj.Network(BANDWIDTH, LATENCY, parallel=parallel)
    np.testing.assert_allclose(gj.time_per_step(tx, params(), net, 0.5, steps=3), [0.5 + MESSAGE] * 3)


def test_an_all_reduce_is_the_rings_two_n_minus_one_rounds_of_a_chunk():
  tx = gj.allreduce_sgd(learning_rate=0.1)
  np.testing.assert_allclose(gj.time_per_step(tx, params(), NET, 0.5, steps=2), [0.5 + RING_ALLREDUCE] * 2)
  np.testing.assert_allclose(RING_ALLREDUCE, 0.49)


def test_diloco_computes_for_h_minus_one_steps_then_all_reduces():
  tx = gj.diloco(optax.sgd(0.1), inner_steps=3)
  np.testing.assert_allclose(gj.time_per_step(tx, params(), NET, 0.5, steps=6),
                             [0.5, 0.5, 0.5 + RING_ALLREDUCE, 0.5, 0.5, 0.5 + RING_ALLREDUCE])


def _streaming(overlap):
  """Two fragments of one model each (leaves a and b), H = 4: fragment a syncs at step 1, b at step 3."""
  return gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=4, overlap=overlap)


def test_streaming_diloco_hides_its_exchange_behind_the_overlapped_steps():
  x = {"a": params(), "b": params()}
  # tau = 1 step of 1 s hides the 0.49 s all-reduce of a fragment entirely.
  np.testing.assert_allclose(gj.time_per_step(_streaming(1), x, NET, 1.0, steps=4), [1.0] * 4)
  # tau = 1 step of 0.2 s hides only 0.2 s of it: 0.29 s are exposed, at the sync step.
  exposed = RING_ALLREDUCE - 0.2
  np.testing.assert_allclose(gj.time_per_step(_streaming(1), x, NET, 0.2, steps=4),
                             [0.2, 0.2 + exposed, 0.2, 0.2 + exposed])
  # Without overlap the whole exchange is exposed, as DiLoCo's.
  np.testing.assert_allclose(gj.time_per_step(_streaming(0), x, NET, 0.2, steps=4),
                             [0.2, 0.2 + RING_ALLREDUCE, 0.2, 0.2 + RING_ALLREDUCE])


def test_the_collectives_and_overlap_from_hand_made_events():
  gather = Exchange("all_gather", 100.0, messages=N - 1, num_nodes=N)  # (n - 1)(latency + part / bandwidth)
  pieces = Exchange("all_to_all", 30.0, messages=N - 1, num_nodes=N)
  gossip = Exchange("gossip", 200.0, messages=3, num_nodes=N, out_degree=3, overlap=2)
  assert gj.simulated_seconds({gather: 1}, NET, 0.0, steps=1) == pytest.approx(7 * 0.11)
  assert gj.simulated_seconds({pieces: 2}, NET, 0.0, steps=1) == pytest.approx(2 * 7 * 0.04)
  # Each exchange exposed past its overlap: 3 * 0.21 in sequence, less 2 steps of 0.1 s.
  sequential = gj.Network(BANDWIDTH, LATENCY, parallel=False)
  assert gj.simulated_seconds({gossip: 1}, sequential, 0.1, steps=5) == pytest.approx(0.5 + 0.63 - 0.2)
  assert gj.simulated_seconds({gossip: 1}, NET, 0.2, steps=5) == pytest.approx(1.0)  # 0.21 < 0.4: hidden
  assert gj.simulated_seconds({}, NET, 0.25, steps=4) == 1.0


def test_a_training_loops_chunks_drain_the_count_and_keep_the_total():
  tx = gj.gossip_sgd(T.ring(N), learning_rate=0.1)
  x, traffic = params(), Traffic()
  state = tx.init(x)
  step = jax.jit(lambda x, s: tx.update(x, s, x))
  with counting(traffic):
    for _ in range(3):
      _, state = step(x, state)
    jax.effects_barrier()
    first = traffic.drain()
    _, state = step(x, state)
    jax.effects_barrier()
  assert first == {Exchange("gossip", float(M), 2 * N, N, out_degree=2): 3}
  assert gj.simulated_seconds(first, NET, 0.5, steps=3) == pytest.approx(3 * (0.5 + MESSAGE))
  assert sum(traffic.events.values()) == 1 and traffic.drain() and not traffic.events
  assert traffic.total == 4 * 2 * N * M  # the bytes count on, as gj.bytes_per_step's


def test_streaming_diloco_overlaps_its_compressed_exchanges_too():
  """With a compressor the fragment travels in an all-to-all and an all-gather of compact pieces, both overlapped."""
  tx = gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=4, overlap=1, compressor=gj.compress.qsgd(7))
  steps = each_step(tx, {"a": params(), "b": params()}, 2)
  assert not steps[0][1] and {(e.kind, e.overlap) for e in steps[1][1]} == {("all_to_all", 1), ("all_gather", 1)}
  assert gj.simulated_seconds(steps[1][1], NET, 100.0, steps=1) == 100.0
  assert gj.simulated_seconds(steps[1][1], NET, 0.0, steps=1) > 2 * (N - 1) * LATENCY
