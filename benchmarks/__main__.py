"""``python -m benchmarks [--quick] [--gpu] [--only NAME ...] [--json PATH]``: run the suite.

Prints one table per benchmark and writes every figure, with the machine and the date,
as JSON (default ``benchmarks/results/results.json``). The MPI benchmark (``mpi_gossip``) needs
``mpiexec`` and runs only when named with ``--only mpi_gossip`` (4 ranks).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import _timing

SUITE = ("optimizer_bandwidth", "dmsgd_step", "memory", "compile_time", "throughput", "node_parallel",
         "named_axis", "mapping_overhead", "resnet20_gpu", "lm_step", "per_node_conv")
OPTIONAL = ("mpi_gossip",)


def _mpi_gossip(quick: bool) -> dict:
  """``mpiexec -n 4 python benchmarks/mpi_gossip.py``, its JSON read back; skipped without mpiexec.

  Launched twice: with glibc's default malloc settings, and with ``gj.backend.mpi_launch_env``
  (the settings the MPI backend's docs recommend for large messages).
  """
  import gossipjax as gj

  mpiexec = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent))
  if mpiexec is None:
    return {"skipped": "mpiexec not found (pip install 'gossipjax[mpi]', see the Makefile)"}
  results = {}
  for name, extra in (("default_malloc", {}), ("mpi_launch_env", gj.backend.mpi_launch_env)):
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp) / "mpi.json"
      cmd = [mpiexec, "-n", "4", sys.executable, str(pathlib.Path(__file__).with_name("mpi_gossip.py")),
             "--json", str(out)]
      if quick:
        cmd += ["--floats", "4096", "--reps", "3"]
      proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **extra))
      if proc.returncode != 0 or not out.exists():
        return {"skipped": f"mpi_gossip failed (exit {proc.returncode}): {proc.stderr[-500:]}"}
      results[name] = json.loads(out.read_text())
      print(proc.stdout, flush=True)
  return results


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
  parser.add_argument("--gpu", action="store_true", help="run the ResNet-20 benchmark even without a GPU")
  parser.add_argument("--no-torch", action="store_true", help="leave the PyTorch peers out of dmsgd_step")
  parser.add_argument("--reps", type=int, default=None, help="repetitions of the dmsgd_step comparison")
  parser.add_argument("--only", nargs="+", choices=SUITE + OPTIONAL, help="run only these benchmarks")
  parser.add_argument("--json", default=None,
                      help="where to write (default benchmarks/results/results.json, "
                           "or benchmarks/results/results_quick.json with --quick)")
  args = parser.parse_args(argv)
  if args.json is None:
    default = "results_quick.json" if args.quick else "results.json"
    args.json = str(pathlib.Path(__file__).parent / "results" / default)

  results = {"machine": _timing.machine(), "command": "python -m benchmarks " + " ".join(argv or sys.argv[1:]),
             "quick": args.quick, "benchmarks": {}}
  for name in args.only or SUITE:
    t0 = time.perf_counter()
    if name == "mpi_gossip":
      r = _mpi_gossip(args.quick)
      r["wall_s"] = time.perf_counter() - t0
      results["benchmarks"][name] = r
      print(f"MPI gossip round: {json.dumps(r, default=float)}\n", flush=True)
      continue
    module = importlib.import_module(f"benchmarks.{name}")
    if name == "dmsgd_step":
      r = module.run(quick=args.quick, include_torch=not args.no_torch, reps=args.reps)
    elif name == "resnet20_gpu":
      r = module.run(quick=args.quick, force=args.gpu)
    else:
      r = module.run(quick=args.quick)
    r["wall_s"] = time.perf_counter() - t0
    results["benchmarks"][name] = r
    print("\n".join(module.table(r)), flush=True)
    print(flush=True)
  pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.json).write_text(json.dumps(results, indent=2, default=float) + "\n")
  print(f"wrote {args.json}")
  return results


if __name__ == "__main__":
  main()
