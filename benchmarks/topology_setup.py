"""Topology setup cost at scale: build + ``check()`` + ``plans()``, seconds and peak memory.

``python -m benchmarks.topology_setup [--nodes 16384 65536] [--families ring ...]``

Each (family, n) runs in a fresh subprocess, so its peak resident memory (``ru_maxrss``)
is its own and a case that runs out of memory or time is reported, not fatal. Not part of
the default suite (``python -m benchmarks``): the dense baseline this was written against
needed gigabytes per case.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

FAMILIES = ("ring", "exponential", "one_peer_exponential", "random_pairs", "torus")
NODES = (16_384, 65_536)


def build(family: str, n: int):
  from gossipjax import topology as T

  if family == "torus":
    rows = 2 ** (int(math.log2(n)) // 2)
    return T.torus(rows, n // rows)
  return getattr(T, family)(n)


def measure(family: str, n: int) -> dict:
  """Times one case in this process (run it in a fresh one: peak RSS is per process)."""
  import gossipjax  # noqa: F401  (import cost is not setup cost)

  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  t0 = time.perf_counter()
  topo = build(family, n)
  t1 = time.perf_counter()
  topo.check("doubly")
  t2 = time.perf_counter()
  plans = topo.plans()
  t3 = time.perf_counter()
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"family": family, "n": n, "build_s": t1 - t0, "check_s": t2 - t1, "plans_s": t3 - t2,
          "total_s": t3 - t0, "peak_rss_mb": peak / 1024, "import_rss_mb": base / 1024,
          "rounds": sum(len(p.rounds) for p in plans)}


def run(families=FAMILIES, nodes=NODES, timeout: float = 300.0) -> list[dict]:
  rows = []
  for n in nodes:
    for family in families:
      cmd = [sys.executable, "-m", "benchmarks.topology_setup", "--one", family, str(n)]
      try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
      except subprocess.TimeoutExpired:
        rows.append({"family": family, "n": n, "error": f"over {timeout:.0f} s"})
        continue
      if out.returncode:
        last = (out.stderr.strip().splitlines() or ["exit " + str(out.returncode)])[-1]
        rows.append({"family": family, "n": n, "error": last[:120]})
      else:
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(table([rows[-1]])[-1], flush=True)
  return rows


def table(rows: list[dict]) -> list[str]:
  lines = [f"{'family':<22s}{'n':>8s}{'build s':>9s}{'check s':>9s}{'plans s':>9s}{'total s':>9s}"
           f"{'peak MB':>9s}"]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['family']:<22s}{r['n']:>8d}  failed: {r['error']}")
    else:
      lines.append(f"{r['family']:<22s}{r['n']:>8d}{r['build_s']:9.3f}{r['check_s']:9.3f}{r['plans_s']:9.3f}"
                   f"{r['total_s']:9.3f}{r['peak_rss_mb']:9.0f}")
  return lines


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
  p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
  p.add_argument("--json", help="also write the rows to this file")
  p.add_argument("--one", nargs=2, metavar=("FAMILY", "N"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.one:
    print(json.dumps(measure(args.one[0], int(args.one[1]))))
    return
  print(table([])[0])
  rows = run(args.families, args.nodes, args.timeout)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
