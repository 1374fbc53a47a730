import jax

# float64 so that trajectories can be compared to NumPy references at round-off, and
# rank promotion raises so that a (nodes,) vs (nodes, d) broadcast slip fails loudly.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
