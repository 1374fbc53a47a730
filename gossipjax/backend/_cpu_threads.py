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
calls `reserve_cpu_threads` after choosing its device count and before JAX's first computation.
The library refuses, in one line that gives that call, to run collectives over CPU devices on a
client with too few threads: by then the client has started and cannot grow, and the
alternative is a run that stalls for XLA's rendezvous timeout and aborts. The sharded and
pmapped backends check their devices when they are built (`check_collective_threads`); every
entry that takes the user's node-stacked arrays as they are placed (the simulation backend's
mixing, mean, gather and ``map``, ``gj.nodes`` / ``gj.chain``, the stacked transforms' ``init``,
`gj.node_mean` and the stacked metrics) checks the CPU devices they are placed on
(`check_placed_threads`): eagerly from each array's sharding, and under ``jax.jit`` from its
sharding type, whose mesh JAX keeps on Auto meshes too, once per trace. The intra-op pool of
the same client is sized from the same number; on a machine with fewer than 2K cores it gets
2K mostly idle threads, which costs little next to a process that aborts.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Any, Iterable, Mapping

import jax

from gossipjax.backend._base import _sharding_of

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
  (``RuntimeWarning``) if that client has too few threads for its devices (on which the
  sharded and pmapped backends then refuse to run).

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
    _warn_if_short(jax.local_devices(), "gj.backend.reserve_cpu_threads (called after JAX started)")
    return
  devices = requested_cpu_devices(num_cpu_devices=jax.config.values["jax_num_cpu_devices"])
  value = pjrt_nproc_setting(devices, os.environ)
  if value is not None:
    os.environ["PJRT_NPROC"] = value


_enough_counted: int | None = None  # a pool counted large enough for every CPU device of this process


def live_pool_size() -> int | None:
  """The running CPU client's pool, counted from its threads where ``/proc`` lists them, else ``None``.

  XLA names the threads of the pool it sizes from ``PJRT_NPROC`` "XLAEigen"; counting them reads
  what the client started with, whatever the environment says now. A count large enough for all
  of this process's CPU devices is kept: the pool never shrinks, and counting takes milliseconds.
  """
  global _enough_counted
  if _enough_counted is not None:
    return _enough_counted
  tasks = "/proc/self/task"
  try:
    ids = os.listdir(tasks)
  except OSError:
    return None
  count = 0
  for tid in ids:
    try:
      with open(f"{tasks}/{tid}/comm") as f:
        count += "XLAEigen" in f.read()
    except OSError:
      pass  # a thread that ended while listing
  # A smaller count is read again next time: it may be a pool whose threads are not all named yet.
  if count >= threads_needed(len(jax.local_devices(backend="cpu"))):
    _enough_counted = count
  return count or None


def _shortfall_of(k: int) -> tuple[int, int, int] | None:
  """``(pool, needed, k)`` where collectives over k >= 2 of this process's CPU devices lack threads."""
  pool = live_pool_size() or pool_size(len(jax.local_devices(backend="cpu")))
  return (pool, threads_needed(k), k) if pool < threads_needed(k) else None


def _shortfall(devices: Iterable[Any]) -> tuple[int, int, int] | None:
  """``(pool, needed, K)`` where collectives over this process's ``devices`` (K >= 2 CPU ones) lack threads."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  if len(local) < 2 or local[0].platform != "cpu":
    return None  # one device waits on no other; accelerators run collectives off this pool
  return _shortfall_of(len(local))


def _refusal(where: str, pool: int, need: int, k: int) -> RuntimeError:
  return RuntimeError(
      f"{where}: XLA's CPU client has {pool} threads, but collectives over {k} CPU devices need {need} (a loop that "
      f"queues more than {MAX_INFLIGHT_PER_DEVICE} steps would deadlock); it started with JAX and cannot grow now: "
      f"call `gj.backend.reserve_cpu_threads()` first, after setting the device count and before any JAX call "
      f"(jax.devices(), jax.make_mesh, an array), or start the process with PJRT_NPROC={need}")


def check_collective_threads(devices: Iterable[Any], where: str) -> None:
  """Refuses collectives over ``devices`` where this process's CPU client has too few threads for them.

  Raises:
    RuntimeError: K >= 2 of ``devices`` are this process's CPU devices and its CPU client has
      fewer than 2K threads; the message gives the call that sizes the client, which must come
      before JAX's first computation, since the client cannot grow once started.
  """
  short = _shortfall(devices)
  if short is not None:
    raise _refusal(where, *short)


@functools.lru_cache(maxsize=256)
def _local_cpu_devices(sharding: Any) -> int:
  """How many of this process's CPU devices a program over arrays of ``sharding`` runs on."""
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):  # a sharding type under jit: a size and a platform, no devices
    device = mesh.abstract_device
    if mesh.empty or device is None or device.platform != "cpu":
      return 0
    # A mesh of several processes has fewer devices here: an upper bound, which the reservation meets.
    return min(mesh.size, len(jax.local_devices(backend="cpu")))
  devices = getattr(sharding, "device_set", ())
  return sum(d.platform == "cpu" and d.process_index == jax.process_index() for d in devices)


def placed_cpu_devices(tree: Any) -> int:
  """The most of this process's CPU devices that one leaf of ``tree`` is placed on (0 for none).

  Reads a concrete array's sharding, or under ``jax.jit`` its sharding type, whose mesh JAX keeps
  on Auto meshes too; host values (NumPy arrays, Python numbers) are placed nowhere.
  """
  most = 0
  for leaf in jax.tree.leaves(tree):
    sharding = _sharding_of(leaf)
    if sharding is not None:
      most = max(most, _local_cpu_devices(sharding))
  return most


def check_placed_threads(tree: Any, where: str) -> None:
  """Refuses to compute on ``tree`` where its leaves span CPU devices whose client has too few threads.

  What the library calls where it takes the user's node-stacked arrays as they are placed (the
  simulation backend, ``gj.nodes``, the stacked transforms' ``init``, the stacked metrics): params
  placed on a mesh of K >= 2 CPU devices make every step a K-device program, whatever the backend.
  Cheap: a look at each leaf's sharding (under ``jax.jit`` once per trace).

  Raises:
    RuntimeError: a leaf spans K >= 2 of this process's CPU devices and its CPU client has fewer
      than 2K threads; the message is `check_collective_threads`'s, with the call that sizes the client.
  """
  k = placed_cpu_devices(tree)
  if k < 2:
    return
  short = _shortfall_of(k)
  if short is not None:
    raise _refusal(f"{where} (arrays placed on {k} CPU devices)", *short)


def _warn_if_short(devices: Iterable[Any], where: str) -> None:
  short = _shortfall(devices)
  if short is not None:
    pool, need, k = short
    warnings.warn(f"{where}: XLA's CPU client has {pool} threads and collectives over {k} CPU devices need "
                  f"{need}; it started with JAX and cannot grow now: call `gj.backend.reserve_cpu_threads()` before "
                  f"the first JAX call, or start the process with PJRT_NPROC={need}. The sharded and pmapped "
                  "backends refuse to run on it.", RuntimeWarning, stacklevel=3)
