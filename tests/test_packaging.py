"""What installing and importing gossipjax does to a process: nothing outside the package, and no private imports."""

import importlib.metadata
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
# import left it, and building a sharded backend must refuse with the line that fixes it.
_IMPORT_CHILD = textwrap.dedent("""
    import json, os, pkgutil, importlib
    import jax, numpy, optax, scipy
    before = dict(os.environ)
    import gossipjax
    for module in pkgutil.walk_packages(gossipjax.__path__, "gossipjax."):
      if module.name != "gossipjax.__main__":
        importlib.import_module(module.name)
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    removed = sorted(set(before) - set(os.environ))
    mesh = jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
    try:
      gossipjax.backend.sharded(mesh)
      refused = ""
    except RuntimeError as e:
      refused = str(e)
    print(json.dumps({"changed": changed, "removed": removed, "refused": refused}))
""")


def test_importing_gossipjax_changes_no_environment_variable_and_refuses_where_the_cpu_pool_is_too_small():
  env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", NPROC="2", JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _IMPORT_CHILD], env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  seen = json.loads(res.stdout.strip().splitlines()[-1])
  assert seen["changed"] == {} and seen["removed"] == []
  assert "call `gj.backend.reserve_cpu_threads()` first" in seen["refused"], seen["refused"]
  assert "PJRT_NPROC=16" in seen["refused"], seen["refused"]


def test_no_module_of_gossipjax_imports_a_private_module_of_another_package():
  private = re.compile(r"^\s*(from|import)\s+[\w.]*\b_src\b|import_module\(\s*['\"][\w.]*_src", re.MULTILINE)
  found = [f"{path.relative_to(PACKAGE.parent)}: {m.group(0).strip()}"
           for path in sorted(PACKAGE.rglob("*.py")) for m in private.finditer(path.read_text())]
  assert not found, found


# The core install: what `pip install gossipjax` brings. The child below runs on a site-packages
# that holds only those distributions (links into this environment's), with Python's own
# site-packages off (-S), so flax, scikit-learn, matplotlib, tqdm and orbax are truly absent.
CORE = {"jax", "optax", "numpy", "scipy", "lazy-loader"}

_CORE_CHILD = textwrap.dedent("""
    import importlib, importlib.util, pkgutil
    import jax, jax.numpy as jnp, optax
    import gossipjax as gj

    TRAIN = ("flax", "sklearn", "matplotlib", "tqdm", "orbax")
    assert not any(importlib.util.find_spec(m) for m in TRAIN), "the train extra is visible"

    def needs_train_extra(call):
      try:
        call()
      except ImportError as e:
        assert "pip install 'gossipjax[train]'" in str(e), e
        return
      raise AssertionError(f"{call} ran without the train extra")

    extra_only = ("gossipjax.train", "gossipjax.__main__")
    for module in pkgutil.walk_packages(gj.__path__, "gossipjax."):
      if module.name.startswith(extra_only):
        needs_train_extra(lambda: importlib.import_module(module.name))
      else:
        importlib.import_module(module.name)
    needs_train_extra(lambda: gj.data.load_digits())
    needs_train_extra(lambda: gj.checkpoint.save("unused", {"w": jnp.ones(2)}, step=0))
    needs_train_extra(lambda: gj.checkpoint.restore("unused", {"w": jnp.ones(2)}))
    from gossipjax import cli
    needs_train_extra(lambda: cli.main(["train", "--help"]))

    n = 8
    W, directed, pairs = gj.topology.ring(n), gj.topology.one_peer_directed_exponential(n), gj.topology.random_pairs(n)
    sgd = optax.sgd(0.1)
    methods = {
        "gossip_sgd": gj.gossip_sgd(W, beta=0.9, learning_rate=0.1),
        "decentlam": gj.decentlam(W, beta=0.9, learning_rate=0.1),
        "allreduce_sgd": gj.allreduce_sgd(learning_rate=0.1, beta=0.9),
        "mix": gj.chain(optax.adam(1e-2), gj.mix(W)),
        "gradient_tracking": gj.gradient_tracking(W, learning_rate=0.1),
        "gradient_tracker": gj.chain(gj.gradient_tracker(W), optax.adam(1e-2), gj.mix(W)),
        "exact_diffusion": gj.exact_diffusion(W, learning_rate=0.1),
        "extra": gj.extra(W, learning_rate=0.1),
        "sgp": gj.sgp(directed, learning_rate=0.1, beta=0.5),
        "choco_sgd": gj.choco_sgd(W, gj.compress.qsgd(4), learning_rate=0.1, consensus_step=0.5, key=1),
        "qg_dmsgd": gj.qg_dmsgd(W, beta=0.9, learning_rate=0.1),
        "periodic_average": gj.chain(gj.gossip_sgd(W, learning_rate=0.1), gj.periodic_average(2)),
        "easgd": gj.easgd(learning_rate=0.1, alpha=0.1, center_rate=0.5, every=2),
        "outer_optimizer": gj.outer_optimizer(sgd, optax.sgd(0.7), inner_steps=2, topology=W),
        "diloco": gj.diloco(sgd, inner_steps=2),
        "noloco": gj.noloco(sgd, pairs, inner_steps=2),
        "streaming_diloco": gj.streaming_diloco(sgd, num_fragments=1, inner_steps=2),
    }
    public = {name for name in gj.algorithms.__all__ if name[0].islower()} | {"mix"}
    assert public == set(methods), f"add to this check: {sorted(public - set(methods))}"
    x = jnp.arange(n * 3.0).reshape(n, 3)
    for name, tx in methods.items():
      updates, _ = jax.jit(tx.update)(x - 1.0, tx.init(x), x)
      assert bool(jnp.isfinite(optax.apply_updates(x, updates)).all()), name
    print("core ok:", len(methods), "methods")
""")


def _core_requirements():
  from packaging.requirements import Requirement

  reqs = [Requirement(r) for r in importlib.metadata.requires("gossipjax") or []]
  return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _distribution_closure(names):
  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name

  found, todo = {}, list(names)
  while todo:
    name = canonicalize_name(todo.pop())
    if name not in found:
      found[name] = importlib.metadata.distribution(name)
      reqs = [Requirement(r) for r in found[name].requires or []]
      todo += [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
  return found


def test_the_core_install_is_jax_optax_numpy_scipy_and_lazy_loader():
  from packaging.utils import canonicalize_name

  assert {canonicalize_name(r.name) for r in _core_requirements()} == CORE


def test_a_core_only_install_imports_every_module_and_steps_every_algorithm(tmp_path):
  site = tmp_path / "site-packages"
  site.mkdir()
  for dist in _distribution_closure(r.name for r in _core_requirements()).values():
    for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
      source = pathlib.Path(dist.locate_file(top))
      if source.exists() and not (site / top).exists():
        (site / top).symlink_to(source)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env.update(PYTHONPATH=f"{site}{os.pathsep}{PACKAGE.parent}", JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-S", "-c", _CORE_CHILD], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=180)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "core ok: 17 methods" in res.stdout


def test_the_lazy_packages_export_what_their_stubs_declare_and_import_nothing_heavy():
  """A name in a package's ``__init__.pyi`` imports (what `import gossipjax` loads on first use) is in its
  ``__all__`` there (what a type checker sees), and ``import gossipjax`` loads no JAX."""
  import ast

  for package in (PACKAGE, PACKAGE / "train"):
    tree = ast.parse((package / "__init__.pyi").read_text())
    imported = {a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    declared = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    assert imported == set(declared), (package.name, imported ^ set(declared))
  child = "import sys, gossipjax, gossipjax.train\nprint(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
  res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
  assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-2000:]
