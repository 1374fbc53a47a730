"""The simulated-time asynchrony tools held against plain NumPy event loops and invariants."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import asynchrony as ga

D = 3


def one_sample_problem(n, seed=0):
  """Node i holds one sample (a_i, b_i): its minibatch is always that sample, so runs are
  deterministic up to peer choice, and f_i(x) = 0.5 (a_i . x - b_i)^2."""
  rng = np.random.default_rng(seed)
  a, b = rng.normal(size=(n, D)), rng.normal(size=n) + np.arange(n)
  data = gj.data.node_data(a, b, [np.array([i]) for i in range(n)])

  def loss_fn(x, batch):
    ai, bi = batch
    return 0.5 * jnp.mean((ai @ x["w"] - bi) ** 2)

  return a, b, data, loss_fn


def least_squares_problem(n, m=40, seed=0):
  rng = np.random.default_rng(seed)
  x_true = rng.normal(size=D)
  a = rng.normal(size=(n * m, D))
  b = a @ x_true + 0.1 * rng.normal(size=n * m)
  data = gj.data.node_data(a, b, gj.data.partition_iid(b, n, seed=seed))

  def loss_fn(x, batch):
    ai, bi = batch
    return 0.5 * jnp.mean((ai @ x["w"] - bi) ** 2)

  full = lambda x: float(np.mean((a @ np.asarray(x) - b) ** 2) / 2)
  return data, loss_fn, full


def stacked(n, value=0.0):
  return {"w": jnp.full((n, D), value)}


def test_cluster_models():
  c = ga.straggler_cluster(4, 10.0, node=2, base_time=0.5, jitter=0.3, latency=0.01, bandwidth=100.0)
  np.testing.assert_allclose(c.mean_time, [0.5, 0.5, 5.0, 0.5])
  draws = jax.vmap(lambda k: ga.compute_time(c, k))(jax.random.split(jax.random.key(0), 4000))
  np.testing.assert_allclose(draws.mean(0), c.mean_time, rtol=0.03)  # log-normal with unit mean
  assert float(ga.transfer_time(c, 50.0)) == pytest.approx(0.51)
  assert float(ga.allreduce_time(c, 400.0)) == pytest.approx(2 * 3 * (0.01 + 1.0))
  with pytest.raises(ValueError):
    ga.cluster(4, slowdown=[1, 2, 0, 1])


def adpsgd_numpy(a, b, speeds, comm, lr, num_events):
  """AD-PSGD as a plain event loop; node i's only peer is i ^ 1 (pairs 0-1, 2-3)."""
  n = len(speeds)
  x, read = np.zeros((n, D)), np.zeros((n, D))
  finish = np.array(speeds) + comm
  for _ in range(num_events):
    i = int(np.argmin(finish))
    g = a[i] * (a[i] @ read[i] - b[i])  # the gradient at the model read at the start: stale
    j = i ^ 1
    avg = 0.5 * (x[i] + x[j])
    x[j] = avg
    x[i] = avg - lr * g
    read[i] = x[i]
    finish[i] += speeds[i] + comm
  return x, finish


def test_adpsgd_matches_numpy_event_loop():
  n, lr, comm = 4, 0.1, 0.05
  a, b, data, loss_fn = one_sample_problem(n)
  speeds = [1.0, 1.37, 2.9, 0.61]
  pairs = gj.topology.from_matrix(np.kron(np.eye(2), np.full((2, 2), 0.5)))
  c = ga.cluster(n, slowdown=speeds, latency=comm)
  sim = ga.adpsgd(loss_fn, data, c, pairs, learning_rate=lr, batch_size=1)
  state = sim.run(sim.init(stacked(n), jax.random.key(0)), 50)
  x_ref, finish_ref = adpsgd_numpy(a, b, speeds, comm, lr, 50)
  np.testing.assert_allclose(state.params["w"], x_ref, atol=1e-12)
  np.testing.assert_allclose(state.next_finish, finish_ref, atol=1e-12)
  assert int(state.events) == 50 and int(state.averages) == 50 and int(state.samples) == 50


def test_adpsgd_straggler_does_not_hold_back_and_its_stale_gradient_is_harmless():
  n, slow = 8, 1000.0
  data, loss_fn, full = least_squares_problem(n)
  c = ga.straggler_cluster(n, slow, latency=0.01)
  sim = ga.adpsgd(loss_fn, data, c, learning_rate=0.05, batch_size=4)
  x0 = stacked(n, 0.0)
  state = sim.init(x0, jax.random.key(1))
  state = sim.run(state, 7 * 900)  # 900 events per fast node: the straggler is not done yet
  assert int(state.counts[0]) == 0 and int(state.counts[1:].min()) == 900
  # one fast node's cycle is 1.01 s: the clock ran at the fast nodes' pace
  assert float(state.clock) == pytest.approx(900 * 1.01, rel=1e-9)
  before = full(gj.node_mean(state.params)["w"])
  while int(state.counts[0]) == 0:
    state = sim.run(state, 1)
  after = full(gj.node_mean(state.params)["w"])
  # its gradient was taken at x = 0, ~7000 updates ago; applied now it moves the mean by lr/n
  assert before < 0.2 * full(np.zeros(D))
  assert after < before * 1.05 + 1e-3
  assert np.isfinite(state.params["w"]).all()


def test_adpsgd_faults_dropout_rejoin_and_lost_messages():
  n = 6
  data, loss_fn, full = least_squares_problem(n)
  f = ga.faults(down=[(2, 20.0, 60.0)], loss_prob=0.3)
  c = ga.cluster(n, jitter=0.2)
  sim = ga.adpsgd(loss_fn, data, c, learning_rate=0.05, batch_size=4, faults=f)
  state = sim.run(sim.init(stacked(n), jax.random.key(2)), 200)
  assert 20.0 < float(state.clock) < 45.0
  frozen = np.asarray(state.params["w"][2])
  count_down = int(state.counts[2])
  state = sim.run(state, 60)
  assert float(state.clock) < 60.0
  np.testing.assert_array_equal(state.params["w"][2], frozen)  # down: no one averages with it
  assert int(state.counts[2]) == count_down
  state = sim.run(state, 600)
  assert float(state.clock) > 80.0 and int(state.counts[2]) > count_down + 5  # rejoined
  assert int(state.lost) > 0.2 * int(state.averages)
  assert np.isfinite(state.params["w"]).all()
  assert full(gj.node_mean(state.params)["w"]) < 0.2 * full(np.zeros(D))
  assert float(gj.consensus_distance(state.params)) < 1e-2


def test_adpsgd_pair_averages_conserve_the_sum_under_losses():
  n = 5
  _, _, data, loss_fn = one_sample_problem(n)
  f = ga.faults(down=[(1, 0.0, 5.0), (3, 2.0, 4.0)], loss_prob=0.4)
  sim = ga.adpsgd(loss_fn, data, ga.cluster(n, jitter=0.5), learning_rate=0.0, batch_size=1, faults=f)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  state = sim.run(sim.init(x0, jax.random.key(3)), 400)
  np.testing.assert_allclose(state.params["w"].sum(0), x0["w"].sum(0), atol=1e-12)
  assert float(gj.consensus_distance(state.params)) < 1e-6 * float(gj.consensus_distance(x0))


def test_adpsgd_event_queue_is_argmin_under_ties():
  from gossipjax.asynchrony._simulator import _EventQueue

  rng = np.random.default_rng(0)
  for n in (1, 2, 5, 8, 13):
    finish = jnp.asarray(rng.integers(0, 4, n).astype(float))  # many ties: the lowest index must win
    queue, update = _EventQueue.build(finish), jax.jit(_EventQueue.update)
    for _ in range(40):
      assert int(queue.node) == int(jnp.argmin(finish)) and float(queue.time) == float(finish.min())
      i, t = queue.node, finish[queue.node] + float(rng.integers(0, 3))
      finish = finish.at[i].set(t)
      queue = update(queue, finish, i, t)


def test_adpsgd_event_cost_does_not_grow_with_n():
  # 131,072 nodes of 64 floats: a dense n x n peer mask alone would be 16 GiB, and an
  # event that copies the (n, d) params (64 MiB) would make these 20,000 events take
  # minutes; an event that touches only its two nodes takes a fraction of a second.
  n, d, events = 131072, 64, 20000
  rng = np.random.default_rng(0)
  data = gj.data.node_data(rng.normal(size=(n, d)), rng.normal(size=n), np.arange(n)[:, None])
  loss_fn = lambda x, batch: 0.5 * jnp.mean((batch[0] @ x - batch[1]) ** 2)
  sim = ga.adpsgd(loss_fn, data, ga.cluster(n, jitter=0.3), learning_rate=0.1, batch_size=1)
  t0 = time.perf_counter()
  state = sim.run(sim.init(jnp.zeros((n, d)), jax.random.key(0)), events)
  jax.block_until_ready(state)
  assert time.perf_counter() - t0 < 30.0  # compile included
  assert int(state.events) == events and int(state.averages) == events
  assert np.isfinite(state.params).all()


def test_adpsgd_peers_come_from_the_sparse_plans():
  n = 64
  _, _, data, loss_fn = one_sample_problem(n)
  sim = ga.adpsgd(loss_fn, data, ga.cluster(n, jitter=0.5), gj.topology.ring(n), learning_rate=0.0, batch_size=1)
  x0 = {"w": jnp.asarray(np.eye(n)[:, :D])}  # node i holds e_i (i < 3): mass moves along ring edges only
  state = sim.run(sim.init(x0, jax.random.key(0)), 3)
  w = np.asarray(state.params["w"])
  for k in range(D):
    reached = np.flatnonzero(w[:, k])
    assert np.all(np.minimum(np.abs(reached - k), n - np.abs(reached - k)) <= 3)
  np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)


def test_synchronous_round_is_the_slowest_node():
  n, comm = 8, 0.3
  data, loss_fn, full = least_squares_problem(n)
  c = ga.straggler_cluster(n, 10.0)
  sim = ga.synchronous(loss_fn, data, c, gj.gossip_sgd(gj.topology.ring(n), learning_rate=0.1), 4, comm_time=comm)
  state = sim.run(sim.init(stacked(n), jax.random.key(0)), 100)
  assert float(state.clock) == pytest.approx(100 * (10.0 + comm))
  assert int(state.samples) == 100 * n * 4
  assert full(gj.node_mean(state.params)["w"]) < 0.05 * full(np.zeros(D))


def test_renormalize_rows_and_live_average():
  n = 6
  w = jnp.asarray(gj.topology.torus(2, 3).matrix(0))
  up = jnp.array([True, True, False, True, True, True])
  delivered = ga.delivered_mask(ga.faults(loss_prob=0.5), jax.random.key(0), n)
  wp = ga.renormalize(w, up, delivered)
  np.testing.assert_allclose(wp.sum(1), 1.0, atol=1e-14)
  assert (wp >= 0).all()
  np.testing.assert_array_equal(wp[2], np.eye(n)[2])  # a down node only keeps its own
  np.testing.assert_array_equal(wp[:, 2], np.eye(n)[2])  # and nobody receives from it
  # symmetric W, symmetric losses: doubly stochastic, so the average of the live nodes is kept
  np.testing.assert_allclose(wp.sum(0), 1.0, atol=1e-14)


def test_faulty_mix_without_faults_is_gossip_sgd_and_freezes_down_nodes():
  n = 6
  topo = gj.topology.ring(n)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))
  g = jnp.asarray(np.random.default_rng(1).normal(size=(n, D)))
  ref = gj.gossip_sgd(topo, learning_rate=0.1)
  tx = optax.chain(optax.scale_by_learning_rate(0.1), ga.faulty_mix(topo))
  u_ref, _ = ref.update(g, ref.init(x), x)
  u, _ = tx.update(g, tx.init(x), x)
  np.testing.assert_allclose(u, u_ref, atol=1e-14)
  up = jnp.arange(n) != 4
  u, _ = tx.update(g, tx.init(x), x, up=up, delivered=jnp.ones((n, n), bool))
  np.testing.assert_array_equal(u[4], 0.0)
  u, _ = tx.update(g, tx.init(x), x, up=up, loss_key=jax.random.key(0), loss_prob=0.0)
  np.testing.assert_array_equal(u[4], 0.0)


@pytest.mark.parametrize("topo", [gj.topology.torus(3, 4), gj.topology.one_peer_exponential(12),
                                  gj.topology.erdos_renyi(12, 0.4, seed=1)], ids=lambda t: t.name)
def test_faulty_mix_on_the_plans_is_the_dense_renormalized_rule(topo):
  n = topo.num_nodes
  rng = np.random.default_rng(0)
  x, g = (jnp.asarray(rng.normal(size=(n, D))) for _ in range(2))
  f = ga.faults(down=[(2, 0.0, 10.0), (7, 5.0, 6.0)], loss_prob=0.3)
  tx = ga.faulty_mix(topo)
  state = tx.init(x)
  for step in range(2 * topo.period):
    key = jax.random.key(step)
    up = ga.is_up(f, float(step), n)
    np.testing.assert_array_equal(up, [i != 2 and not (i == 7 and step == 5) for i in range(n)])
    w = ga.renormalize(jnp.asarray(topo.matrix(step)), up, ga.delivered_mask(f, key, n))
    u, state = tx.update(g, state, x, up=up, loss_key=key, loss_prob=f.loss_prob)
    want = w @ (x + jnp.where(up[:, None], g, 0.0)) - x
    np.testing.assert_allclose(u, want, atol=1e-13)
    dense, _ = tx.update(g, tx.init(x), x, up=up, delivered=ga.delivered_mask(f, key, n))
    if step == 0:
      np.testing.assert_allclose(dense, want, atol=1e-13)


def test_faulty_mix_sums_bfloat16_in_float32_and_leaves_integer_leaves_alone():
  """From x = 0 the update is the mixed value itself: W' u summed in float32 and rounded once."""
  n, topo = 16, gj.topology.ring(16)  # weight 1/3, which bfloat16 would round to 0.33398
  f = ga.faults(down=[(3, 0.0, 1.0)], loss_prob=0.3)
  up, delivered = ga.is_up(f, 0.5, n), ga.delivered_mask(f, jax.random.key(0), n)
  rng = np.random.default_rng(0)
  u32 = jnp.asarray(1 + rng.normal(size=(n, 64)), jnp.float32)
  u16 = u32.astype(jnp.bfloat16)
  counts = jnp.arange(n, dtype=jnp.int32)
  tx = ga.faulty_mix(topo)

  @jax.jit
  def mixed(u, count_update):
    params = {"w": jnp.zeros_like(u), "count": counts}
    got, _ = tx.update({"w": u, "count": count_update}, tx.init(params), params, up=up, delivered=delivered)
    return got

  got = mixed(u16, jnp.zeros(n, jnp.int32))
  assert got["w"].dtype == jnp.bfloat16
  # The same float32 computation, rounded once, to the bit.
  np.testing.assert_array_equal(got["w"], mixed(u16.astype(jnp.float32), jnp.zeros(n, jnp.int32))["w"].astype(jnp.bfloat16))
  # Within half a unit in the last place of the exact W' u (a bfloat16 sum is not).
  exact = np.asarray(ga.renormalize(jnp.asarray(topo.matrix(0)), up, delivered)) @ np.where(
      np.asarray(up)[:, None], np.asarray(u16, np.float64), 0.0)
  live = np.asarray(up)
  np.testing.assert_array_equal(got["w"][~live], 0.0)  # down: x = 0 kept
  ulp = 2.0 ** (np.floor(np.log2(np.abs(exact[live]))) - 7)
  assert np.max(np.abs(np.asarray(got["w"], np.float64)[live] - exact[live]) / ulp) <= 0.5 + 1e-3
  np.testing.assert_array_equal(got["count"], np.zeros(n))  # not mixed: its update passes through
  np.testing.assert_array_equal(mixed(u16, counts)["count"], counts)


def test_delivered_edges_draws_one_number_per_link_and_loses_both_directions():
  f = ga.faults(loss_prob=0.5)
  key = jax.random.key(0)
  m = np.asarray(ga.delivered_mask(f, key, 40))
  np.testing.assert_array_equal(m, m.T)
  assert m.diagonal().all() and 0.4 < 1 - m.mean() < 0.6
  dst, src = np.array([3, 17, 39]), np.array([9, 2, 0])
  np.testing.assert_array_equal(ga.delivered_edges(f, key, dst, src), m[dst, src])
  one_way = np.asarray(ga.delivered_mask(f, key, 40, symmetric=False))
  assert (one_way != one_way.T).any()


def test_faulty_mix_step_is_linear_in_n():
  # 262,144 nodes on a ring: the dense W alone would be 512 GiB; on the plans a step is two
  # gathers and one random draw per link.
  n = 262144
  topo = gj.topology.ring(n)
  f = ga.faults(down=[(5, 0.0, 1.0)], loss_prob=0.2)
  tx = ga.faulty_mix(topo)
  x = jnp.ones((n, 4))
  step = jax.jit(lambda x, key: tx.update(x, tx.init(x), x, up=ga.is_up(f, 0.5, n), loss_key=key,
                                          loss_prob=f.loss_prob)[0])
  t0 = time.perf_counter()
  u = jax.block_until_ready(step(x, jax.random.key(0)))
  assert time.perf_counter() - t0 < 20.0
  np.testing.assert_allclose(u[5], 0.0)  # down: frozen
  live = np.arange(n) != 5
  np.testing.assert_allclose(u[live], 1.0, atol=1e-12)  # live nodes average only twos (ones plus ones)


def test_synchronous_dpsgd_with_faults_keeps_training():
  n = 8
  data, loss_fn, full = least_squares_problem(n)
  f = ga.faults(down=[(3, 10.0, 40.0), (5, 0.0, 200.0)], loss_prob=0.2)  # node 5 never returns
  tx = optax.chain(optax.scale_by_learning_rate(0.05), ga.faulty_mix(gj.topology.ring(n)))
  sim = ga.synchronous(loss_fn, data, ga.cluster(n, jitter=0.1), tx, 4, faults=f)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  state = sim.run(sim.init(x0, jax.random.key(0)), 150)
  np.testing.assert_array_equal(state.params["w"][5], x0["w"][5])  # down the whole time
  live = {"w": jnp.delete(state.params["w"], 5, axis=0)}
  assert np.isfinite(state.params["w"]).all()
  assert float(gj.consensus_distance(live)) < 1e-3 * float(gj.consensus_distance(x0))
  assert full(gj.node_mean(live)["w"]) < 0.1 * full(np.zeros(D))


def test_sgp_with_tau_0_and_no_delay_is_gj_sgp():
  n, lr, steps = 8, 0.1, 20
  _, _, data, loss_fn = one_sample_problem(n)
  topo = gj.topology.one_peer_directed_exponential(n)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  sim = ga.sgp_bounded_staleness(loss_fn, data, ga.cluster(n, jitter=0.3), topo, learning_rate=lr, batch_size=1,
                                 tau=0)
  state = sim.run(sim.init(x0, jax.random.key(0)), steps)
  tx = gj.sgp(topo, learning_rate=lr)
  x, opt = x0, tx.init(x0)
  grad = jax.vmap(jax.grad(loss_fn))

  @jax.jit
  def step(x, opt):
    u, opt = tx.update(grad(x, (data.inputs[:, None], data.targets[:, None])), opt, x)
    return optax.apply_updates(x, u), opt

  for _ in range(steps):
    x, opt = step(x, opt)
  np.testing.assert_allclose(ga.sgp_params(state)["w"], x["w"], atol=1e-12)
  coef = jnp.where(state.pending, state.share, 0.0)
  in_flight = coef * jax.vmap(lambda w, src: w[src])(state.sent_w, state.source)
  np.testing.assert_allclose(state.w + in_flight.sum((0, 1)), opt.push_weight, atol=1e-12)


def test_sgp_staleness_hides_a_slow_link_and_stays_exact():
  n = 8
  topo = gj.topology.one_peer_directed_exponential(n)
  slow_link = np.ones((n, n))
  slow_link[:, 0] = 3.0  # node 0's outgoing links are 3x slower than a step
  c = ga.cluster(n, latency=1.0)  # a message takes as long as a gradient
  data, loss_fn, full = least_squares_problem(n)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  times, states = {}, {}
  for tau in (0, 4):
    sim = ga.sgp_bounded_staleness(loss_fn, data, c, topo, learning_rate=0.05, batch_size=4, tau=tau,
                                   link_slowdown=slow_link)
    states[tau] = sim.run(sim.init(x0, jax.random.key(0)), 200)
    times[tau] = float(states[tau].clock)
  assert times[0] > 2 * 200  # every 1 s step waits for a message of 1 s (or 3 s) after it
  assert times[4] < 1.1 * 200  # overlap: the messages travel while nodes compute
  assert int(states[4].late) > 0 and int(states[0].late) == 0
  assert float(states[4].waited) < 0.2 * float(states[0].waited)
  for s in states.values():
    x = ga.sgp_params(s)
    assert full(gj.node_mean(x)["w"]) < 0.1 * full(np.zeros(D))
  # learning rate 0: push-sum with late messages still reaches the exact average
  sim = ga.sgp_bounded_staleness(loss_fn, data, c, topo, learning_rate=0.0, batch_size=4, tau=3,
                                 link_slowdown=slow_link)
  s = sim.run(sim.init(x0, jax.random.key(0)), 150)
  np.testing.assert_allclose(ga.sgp_params(s)["w"], np.broadcast_to(x0["w"].mean(0), (n, D)), atol=1e-6)


def sgp_dense_reference(loss_fn, data, c, topo, lr, batch_size, tau, link, x0, key, steps):
  """SGP with bounded staleness on dense (slots, n, n) message tables, in NumPy: the rule as
  written in the simulator's docstring (same random draws)."""
  n, slots = topo.num_nodes, tau + 1
  grad = jax.vmap(jax.grad(loss_fn))
  z, w, start = np.array(x0["w"]), np.ones(n), np.zeros(n)
  sent_z, sent_w = np.zeros((slots, n, D)), np.zeros((slots, n))
  share, arrival, pending = np.zeros((slots, n, n)), np.zeros((slots, n, n)), np.zeros((slots, n, n), bool)
  waited, late = 0.0, 0
  for k in range(steps):
    key, k_batch, k_time = jax.random.split(key, 3)
    for slot in range(slots):
      sent = k - 1 - ((k - 1 - slot) % slots)
      deliver = pending[slot] & ((arrival[slot] <= start[:, None]) | (sent == k - 1 - tau))
      late += int((deliver & (sent < k - 1)).sum())
      coef = np.where(deliver, share[slot], 0.0)
      z, w = z + coef @ sent_z[slot], w + coef @ sent_w[slot]
      pending[slot] &= ~deliver
    g = np.asarray(grad({"w": jnp.asarray(z / w[:, None])}, gj.data.sample_batches(data, k_batch, batch_size))["w"])
    finish = start + np.asarray(ga.compute_time(c, k_time))
    p, slot = topo.matrix(k), k % slots
    z_half = z - lr * g
    pending[slot], arrival[slot], share[slot] = (p != 0) & ~np.eye(n, dtype=bool), finish[None, :] + link, p
    sent_z[slot], sent_w[slot] = z_half, w
    z, w = z_half * np.diag(p)[:, None], w * np.diag(p)
    must = pending[(k - tau) % slots] & (k - tau >= 0)
    start_next = np.maximum(finish, np.where(must, arrival[(k - tau) % slots], -np.inf).max(axis=1))
    waited += float((start_next - finish).sum())
    start = start_next
  return z, w, start, waited, late


@pytest.mark.parametrize("tau", [1, 3])
def test_sgp_on_the_plans_matches_the_dense_rule(tau):
  n, steps = 8, 30
  topo = gj.topology.one_peer_directed_exponential(n)
  data, loss_fn, _ = least_squares_problem(n)
  slow = np.ones((n, n))
  slow[:, 2] = 2.5
  c = ga.cluster(n, jitter=0.4, latency=0.7)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  sim = ga.sgp_bounded_staleness(loss_fn, data, c, topo, learning_rate=0.05, batch_size=4, tau=tau,
                                   link_slowdown=slow)
  state = sim.run(sim.init(x0, jax.random.key(5)), steps)
  z, w, start, waited, late = sgp_dense_reference(loss_fn, data, c, topo, 0.05, 4, tau, 0.7 * slow, x0,
                                                  jax.random.key(5), steps)
  np.testing.assert_allclose(state.z["w"], z, atol=1e-12)
  np.testing.assert_allclose(state.w, w, atol=1e-12)
  np.testing.assert_allclose(state.start, start, atol=1e-12)
  assert float(state.waited) == pytest.approx(waited) and int(state.late) == late > 0


def test_sgp_step_is_linear_in_n():
  # 65,536 nodes: the dense (tau + 1, n, n) tables alone would be 3 x 64 GiB.
  n = 65536
  data, loss_fn, _ = least_squares_problem(n, m=1)
  sim = ga.sgp_bounded_staleness(loss_fn, data, ga.cluster(n, jitter=0.3, latency=0.5),
                                 gj.topology.one_peer_directed_exponential(n), learning_rate=0.05, batch_size=1,
                                 tau=2)
  t0 = time.perf_counter()
  state = jax.block_until_ready(sim.run(sim.init(stacked(n), jax.random.key(0)), 5))
  assert time.perf_counter() - t0 < 30.0
  in_flight = jnp.where(state.pending, state.share, 0.0) * jax.vmap(lambda w, src: w[src])(state.sent_w, state.source)
  assert float(state.w.sum() + in_flight.sum()) == pytest.approx(n)  # push-sum conserves the weight
  assert np.isfinite(ga.sgp_params(state)["w"]).all()


def test_a_round_with_every_node_down_waits_for_the_first_to_return():
  n = 4
  _, _, data, loss_fn = one_sample_problem(n)
  f = ga.faults(down=[(i, 0.0, 5.0 + i) for i in range(n)])  # all down at first; node 0 back at 5
  tx = optax.chain(optax.scale_by_learning_rate(0.1), ga.faulty_mix(gj.topology.ring(n)))
  sim = ga.synchronous(loss_fn, data, ga.cluster(n), tx, 1, faults=f)
  x0 = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(n, D)))}
  state = sim.run(sim.init(x0, jax.random.key(0)), 1)
  assert (int(state.rounds), float(state.clock), int(state.samples)) == (1, 5.0, 0)
  np.testing.assert_array_equal(state.params["w"], x0["w"])  # nobody computed, nobody mixed
  state = sim.run(sim.run(state, 1), 1)  # node 0 alone, then node 0 and node 1 (back at 6)
  assert (int(state.rounds), float(state.clock), int(state.samples)) == (3, 7.0, 3)


@pytest.mark.parametrize("method", ["adpsgd", "synchronous"])
def test_a_run_in_which_no_node_can_ever_compute_stops_and_says_so(method):
  n = 4
  _, _, data, loss_fn = one_sample_problem(n)
  f = ga.faults(down=[(i, 0.5, float("inf")) for i in range(n)])  # every node down for good at 0.5
  if method == "adpsgd":
    sim = ga.adpsgd(loss_fn, data, ga.cluster(n), learning_rate=0.1, batch_size=1, faults=f)
  else:
    tx = optax.chain(optax.scale_by_learning_rate(0.1), ga.faulty_mix(gj.topology.ring(n)))
    sim = ga.synchronous(loss_fn, data, ga.cluster(n), tx, 1, faults=f)
  state = sim.init(stacked(n, 1.0), jax.random.key(0))
  with pytest.warns(RuntimeWarning, match=r"no node can compute after simulated time 1: every node is down for good"):
    state = sim.run(state, 40)
  if method == "adpsgd":  # each node's first gradient overlapped its outage: lost
    assert (int(state.events), float(state.clock)) == (0, 1.0)
  else:  # one round (0 to 1, every node up at its start), then nothing
    assert (int(state.rounds), float(state.clock), int(state.samples)) == (1, 1.0, n)
  assert np.isfinite(state.params["w"]).all()


def test_simulators_check_node_counts_against_each_other():
  _, _, data4, loss_fn = one_sample_problem(4)
  tx = optax.chain(optax.scale_by_learning_rate(0.1), ga.faulty_mix(gj.topology.ring(4)))
  adpsgd = lambda data, c, **kw: ga.adpsgd(loss_fn, data, c, learning_rate=0.1, batch_size=1, **kw)
  sync = lambda data, c, **kw: ga.synchronous(loss_fn, data, c, tx, 1, **kw)
  sgp = lambda data, c, topo: ga.sgp_bounded_staleness(loss_fn, data, c, topo, learning_rate=0.1, batch_size=1)
  for build in (adpsgd, sync):
    with pytest.raises(ValueError, match="data has 4 nodes, cluster 8"):
      build(data4, ga.cluster(8))
    with pytest.raises(ValueError, match=r"the faults name node\(s\) \[7\], but the cluster has 4 nodes"):
      build(data4, ga.cluster(4), faults=ga.faults(down=[(7, 0.0, 1.0)]))
  with pytest.raises(ValueError, match="adpsgd: the topology has 8 nodes, the cluster 4"):
    adpsgd(data4, ga.cluster(4), topology=gj.topology.ring(8))
  with pytest.raises(ValueError, match="sgp_bounded_staleness: the topology has 8 nodes, the cluster 4"):
    sgp(data4, ga.cluster(4), gj.topology.one_peer_directed_exponential(8))
  for sim in (adpsgd(data4, ga.cluster(4)), sync(data4, ga.cluster(4)),
              sgp(data4, ga.cluster(4), gj.topology.one_peer_directed_exponential(4))):
    for rows in (3, 6):
      with pytest.raises(ValueError, match=rf"params\['w'\] has a leading node axis of {rows}, but the cluster of 4"):
        sim.init(stacked(rows), jax.random.key(0))


def test_timings_must_be_finite_and_non_negative():
  nan, inf = float("nan"), float("inf")
  for kwargs, message in (({"jitter": nan}, "jitter must be finite"), ({"latency": inf}, "latency must be finite"),
                          ({"base_time": nan}, "base_time and every slowdown must be finite and positive"),
                          ({"slowdown": [1.0, nan, 1.0, 1.0]}, "every slowdown must be finite"),
                          ({"slowdown": [1.0, 2.0]}, r"slowdown must be one number or 4 \(one per node\)"),
                          ({"bandwidth": nan}, "bandwidth must be > 0")):
    with pytest.raises(ValueError, match=message):
      ga.cluster(4, **kwargs)
  with pytest.raises(ValueError, match="not NaN"):
    ga.faults(down=[(1, 0.0, nan)])
  with pytest.raises(ValueError, match=r"node must be a non-negative integer, got \[2.5\]"):
    ga.faults(down=[(2.5, 0.0, 1.0)])
  _, _, data, loss_fn = one_sample_problem(4)
  tx = optax.scale_by_learning_rate(0.1)
  with pytest.raises(ValueError, match="comm_time must be a finite number >= 0"):
    ga.synchronous(loss_fn, data, ga.cluster(4), tx, 1, comm_time=nan)
  with pytest.raises(ValueError, match="model_bytes must be a finite number >= 0"):
    ga.adpsgd(loss_fn, data, ga.cluster(4), learning_rate=0.1, batch_size=1, model_bytes=-1.0)
  with pytest.raises(ValueError, match="link_slowdown factor must be finite and positive"):
    ga.sgp_bounded_staleness(loss_fn, data, ga.cluster(4), gj.topology.one_peer_directed_exponential(4),
                             learning_rate=0.1, batch_size=1, link_slowdown=[1.0, inf, 1.0, 1.0])
  sim = ga.sgp_bounded_staleness(loss_fn, data, ga.cluster(4), gj.topology.one_peer_directed_exponential(4),
                                 learning_rate=0.1, batch_size=1, tau=np.int64(2))  # a NumPy integer is an integer
  assert int(sim.run(sim.init(stacked(4), jax.random.key(0)), 1).step) == 1
