"""Multi-device steps queued without waiting never deadlock XLA's CPU client (gj.backend.reserve_cpu_threads)."""

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gossipjax as gj
from gossipjax.backend import _cpu_threads as cpu

K = 8  # conftest gives 8 CPU devices

# A user's loop: 8 CPU devices, one-peer exponential gossip (a lax.switch of ppermutes), no wait
# on any step. It runs more steps than XLA's 32 programs in flight per device, so the host gets
# far enough ahead to reach the state that deadlocked the client before it was sized.
UNSYNCHRONISED_STEPS = 100
_CHILD = textwrap.dedent(f"""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={K}"
    import jax
    import numpy as np
    import optax
    import gossipjax as gj

    gj.backend.reserve_cpu_threads()
    mesh = jax.make_mesh(({K},), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
    backend = gj.backend.sharded(mesh)
    tx = gj.gossip_sgd(gj.topology.one_peer_exponential(16), beta=0.9, learning_rate=0.1, backend=backend)
    x = backend.shard(np.zeros((16, 4), np.float32))
    target = backend.shard(np.arange(64, dtype=np.float32).reshape(16, 4))
    state = tx.init(x)

    @jax.jit
    def step(x, state):
      updates, state = tx.update(x - target, state, x)
      return optax.apply_updates(x, updates), state

    for _ in range({UNSYNCHRONISED_STEPS}):
      x, state = step(x, state)
    print("finished", float(np.asarray(x).sum()))
""")


def _fresh_env():
  # The child must get its pool from its own reserve_cpu_threads(), not inherit this process's setting.
  drop = ("XLA_FLAGS", "PJRT_NPROC", "NPROC")
  return dict({k: v for k, v in os.environ.items() if k not in drop}, JAX_PLATFORMS="cpu")


def _run_child(timeout):
  try:
    res = subprocess.run([sys.executable, "-c", _CHILD], env=_fresh_env(), capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired:
    return f"hung for {timeout} s"
  if res.returncode != 0 or "finished" not in res.stdout:
    lines = res.stderr.strip().splitlines() or [""]
    cause = next((line for line in lines if "Termination timeout" in line), lines[-1])
    return f"exit {res.returncode}: {cause[-300:]}"
  return None


@pytest.mark.slow
def test_ten_fresh_processes_of_unsynchronised_steps_all_finish():
  # Two at a time: the machines this runs on have two cores. A deadlocked child aborts on XLA's
  # 40 s rendezvous timeout; the subprocess timeout only keeps a different hang from stalling CI.
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    failures = [f for f in pool.map(lambda _: _run_child(timeout=150), range(10)) if f]
  assert not failures, f"{len(failures)} of 10 processes did not finish: {failures}"


def test_this_process_has_the_threads_its_devices_need():
  # conftest forced K CPU devices and reserved their threads before JAX computed, so the pool was sized in time.
  assert jax.local_device_count() == K
  assert cpu.pool_size(K) >= cpu.threads_needed(K)
  # The live client: XLA sizes its intra-op pool ("XLAEigen" threads) from the same number.
  tasks = "/proc/self/task"
  if not os.path.isdir(tasks):
    pytest.skip("no /proc to count the client's threads")
  jax.numpy.zeros(1).block_until_ready()
  names = []
  for tid in os.listdir(tasks):
    try:
      with open(f"{tasks}/{tid}/comm") as f:
        names.append(f.read())
    except OSError:
      pass  # a thread that ended while listing
  eigen = sum("XLAEigen" in name for name in names)
  if not eigen:
    pytest.skip("XLA's CPU threads carry another name in this version")
  assert eigen >= cpu.threads_needed(K)


def test_pjrt_nproc_is_set_only_where_the_pool_would_be_too_small():
  assert cpu.pjrt_nproc_setting(8, {}, cores=2) == "16"
  assert cpu.pjrt_nproc_setting(8, {}, cores=16) is None
  assert cpu.pjrt_nproc_setting(1, {}, cores=2) is None
  assert cpu.pjrt_nproc_setting(8, {"NPROC": "4"}, cores=64) == "16"  # XLA reads NPROC before the cores
  assert cpu.pjrt_nproc_setting(8, {"PJRT_NPROC": "4"}, cores=2) is None  # the user's own choice stands
  assert cpu.pjrt_nproc_setting(8, {"PJRT_NPROC": ""}, cores=2) == "16"  # XLA ignores a value it cannot read


def test_requested_cpu_devices_reads_the_flag_and_the_jax_option():
  flags = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4"}
  assert cpu.requested_cpu_devices(flags) == 4
  assert cpu.requested_cpu_devices(flags, num_cpu_devices=6) == 6
  assert cpu.requested_cpu_devices({}) == 1


# The loop above on 4 CPU devices in a fresh process whose XLA reads NPROC=2, so its client gets
# max(2, 4) = 4 threads on any machine, 4 short of what collectives over 4 devices need.
_SHORT_CHILD = _CHILD.replace(f"count={K}", "count=4").replace(f"(({K},)", "((4,)")


@pytest.mark.parametrize("reserve", [False, True], ids=["without_reservation", "reserved_first"])
def test_too_few_client_threads_give_a_clear_error_never_a_hang(reserve):
  child = _SHORT_CHILD if reserve else _SHORT_CHILD.replace("gj.backend.reserve_cpu_threads()\n", "")
  assert ("reserve_cpu_threads" in child) == reserve and "count=4" in child
  try:
    res = subprocess.run([sys.executable, "-c", child], env=dict(_fresh_env(), NPROC="2"), capture_output=True,
                         text=True, timeout=60)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{UNSYNCHRONISED_STEPS} steps on 4 CPU devices neither finished nor failed within 60 s")
  if reserve:  # the line the error gives, followed: the client has its threads and the loop finishes
    assert res.returncode == 0 and "finished" in res.stdout, res.stderr[-2000:]
    return
  assert res.returncode != 0 and "finished" not in res.stdout
  last = res.stderr.strip().splitlines()[-1]
  assert last.startswith("RuntimeError: gj.backend.sharded: XLA's CPU client has 4 threads, but collectives over 4 "
                         "CPU devices need 8"), last
  assert "call `gj.backend.reserve_cpu_threads()` first" in last and "PJRT_NPROC=8" in last


def test_a_client_with_too_few_threads_is_refused_where_collectives_start(monkeypatch):
  mesh = jax.make_mesh((K,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  monkeypatch.setattr(cpu, "live_pool_size", lambda: 2)  # as a client started without the reservation on 2 cores
  with pytest.raises(RuntimeError, match=rf"^gj.backend.sharded: XLA's CPU client has 2 threads, but collectives "
                                         rf"over {K} CPU devices need {2 * K} .*PJRT_NPROC={2 * K}$"):
    gj.backend.sharded(mesh)
  with pytest.raises(RuntimeError, match=r"^gj.backend.pmapped: .* need 8 .*reserve_cpu_threads\(\)` first"):
    gj.backend.pmapped(axis_size=4).mixer(gj.topology.ring(8))
  one = jax.make_mesh((1,), ("nodes",), devices=jax.devices()[:1])
  gj.backend.sharded(one)  # one device waits on no other
  monkeypatch.setattr(cpu, "live_pool_size", lambda: 2 * K)
  gj.backend.sharded(mesh)


def test_reserving_after_jax_started_changes_nothing_and_says_so(monkeypatch):
  # This process's client started with conftest's setting; a late call cannot resize it.
  jax.numpy.zeros(1).block_until_ready()
  monkeypatch.delenv("PJRT_NPROC", raising=False)
  monkeypatch.setattr(cpu, "live_pool_size", lambda: None)  # no /proc: the pool is read from the environment
  monkeypatch.setenv("NPROC", "2")  # so the client looks too small on any machine
  with pytest.warns(RuntimeWarning, match=r"reserve_cpu_threads \(called after JAX started\).*PJRT_NPROC=16"):
    gj.backend.reserve_cpu_threads()
  assert "PJRT_NPROC" not in os.environ
  assert jax.config.values["jax_num_cpu_devices"] == -1  # the probe of whether JAX started put the option back


# Params the user placed on the CPU devices themselves, reaching the library without a sharded
# backend: every way in must refuse a client too small for them, as the backends' constructors do.
def _placed(axis_type):
  mesh = jax.make_mesh((K,), ("nodes",), axis_types=(axis_type,))
  return jax.device_put(jnp.arange(2.0 * K * 3).reshape(2 * K, 3), NamedSharding(mesh, P("nodes")))


def _step_under_jit(make_tx):
  def run(x):
    tx = make_tx()
    state = tx.init(np.asarray(x))  # made from host values: only the step sees how x is placed
    return jax.jit(lambda x, s: tx.update(x, s, x))(x, state)
  return run


_PLACED_PATHS = {
    "gossip_sgd.init": lambda x: gj.gossip_sgd(gj.topology.ring(2 * K), learning_rate=0.1).init(x),
    "gossip_sgd under jit": _step_under_jit(lambda: gj.gossip_sgd(gj.topology.ring(2 * K), beta=0.9, learning_rate=0.1)),
    "chain.init": lambda x: gj.chain(optax.adam(0.1), gj.mix(gj.topology.ring(2 * K))).init(x),
    "chain under jit": lambda x: jax.jit(lambda x: (lambda tx: tx.update(x, tx.init(x), x))(
        gj.chain(optax.adam(0.1), gj.mix(gj.topology.ring(2 * K)))))(x),
    "allreduce_sgd under jit": _step_under_jit(lambda: gj.allreduce_sgd(learning_rate=0.1)),
    "simulate().map": lambda x: gj.backend.simulate().map(jnp.sum)(x),
    "simulate().mean": lambda x: gj.backend.simulate().mean(x),
    "node_mean": gj.node_mean,
    "consensus_distance": gj.consensus_distance,
    "nonfinite_nodes": gj.nonfinite_nodes,
}


@pytest.mark.filterwarnings("ignore:gj.backend.simulate. the params mixed")  # built for the simulation on purpose
@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("path", list(_PLACED_PATHS))
def test_params_placed_on_cpu_devices_are_refused_on_a_small_client_by_every_way_in(monkeypatch, path, axis_type):
  run = _PLACED_PATHS[path]
  x = _placed(axis_type)
  run(x)  # this process's client has its threads
  monkeypatch.setattr(cpu, "live_pool_size", lambda: 2)  # as a client started without the reservation on 2 cores
  run(jnp.asarray(np.asarray(x)))  # one device waits on no other
  with pytest.raises(RuntimeError, match=rf"\(arrays placed on {K} CPU devices\): XLA's CPU client has 2 threads, "
                                         rf"but collectives over {K} CPU devices need {2 * K} .*reserve_cpu_threads"):
    run(x)


QUEUED_METRICS = 2 * cpu.MAX_INFLIGHT_PER_DEVICE  # eager calls, each a program: more than the queue holds

# The deadlock reached without a sharded backend: the user places the params on 4 CPU devices and
# runs transforms built for the simulation, queueing steps without waiting on any, in a fresh
# process whose client gets max(NPROC=2, 4) = 4 threads. Each way in either is refused at once or,
# reserved, finishes; before the library looked at placed params this aborted after about 60 s.
_PLACED_CHILD = textwrap.dedent(f"""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import numpy as np
    import optax
    import gossipjax as gj
    from jax.sharding import NamedSharding, PartitionSpec as P

    gj.backend.reserve_cpu_threads()
    ring = gj.topology.ring(8)
    target = np.arange(24, dtype=np.float32).reshape(8, 3)

    def placed(x):
      mesh = jax.make_mesh((4,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
      return jax.device_put(x, NamedSharding(mesh, P("nodes")))

    def loop(tx, x, state):
      step = jax.jit(lambda x, s: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(x - target, s, x)))
      for _ in range({UNSYNCHRONISED_STEPS}):
        x, state = step(x, state)
      return x

    def gossip_sgd():  # the transform's init on the placed params, then jitted steps
      x = placed(np.zeros((8, 3), np.float32))
      tx = gj.gossip_sgd(ring, learning_rate=0.1)
      return loop(tx, x, tx.init(x))

    def chain_jitted_init():  # init and steps both under jit
      x = placed(np.zeros((8, 3), np.float32))
      tx = gj.chain(optax.sgd(0.1, momentum=0.9), gj.mix(ring))
      return loop(tx, x, jax.jit(tx.init)(x))

    def state_made_on_the_host():  # only the jitted step sees the placement
      tx = gj.gossip_sgd(ring, beta=0.9, learning_rate=0.1)
      return loop(tx, placed(np.zeros((8, 3), np.float32)), tx.init(np.zeros((8, 3), np.float32)))

    def queued_metrics():  # the stacked metrics, queued eagerly
      x = placed(target)
      return [gj.consensus_distance(x) for _ in range({QUEUED_METRICS})][-1]

    for path in (gossip_sgd, chain_jitted_init, state_made_on_the_host, queued_metrics):
      try:
        np.asarray(path())
        print(path.__name__, "finished", flush=True)
      except RuntimeError as e:
        print(path.__name__, "refused", str(e).splitlines()[0], flush=True)
""")


@pytest.mark.parametrize("reserve", [False, True], ids=["without_reservation", "reserved_first"])
def test_params_placed_by_the_user_on_cpu_devices_give_a_clear_error_never_a_hang(reserve):
  child = _PLACED_CHILD if reserve else _PLACED_CHILD.replace("gj.backend.reserve_cpu_threads()\n", "")
  assert ("reserve_cpu_threads()\n" in child) == reserve
  try:
    res = subprocess.run([sys.executable, "-c", child], env=dict(_fresh_env(), NPROC="2"), capture_output=True,
                         text=True, timeout=60)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{UNSYNCHRONISED_STEPS} steps on params placed on 4 CPU devices neither finished nor failed in 60 s")
  assert res.returncode == 0, res.stderr[-2000:]
  lines = res.stdout.strip().splitlines()
  paths = ("gossip_sgd", "chain_jitted_init", "state_made_on_the_host", "queued_metrics")
  assert [line.split()[0] for line in lines] == list(paths), res.stdout + res.stderr[-2000:]
  for line in lines:
    if reserve:
      assert line.split()[1] == "finished", line
      continue
    assert line.split()[1] == "refused", line
    assert ("(arrays placed on 4 CPU devices): XLA's CPU client has 4 threads, but collectives over 4 CPU devices "
            "need 8") in line, line
    assert "call `gj.backend.reserve_cpu_threads()` first" in line and line.endswith("PJRT_NPROC=8"), line
