"""For one GPU: a 6-layer GPT of width 256 (about 4.8 M parameters), context 256, 2,000 steps in bfloat16."""

import dataclasses

from language_model.configs import default


def get_config() -> default.Config:
  return dataclasses.replace(default.get_config(), steps=2000, global_batch=256, context=256, layers=6, width=256,
                             heads=8, compute_dtype="bfloat16", max_bytes=None, test_windows=512, inner_steps=100,
                             log_every=100)
