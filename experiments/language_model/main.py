"""Data-parallel, decentralized and low-communication AdamW on a byte-level GPT,
``python experiments/language_model/main.py --out DIR``."""

import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from language_model import train  # noqa: E402
from language_model.configs import default, gpu, quick  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="directory for results.json, results.md and the figures")
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="the configuration of the test: seconds")
  size.add_argument("--gpu", action="store_true", help="a larger GPT and more tokens, for one GPU")
  parser.add_argument("--steps", type=int, help="override the number of steps")
  parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gossipjax_language_model_jax_cache"),
                      help="JAX's persistent compilation cache (default: %(default)s)")
  args = parser.parse_args(argv)
  config = (quick if args.quick else gpu if args.gpu else default).get_config()
  if args.steps is not None:
    config = dataclasses.replace(config, steps=args.steps)
  train.enable_compilation_cache(args.cache)
  train.train_and_evaluate(config, args.out)


if __name__ == "__main__":
  main()
