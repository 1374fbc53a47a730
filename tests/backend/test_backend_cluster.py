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
from gossipjax.backend._blocks import buckets

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
  tx = gj.per_node(optax.adam(1e-3), be)
  x = be.shard(jnp.ones((16, 3)))
  tx.init(x)
  before = len(be._compiled)
  for _ in range(3):
    tx.init(x)
  assert len(be._compiled) == before == 1


COMPILE_TIMES = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
import gossipjax as gj

topo = gj.topology.random_pairs(8, period=64)
sharded = gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))
# A 64-32-32-10 MLP per node.
x = {f"layer{i}": {"w": np.ones((8, a, b)), "b": np.ones((8, b))} for i, (a, b) in enumerate([(64, 32), (32, 32), (32, 10)])}
assert len(sharded.mixer(topo).table.patterns) < 64  # steps with the same pairs share a branch

def seconds(backend, x):
  tx = gj.gossip_sgd(topo, learning_rate=0.1, backend=backend)
  state = tx.init(x)
  start = time.perf_counter()
  jax.jit(lambda p, s: tx.update(p, s, p)).lower(x, state).compile()
  return time.perf_counter() - start

times = {"simulate": [], "sharded": []}
for _ in range(3):  # alternating, best of three: the machine is shared
  times["simulate"].append(seconds(gj.backend.simulate(), x))
  times["sharded"].append(seconds(sharded, sharded.shard(x)))
print(min(times["simulate"]), min(times["sharded"]))
"""


def test_a_long_period_compiles_in_at_most_twice_the_simulated_time():
  # A fresh process, so that neither side pays for what earlier tests left in JAX's caches.
  out = subprocess.run([sys.executable, "-c", COMPILE_TIMES], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  simulated, sharded = map(float, out.stdout.split())
  assert sharded <= 2 * simulated, (sharded, simulated)


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
