"""What installing and importing gossipjax does to a process: nothing outside the package, and no private imports."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gossipjax"

# A process about to deadlock XLA's CPU client (8 CPU devices, a pool of 8 threads) that never calls
# reserve_cpu_threads: importing every module of gossipjax must leave its environment as JAX's own
# import left it, and building a sharded backend must warn with the line that fixes it.
_IMPORT_CHILD = textwrap.dedent("""
    import json, os, pkgutil, importlib, warnings
    import jax, numpy, optax, scipy
    before = dict(os.environ)
    import gossipjax
    for module in pkgutil.walk_packages(gossipjax.__path__, "gossipjax."):
      if module.name != "gossipjax.__main__":
        importlib.import_module(module.name)
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    removed = sorted(set(before) - set(os.environ))
    mesh = jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      gossipjax.backend.sharded(mesh)
    print(json.dumps({"changed": changed, "removed": removed, "warnings": [str(w.message) for w in caught]}))
""")


def test_importing_gossipjax_changes_no_environment_variable_and_warns_where_the_cpu_pool_is_too_small():
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", NPROC="2", JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _IMPORT_CHILD], env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  seen = json.loads(res.stdout.strip().splitlines()[-1])
  assert seen["changed"] == {} and seen["removed"] == []
  assert any("Fix: call `gj.backend.reserve_cpu_threads()`" in w and "PJRT_NPROC=16" in w for w in seen["warnings"]), \
      seen["warnings"]


def test_no_module_of_gossipjax_imports_a_private_module_of_another_package():
  private = re.compile(r"^\s*(from|import)\s+[\w.]*\b_src\b|import_module\(\s*['\"][\w.]*_src", re.MULTILINE)
  found = [f"{path.relative_to(PACKAGE.parent)}: {m.group(0).strip()}"
           for path in sorted(PACKAGE.rglob("*.py")) for m in private.finditer(path.read_text())]
  assert not found, found
