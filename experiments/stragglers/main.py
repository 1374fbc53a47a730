"""Table 2 of Zhang, Lian, Zhang and Liu, "Decentralized Distributed Deep Learning" (one slow learner
in 16): ``python experiments/stragglers/main.py --out DIR``."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stragglers import train  # noqa: E402
from stragglers.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json and the figure")
  parser.add_argument("--quick", action="store_true", help="the few-minute configuration")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
