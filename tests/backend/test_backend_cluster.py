"""What a cluster pays for: fused exchanges, current meshes, and compile time of time-varying graphs."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T
from gossipjax.backend._block_plan import _rows_sent, fixed_slots, step_table, step_table_or_none
from gossipjax.backend._buckets import buckets

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi"))
import backend_cases as cases  # noqa: E402

K = 8  # conftest gives 8 CPU devices
AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit


def _mesh(kind):
  return jax.make_mesh((K,), ("nodes",), axis_types=(kind,))


def _permutes(compiled_text: str) -> int:
  return len(re.findall(r"\bcollective-permute(?:-start)?\(", compiled_text))


@pytest.fixture(scope="module")
def resnet20():
  from benchmarks.resnet20_gpu import ResNetCifar

  shapes = jax.eval_shape(lambda: ResNetCifar().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3))))["params"]
  return jax.tree.map(lambda s: jnp.zeros((16,) + s.shape, s.dtype), shapes)


@pytest.mark.parametrize("bucket_bytes", [gj.backend.sharded.__kwdefaults__["bucket_bytes"], 256 * 1024])
def test_resnet20_on_ring16_sends_one_permute_per_exchange_and_bucket(resnet20, bucket_bytes):
  leaves = jax.tree.leaves(resnet20)
  assert 60 <= len(leaves) <= 70  # ResNet-20's kernels, biases and norms
  be = gj.backend.sharded(_mesh(AUTO), bucket_bytes=bucket_bytes)
  params = be.shard(resnet20)
  tx = gj.gossip_sgd(T.ring(16), beta=0.9, learning_rate=0.1, backend=be)
  lowered = jax.jit(lambda p, s: tx.update(p, s, p)).lower(params, tx.init(params))
  # A ring of 2 nodes per device is 2 exchanges (to the next and the previous device).
  exchanges = len(be.mixer(T.ring(16)).plans[0].exchanges)
  num_buckets = len(buckets([x[:1] for x in leaves], bucket_bytes))
  assert exchanges == 2 and (num_buckets == 1 if bucket_bytes > 2**20 else 1 < num_buckets < 10)
  if num_buckets == 1:  # the compiled program (XLA may combine collectives, never split them)
    assert _permutes(lowered.compile().as_text()) == exchanges
  assert len(re.findall(r"collective_permute", lowered.as_text())) == exchanges * num_buckets


def test_mixed_dtypes_travel_in_their_own_buckets_and_mix_exactly():
  be = gj.backend.sharded(_mesh(AUTO), bucket_bytes=64)
  rng = np.random.default_rng(0)
  tree = {"a": rng.normal(size=(16, 3)), "b": rng.normal(size=(16, 2, 2)).astype(np.float32),
          "c": rng.normal(size=(16, 40)).astype(np.float32), "e": rng.normal(size=(16, 5)).astype(jnp.bfloat16)}
  assert buckets([x[:1] for x in jax.tree.leaves(tree)], 64) == [[0], [1], [2], [3]]
  assert buckets([x[:1] for x in jax.tree.leaves(tree)], 1 << 20) == [[0], [1, 2], [3]]
  topo = T.one_peer_exponential(16)
  want = [gj.backend.simulate().mixer(topo).mix(tree, step) for step in range(4)]
  for cap in (64, 1 << 20):
    mixer = gj.backend.sharded(_mesh(AUTO), bucket_bytes=cap).mixer(topo)
    mix = jax.jit(mixer.mix)
    for step in range(4):
      got = mix(be.shard(tree), jnp.int32(step))
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want[step])):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "25MB"])
def test_bucket_cap_must_be_a_positive_number_of_bytes(bad):
  for make in (lambda: gj.backend.sharded(_mesh(AUTO), bucket_bytes=bad),
               lambda: gj.backend.pmapped(bucket_bytes=bad)):
    with pytest.raises(ValueError, match=r"^gj\.backend\.(sharded|pmapped): bucket_bytes must be a positive"):
      make()


def _run(name, topo, be, x0, a, b, eager):
  tx = cases.algorithm(name, topo, be)
  grad = be.map(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))

  def step(x, state, a, b):
    updates, state = tx.update(grad(x, a, b), state, x)
    return optax.apply_updates(x, updates), state

  step = step if eager else jax.jit(step)
  x, a, b = be.shard(x0), be.shard(a), be.shard(b)
  state = tx.init(x)
  out = []
  for _ in range(3):
    x, state = step(x, state, a, b)
    out.append(np.asarray(x))
  for leaf in jax.tree.leaves(state):
    if getattr(leaf, "ndim", 0) and leaf.shape[0] == x0.shape[0]:  # per-node state follows the params
      assert leaf.sharding.is_equivalent_to(x.sharding, leaf.ndim), (name, leaf.sharding)
  return np.stack(out)


MESHES = [(EXPLICIT, False), (EXPLICIT, True), (AUTO, True)]  # Auto under jit: test_backend_sharded


@pytest.mark.parametrize("name", list(cases.ALGORITHMS))
@pytest.mark.parametrize("kind, eager", MESHES, ids=["explicit-jit", "explicit-eager", "auto-eager"])
def test_every_algorithm_on_explicit_and_auto_meshes_jit_and_eager(name, kind, eager):
  topo = T.one_peer_exponential(16) if cases.applies(name, T.one_peer_exponential(16)) else T.ring(16)
  x0, a, b = cases.problem(16)
  got = _run(name, topo, gj.backend.sharded(_mesh(kind)), x0, a, b, eager)
  np.testing.assert_allclose(got, cases.reference(name, topo, x0, a, b, steps=3), rtol=0, atol=1e-12)


def test_unplaced_params_are_placed_under_jit_on_an_explicit_mesh():
  be = gj.backend.sharded(_mesh(EXPLICIT))
  tx = gj.choco_sgd(T.ring(16), gj.compress.top_k(0.5), learning_rate=0.1, consensus_step=0.5, backend=be)
  x = np.ones((16, 4))
  u, state = jax.jit(tx.update)(x, tx.init(x), x)
  assert u.sharding.spec[0] == "nodes"
  placed = be.shard(x)
  state = tx.init(placed)
  assert state.key.sharding.is_equivalent_to(placed.sharding, 2)


def test_sharded_map_compiles_once_per_function():
  be = gj.backend.sharded(_mesh(EXPLICIT))
  x = be.shard(jnp.ones((16, 3)))
  square = lambda v: v * v
  be.map(square)(x)
  for _ in range(3):
    be.map(square)(x)
  assert len(be._compiled) == 1
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
  tx = gj.per_node(optax.adam(1e-3), backend=be)  # called eagerly: one program, not one per call
  tx.init(x)
  first = len(compiles)
  for _ in range(3):
    tx.init(x)
  assert len(compiles) == first


COMPILE_TIMES = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
import gossipjax as gj
gj.backend.reserve_cpu_threads()

topo = gj.topology.random_pairs(8, period=64)
sharded = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))
# A 64-32-32-10 MLP per node.
x = {f"layer{i}": {"w": np.ones((8, a, b)), "b": np.ones((8, b))} for i, (a, b) in enumerate([(64, 32), (32, 32), (32, 10)])}
assert len(sharded.mixer(topo).table.patterns) < 64  # steps with the same pairs share a branch

def seconds(backend, x, topo=topo):
  tx = gj.gossip_sgd(topo, learning_rate=0.1, backend=backend)
  state = tx.init(x)
  start = time.perf_counter()
  jax.jit(lambda p, s: tx.update(p, s, p)).lower(x, state).compile()
  return time.perf_counter() - start

times = {"simulate": [], "sharded": []}
for _ in range(5):  # alternating, best of five: the machine is shared
  times["simulate"].append(seconds(gj.backend.simulate(), x))
  times["sharded"].append(seconds(sharded, sharded.shard(x)))
print(min(times["simulate"]), min(times["sharded"]))

# 4 nodes per device: nearly every step of a random matching is an exchange pattern of its own.
x32 = jax.tree.map(lambda v: np.ones((32,) + v.shape[1:]), x)
short, long = gj.topology.random_pairs(32, period=4), gj.topology.random_pairs(32, period=256)
assert sharded.mixer(long).table.slots and not sharded.mixer(short).table.slots  # the fixed exchanges
times = {"short": [], "long": [], "simulate": []}
for _ in range(3):
  times["short"].append(seconds(sharded, sharded.shard(x32), short))
  times["long"].append(seconds(sharded, sharded.shard(x32), long))
  times["simulate"].append(seconds(gj.backend.simulate(), x32, long))
print(min(times["short"]), min(times["long"]), min(times["simulate"]))
"""


def test_a_long_period_compiles_within_a_small_multiple_of_the_simulated_time():
  # A fresh process, so that neither side pays for what earlier tests left in JAX's caches.
  out = subprocess.run([sys.executable, "-c", COMPILE_TIMES], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.split("\n")
  simulated, sharded = map(float, lines[0].split())
  # 1.8x to 1.95x alone on 2 idle cores, 2.2x beside the other pytest worker's compiles (the sharded compile has
  # 8 devices' threads to share the cores with).
  assert sharded <= 3 * simulated, (sharded, simulated)
  # Several nodes per device: period 256 compiles within 3x the time of period 4 (one branch per step took
  # 12x), and within 6x the simulation (the sharded program's own tables and exchanges; 7.6x before the fixed
  # exchanges). Beside another test's compiles, best of two rounds gave 2.3x and 5.5x: the bounds leave room.
  short, long, simulated = map(float, lines[1].split())
  assert long <= 3 * short and long <= 6 * simulated, (short, long, simulated)


def test_fixed_exchanges_are_taken_only_where_they_send_at_most_half_again_the_rows():
  be = gj.backend.sharded(_mesh(AUTO))
  for n, fixed in ((16, False), (32, True), (128, True)):  # 2, 4 and 16 nodes per device, period 256
    mixer = be.mixer(gj.topology.random_pairs(n, period=256))
    per_step = step_table(mixer.plans).rows_sent().mean()
    ratio = float(step_table_or_none(mixer.plans, mixer.topology).rows_sent().mean()) / per_step
    assert bool(mixer.table.slots) == fixed and (ratio <= 1.5 if fixed else ratio == 1.0), (n, ratio)
  # What the fixed form would send at 2 nodes per device: over 1.5x, so one branch per step is kept.
  mixer = be.mixer(gj.topology.random_pairs(16, period=256))
  rows = min(_rows_sent(mixer.plans, fixed_slots(K, f)[0])
             for f in ("matchings", "offsets"))
  assert rows > 1.5 * step_table(mixer.plans).rows_sent().sum()


@pytest.mark.parametrize("n, period", [(32, 256), (128, 64)])
def test_a_long_period_on_fixed_exchanges_equals_the_simulation(n, period):
  topo = gj.topology.random_pairs(n, period=period)
  be = gj.backend.sharded(_mesh(EXPLICIT))
  mixer = be.mixer(topo)
  assert mixer.table is not None and mixer.table.slots and mixer.table.branches < 64
  rows = mixer.table.rows_sent()
  assert rows.mean() <= 1.5 * step_table(mixer.plans).rows_sent().mean()
  rng = np.random.default_rng(0)
  x = {"w": rng.normal(size=(n, 5, 3)), "b": rng.normal(size=(n, 4))}
  mix = jax.jit(lambda x, k: mixer.mix(x, k))
  sim = gj.mixing.make_mixer(topo)
  for k in (0, 1, 77, period - 1, period + 3):  # traced steps, and one past the period
    got, want = mix(be.shard(x), k), sim.mix(x, k)
    for name in x:
      np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=0, atol=1e-14)


def _permute_bytes(compiled_text: str) -> int:
  """Bytes of every collective-permute's result in a compiled (CPU) program."""
  total = 0
  for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute\(", compiled_text):
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += size * {"f64": 8, "f32": 4, "bf16": 2, "u16": 2, "s16": 2, "u8": 1, "s8": 1, "u32": 4, "s32": 4}[dtype]
  return total


@pytest.mark.parametrize("compressor, compact_bytes", [
    (gj.compress.top_k(0.01), 10 * 4 + 10 * 2),  # 10 float32 values, 10 uint16 indices
    (gj.compress.random_k(0.01), 10 * 4),  # the values alone: the receiver rebuilds the indices
    (gj.compress.qsgd(4), 1000 + 4),  # int8 levels and a float32 norm
    (gj.compress.sign(), 125 + 4),  # 1,000 packed sign bits and a float32 scale
], ids=lambda v: type(v).__name__ if not isinstance(v, int) else "")
def test_choco_sends_the_compact_form(compressor, compact_bytes):
  be = gj.backend.sharded(_mesh(AUTO))
  topo = T.ring(16)
  tx = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5, backend=be)
  x0 = {"w": np.random.default_rng(0).normal(size=(16, 1000)).astype(np.float32)}
  x = be.shard(x0)
  step = jax.jit(lambda p, s: tx.update(jax.tree.map(lambda v: 0.1 * v, p), s, p))
  exchanges = be.mixer(topo).plans[0].exchanges
  rows = max(int(ex.count.max()) for ex in exchanges)  # one row (node) per exchange on ring(16) over 8
  sent = _permute_bytes(step.lower(x, tx.init(x)).compile().as_text())
  assert 0 < sent <= 1.1 * len(exchanges) * rows * compact_bytes
  # The same numbers as the simulation, which mixes the decoded messages densely.
  sim = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5)
  got, want = (x, tx.init(x)), (x0, sim.init(x0))
  sim_step = jax.jit(lambda p, s: sim.update(jax.tree.map(lambda v: 0.1 * v, p), s, p))
  for _ in range(3):
    u, s = step(*got)
    got = (optax.apply_updates(got[0], u), s)
    u, s = sim_step(*want)
    want = (optax.apply_updates(want[0], u), s)
  np.testing.assert_allclose(got[0]["w"], want[0]["w"], rtol=0, atol=2e-6)  # float32: a norm's last ulp
  assert float(got[1].message_bits[0]) == 8 * compact_bytes


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_choco_on_model_sharded_nodes_equals_the_simulation(kind):
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(kind, kind))
  be = gj.backend.sharded(mesh)
  rng = np.random.default_rng(0)
  host = {"w": rng.normal(size=(8, 64, 4)).astype(np.float32), "b": rng.normal(size=(8, 4)).astype(np.float32)}
  layout = {"w": P("nodes", "model"), "b": P("nodes")}
  for compressor in (gj.compress.top_k(0.1), gj.compress.sign(), gj.compress.random_k(0.1), gj.compress.qsgd(4)):
    x = {k: jax.device_put(host[k], NamedSharding(mesh, layout[k])) for k in host}
    tx = gj.choco_sgd(T.ring(8), compressor, learning_rate=0.1, consensus_step=0.5, backend=be, seed=1)
    sim = gj.choco_sgd(T.ring(8), compressor, learning_rate=0.1, consensus_step=0.5, seed=1)
    step = jax.jit(lambda p, s: tx.update(jax.tree.map(lambda v: 0.1 * v, p), s, p))
    state, sim_state, y = tx.init(x), sim.init(host), host
    for _ in range(1):
      u, state = step(x, state)
      x = jax.tree.map(jnp.add, x, u)
      u, sim_state = sim.update(jax.tree.map(lambda v: 0.1 * v, y), sim_state, y)
      y = jax.tree.map(jnp.add, y, u)
    assert kind == AUTO or x["w"].sharding.is_equivalent_to(NamedSharding(mesh, layout["w"]), 3), compressor
    for k in host:
      np.testing.assert_allclose(x[k], y[k], rtol=0, atol=1e-6, err_msg=f"{compressor} {k}")
    assert isinstance(state, gj.ChocoState) and isinstance(sim_state, gj.ChocoState)
    np.testing.assert_array_equal(state.message_bits, sim_state.message_bits)
    if kind == EXPLICIT:
      # The node's 2 devices each send half of its compact message to their peers: one copy per
      # neighbour between nodes (up to the padding of odd halves), where each sending it all was 2x.
      per_device = _permute_bytes(step.lower(x, state).compile().as_text())
      message = float(np.asarray(sim_state.message_bits)[0]) / 8
      assert 2 * per_device <= 1.1 * 2 * message, (compressor, per_device, message)  # 2 neighbours on a ring


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_choco_top_k_on_model_sharded_nodes_gathers_candidates_not_the_layer(kind):
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(kind, kind))
  host = np.random.default_rng(5).normal(size=(8, 64, 4)).astype(np.float32)
  x = jax.device_put(host, NamedSharding(mesh, P("nodes", "model")))  # each node's layer split over 2 devices
  tx = gj.choco_sgd(T.ring(8), gj.compress.top_k(0.1), learning_rate=0.1, consensus_step=0.5,
                    backend=gj.backend.sharded(mesh))
  step = jax.jit(lambda p, s: tx.update(0.1 * p, s, p))
  gathers = [re.search(r"= \w+\[([\d,]*)\]\S* all-gather", line).group(1)
             for line in _collective_lines(step.lower(x, tx.init(x)).compile().as_text()) if "all-gather" in line]
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in gathers]
  # 2 nodes a device: each gathers its 2 devices' 26 candidates (values, then indices), not its 256 entries.
  assert sizes and max(sizes) == 2 * 2 * 26, sizes
  u, state = step(x, tx.init(x))
  sim = gj.choco_sgd(T.ring(8), gj.compress.top_k(0.1), learning_rate=0.1, consensus_step=0.5)
  want, sim_state = sim.update(0.1 * host, sim.init(host), host)
  np.testing.assert_allclose(u, want, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(state.message_bits, sim_state.message_bits)


def _collective_lines(compiled_text: str) -> list[str]:
  return [line for line in compiled_text.split("\n")
          if re.search(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(", line)]


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_a_model_sharded_node_keeps_its_layout_through_the_mixing(kind):
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(kind, kind))
  be = gj.backend.sharded(mesh)
  rng = np.random.default_rng(0)
  host = {"w": rng.normal(size=(8, 6, 4)), "b": rng.normal(size=(8, 4)), "v": rng.normal(size=(8, 4, 6))}
  layout = {"w": P("nodes", "model"), "b": P("nodes"), "v": P("nodes", None, "model")}
  x = {k: jax.device_put(host[k], NamedSharding(mesh, layout[k])) for k in host}
  for topo in (T.ring(8), T.one_peer_exponential(8)):
    tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
    update = jax.jit(lambda p, s: tx.update(p, s, p))
    state = tx.init(x)
    assert [line for line in _collective_lines(update.lower(x, state).compile().as_text())
            if "collective-permute" not in line] == []  # no all-gather over 'model', no all-reduce
    u, _ = update(x, state)
    sim = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
    want, _ = sim.update(host, sim.init(host), host)
    for k in host:
      assert u[k].sharding.is_equivalent_to(x[k].sharding, u[k].ndim), (k, u[k].sharding)
      np.testing.assert_allclose(u[k], want[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(cases.ALGORITHMS))
def test_every_algorithm_on_a_two_axis_mesh_equals_the_simulation(name):
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(AUTO, AUTO))
  be = gj.backend.sharded(mesh)
  topo = T.one_peer_exponential(8) if cases.applies(name, T.one_peer_exponential(8)) else T.ring(8)
  rng = np.random.default_rng(1)
  x0, a, b = rng.normal(size=(8, 4)), rng.normal(size=(8, 6, 4)), rng.normal(size=(8, 6))
  tx = cases.algorithm(name, topo, be)
  grad = be.map(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))

  @jax.jit
  def step(x, state):
    updates, state = tx.update(grad(x, a, b), state, x)
    return optax.apply_updates(x, updates), state

  x = jax.device_put(x0, NamedSharding(mesh, P("nodes", "model")))
  state = tx.init(x)
  for _ in range(3):
    x, state = step(x, state)
  assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("nodes", "model")), 2)
  np.testing.assert_allclose(x, cases.reference(name, topo, x0, a, b, steps=3)[-1], rtol=0, atol=1e-12)


def test_float32_on_a_two_axis_mesh_equals_the_simulation_to_1e5():
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"))
  be = gj.backend.sharded(mesh)
  x0 = np.random.default_rng(2).normal(size=(8, 16)).astype(np.float32)
  g = 0.1 * x0
  out = {}
  for name, backend, x in (("sim", gj.backend.simulate(), x0),
                           ("sharded", be, jax.device_put(x0, NamedSharding(mesh, P("nodes", "model"))))):
    tx = gj.gossip_sgd(T.one_peer_exponential(8), beta=0.9, learning_rate=0.1, backend=backend)
    state = tx.init(x)
    for _ in range(5):
      u, state = jax.jit(tx.update)(g, state, x)
      x = optax.apply_updates(x, u)
    out[name] = np.asarray(x)
  np.testing.assert_allclose(out["sharded"], out["sim"], rtol=0, atol=1e-5)


def test_hierarchical_gossip_averages_inside_a_node_and_gossips_between_nodes():
  be = gj.backend.hierarchical(2)  # 4 nodes of 2 devices: devices (0, 1) are node 0, (2, 3) node 1, ...
  assert dict(be.mesh.shape) == {"nodes": 4, "data": 2}
  rng = np.random.default_rng(3)
  x0, a, b = rng.normal(size=(4, 5)), rng.normal(size=(4, 8, 5)), rng.normal(size=(4, 8))
  loss = lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)
  topo = T.ring(4)
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
  grad = be.map(jax.grad(loss))

  @jax.jit
  def step(x, state, a, b):
    updates, state = tx.update(grad(x, a, b), state, x)
    return optax.apply_updates(x, updates), state

  x, (a_dev, b_dev) = be.shard(x0), be.shard_batch((a, b))
  assert tuple(a_dev.sharding.spec) == ("nodes", "data")  # a node's 8 samples: 4 on each of its devices
  state = tx.init(x)
  lines = _collective_lines(step.lower(x, state, a_dev, b_dev).compile().as_text())
  node = lambda device: device // 2
  inside = [line for line in lines if "collective-permute" not in line]  # gradient all-reduce, gathered shares
  permutes = [line for line in lines if "collective-permute" in line]
  assert inside and permutes
  for line in inside:  # replica groups of 2 consecutive devices: one node's
    assert re.search(r"replica_groups=(\[4,2\]<=\[8\]|\{\{0,1\},\{2,3\},\{4,5\},\{6,7\}\})", line), line
  for line in permutes:
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
    assert pairs and all(node(s) != node(t) and s % 2 == t % 2 for s, t in pairs), pairs
  for _ in range(3):
    x, state = step(x, state, a_dev, b_dev)
  # The same as simulating the 4 nodes, each with its whole batch.
  sim = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
  xs, ss = x0, sim.init(x0)
  for _ in range(3):
    u, ss = sim.update(jax.vmap(jax.grad(loss))(xs, a, b), ss, xs)
    xs = optax.apply_updates(xs, u)
  np.testing.assert_allclose(x, xs, rtol=0, atol=1e-12)


def _between_nodes(line: str, per_node: int) -> int:
  """Bytes a collective-permute line moves between devices of different nodes (its result, once per pair)."""
  dtype, dims = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute", line).groups()
  size = int(np.prod([int(d) for d in dims.split(",") if d])) * {"f64": 8, "f32": 4}[dtype]
  pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
  return size * sum(int(s) // per_node != int(t) // per_node for s, t in pairs)


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT], ids=["auto", "explicit"])
def test_nodes_of_two_devices_send_one_copy_per_neighbour_in_one_permute_per_exchange(resnet20, kind):
  from jax.sharding import Mesh

  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("nodes", "data"), axis_types=(kind, kind))
  be = gj.backend.hierarchical(2) if kind == AUTO else gj.backend.Sharded(mesh, data_axis="data")
  rng = np.random.default_rng(4)
  leaves = jax.tree.leaves(resnet20)[:None if kind == AUTO else 12]  # ResNet-20; on Explicit its first leaves
  host = [rng.normal(size=(4,) + v.shape[1:]) for v in leaves]
  topo = T.ring(4)
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
  x = be.shard(host)
  update = jax.jit(lambda p, s: tx.update(p, s, p))
  lines = _collective_lines(update.lower(x, tx.init(x)).compile().as_text())
  permutes = [line for line in lines if "collective-permute" in line]
  exchanges = len(be.mixer(topo).plans[0].exchanges)
  assert exchanges == 2 and len(permutes) <= 2 * exchanges, len(permutes)
  model = sum(v[0].nbytes for v in jax.tree.leaves(host))
  neighbours = 8  # each of the 4 nodes sends to 2
  assert sum(_between_nodes(line, 2) for line in permutes) <= 1.25 * neighbours * model
  for line in lines:  # the rest stays inside a node: replica groups of its 2 devices
    if "collective-permute" not in line:
      assert re.search(r"replica_groups=(\[4,2\]<=\[8\]|\{\{0,1\},\{2,3\},\{4,5\},\{6,7\}\})", line), line
  sim = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
  want, _ = jax.jit(lambda p, s: sim.update(p, s, p))(host, sim.init(host))
  got, _ = update(x, tx.init(x))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def test_map_splits_a_model_sharded_node_over_its_devices_on_an_explicit_mesh():
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(EXPLICIT, EXPLICIT))
  be = gj.backend.sharded(mesh)
  w0 = np.random.default_rng(0).normal(size=(8, 64, 4))
  w = jax.device_put(w0, NamedSharding(mesh, P("nodes", "model")))
  fn = jax.jit(be.map(lambda w, c: (w * jnp.sum(w) + c, jnp.sum(w ** 2)), in_axes=(0, None)))
  (out, norm), hlo = fn(w, 1.0), fn.lower(w, 1.0).compile().as_text()
  # Each device works on its half of the node's layer: the sum is an all-reduce of partial sums,
  # and no device gathers the layer (a shard_map manual over the node axis alone gathered it).
  assert "all-gather" not in hlo and "all-reduce" in hlo
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("nodes", "model")), 3)  # the param's layout
  # atol: w * sum(w) + 1 cancels where the product is near -1, and the partial sums add in another order.
  np.testing.assert_allclose(out, w0 * w0.sum(axis=(1, 2), keepdims=True) + 1.0, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(norm, (w0 ** 2).sum(axis=(1, 2)), rtol=1e-12)


def test_layouts_a_node_axis_cannot_take_are_refused():
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("nodes", "model"), axis_types=(AUTO, AUTO))
  be = gj.backend.sharded(mesh)
  mixer = be.mixer(T.ring(8))
  split = jax.device_put(np.ones((8, 4)), NamedSharding(mesh, P(("nodes", "model"))))
  with pytest.raises(ValueError, match=r"^gj\.backend\.sharded.*splits its node axis over the mesh axes"):
    mixer.mix({"w": split}, 0)
  with pytest.raises(ValueError, match=r"^gj\.backend\.hierarchical: devices_per_node must be a positive divisor"):
    gj.backend.hierarchical(3)
  d = jax.devices()
  with pytest.raises(ValueError, match=rf"^gj\.backend\.hierarchical: devices lists {d[0]} more than once"):
    gj.backend.hierarchical(2, devices=[d[0], d[0], d[1], d[1]])
  with pytest.raises(ValueError, match=r"^gj\.backend\.hierarchical: a batch of shape \(4, 7, 5\) cannot be split"):
    gj.backend.hierarchical(2).shard_batch(np.ones((4, 7, 5)))
