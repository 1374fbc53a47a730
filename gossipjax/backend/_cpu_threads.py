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
client starts, so it must be set before the client exists. That is the process's choice, not
a side effect of importing gossipjax: an entry point (the CLI, the examples, the tests' conftest)
calls `reserve_cpu_threads` after choosing its device count and before JAX's first computation,
and the sharded and pmapped backends warn, with that line, when the client they run on has too
few threads. The intra-op pool of the same client is sized from the same number; on a machine
with fewer than 2K cores it gets 2K mostly idle threads, which costs little next to a process
that aborts.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Iterable, Mapping

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
  # JAX refuses a new jax_num_cpu_devices once its backends exist, and only then: the one public
  # way to ask without starting them. Where they have not started, the value is put back at once.
  current = jax.config.values["jax_num_cpu_devices"]
  try:
    jax.config.update("jax_num_cpu_devices", current + 1)
  except RuntimeError:
    return True
  jax.config.update("jax_num_cpu_devices", current)
  return False


def reserve_cpu_threads() -> None:
  """Sizes XLA's CPU client for collectives over this process's CPU devices; call before JAX computes.

  Multi-device programs on CPU devices (``--xla_force_host_platform_device_count=K`` or
  ``jax_num_cpu_devices``, a sharded or pmapped backend) need 2K client threads, or a loop
  that queues steps without waiting can deadlock XLA's CPU client (see this module). This sets
  ``PJRT_NPROC`` to 2K where the client would get fewer, unless ``PJRT_NPROC`` is already set.
  Importing gossipjax changes no environment variable; a program that runs several CPU devices
  calls this once, after choosing the device count and before its first JAX computation::

    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import gossipjax as gj
    gj.backend.reserve_cpu_threads()

  Called after JAX has started its CPU client, it changes nothing, and warns
  (``RuntimeWarning``) if that client has too few threads for its devices.

  Example:
    In a process whose JAX has computed already, the call changes nothing:

    >>> import os, jax.numpy as jnp, gossipjax as gj
    >>> _ = jnp.zeros(1)                      # JAX's CPU client has started
    >>> before = os.environ.get("PJRT_NPROC")
    >>> gj.backend.reserve_cpu_threads()
    >>> os.environ.get("PJRT_NPROC") == before
    True
  """
  if _cpu_client_started():
    check_collective_threads(jax.local_devices(), "gj.backend.reserve_cpu_threads (called after JAX started)")
    return
  devices = requested_cpu_devices(num_cpu_devices=jax.config.values["jax_num_cpu_devices"])
  value = pjrt_nproc_setting(devices, os.environ)
  if value is not None:
    os.environ["PJRT_NPROC"] = value


def check_collective_threads(devices: Iterable[Any], where: str) -> None:
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
        f"deadlock and abort on a rendezvous timeout. Fix: call `gj.backend.reserve_cpu_threads()` after choosing the device count and "
        f"before the first JAX computation (or start the process with PJRT_NPROC={threads_needed(k)}).",
        RuntimeWarning,
        stacklevel=2,
    )
