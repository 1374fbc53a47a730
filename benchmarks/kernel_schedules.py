"""What bounds the native DmSGD kernel: its step against the copy and against cut-down schedules.

Compiles ``kernel_schedules.cc`` (which includes ``gossipjax/_native/circulant_dmsgd.cc`` whole, so
the step timed is the one ``gj.gossip_sgd_step`` runs) and times, outside JAX, in one run:
the in-place copy, the no-mixing update, the library's step on the ring and the exponential
graph, and for the exponential graph two schedules cut down from the kernel's own plan: each
output reading only its own row back from scratch (the cost of sending every row through
scratch and writing it later), and the mixing alone (its cache reads, no local steps).
The copy, the no-mixing update and each graph's step run again on one thread: what one core
can do on its own tells a step bound by memory from one bound by the work on the core.
Each step is first checked against a double-precision reference.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile

import jax

import gossipjax as gj
from gossipjax import _native
from gossipjax._src.fused import _circulant

SOURCE = pathlib.Path(__file__).with_name("kernel_schedules.cc")


def _graph_args(topology) -> list[str]:
  shifts, weights, self_weight = _circulant(topology.plans()[0])
  return [",".join(map(str, shifts)), ",".join(repr(w) for w in weights), repr(self_weight)]


def run(quick: bool = False) -> dict:
  n, d, reps = (8, 1 << 14, 3) if quick else (64, 1 << 20, 11)
  cxx = _native._compiler()
  if cxx is None:
    return {"skipped": "no C++ compiler found (set CXX, or install g++)"}
  graphs = {"ring": gj.topology.ring(n), "exponential": gj.topology.exponential(n)}
  with tempfile.TemporaryDirectory() as tmp:
    exe = pathlib.Path(tmp) / "kernel_schedules"
    flags = ["-O3", "-march=native", "-fopenmp", "-std=c++17", f"-I{jax.ffi.include_dir()}"]
    build = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
      return {"skipped": f"building {SOURCE.name} failed: {build.stderr.strip()[-800:]}"}
    args = [str(n), str(d), str(reps)]
    for name, topology in graphs.items():
      args += [name, *_graph_args(topology)]
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
  r = json.loads(proc.stdout)
  copy = r["cases"]["copy"]
  copy_gbps = copy["passes"] * n * d * 4 / copy["ms"] / 1e6
  for case in r["cases"].values():
    case["gbps"] = case["passes"] * n * d * 4 / case["ms"] / 1e6
    case["fraction_of_copy_bandwidth"] = case["gbps"] / copy_gbps
  return r


def table(r: dict) -> list[str]:
  if "skipped" in r:
    return [f"Kernel schedules: skipped ({r['skipped']})"]
  lines = [f"Native kernel against cut-down schedules, {r['n']} nodes x {r['d']} floats, {r['threads']} threads "
           f"(outside JAX; max |error| vs a float64 reference: "
           + ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_error"].items()) + ")"]
  for name, c in r["cases"].items():
    lines.append(f"  {name:28s} {c['ms']:8.2f} ms  {c['passes']} passes  {c['gbps']:6.1f} GB/s  "
                 f"{c['fraction_of_copy_bandwidth']:.2f} of copy bandwidth")
  return lines
