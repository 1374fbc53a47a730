"""Enough XLA:CPU client threads that multi-device steps queued ahead of the host cannot starve.

XLA's CPU client (as of jaxlib 0.10.2) runs two kinds of work on one pool of
``max(cores, K)`` threads, K being the process's CPU devices:

- the launch of each device's share of a multi-device program (a ``jax.jit`` of a
  ``shard_map``, a ``jax.pmap``). Before it hands the program on, the launch waits on a
  per-device semaphore of 32 programs in flight, holding its pool thread while it waits;
- the device programs themselves, where a collective (``ppermute``, ``psum``) holds its pool
  thread until all K participants arrive.

A training loop that does not wait on each step runs ahead of the devices. Once 32 steps
are queued, the launch of the next step on device d holds a thread until d's oldest step
finishes; the K - 1 other devices' oldest steps hold the remaining K - 1 threads, waiting in
their collective for device d; and device d's oldest step is queued with no thread to run
on. Nothing moves until XLA's rendezvous timeout aborts the process ("Expected 8 threads
to join the rendezvous, but only 7 of them arrived"). It hits any multi-device program with
a collective, gossipjax's or not, on simulated CPU devices
(``--xla_force_host_platform_device_count``) whenever 2K exceeds the cores, and with
several CPU devices per process under ``jax.distributed``.

At most K launches wait at once (the host dispatches one program at a time and waits for
its K launches) and the devices run one step at a time, so 2K threads always leave a free
one for the step every other device waits for. XLA sizes the pool from the ``PJRT_NPROC``
environment variable (else ``NPROC``, else the cores the process may run on) when the CPU
client starts, so gossipjax sets ``PJRT_NPROC`` when it is imported, before the client
exists. The intra-op pool of the same client is sized from the same number; on a machine
with fewer than 2K cores it gets 2K mostly idle threads, which costs little next to a
process that aborts.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Iterable, Mapping

import jax

# The depth of the per-device semaphore: fewer queued steps than this never wait on it.
MAX_INFLIGHT_PER_DEVICE = 32

_FORCED_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def threads_needed(local_devices: int) -> int:
  """Pool threads that K local CPU devices need: K waiting launches plus one step on each device."""
  return 2 * local_devices


def _as_int(value: str | None) -> int | None:
  try:
    return int(value) if value is not None else None
  except ValueError:
    return None


def _usable_cores() -> int:
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def pool_size(local_devices: int, env: Mapping[str, str] | None = None, cores: int | None = None) -> int:
  """The pool XLA's CPU client starts with for ``local_devices`` devices under ``env``."""
  env = os.environ if env is None else env
  base = _as_int(env.get("PJRT_NPROC"))
  if base is None:
    base = _as_int(env.get("NPROC"))
  if base is None:
    base = _usable_cores() if cores is None else cores
  return max(base, local_devices)


def requested_cpu_devices(env: Mapping[str, str] | None = None, num_cpu_devices: int = -1) -> int:
  """How many CPU devices the client will create, from ``jax_num_cpu_devices`` or ``XLA_FLAGS``."""
  if num_cpu_devices >= 0:
    return num_cpu_devices
  env = os.environ if env is None else env
  found = _FORCED_DEVICES.findall(env.get("XLA_FLAGS", ""))
  return int(found[-1]) if found else 1


def pjrt_nproc_setting(local_devices: int, env: Mapping[str, str], cores: int | None = None) -> str | None:
  """The ``PJRT_NPROC`` value to set, or None where the pool is already large enough or the user chose it."""
  if _as_int(env.get("PJRT_NPROC")) is not None:
    return None
  need = threads_needed(local_devices)
  return str(need) if pool_size(local_devices, env, cores) < need else None


def _cpu_client_started() -> bool:
  # No public JAX call answers this without starting the backends; jax_num_cpu_devices uses the same check.
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False


def reserve_collective_threads() -> None:
  """Sets ``PJRT_NPROC`` for the CPU devices this process asked for, if XLA's CPU client has not started."""
  if _cpu_client_started():
    return  # too late for this client; check_collective_threads warns where it matters
  devices = requested_cpu_devices(num_cpu_devices=jax.config.jax_num_cpu_devices)
  value = pjrt_nproc_setting(devices, os.environ)
  if value is not None:
    os.environ["PJRT_NPROC"] = value


def check_collective_threads(devices: Iterable[jax.Device], where: str) -> None:
  """Warns when this process's CPU client has too few threads for collectives over ``devices``."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  if not local or local[0].platform != "cpu":
    return
  k = len(local)
  pool = pool_size(len(jax.local_devices(backend="cpu")))
  if pool < threads_needed(k):
    warnings.warn(
        f"{where}: XLA's CPU client has {pool} threads for collectives over {k} local CPU devices; with more "
        f"than {MAX_INFLIGHT_PER_DEVICE} steps queued (a loop that does not wait on each step) it can "
        f"deadlock and abort on a rendezvous timeout. gossipjax sizes the client on import, from XLA_FLAGS or "
        f"jax_num_cpu_devices; this one started before that import or got its device count after it. Import "
        f"gossipjax after choosing the device count and before the first JAX computation, or set "
        f"PJRT_NPROC={threads_needed(k)} in the environment before JAX starts.",
        RuntimeWarning,
    )
