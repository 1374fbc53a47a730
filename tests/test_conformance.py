"""The conformance matrix: every public method on every backend, in float32 and bfloat16, fresh and restored.

One test per backend runs every method of ``gossipjax/__init__.py`` (the cases live in
``tests/mpi/conformance_cases.py``, shared with the MPI launch) in both dtypes, once from
the start and once from a checkpoint restored mid-run, and reports every case that raises or
differs from the simulation at once, each by method, backend, dtype and run. A feature built
on one path and missing on another is found here, not by a user. 8 nodes everywhere: one a
device, two a device (on 4 devices), two a node of 2 devices, and 4 an MPI rank.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import gossipjax as gj

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import conformance_cases as cc  # noqa: E402

N = cc.N


@functools.cache
def _simulation() -> dict:
  return cc.run_all(cc.Harness("simulate", gj.backend.simulate(), N))


def _sharded(devices: int, axis_type: jax.sharding.AxisType) -> cc.Harness:
  mesh = jax.make_mesh((devices,), ("nodes",), axis_types=(axis_type,), devices=jax.devices()[:devices])
  be = gj.backend.sharded(mesh)
  return cc.Harness("sharded", be, N, place=be.shard, place_data=be.shard_batch, settle=cc.settle_on(mesh, "nodes", N))


def _hierarchical() -> cc.Harness:
  be = gj.backend.hierarchical(2)  # 8 devices: 4 nodes of 2 devices, each holding 2 of the 8 nodes
  return cc.Harness("hierarchical", be, N, place=be.shard, place_data=be.shard_batch,
                    settle=cc.settle_on(be.mesh, "nodes", N))


def _pmapped(devices: int = 4) -> cc.Harness:
  # (n, ...) -> (devices, n / devices, ...): device d holds nodes d*B ... d*B + B - 1, placed as the pmap returns them
  on_devices = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:devices], ("devices",)),
                                          jax.sharding.PartitionSpec("devices"))

  def blocks(tree):
    return jax.tree.map(lambda v: jax.device_put(np.asarray(v).reshape((devices, -1) + np.shape(v)[1:]), on_devices),
                        tree)

  def pmap(fn):  # jax.pmap is jit of shard_map: the outer jit changes nothing but takes the compiler options
    return cc.jit(jax.pmap(fn, axis_name="devices", devices=jax.devices()[:devices]))

  def rows(x):
    return cc.flat(jax.tree.map(lambda v: np.asarray(v).reshape((N,) + v.shape[2:]), x))

  return cc.Harness("pmapped", gj.backend.pmapped("devices", axis_size=devices), N, place=blocks, place_data=blocks,
                    wrap=pmap, wrap_init=pmap, precompile=False, rows=rows)


HARNESSES = {
    "sharded-1-per-device": lambda: _sharded(8, jax.sharding.AxisType.Auto),  # as `gossipjax train` builds it
    "sharded-2-per-device": lambda: _sharded(4, jax.sharding.AxisType.Explicit),  # jax.make_mesh's default
    "hierarchical": _hierarchical,
    "pmapped": _pmapped,
}

# Holes a fix has yet to close: (method, backend, what its failing lines say) -> the hole. Each
# is a strict xfail: once its lines are gone, the test fails until the entry is removed.
KNOWN: dict[tuple[str, str, str], str] = {}


def _assert_conforms(backend: str, errors: list[str]) -> None:
  known = [(m, says) for m, b, says in KNOWN if b == backend]
  is_known = lambda line: any(line.startswith(f"{m} / ") and says in line for m, says in known)
  unknown = [line for line in errors if not is_known(line)]
  assert not unknown, f"{len(unknown)} case(s) do not conform:\n" + "\n".join(unknown)
  gone = [(m, says) for m, says in known if not any(line.startswith(f"{m} / ") and says in line for line in errors)]
  assert not gone, f"these conform on {backend} now, remove them from KNOWN: {gone}"
  if known:
    holes: dict[str, list[str]] = {}
    for m, says in known:
      holes.setdefault(KNOWN[m, backend, says], []).append(m)
    pytest.xfail("; ".join(f"{', '.join(sorted(ms))} on {backend}: {hole}" for hole, ms in holes.items()))


def test_the_matrix_has_a_row_for_every_public_method():
  """A method added to gj.algorithms (or gj.mix) without a row here fails, so the matrix cannot fall behind."""
  public = {name for name in gj.algorithms.__all__ if name[0].islower()} | {"mix"}
  assert public == set(cc.methods(N)), public ^ set(cc.methods(N))


def test_every_method_conforms_on_simulate():
  """The reference itself: a run restored mid-way equals the uninterrupted one."""
  sim = _simulation()
  _assert_conforms("simulate", cc.check("simulate", sim, sim))


@pytest.mark.parametrize("backend", list(HARNESSES))
def test_every_method_conforms(backend):
  assert jax.device_count() >= 8
  h = HARNESSES[backend]()
  _assert_conforms(backend, cc.check(backend, cc.run_all(h), _simulation(), h.held))


@pytest.mark.mpi
def test_every_method_conforms_under_mpi():
  """One ``mpiexec -n 2`` launch runs the whole matrix, 4 nodes a rank."""
  from _launch import mpiexec, run

  script = Path(__file__).parent / "mpi" / "check_conformance.py"
  res = run([*mpiexec(2), sys.executable, script], timeout=300, cwd=script.parent)
  assert res.returncode == 0, res.stdout[-6000:]
  assert sorted(re.findall(r"^rank (\d)/2: OK", res.stdout, flags=re.MULTILINE)) == ["0", "1"], res.stdout[-6000:]
