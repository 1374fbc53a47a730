"""What a gossip round sends: collectives, bytes on the wire, trace and compile time, per backend.

``python -m benchmarks.communication [--quick] [--only PART ...] [--json PATH]`` prints a table per part
and writes ``benchmarks/results/communication.json`` (with ``--only``, it updates those parts of the file
and keeps the others, so the GPU part can come from another machine; ``--quick``, a smoke run at small
sizes, writes only where ``--json`` says). The parts, on 8 XLA CPU devices
(the module asks XLA for them before JAX loads, unless ``XLA_FLAGS`` already sets a count):

- ``leaves``: ``gj.gossip_sgd`` on ring(16) and one_peer_exponential(16), 100,000 float32 per node split
  into 1, 10 or 100 leaves, fused (the default ``bucket_bytes``) against per leaf (``bucket_bytes=1``):
  collective-permutes and the bytes of their results in the compiled per-device program (what one device
  receives), trace, lower and compile time (best of 3, each from a fresh function);
- ``compression``: ``gj.choco_sgd`` on ring(16) with each compressor on a ResNet-20's params: the bytes a
  device receives per exchange and node, from the compiled program, next to ``compressor.bits`` and the
  dense size;
- ``outer``: ``gj.diloco``'s compressed outer exchange on ResNet-20 params, 8 nodes on the 8 devices, each
  compressor in its two forms (``compressed_mean``, reduce-scatter and all-gather): the bytes the compiled
  round's all-to-alls and all-gathers bring one device from the others, next to ``gj.bytes_per_step`` and
  the dense all-reduce's count, over the model's bytes;
- ``hierarchical``: ``gj.gossip_sgd`` on ``gj.backend.hierarchical(D)``, D = 2 and 4, ResNet-20 params on a
  ring of the 8 / D nodes under jit: collective-permutes, all-gathers, and the bytes the permutes move between
  devices of different nodes per neighbour, over the model's bytes (float32: XLA:CPU compiles a bfloat16
  permute as float32, so CPU HLO would count a bf16 model's bytes twice);
- ``matchings``: exchanges per step of ``random_pairs(n)`` on 8 devices (n = 16, 32, 64), against the most
  device pairs one device sends or receives, the least number of exchanges that can carry a step;
- ``period``: compile time and kernels of ``random_pairs(n, period=P)`` at 1, 2, 4 and 16 nodes per device,
  sharded against simulated (best of 3; of 1 at period 256 with several nodes per device), and of the fixed
  exchanges at 4 nodes per device with every exchange at its longest message (no branch);
- ``mpi``: a jitted MPI gossip round (``mixer.mix``) of a ResNet-20's params on a ring of 4 ranks
  (``mpiexec -n 4``, launched with ``gj.backend.mpi_launch_env``), fused against per leaf: ms per
  round (median of the slowest rank) and ``sendrecv`` calls in the program;
- ``gpu``: the ``gj.gossip_sgd`` step on ResNet-20 params sharded over all of the machine's GPUs
  (2 nodes per GPU), fused and per leaf, ms per step; recorded as skipped without a GPU.

Not part of ``python -m benchmarks``: it launches MPI and may run on a GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

# 8 CPU devices (XLA reads this when JAX loads), unless the caller chose a count.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gossipjax as gj  # noqa: E402
from benchmarks import _timing  # noqa: E402

gj.backend.reserve_cpu_threads()  # before JAX's first computation: threads for collectives over 8 CPU devices

PARTS = ("leaves", "compression", "outer", "hierarchical", "matchings", "period", "mpi", "gpu")
DEVICES = 8
NODES = 16
PER_LEAF = 1  # bucket_bytes=1: every leaf is a bucket of its own, one message per leaf
DEFAULT_BUCKET = gj.backend.sharded.__kwdefaults__["bucket_bytes"]
RESULTS = pathlib.Path(__file__).parent / "results" / "communication.json"
_ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "u32": 4, "s32": 4, "u16": 2, "s16": 2, "u8": 1, "s8": 1,
             "pred": 1}


def permutes(compiled_text: str) -> int:
  """Collective-permutes in a compiled program (``-start`` where the backend makes them asynchronous)."""
  return len(re.findall(r"\bcollective-permute(?:-start)?\(", compiled_text))


def kernels(compiled_text: str) -> int:
  """Fusions in a compiled program: on XLA:CPU each is a kernel of its own, compiled apart."""
  return len(re.findall(r" fusion\(", compiled_text))


def permute_bytes(compiled_text: str) -> int:
  """Bytes of the arrays the collective-permutes of a compiled CPU program deliver to one device."""
  total = 0
  for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute\(", compiled_text):
    total += int(np.prod([int(d) for d in dims.split(",") if d])) * _ITEMSIZE[dtype]
  return total


def split_tree(n: int, floats: int, leaves: int) -> dict:
  """``floats`` float32 per node split into ``leaves`` equal leaves."""
  return {f"w{i:03d}": jnp.zeros((n, floats // leaves), jnp.float32) for i in range(leaves)}


def resnet20_shapes() -> dict:
  """One node's ResNet-20 params (CIFAR-10: 272,474 floats in 65 leaves) as shapes."""
  from benchmarks.resnet20_gpu import ResNetCifar

  return jax.eval_shape(lambda: ResNetCifar().init(jax.random.key(0), jnp.zeros((1, 32, 32, 3))))["params"]


def resnet20_tree(n: int, key: int = 0) -> dict:
  shapes = resnet20_shapes()
  keys = iter(jax.random.split(jax.random.key(key), len(jax.tree.leaves(shapes))))
  return jax.tree.map(lambda s: 0.1 * jax.random.normal(next(keys), (n,) + s.shape, s.dtype), shapes)


def sharded_backend(bucket_bytes: int = DEFAULT_BUCKET, devices=None) -> gj.backend.Sharded:
  devices = jax.devices("cpu")[:DEVICES] if devices is None else devices
  mesh = jax.make_mesh((len(devices),), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  return gj.backend.sharded(mesh, bucket_bytes=bucket_bytes)


def compile_times(build, reps: int) -> dict:
  """Best of ``reps`` trace, lower and compile times, each from a fresh ``build() -> (fn, args)``.

  Also the compiled program's text (of the last repetition).
  """
  best = {"trace_s": float("inf"), "lower_s": float("inf"), "compile_s": float("inf")}
  for _ in range(reps):
    fn, args = build()
    _timing.wait_until_quiet()
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    for name, seconds in (("trace_s", t1 - t0), ("lower_s", t2 - t1), ("compile_s", t3 - t2)):
      best[name] = min(best[name], seconds)
  best["hlo"] = compiled.as_text()
  return best


def gossip_update(topo: gj.topology.Topology, be, params):
  """A fresh ``(fn, args)``: one ``gj.gossip_sgd`` update on ``params``, the params as their own gradients."""
  tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
  return (lambda p, s: tx.update(p, s, p)), (params, tx.init(params))


def against_leaves(quick: bool) -> dict:
  floats, counts, reps = (1_000, (1, 10), 1) if quick else (100_000, (1, 10, 100), 3)
  topos = {"ring": gj.topology.ring(NODES), "one_peer_exponential": gj.topology.one_peer_exponential(NODES)}
  rows = []
  for name, topo in topos.items():
    for leaves in counts:
      row = {"topology": name, "leaves": leaves}
      for mode, bucket_bytes in (("fused", DEFAULT_BUCKET), ("per_leaf", PER_LEAF)):
        be = sharded_backend(bucket_bytes)
        mixer = be.mixer(topo)
        # A time-varying graph compiles one branch per exchange pattern; where every step of the period has a
        # pattern of its own (one_peer_exponential(16) on 8 devices), a round is the program over the period.
        period = topo.period if topo.is_time_varying else 1
        if topo.is_time_varying:
          assert len(mixer.table.patterns) == period, "every step must have its own branch"
        params = be.shard(split_tree(NODES, floats, leaves))
        t = compile_times(lambda: gossip_update(topo, be, params), reps)
        hlo = t.pop("hlo")
        row[mode] = dict(t, permutes_per_round=permutes(hlo) / period, bytes_per_round=permute_bytes(hlo) / period)
      rows.append(row)
  return {"devices": DEVICES, "nodes": NODES, "floats_per_node": floats, "dtype": "float32",
          "default_bucket_bytes": DEFAULT_BUCKET, "best_of": reps, "rows": rows}


def _node_link_bytes(compiled_text: str, devices_per_node: int) -> tuple[int, int, int]:
  """Collective-permutes, all-gathers, and the bytes the permutes move between devices of different nodes.

  A permute moves its result's bytes once per ``{source,target}`` pair; devices ``d`` and ``e``
  are one node's where ``d // devices_per_node == e // devices_per_node`` (`gj.backend.hierarchical`
  groups devices in order). Bytes as the CPU program's types say (see the page on bf16).
  """
  count, between = 0, 0
  for line in compiled_text.split("\n"):
    shape = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute(?:-start)?\(", line)
    if not shape:
      continue
    count += 1
    size = int(np.prod([int(d) for d in shape.group(2).split(",") if d])) * _ITEMSIZE[shape.group(1)]
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
    between += size * sum(int(s) // devices_per_node != int(t) // devices_per_node for s, t in pairs)
  gathers = len(re.findall(r"\ball-gather(?:-start)?\(", compiled_text))
  return count, gathers, between


def hierarchical_round(quick: bool) -> dict:
  """``gj.gossip_sgd`` on ``gj.backend.hierarchical(D)`` under jit: permutes, and bytes between nodes per neighbour."""
  rows = []
  for per_node in (2, 4):
    be = gj.backend.hierarchical(per_node, devices=jax.devices("cpu")[:DEVICES])
    n = DEVICES // per_node
    topo = gj.topology.ring(n)
    host = split_tree(n, 1_000, 10) if quick else resnet20_tree(n)
    params = be.shard(host)
    tx = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1, backend=be)
    update = jax.jit(lambda p, s, tx=tx: tx.update(p, s, p))
    hlo = update.lower(params, tx.init(params)).compile().as_text()
    count, gathers, between = _node_link_bytes(hlo, per_node)
    w = topo.matrix()
    neighbours = int(np.count_nonzero(w - np.diag(np.diag(w))))  # directed node pairs that exchange
    model = _timing.tree_bytes(jax.tree.map(lambda v: v[0], host))
    sim = gj.gossip_sgd(topo, beta=0.9, learning_rate=0.1)
    want, _ = sim.update(host, sim.init(host), host)
    got, _ = update(params, tx.init(params))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    rows.append({"devices_per_node": per_node, "nodes": n, "topology": f"ring({n})",
                 "exchanges": len(be.mixer(topo).plans[0].exchanges), "permutes": count, "all_gathers": gathers,
                 "bytes_between_nodes": between, "neighbour_links": neighbours, "model_bytes": model,
                 "per_neighbour_over_model": between / neighbours / model, "max_abs_diff_vs_simulation": diff})
  return {"devices": DEVICES, "model": "10 leaves of 100 float32" if quick else "ResNet-20",
          "leaves": len(jax.tree.leaves(host)), "rows": rows}


def matching_exchanges(quick: bool) -> dict:
  """Exchanges (ppermutes) per step of ``random_pairs(n)`` on 8 devices, against the busiest device's degree."""
  from gossipjax.backend._block_plan import compile_topology

  rows = []
  for n in (16, 32) if quick else (16, 32, 64):
    topo = gj.topology.random_pairs(n)
    plans = compile_topology(topo, DEVICES)
    counts, degrees = [], []
    for p in plans:
      pairs = {pair for ex in p.exchanges for pair in ex.pairs}
      sends = np.bincount([s for s, _ in pairs], minlength=DEVICES)
      gets = np.bincount([t for _, t in pairs], minlength=DEVICES)
      counts.append(len(p.exchanges))
      degrees.append(int(max(sends.max(), gets.max())) if pairs else 0)
    rows.append({"topology": f"random_pairs({n})", "nodes_per_device": n // DEVICES, "period": topo.period,
                 "mean_exchanges": float(np.mean(counts)), "max_exchanges": max(counts),
                 "mean_degree": float(np.mean(degrees))})
  return {"devices": DEVICES, "rows": rows}


def compressors() -> dict:
  C = gj.compress
  return {"identity": C.identity(), "top_k(0.01)": C.top_k(0.01), "random_k(0.01)": C.random_k(0.01),
          "qsgd(4)": C.qsgd(4), "sign": C.sign()}


def against_compression(quick: bool) -> dict:
  be = sharded_backend()
  topo = gj.topology.ring(NODES)
  exchanges = be.mixer(topo).plans[0].exchanges
  rows_per_exchange = max(int(ex.count.max()) for ex in exchanges)
  if quick:
    model, params = "one 1,000-float leaf", {"w": jnp.zeros((NODES, 1_000), jnp.float32)}
  else:
    model, params = "ResNet-20", resnet20_tree(NODES)
  one_node = jax.tree.map(lambda x: x[0], params)
  dense = _timing.tree_bytes(one_node)
  params = be.shard(params)
  rows = []
  for name, compressor in compressors().items():
    tx = gj.choco_sgd(topo, compressor, learning_rate=0.1, consensus_step=0.5, backend=be)
    step = jax.jit(lambda p, s: tx.update(jax.tree.map(lambda v: 0.1 * v, p), s, p))
    hlo = step.lower(params, tx.init(params)).compile().as_text()
    sent = permute_bytes(hlo) / (len(exchanges) * rows_per_exchange)
    compact = float(compressor.bits(one_node)) / 8
    rows.append({"compressor": name, "permutes": permutes(hlo), "bytes_per_exchange": sent,
                 "compact_bytes": compact, "dense_bytes": dense, "sent_over_compact": sent / compact,
                 "sent_over_dense": sent / dense})
  return {"devices": DEVICES, "nodes": NODES, "model": model, "leaves": len(jax.tree.leaves(one_node)),
          "floats_per_node": sum(x.size for x in jax.tree.leaves(one_node)), "exchanges_per_round": len(exchanges),
          "rows": rows}


def _gathered_bytes(compiled_text: str, devices: int) -> float:
  """What the all-gathers and all-to-alls of a compiled program bring one device from the ``devices - 1`` others."""
  total = 0.0
  for result in re.findall(r"= (\(?[a-z0-9]+\[[^\n]*?) (?:all-gather|all-to-all)\(", compiled_text):
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", result):
      total += int(np.prod([int(d) for d in dims.split(",") if d])) * _ITEMSIZE[dtype] * (devices - 1) / devices
  return total


def outer_exchange(quick: bool) -> dict:
  be = sharded_backend()
  n = DEVICES
  if quick:
    model, params = "one 1,000-float leaf", {"w": jnp.zeros((n, 1_000), jnp.float32)}
  else:
    model, params = "ResNet-20", resnet20_tree(n)
  one_node = jax.tree.map(lambda x: x[0], params)
  dense = _timing.tree_bytes(one_node)
  sharded = be.shard(params)
  allreduce = float(gj.bytes_per_step(gj.diloco(optax.sgd(0.1), inner_steps=1), params)[0])
  rows = []
  for name, compressor in compressors().items():
    for form in ("reduce_scatter", "all_gather"):
      tx = gj.diloco(optax.sgd(0.1), inner_steps=1, compressor=compressor, compressed_mean=form, backend=be)
      hlo = jax.jit(tx.update).lower(sharded, tx.init(sharded), sharded).compile().as_text()
      sent = _gathered_bytes(hlo, n)
      counted = float(gj.bytes_per_step(tx, params)[0])
      rows.append({"compressor": name, "form": form, "hlo_bytes": sent, "counted_bytes": counted,
                   "hlo_over_counted": sent / counted, "over_model": sent / dense,
                   "over_dense_allreduce": sent / allreduce})
  return {"devices": DEVICES, "nodes": n, "model": model, "dense_bytes": dense, "allreduce_bytes": allreduce,
          "rows": rows}


def mlp_tree(n: int) -> dict:
  """A 64-32-32-10 MLP per node (float32)."""
  sizes = [(64, 32), (32, 32), (32, 10)]
  return {f"layer{i}": {"w": jnp.ones((n, a, b), jnp.float32), "b": jnp.ones((n, b), jnp.float32)}
          for i, (a, b) in enumerate(sizes)}


def against_period(quick: bool) -> dict:
  from gossipjax.backend._block_plan import compile_topology, step_table

  periods, per_device, reps = ((4, 16), (1, 4), 1) if quick else ((4, 16, 64, 256), (1, 2, 4, 16), 3)
  sharded = sharded_backend()
  simulate = gj.backend.simulate()
  rows = []
  for b in per_device:
    n = b * DEVICES
    params = {"simulate": mlp_tree(n), "sharded": sharded.shard(mlp_tree(n))}
    for period in periods:
      topo = gj.topology.random_pairs(n, period=period)
      times = {"simulate": [], "sharded": []}
      for _ in range(reps if b == 1 or period < 256 else 1):  # alternating: the machine is shared
        for name, be in (("simulate", simulate), ("sharded", sharded)):
          t = compile_times(lambda: gossip_update(topo, be, params[name]), 1)
          t["kernels"] = kernels(t.pop("hlo"))
          times[name].append(t)
      best = {name: {k: min(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
      table = sharded.mixer(topo).table
      # Rows a device sends a step: as compiled, and with one exchange pattern per step.
      per_step = step_table(compile_topology(topo, DEVICES)).rows_sent().mean()
      rows.append({"nodes": n, "nodes_per_device": b, "period": period, "branches": table.branches,
                   "fixed_exchanges": bool(table.slots), "rows_per_step": float(table.rows_sent().mean()),
                   "rows_per_step_per_pattern": float(per_step), **best,
                   "compile_ratio": best["sharded"]["compile_s"] / best["simulate"]["compile_s"]})
  # What bounds the fixed form: the same program with every exchange at its longest message (no branch).
  n, period = 4 * DEVICES, 256
  topo = gj.topology.random_pairs(n, period=period)
  params = {"simulate": mlp_tree(n), "sharded": sharded.shard(mlp_tree(n))}
  times = {"simulate": [], "fixed": [], "longest": []}
  for _ in range(reps):
    for name, be in (("simulate", simulate), ("fixed", sharded), ("longest", _LongestMessages(sharded.mesh))):
      t = compile_times(lambda: gossip_update(topo, be, params["simulate" if name == "simulate" else "sharded"]), 1)
      t["kernels"] = kernels(t.pop("hlo"))
      times[name].append(t)
  floor = {name: {k: min(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
  return {"devices": DEVICES, "model": "MLP 64-32-32-10 per node, float32", "best_of": reps,
          "best_of_at_period_256": 1, "rows": rows,
          "no_branch": {"nodes": n, "period": period, "best_of": reps, **floor}}


class _LongestMessages(gj.backend.Sharded):
  """The sharded backend with every fixed exchange at its longest message of the period: no branch."""

  def mixer(self, topology):
    m = super().mixer(topology)
    t = m.table
    assert t is not None and t.slots and t.slot_size is not None
    longest = dataclasses.replace(t, slots=tuple(options[-1:] for options in t.slots),
                                  slot_size=np.zeros_like(t.slot_size))
    return dataclasses.replace(m, table=longest)


def mpi_round(quick: bool) -> dict:
  """Launches ``mpiexec -n 4`` on this module's ``--mpi-ranks`` entry and reads its JSON back."""
  mpiexec = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent))
  if mpiexec is None:
    return {"skipped": "mpiexec not found (pip install 'gossipjax[mpi]', see the Makefile)"}
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "mpi.json"
    cmd = [mpiexec, "-n", "4", sys.executable, "-m", "benchmarks.communication", "--mpi-ranks", "--json", str(out)]
    cmd += ["--reps", "5" if quick else "50"]
    # One CPU device per rank: the ranks are the nodes (and 4 ranks do not share a GPU).
    env = dict(os.environ, **gj.backend.mpi_launch_env, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not out.exists():
      return {"skipped": f"the MPI ranks failed (exit {proc.returncode}): {proc.stderr[-500:]}"}
    return json.loads(out.read_text())


def _mpi_ranks(reps: int, path: str) -> None:
  """One MPI rank (under ``mpiexec``): ResNet-20 params, one node per rank on a ring, fused and per leaf."""
  from benchmarks.mpi_gossip import timed

  rounds, sendrecvs, outputs = {}, {}, {}
  for mode, bucket_bytes in (("fused", DEFAULT_BUCKET), ("per_leaf", PER_LEAF)):
    be = gj.backend.mpi(bucket_bytes=bucket_bytes)
    topo = gj.topology.ring(be.size)
    x = resnet20_tree(topo.num_nodes, key=1)
    x = jax.tree.map(lambda v: v[be.node_slice(topo.num_nodes)], x)
    mix = jax.jit(be.mixer(topo).mix)
    sendrecvs[mode] = len(re.findall(r"custom_call @mpi_sendrecv", mix.lower(x).as_text()))
    outputs[mode] = mix(x)
    rounds[mode] = lambda mix=mix, x=x: jax.block_until_ready(mix(x))
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, outputs.values())))
  seconds = timed(rounds, be.comm, reps)
  one_node = jax.tree.map(lambda v: v[0], x)
  if be.rank == 0:
    pathlib.Path(path).write_text(json.dumps({
        "ranks": be.size, "topology": f"ring({be.size})", "model": "ResNet-20", "leaves": len(jax.tree.leaves(x)),
        "bytes_per_node": _timing.tree_bytes(one_node), "reps": reps, "launch": "gj.backend.mpi_launch_env",
        "fused": {"sendrecvs": sendrecvs["fused"], "seconds_per_round": seconds["fused"]},
        "per_leaf": {"sendrecvs": sendrecvs["per_leaf"], "seconds_per_round": seconds["per_leaf"]},
        "per_leaf_over_fused": seconds["per_leaf"] / seconds["fused"], "max_abs_diff": diff}, indent=2))


def gpu_step(quick: bool) -> dict:
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    return {"skipped": f"no GPU here (jax platform: {jax.devices()[0].platform})"}
  return sharded_step(gpus, quick)


def sharded_step(devices: list, quick: bool) -> dict:
  """The ``gj.gossip_sgd`` step on ResNet-20 params, 2 nodes per device, fused and per leaf: ms per step."""
  n = 2 * len(devices)
  steps, counts = {}, {}
  for mode, bucket_bytes in (("fused", DEFAULT_BUCKET), ("per_leaf", PER_LEAF)):
    be = sharded_backend(bucket_bytes, devices=devices)
    tx = gj.gossip_sgd(gj.topology.ring(n), beta=0.9, learning_rate=0.1, backend=be)
    params = be.shard(resnet20_tree(n))
    grads = be.shard(resnet20_tree(n, key=1))

    def step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile()
    counts[mode] = permutes(compiled.as_text())
    box = {"p": params, "s": tx.init(params)}

    def call(compiled=compiled, box=box, grads=grads):
      box["p"], box["s"] = compiled(box["p"], box["s"], grads)
      jax.block_until_ready(box["p"])

    steps[mode] = call
  seconds = _timing.interleaved(steps, reps=5 if quick else 50, warmup=3)
  return {"machine": _timing.machine(), "gpus": len(devices), "nodes": n, "model": "ResNet-20",
          "topology": f"ring({n})", "fused": {"permutes": counts["fused"], "seconds_per_step": seconds["fused"]},
          "per_leaf": {"permutes": counts["per_leaf"], "seconds_per_step": seconds["per_leaf"]},
          "per_leaf_over_fused": seconds["per_leaf"] / seconds["fused"]}


def run(quick: bool = False, parts: tuple[str, ...] = PARTS) -> dict:
  cpus = jax.devices("cpu")
  if len(cpus) < DEVICES:
    raise RuntimeError(f"benchmarks.communication needs {DEVICES} CPU devices; start Python with "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
  measure = {"leaves": against_leaves, "compression": against_compression, "outer": outer_exchange,
             "period": against_period,
             "hierarchical": hierarchical_round, "matchings": matching_exchanges, "mpi": mpi_round, "gpu": gpu_step}
  out = {}
  for part in parts:
    t0 = time.perf_counter()
    if part == "gpu":
      out[part] = measure[part](quick)
    else:  # the CPU figures stay CPU figures on a machine with a GPU
      with jax.default_device(cpus[0]):
        out[part] = measure[part](quick)
    out[part]["wall_s"] = time.perf_counter() - t0
  return out


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x" if b else "-"


def table(r: dict) -> list[str]:
  lines = []
  if "leaves" in r:
    p = r["leaves"]
    lines += [f"gossip_sgd, {p['nodes']} nodes on {p['devices']} CPU devices, {p['floats_per_node']:,} float32 "
              f"per node; fused (bucket_bytes={p['default_bucket_bytes']}) | per leaf (bucket_bytes=1), "
              f"best of {p['best_of']}",
              "  topology              leaves  permutes/round  KiB/round (one device)  trace+lower s "
              "(per leaf/fused)  compile s (per leaf/fused)"]
    for row in p["rows"]:
      f, e = row["fused"], row["per_leaf"]
      tf, te = f["trace_s"] + f["lower_s"], e["trace_s"] + e["lower_s"]
      lines.append(f"  {row['topology']:<21s} {row['leaves']:>6d}  {f['permutes_per_round']:>5g} | "
                   f"{e['permutes_per_round']:<6g}  {f['bytes_per_round'] / 1024:>9.1f} | "
                   f"{e['bytes_per_round'] / 1024:<9.1f}  {tf:6.3f} | {te:6.3f} ({_ratio(te, tf)})   "
                   f"{f['compile_s']:6.3f} | {e['compile_s']:6.3f} ({_ratio(e['compile_s'], f['compile_s'])})")
  if "compression" in r:
    p = r["compression"]
    leaves = f"{p['leaves']} leaf" if p["leaves"] == 1 else f"{p['leaves']} leaves"
    lines += ["", f"choco_sgd on ring({p['nodes']}) over {p['devices']} CPU devices, {p['model']} ({leaves}, "
              f"{p['floats_per_node']:,} floats): bytes one device receives per exchange and node",
              "  compressor       permutes  sent bytes  compressor.bits/8  sent/compact  sent/dense"]
    for row in p["rows"]:
      lines.append(f"  {row['compressor']:<16s} {row['permutes']:>8d} {row['bytes_per_exchange']:>11,.0f} "
                   f"{row['compact_bytes']:>18,.0f} {row['sent_over_compact']:>13.3f} {row['sent_over_dense']:>11.4f}")
  if "outer" in r:
    p = r["outer"]
    lines += ["", f"diloco's compressed outer round, {p['nodes']} nodes on {p['devices']} CPU devices, {p['model']}: "
              f"bytes one device receives (all-to-alls and all-gathers), the dense all-reduce counts "
              f"{p['allreduce_bytes'] / p['dense_bytes']:.3f} models",
              "  compressor       form             HLO bytes  counted  HLO/counted  /model  /dense all-reduce"]
    for row in p["rows"]:
      lines.append(f"  {row['compressor']:<16s} {row['form']:<15s} {row['hlo_bytes']:>10,.0f} "
                   f"{row['counted_bytes']:>9,.0f} {row['hlo_over_counted']:>11.3f} {row['over_model']:>7.3f} "
                   f"{row['over_dense_allreduce']:>17.3f}")
  if "hierarchical" in r:
    p = r["hierarchical"]
    lines += ["", f"gossip_sgd on gj.backend.hierarchical(D), {p['model']} ({p['leaves']} leaves), {p['devices']} CPU "
              "devices, under jit: collectives and bytes between nodes per neighbour (over the model's bytes)",
              "  D  topology  exchanges  permutes  all-gathers  between nodes / neighbour / model  max diff vs sim"]
    for row in p["rows"]:
      lines.append(f"  {row['devices_per_node']}  {row['topology']:<8s} {row['exchanges']:>10d} {row['permutes']:>9d} "
                   f"{row['all_gathers']:>12d} {row['per_neighbour_over_model']:>35.3f} "
                   f"{row['max_abs_diff_vs_simulation']:>16.2g}")
  if "matchings" in r:
    p = r["matchings"]
    lines += ["", f"exchanges per step on {p['devices']} devices (the busiest device's degree is the least possible)",
              "  topology          nodes/device  mean exchanges  max  mean degree"]
    for row in p["rows"]:
      lines.append(f"  {row['topology']:<17s} {row['nodes_per_device']:>12d} {row['mean_exchanges']:>15.3f} "
                   f"{row['max_exchanges']:>4d} {row['mean_degree']:>12.3f}")
  if "period" in r:
    p = r["period"]
    lines += ["", f"random_pairs(n, period=P) on {p['devices']} devices, gossip_sgd on {p['model']}: seconds",
              "  n   period  branches  simulate: trace+lower  compile   sharded: trace+lower  compile   "
              "sharded/simulate compile  kernels: simulate / sharded  rows a step: compiled / per-step patterns"]
    for row in p["rows"]:
      s, h = row["simulate"], row["sharded"]
      lines.append(f"  {row['nodes']:<4d}{row['period']:>6d} {row['branches']:>9d} {s['trace_s'] + s['lower_s']:22.3f} "
                   f"{s['compile_s']:8.3f} {h['trace_s'] + h['lower_s']:21.3f} {h['compile_s']:8.3f} "
                   f"{row['compile_ratio']:25.2f}x  {s.get('kernels', 0):17d} / {h.get('kernels', 0):<7d} "
                   f"{row['rows_per_step']:8.2f} / {row['rows_per_step_per_pattern']:.2f}"
                   + (" (fixed)" if row["fixed_exchanges"] else ""))
    if "no_branch" in p:
      f = p["no_branch"]
      lines += [f"random_pairs({f['nodes']}, period={f['period']}), compile (s) and kernels, best of {f['best_of']}: "
                + ", ".join(f"{name} {f[name]['compile_s']:.3f} ({f[name]['kernels']})"
                            for name in ("simulate", "fixed", "longest"))
                + " (longest: every fixed exchange at its longest message, no branch)"]
  if "mpi" in r:
    p = r["mpi"]
    lines.append("")
    if "skipped" in p:
      lines.append(f"MPI gossip round: skipped: {p['skipped']}")
    else:
      lines += [f"MPI gossip round, {p['model']} ({p['leaves']} leaves, {p['bytes_per_node'] / 2**20:.2f} MiB per "
                f"node) on {p['topology']}, {p['ranks']} ranks, median of {p['reps']} (slowest rank)"]
      for mode in ("fused", "per_leaf"):
        lines.append(f"  {mode:<9s} {p[mode]['sendrecvs']:>4d} sendrecv  {p[mode]['seconds_per_round'] * 1e3:8.3f} ms")
      lines.append(f"  per leaf / fused: {p['per_leaf_over_fused']:.2f}x")
  if "gpu" in r:
    p = r["gpu"]
    lines.append("")
    if "skipped" in p:
      lines.append(f"gossip_sgd step on GPUs: skipped: {p['skipped']}")
    else:
      lines += [f"gossip_sgd step, {p['model']}, {p['topology']} on {p['gpus']} x {p['machine']['device']}"]
      for mode in ("fused", "per_leaf"):
        ms = p[mode]["seconds_per_step"] * 1e3
        lines.append(f"  {mode:<9s} {p[mode]['permutes']:>4d} permutes  {ms:8.3f} ms/step")
      lines.append(f"  per leaf / fused: {p['per_leaf_over_fused']:.2f}x")
  return lines


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.communication", description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes: checks that every part runs")
  parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts and update them in the JSON file")
  parser.add_argument("--json", default=None,
                      help="where to write (default benchmarks/results/communication.json; with --quick, nowhere)")
  parser.add_argument("--mpi-ranks", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--reps", type=int, default=50, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.mpi_ranks:
    _mpi_ranks(args.reps, args.json)
    return {}
  path = pathlib.Path(args.json) if args.json else None if args.quick else RESULTS
  t0 = time.perf_counter()
  parts = run(args.quick, tuple(args.only or PARTS))
  command = "python -m benchmarks.communication " + " ".join(sys.argv[1:] if argv is None else argv)
  for part in parts.values():
    part["command"] = command.strip()
  result = json.loads(path.read_text()) if args.only and path and path.exists() else {}
  result.setdefault("parts", {}).update(parts)
  if not args.only:
    result.update(command=command.strip(), machine=_timing.machine(), quick=args.quick,
                  wall_s=time.perf_counter() - t0)
  print("\n".join(table(result["parts"])))
  if path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
  return result


if __name__ == "__main__":
  main()
