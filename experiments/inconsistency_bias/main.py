"""The inconsistency-bias verification of Yuan (2021), "Decentralized Optimization Algorithms for Large-Scale
Deep Neural Network Training": ``python experiments/inconsistency_bias/main.py --out DIR``."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inconsistency_bias import train  # noqa: E402
from inconsistency_bias.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json and the figures")
  parser.add_argument("--quick", action="store_true", help="the under-a-minute configuration")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
