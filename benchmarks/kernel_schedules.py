"""What bounds the native DmSGD kernel: its step against the copy and against cut-down schedules.

Compiles ``kernel_schedules.cc`` (which includes ``gossipjax/_native/circulant_dmsgd.cc`` whole, so
the step timed is the one ``gj.gossip_sgd_step`` runs) and times, outside JAX, in one run:
the in-place copy, the no-mixing update, the library's step on the ring, the exponential
graph and two steps of the one-peer exponential graph (shifts 2 and n/2: the rows form rings along
cycles of stride 2, and pairs), and for the exponential graph two schedules cut down from the kernel's own plan: each
output reading only its own row back from scratch (the cost of sending every row through
scratch and writing it later), the mixing alone (its cache reads, no local steps), and the
library's step with other column blocks than the one it picks (1,024, 2,048 and 8,192 columns).
Two read-only sums (over x; over x, m and g) time the reads alone: where a loop's writes back ride
along with its reads, as on this machine, the three reads every step must make are its floor, and
the table says how far above that floor the 80% line lies.
The copy, the no-mixing update, the reads and each graph's step run again on one thread: what one core
can do on its own tells a step bound by memory from one bound by the work on the core.
Each step is first checked against a double-precision reference.

A second run times the same cases (the exponential graph's, no ring) on rows short enough that
x, m and g stay in the last-level cache (``in_cache``: 64 x 16,384 floats, 12 MiB), scaled to
the full problem: the work on the cores alone, with no memory stream to wait for. A step whose
in-cache time is near the time the 80% target allows can reach the target only if its memory
stream and its work on the cores overlap almost perfectly.
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


def _graph_args(topology, step: int = 0) -> list[str]:
  shifts, weights, self_weight = _circulant(topology.plans()[step])
  return [",".join(map(str, shifts)), ",".join(repr(w) for w in weights), repr(self_weight)]


def _fractions(r: dict, n: int, d: int, scale: int, copy_gbps: float | None = None) -> float:
  """Adds each case's GB/s (its passes over n x d floats) and its fraction of the copy's."""
  for case in r["cases"].values():
    case["ms"] *= scale  # to the full problem
    case["gbps"] = case["passes"] * n * d * scale * 4 / case["ms"] / 1e6
  copy_gbps = copy_gbps or r["cases"]["copy"]["gbps"]
  for case in r["cases"].values():
    case["fraction_of_copy_bandwidth"] = case["gbps"] / copy_gbps
  return copy_gbps


def run(quick: bool = False) -> dict:
  n, d, reps = (8, 1 << 14, 3) if quick else (64, 1 << 20, 11)
  d_cached = 1 << 10 if quick else 1 << 14  # n x d_cached x 3 floats: 12 MiB at n = 64
  cxx = _native._compiler()
  if cxx is None:
    return {"skipped": "no C++ compiler found (set CXX, or install g++)"}
  graphs = {"ring": gj.topology.ring(n), "exponential": gj.topology.exponential(n)}
  one_peer = gj.topology.one_peer_exponential(n)  # W(k) = (I + P^(2^k)) / 2: rings along cycles of stride 2^k
  rounds = {f"one_peer_shift_{2**k}": k for k in (1, one_peer.period - 1)}
  with tempfile.TemporaryDirectory() as tmp:
    exe = pathlib.Path(tmp) / "kernel_schedules"
    flags = ["-O3", "-march=native", "-fopenmp", "-std=c++17", f"-I{jax.ffi.include_dir()}"]
    build = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
      return {"skipped": f"building {SOURCE.name} failed: {build.stderr.strip()[-800:]}"}
    args = [str(n), str(d), str(reps)]
    for name, topology in graphs.items():
      args += [name, *_graph_args(topology)]
    for name, k in rounds.items():
      args += [name, *_graph_args(one_peer, k)]
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
    # Each in-cache step takes d_cached / d of the full one: more rounds for as steady a median.
    cached = [str(n), str(d_cached), str(reps * 8), "exponential", *_graph_args(graphs["exponential"])]
    proc_cached = subprocess.run([str(exe), *cached], capture_output=True, text=True, check=True)
  r = json.loads(proc.stdout)
  copy_gbps = _fractions(r, n, d, 1)
  in_cache = json.loads(proc_cached.stdout)
  _fractions(in_cache, n, d_cached, d // d_cached, copy_gbps)
  c = r["cases"]  # the 80% line: a step's passes (no_mixing's) at 80% of the copy's bandwidth
  line = c["copy"]["ms"] * c["no_mixing"]["passes"] / c["copy"]["passes"] / 0.8
  floor = c["read_three"]["ms"]
  r["read_floor"] = {"read_three_ms": floor, "line_80_ms": line, "line_over_read_floor": line / floor,
                     "step_over_read_floor": {g: c[g]["ms"] / floor for g in r["max_abs_error"]}}
  r["in_cache"] = {"d": d_cached, "cases": in_cache["cases"],
                   "note": "ms scaled to n x d; fraction_of_copy_bandwidth against the copy from memory above"}
  return r


def _row(name: str, c: dict) -> str:
  return (f"  {name:34s} {c['ms']:8.2f} ms  {c['passes']} passes  {c['gbps']:6.1f} GB/s  "
          f"{c['fraction_of_copy_bandwidth']:.2f} of copy bandwidth")


def table(r: dict) -> list[str]:
  if "skipped" in r:
    return [f"Kernel schedules: skipped ({r['skipped']})"]
  lines = [f"Native kernel against cut-down schedules, {r['n']} nodes x {r['d']} floats, {r['threads']} threads "
           f"(outside JAX; max |error| vs a float64 reference: "
           + ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_error"].items()) + ")"]
  lines += [_row(name, c) for name, c in r["cases"].items()]
  fl = r["read_floor"]
  lines.append(f"  The step's floor, reading x, m and g: {fl['read_three_ms']:.2f} ms; the 80% line, {fl['line_80_ms']:.2f} ms, "
               f"is {fl['line_over_read_floor']:.2f}x that floor; each step's time over the floor: "
               + ", ".join(f"{g} {v:.2f}x" for g, v in fl["step_over_read_floor"].items()))
  cached = r["in_cache"]
  lines.append(f"The same on {r['n']} x {cached['d']} floats, in cache, times scaled to {r['n']} x {r['d']} "
               "(fractions of the copy from memory above):")
  lines += [_row(name + "_in_cache", c) for name, c in cached["cases"].items()]
  return lines
