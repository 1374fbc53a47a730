"""Figure 1 / Table 1 of Zhang, Lian, Zhang and Liu, "Decentralized Distributed Deep Learning":
``python experiments/allreduce_vs_gossip/main.py --out DIR``."""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from allreduce_vs_gossip import train  # noqa: E402
from allreduce_vs_gossip.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json, results.md and the figure")
  parser.add_argument("--quick", action="store_true", help="the few-minute configuration")
  parser.add_argument("--epochs", type=int, help="override the number of epochs")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  if args.epochs is not None:
    config = dataclasses.replace(config, epochs=args.epochs)
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
