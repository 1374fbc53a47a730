"""Interleaved timing, copy bandwidth and machine facts shared by the benchmarks."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


def wait_until_quiet(window: float = 0.005, busy: float = 0.1, timeout: float = 2.0, quiet_windows: int = 3) -> float:
  """Waits until this process's threads use under ``busy`` of one core over ``quiet_windows`` windows in a row.

  One quiet window is not enough on a loaded machine: a busy thread that the OS happens not
  to schedule for ``window`` seconds looks idle. Returns the seconds waited (at most about
  ``timeout``, after which it gives up quietly).
  """
  start = time.perf_counter()
  quiet = 0
  while time.perf_counter() - start < timeout:
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(window)
    quiet = quiet + 1 if time.process_time() - cpu < busy * (time.perf_counter() - wall) else 0
    if quiet == quiet_windows:
      break
  return time.perf_counter() - start


def interleaved(steps: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                settle: float = 0.02, quiet_timeout: float = 2.0) -> dict[str, float]:
  """Median seconds per call of each step, calling them in turn ``reps`` times.

  Each step is a stateful closure that runs one call to completion (it blocks) and keeps
  its own (donated) buffers. Interleaving means a burst of load from other processes hits
  every contender alike, so the ratios hold even where the absolute times wander. The
  order rotates every repetition. Before each call this process must go quiet (see
  `wait_until_quiet`: a call can return while its runtime still works on another thread for
  longer than the pause; after the optax step on the one-peer exponential graph, one of the
  runtime's threads stayed busy for 30-45 ms and slowed whatever ran next), then a
  short untimed pause lets the previous contender's worker threads (OpenMP spins after a
  torch call) go idle. That leftover work is left out of every contender's time, so the
  contender that caused it gets the benefit, not the next one the cost. A process that is
  never quiet (a runtime thread that polls all the time) would pay ``quiet_timeout`` per
  call: after one wait that long, the rest of the run only pauses.
  """
  for _ in range(warmup):
    for step in steps.values():
      step()
  names = list(steps)
  times: dict[str, list[float]] = {name: [] for name in steps}
  wait = True
  for rep in range(reps):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      step = steps[name]
      if wait and wait_until_quiet(timeout=quiet_timeout) >= quiet_timeout:
        wait = False
      time.sleep(settle)
      t0 = time.perf_counter()
      step()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(ts) for name, ts in times.items()}


def copy_step(shape: tuple[int, ...], dtype=jnp.float32) -> tuple[Callable[[], object], int]:
  """A stateful in-place copy-like pass over a buffer, and the bytes it moves per call.

  ``x * c`` with ``c`` a traced scalar (1.0 at run time) cannot be simplified away by XLA,
  and donating ``x`` lets it write in place, as a donated optimizer step does.
  """
  f = jax.jit(lambda x, c: x * c, donate_argnums=0)
  state = {"x": jnp.ones(shape, dtype)}
  one = jnp.asarray(1.0, dtype)

  def step():
    state["x"] = f(state["x"], one)
    jax.block_until_ready(state["x"])

  return step, 2 * state["x"].size * state["x"].dtype.itemsize


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def machine() -> dict:
  """What the figures were measured on."""
  dev = jax.devices()[0]
  return {
      "date": datetime.date.today().isoformat(),
      "platform": dev.platform,
      "device": getattr(dev, "device_kind", str(dev)),
      "cpu_count": os.cpu_count(),
      "processor": platform.processor() or platform.machine(),
      "python": platform.python_version(),
      "jax": jax.__version__,
  }
