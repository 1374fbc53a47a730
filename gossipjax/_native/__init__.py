"""Native CPU kernels for the simulation, built with the system C++ compiler at first use.

``load()`` compiles ``circulant_dmsgd.cc`` against the XLA FFI headers that ship with jaxlib
(``jax.ffi.include_dir()``), caches the shared library on disk (``$GOSSIPJAX_CACHE_DIR``, else
``~/.cache/gossipjax``; one file per source, jaxlib version and machine) and registers it as
an XLA custom call on the CPU. Where no compiler is found or the build fails, ``load()`` says
why and callers fall back to the same step written in JAX.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

SOURCE = pathlib.Path(__file__).with_name("circulant_dmsgd.cc")
TARGET = "gossipjax_circulant_dmsgd"
SYMBOL = "GossipjaxCirculantDmsgd"


@dataclasses.dataclass(frozen=True)
class NativeStatus:
  """Whether the native kernel is registered, and if not, why."""

  available: bool
  reason: str
  library: str | None = None


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("GOSSIPJAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "gossipjax")


def _compiler() -> str | None:
  return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _flags(include: str) -> list[str]:
  # -march=native: the library is built on (and cached for) the machine that runs it.
  return ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", f"-I{include}"]


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith(("flags", "model name"))), "")
  except OSError:
    return platform.processor()


def build(cxx: str) -> pathlib.Path | str:
  """The cached shared library, compiling it with ``cxx`` if needed; a string says why it failed."""
  flags = _flags(jax.ffi.include_dir())
  key = hashlib.sha256(
      SOURCE.read_bytes() + jax.__version__.encode() + " ".join(flags).encode() + _cpu_id().encode()
  ).hexdigest()[:16]
  lib = cache_dir() / f"circulant_dmsgd-{key}.so"
  if lib.exists():
    return lib
  try:
    lib.parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    return f"cannot create the cache directory {lib.parent} (set GOSSIPJAX_CACHE_DIR): {e}"
  with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
    out = pathlib.Path(tmp) / lib.name
    try:
      proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
    except OSError as e:
      return f"running the C++ compiler {cxx!r} failed: {e}"
    if proc.returncode != 0 or not out.exists():
      return f"building {SOURCE.name} with {cxx} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    os.replace(out, lib)  # atomic: several processes may build at once
  return lib


@functools.cache
def load() -> NativeStatus:
  """Builds (once, cached on disk) and registers the kernel; never raises."""
  if os.environ.get("GOSSIPJAX_NO_NATIVE"):
    return NativeStatus(False, "disabled by GOSSIPJAX_NO_NATIVE")
  if platform.system() != "Linux":
    return NativeStatus(False, f"native kernels are built on Linux only (this is {platform.system()})")
  cxx = _compiler()
  if cxx is None:
    return NativeStatus(False, "no C++ compiler found (set CXX, or install g++)")
  lib = build(cxx)
  if isinstance(lib, str):
    return NativeStatus(False, lib)
  try:
    handler = getattr(ctypes.cdll.LoadLibrary(str(lib)), SYMBOL)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  except (OSError, AttributeError) as e:
    return NativeStatus(False, f"loading {lib} failed: {e}")
  return NativeStatus(True, "built and registered", str(lib))
