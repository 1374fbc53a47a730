"""DmSGD vs DecentLaM vs PmSGD as the total batch grows (Kun Yuan, "Decentralized Optimization Algorithms
for Large-Scale Deep Neural Network Training", lecture, 2021).

``python experiments/large_batch/main.py --out DIR [--quick] [--data-dir CIFAR10_DIR]``
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from large_batch import train  # noqa: E402
from large_batch.configs import default, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory for results.json, results.md and the figure")
  parser.add_argument("--quick", action="store_true", help="the few-minute configuration")
  parser.add_argument("--data-dir", help="CIFAR-10 in python-pickle format (data_batch_*, test_batch)")
  parser.add_argument("--width", type=int, help="first-stage channels of the ResNet-20 (16 in the paper)")
  parser.add_argument("--epochs", type=float, help="epochs per run")
  parser.add_argument("--total-batches", type=int, nargs="+", help="total batch sizes (over all nodes)")
  parser.add_argument("--nodes", type=int, help="number of nodes")
  args = parser.parse_args(argv)
  config = (quick if args.quick else default).get_config()
  overrides = dict(data_dir=args.data_dir, width=args.width, epochs=args.epochs, num_nodes=args.nodes,
                   total_batches=tuple(args.total_batches) if args.total_batches else None)
  config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
