"""``python -m benchmarks [--quick] [--gpu] [--only NAME ...] [--json PATH]``: run the suite.

Prints one table per benchmark and writes every figure, with the machine and the date,
as JSON (default ``benchmarks/results.json``). The MPI benchmark (``mpi_gossip``) needs
``mpiexec`` and runs only when named with ``--only mpi_gossip``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import time

from benchmarks import _timing

SUITE = ("optimizer_bandwidth", "dmsgd_step", "memory", "compile_time", "scale", "resnet20_gpu")
OPTIONAL = ("mpi_gossip",)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
  parser.add_argument("--gpu", action="store_true", help="run the ResNet-20 benchmark even without a GPU")
  parser.add_argument("--no-torch", action="store_true", help="leave the PyTorch peers out of dmsgd_step")
  parser.add_argument("--only", nargs="+", choices=SUITE + OPTIONAL, help="run only these benchmarks")
  parser.add_argument("--json", default=str(pathlib.Path(__file__).with_name("results.json")), help="where to write")
  args = parser.parse_args(argv)

  results = {"machine": _timing.machine(), "command": "python -m benchmarks " + " ".join(argv or sys.argv[1:]),
             "quick": args.quick, "benchmarks": {}}
  for name in args.only or SUITE:
    module = importlib.import_module(f"benchmarks.{name}")
    t0 = time.perf_counter()
    if name == "dmsgd_step":
      r = module.run(quick=args.quick, include_torch=not args.no_torch)
    elif name == "resnet20_gpu":
      r = module.run(quick=args.quick, force=args.gpu)
    else:
      r = module.run(quick=args.quick)  # an optional module (mpi_gossip) follows the same run/table shape
    r["wall_s"] = time.perf_counter() - t0
    results["benchmarks"][name] = r
    table = getattr(module, "table", lambda r: [json.dumps(r, default=float)])
    print("\n".join(table(r)), flush=True)
    print(flush=True)
  pathlib.Path(args.json).write_text(json.dumps(results, indent=2, default=float) + "\n")
  print(f"wrote {args.json}")
  return results


if __name__ == "__main__":
  main()
