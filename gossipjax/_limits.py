"""Bounds shared by the checks and the command line, importable without JAX."""

MAX_PERIOD = 2**31 - 1  # the largest period an int32 step counter reaches
