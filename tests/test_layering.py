"""The import layering: no package imports another package's private module.

A package is a subpackage of gossipjax (gossipjax/backend, gossipjax/mixing, ...). The rule: a module may import
from its own package anything, and from another package only the names its ``__init__`` exports (an import path
with no ``_private`` part past the package). The top-level private modules gossipjax/_x.py are the shared core:
any package may import them. KNOWN lists the cross-imports that stand today, to be removed one by one; a new one
fails here. Parsed with ``ast``: no JAX.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gossipjax"

KNOWN = {
    ('gossipjax/_guard.py', 'gossipjax.backend._base.follow_placement'),
    ('gossipjax/_mapping.py', 'gossipjax.backend._base.mesh_of_explicit'),
    ('gossipjax/_mapping.py', 'gossipjax.backend._sharded.conform'),
    ('gossipjax/_mapping.py', 'gossipjax.backend._sharded.leaf_spec'),
    ('gossipjax/_stacked.py', 'gossipjax.backend._base.auto_where_explicit'),
    ('gossipjax/_stacked.py', 'gossipjax.backend._cpu_threads.check_placed_threads'),
    ('gossipjax/_stacked.py', 'gossipjax.backend._precision.mean_terms'),
    ('gossipjax/_stacked.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_allreduce_sgd.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.compress._base.Identity'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.compress._base.leaf_keys'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.mixing._collectives.node_index'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.mixing._collectives.node_shape'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.mixing._node_mixer.NodeMixer'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.mixing._stacked_adapter.on_nodes'),
    ('gossipjax/algorithms/_choco.py', 'gossipjax.topology._plan.plan_from_edges'),
    ('gossipjax/algorithms/_common.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_compressed_mean.py', 'gossipjax.mixing._collectives.gathered_nodes'),
    ('gossipjax/algorithms/_compressed_mean.py', 'gossipjax.mixing._collectives.node_all_to_all'),
    ('gossipjax/algorithms/_compressed_mean.py', 'gossipjax.mixing._collectives.node_gather'),
    ('gossipjax/algorithms/_compressed_mean.py', 'gossipjax.mixing._contract.accumulation_dtype'),
    ('gossipjax/algorithms/_compressed_mean.py', 'gossipjax.mixing._stacked_adapter.on_nodes'),
    ('gossipjax/algorithms/_decentlam.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_easgd.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_easgd.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_gossip_sgd.py', 'gossipjax.mixing._mix.mix_named'),
    ('gossipjax/algorithms/_gradient_tracking.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_outer_optimizer.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_outer_optimizer.py', 'gossipjax.mixing._collectives.node_index'),
    ('gossipjax/algorithms/_outer_optimizer.py', 'gossipjax.mixing._collectives.node_shape'),
    ('gossipjax/algorithms/_outer_optimizer.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_participation.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_participation.py', 'gossipjax.mixing._collectives.node_fractions'),
    ('gossipjax/algorithms/_participation.py', 'gossipjax.mixing._collectives.node_shape'),
    ('gossipjax/algorithms/_periodic_average.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_periodic_average.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_qg_dmsgd.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_sgp.py', 'gossipjax.mixing._collectives.node_shape'),
    ('gossipjax/algorithms/_sgp.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/algorithms/_streaming.py', 'gossipjax.mixing._collectives.node_average'),
    ('gossipjax/algorithms/_streaming.py', 'gossipjax.mixing._collectives.node_index'),
    ('gossipjax/algorithms/_streaming.py', 'gossipjax.mixing._collectives.node_shape'),
    ('gossipjax/algorithms/_streaming.py', 'gossipjax.mixing._contract.next_count'),
    ('gossipjax/asynchrony/_faults.py', 'gossipjax.backend._table.mix_from_table'),
    ('gossipjax/asynchrony/_faults.py', 'gossipjax.backend._table.plan_table'),
    ('gossipjax/asynchrony/_faults.py', 'gossipjax.mixing._stacked_adapter.stacked_transform'),
    ('gossipjax/asynchrony/_mpi_async.py', 'gossipjax.backend._mpi_fault.abort_job'),
    ('gossipjax/asynchrony/_plans.py', 'gossipjax.backend._table.PlanTable'),
    ('gossipjax/asynchrony/_plans.py', 'gossipjax.backend._table.plan_table'),
    ('gossipjax/cli.py', 'gossipjax.backend._network.network'),
    ('gossipjax/cli.py', 'gossipjax.train._job.JOB_FILES'),
    ('gossipjax/cli.py', 'gossipjax.train._job.JobError'),
    ('gossipjax/cli.py', 'gossipjax.train._job.JobLog'),
    ('gossipjax/cli.py', 'gossipjax.train._job.LOG'),
    ('gossipjax/cli.py', 'gossipjax.train._job.OutputFolder'),
    ('gossipjax/cli.py', 'gossipjax.train._job.RunCheckpoints'),
    ('gossipjax/cli.py', 'gossipjax.train._job.UsageError'),
    ('gossipjax/cli.py', 'gossipjax.train._job.fresh_folder'),
    ('gossipjax/cli.py', 'gossipjax.train._job.run_folder'),
    ('gossipjax/cli.py', 'gossipjax.train._job.warn'),
    ('gossipjax/cli.py', 'gossipjax.train._placement.Placement'),
    ('gossipjax/cli.py', 'gossipjax.train._registry.AlgorithmOptions'),
    ('gossipjax/cli.py', 'gossipjax.train._registry.MOMENTUM'),
    ('gossipjax/cli.py', 'gossipjax.train._registry.NEEDS_NO_TOPOLOGY'),
    ('gossipjax/cli.py', 'gossipjax.train._registry.OWN_TOPOLOGY'),
    ('gossipjax/mixing/__init__.py', 'gossipjax.backend._base.Backend'),
    ('gossipjax/mixing/__init__.py', 'gossipjax.backend._base.Mixer'),
    ('gossipjax/mixing/__init__.py', 'gossipjax.backend._base.follow_placement'),
    ('gossipjax/mixing/__init__.py', 'gossipjax.backend._buckets.Wire'),
    ('gossipjax/mixing/_contract.py', 'gossipjax.backend._base.current'),
    ('gossipjax/mixing/_contract.py', 'gossipjax.backend._cpu_threads.check_placed_threads'),
    ('gossipjax/mixing/_contract.py', 'gossipjax.backend._precision.accumulation_dtype'),
    ('gossipjax/mixing/_contract.py', 'gossipjax.topology._topology.Stochasticity'),
    ('gossipjax/mixing/_mix.py', 'gossipjax.backend._base.Backend'),
    ('gossipjax/mixing/_node_mixer.py', 'gossipjax.backend._base.Mixer'),
    ('gossipjax/mixing/_node_mixer.py', 'gossipjax.backend._block_plan.check_rounds_apart'),
    ('gossipjax/mixing/_node_mixer.py', 'gossipjax.backend._block_plan.rounds_alone'),
    ('gossipjax/mixing/_node_mixer.py', 'gossipjax.backend._buckets.Wire'),
    ('gossipjax/train/_loop.py', 'gossipjax.backend._network.network'),
    ('gossipjax/train/_loop.py', 'gossipjax.backend._network.simulated_seconds'),
    ('gossipjax/train/_loop.py', 'gossipjax.backend._traffic.Traffic'),
    ('gossipjax/train/_loop.py', 'gossipjax.backend._traffic.counting'),
}


def _cross_imports() -> set[tuple[str, str]]:
  found = set()
  for f in sorted(ROOT.rglob("*.py")):
    mod = ["gossipjax", *f.relative_to(ROOT).with_suffix("").parts]
    pkg = mod if f.name == "__init__.py" else mod[:-1]
    if mod[-1] == "__init__":
      mod = mod[:-1]
    own = mod[1] if len(mod) > 1 and (ROOT / mod[1]).is_dir() else None
    for n in ast.walk(ast.parse(f.read_text())):
      if isinstance(n, ast.ImportFrom):
        if n.level:
          base = pkg[: len(pkg) - (n.level - 1)] + (n.module.split(".") if n.module else [])
        else:
          base = (n.module or "").split(".")
        targets = [[*base, a.name] for a in n.names]
      elif isinstance(n, ast.Import):
        targets = [a.name.split(".") for a in n.names]
      else:
        continue
      for t in targets:
        if t[0] != "gossipjax" or len(t) < 2 or not (ROOT / t[1]).is_dir() or t[1] == own:
          continue
        if any(p.startswith("_") and not p.startswith("__") for p in t[2:]):
          found.add((str(f.relative_to(ROOT.parent)), ".".join(t)))
  return found


def test_no_new_private_cross_import():
  new = _cross_imports() - KNOWN
  assert not new, f"imports of another package's private module (use its public names): {sorted(new)}"
