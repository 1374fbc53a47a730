"""Performance contracts: no recompiles for time-varying W, no dense matmul in sparse mixing,
the library step equals a hand-fused one, and the benchmark suite runs."""

import json
import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the benchmarks/ package

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import _timing  # noqa: E402
from benchmarks import dmsgd_step  # noqa: E402


class CompileCounter:
  """Counts XLA backend compilations while active (JAX's own monitoring event)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def _listener(self, event, duration, **kwargs):
    del duration, kwargs
    if event == self.EVENT:
      self.count += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def _time_varying():
  topos = [gj.topology.one_peer_exponential(8)]
  if hasattr(gj.topology, "random_pairs"):
    topos.append(gj.topology.random_pairs(8, seed=1, period=5))
  return topos


def _dmsgd_update(topology):
  tx = gj.gossip_sgd(topology, beta=0.9, learning_rate=0.1)

  def step(x, state, g):
    updates, state = tx.update(g, state, x)
    return optax.apply_updates(x, updates), state

  return tx, step


@pytest.mark.parametrize("topology", _time_varying(), ids=lambda t: t.name)
def test_time_varying_topology_compiles_once(topology):
  assert topology.is_time_varying and topology.period > 1
  tx, step = _dmsgd_update(topology)
  step = jax.jit(step)
  x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  g = jnp.ones_like(x)
  state = tx.init(x)
  with CompileCounter() as first:
    x, state = step(x, state, g)
    jax.block_until_ready(x)
  assert first.count >= 1  # the counter sees compilations at all
  with CompileCounter() as later:
    for _ in range(2 * topology.period + 1):
      x, state = step(x, state, g)
    jax.block_until_ready(x)
  assert later.count == 0
  assert step._cache_size() == 1
  # And the traced step really walks the period: W(k) differs between consecutive steps.
  assert not np.allclose(topology.matrix(0), topology.matrix(1))


def test_compile_counter_sees_a_recompile():
  """The negative control: a step counter passed as a static Python int recompiles per value."""
  topo = gj.topology.one_peer_exponential(8)
  mixer = gj.backend.simulate().mixer(topo)
  mix = jax.jit(mixer.mix, static_argnums=1)
  x = jnp.ones((8, 2), jnp.float32)
  mix(x, 0)
  with CompileCounter() as c:
    for k in range(1, topo.period):
      mix(x, k)
  assert c.count == topo.period - 1


def _hlo(f, *args):
  return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("topology", [gj.topology.ring(16), gj.topology.exponential(16),
                                      gj.topology.one_peer_exponential(16)], ids=lambda t: t.name)
def test_mixing_lowers_to_no_matmul(topology):
  x = jnp.ones((16, 5), jnp.float32)
  mixer = gj.backend.simulate().mixer(topology)
  step = jnp.zeros([], jnp.int32)
  tx, update = _dmsgd_update(topology)
  for text in (_hlo(mixer.mix, x, step), _hlo(update, x, tx.init(x), x)):
    assert "dot_general" not in text and "stablehlo.dot " not in text and "stablehlo.dot(" not in text
  # The dense foil does contain one: the check above can fail.
  assert "dot_general" in _hlo(lambda y: jnp.asarray(topology.matrix(0), jnp.float32) @ y, x)


def test_library_step_equals_hand_fused_step():
  params, (x, y) = dmsgd_step.problem(num_nodes=8, batch=4, sizes=(12, 8, 8, 3))
  tx, lib = dmsgd_step.library_step(gj.topology.ring(8))
  fused = dmsgd_step.fused_ring_step()
  copy = lambda t: jax.tree.map(jnp.copy, t)
  p1, s1 = copy(params), tx.init(params)
  p2, m2 = copy(params), jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    p1, s1 = lib(p1, s1, x, y)
    p2, m2 = fused(p2, m2, x, y)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  assert moved > 1e-3  # the steps did something
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(s1[0].trace["w0"]), np.asarray(m2["w0"]), rtol=1e-5, atol=1e-6)


def test_timing_waits_for_work_left_on_another_thread():
  """A contender's leftover work on another thread (the runtime's, after a call has returned)
  must not run into the next contender's timed call: the timing waits until the process is quiet."""
  end = time.perf_counter() + 0.3

  def spin():
    while time.perf_counter() < end:
      pass

  worker = threading.Thread(target=spin)
  worker.start()
  waited = _timing.wait_until_quiet()
  worker.join()
  assert waited >= 0.2
  assert _timing.wait_until_quiet() < 0.2  # an idle process goes on at once


def test_timing_stops_waiting_for_a_process_that_is_never_quiet():
  stop = threading.Event()

  def spin():
    while not stop.is_set():
      pass

  worker = threading.Thread(target=spin)
  worker.start()
  try:
    calls = []
    start = time.perf_counter()
    times = _timing.interleaved({"a": lambda: calls.append(1), "b": lambda: calls.append(2)}, reps=20, warmup=0,
                                settle=0.0, quiet_timeout=0.1)
    elapsed = time.perf_counter() - start
  finally:
    stop.set()
    worker.join()
  assert len(calls) == 40 and set(times) == {"a", "b"}
  assert 0.1 <= elapsed < 2.0  # one wait of 0.1 s, not forty


@pytest.mark.slow
def test_benchmark_suite_quick(tmp_path):
  out = tmp_path / "results.json"
  bench_main.main(["--quick", "--no-torch", "--json", str(out),
                   "--only", "optimizer_bandwidth", "dmsgd_step", "memory", "compile_time", "throughput",
                   "node_parallel", "named_axis", "resnet20_gpu"])
  r = json.loads(out.read_text())["benchmarks"]
  assert set(r["named_axis"]["update_ms"]) == {"stacked", "chain(method)", "chain(trace, lr, mix)", "rolls"}
  assert all(v > 0 for v in r["named_axis"]["update_ms"].values())
  assert set(r["optimizer_bandwidth"]["fraction_of_copy_bandwidth"]) >= {
      "gossipjax_ring(8)", "gossipjax_one_peer_exponential(8)", "hand_fused_ring", "no_mixing_floor"}
  assert all(v > 0 for v in r["optimizer_bandwidth"]["fraction_of_copy_bandwidth"].values())
  assert r["dmsgd_step"]["max_abs_param_diff_vs_hand_fused"] < 1e-5
  assert r["memory"]["donated"]["peak"] < r["memory"]["not_donated"]["peak"]
  assert all(c == 1 for c in r["compile_time"]["compilations_over_two_periods"].values())
  assert set(r["throughput"]["node_steps_per_s"]) == {"4", "16"} and all(v > 0 for v in r["throughput"]["node_steps_per_s"].values())
  rows = r["node_parallel"]["rows"]
  assert set(rows) == {f"{sweep}_{k}" for sweep in ("weak", "strong") for k in (1, 2, 4, 8)} | {"plain_vmap"}
  assert all(row["seconds_per_step"] > 0 for row in rows.values())
  for k in (2, 4, 8):  # a fixed n split over k devices: each does about 1/k of the FLOPs
    assert 0.9 / k < rows[f"strong_{k}"]["flops_per_device_ratio_to_1_device"] < 1.3 / k
  if jax.devices()[0].platform != "gpu":
    assert "skipped" in r["resnet20_gpu"]
