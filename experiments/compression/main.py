"""CHOCO-SGD with the compressors of `gj.compress`, among them the threshold-at-mean rule of Cui (2019),
"Decentralized Deep Learning with Gradient Compression": test accuracy vs bits sent,
``python experiments/compression/main.py --out DIR``."""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compression import train  # noqa: E402
from compression.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json, results.md and the figure")
  parser.add_argument("--quick", action="store_true", help="the few-minute configuration")
  parser.add_argument("--steps", type=int, help="override the number of steps")
  parser.add_argument("--partition", choices=("iid", "dirichlet"), help="override the data split")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  overrides = {k: v for k, v in (("steps", args.steps), ("partition", args.partition)) if v is not None}
  train.train_and_evaluate(dataclasses.replace(config, **overrides), args.out)


if __name__ == "__main__":
  main()
