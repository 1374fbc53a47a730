"""DiLoCo and NoLoCo against gossip and all-reduce AdamW at equal bytes sent per node,
``python experiments/low_communication/main.py --out DIR``."""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from low_communication import train  # noqa: E402
from low_communication.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json, results.md and the figure")
  parser.add_argument("--quick", action="store_true", help="the few-minute configuration")
  parser.add_argument("--steps", type=int, help="override the number of steps")
  parser.add_argument("--partition", choices=("iid", "dirichlet"), help="override the data split")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  overrides = {k: v for k, v in (("steps", args.steps), ("partition", args.partition)) if v is not None}
  config = dataclasses.replace(config, **overrides)
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
