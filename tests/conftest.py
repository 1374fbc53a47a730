import os
import sys
from pathlib import Path

# 8 CPU devices for the sharded and pmapped backends; XLA reads this when jax first loads.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# Most tests compile a program, run it on a few numbers and drop it: XLA's code-generation optimisations
# (LLVM's) cost more than they save there (about 30% of the CPU time of tests/test_composition.py). JAX's
# jax_disable_most_optimizations turns them off, here and in every process a test launches (the CLI, the MPI
# ranks, the docs' notebooks inherit it); XLA's HLO passes, which decide the programs' collectives, fusions and
# layouts, run as in production; results may round differently in the last bits (bfloat16 the most).
# `JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test` runs the suite fully optimised.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax

# float64 so that trajectories can be compared to NumPy references at round-off, and
# rank promotion raises so that a (nodes,) vs (nodes, d) broadcast slip fails loudly.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

import gossipjax as gj  # noqa: E402

# Before JAX's first computation: collectives over the 8 CPU devices need 16 client threads.
gj.backend.reserve_cpu_threads()

# Test modules in the subfolders import the shared helpers (``_launch``) from here.
sys.path.insert(0, str(Path(__file__).parent))
