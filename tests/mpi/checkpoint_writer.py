"""One of several processes saving into shared checkpoint directories at the same time.

Usage: python checkpoint_writer.py WRITER START_FILE DIRECTORY STEPS [DIRECTORY STEPS ...]

Waits until START_FILE exists (so that the writers start together), then, for each DIRECTORY
in turn, saves each of its STEPS (comma-separated) with the value ``10 * step + WRITER``, and
prints ``writer WRITER done``.
"""

import os
import sys
import time

import numpy as np

import gossipjax as gj

writer, start, jobs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
while not os.path.exists(start):
  time.sleep(0.01)
for directory, steps in zip(jobs[::2], jobs[1::2]):
  for step in map(int, steps.split(",")):
    value = 10 * step + writer
    gj.checkpoint.save(directory, {"w": np.full((64,), value, np.float32), "step": np.int32(value)}, step=step)
print(f"writer {writer} done", flush=True)
