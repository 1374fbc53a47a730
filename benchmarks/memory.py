"""Peak memory of the jitted 64-node DmSGD step against params + optimizer state + grads.

XLA's own buffer assignment for the compiled step (``compiled.memory_analysis()``):
peak = arguments + outputs + temporaries - outputs that alias donated arguments. The
baseline is what any DmSGD step must hold: params, momentum (the optimizer state) and
grads. Measured with and without donating params and optimizer state.
"""

from __future__ import annotations

import jax

import gossipjax as gj
from benchmarks import _timing, dmsgd_step


def _peak(compiled) -> dict:
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
          "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes, "peak": peak}


def run(quick: bool = False) -> dict:
  n, batch, sizes = (8, 8, (96, 32, 32, 10)) if quick else (64, 32, dmsgd_step.SIZES)
  params, (x, y) = dmsgd_step.problem(n, batch, sizes)
  tx, donated = dmsgd_step.library_step(gj.topology.ring(n))
  state = tx.init(params)
  out = {"num_nodes": n, "params_bytes": _timing.tree_bytes(params), "opt_state_bytes": _timing.tree_bytes(state),
         "batch_bytes": _timing.tree_bytes((x, y))}
  base = 2 * out["params_bytes"] + out["opt_state_bytes"]  # params + grads + optimizer state
  out["baseline_bytes"] = base
  plain = jax.jit(donated.__wrapped__)
  for name, f in (("donated", donated), ("not_donated", plain)):
    info = _peak(f.lower(params, state, x, y).compile())
    info["ratio_to_baseline"] = info["peak"] / base
    info["peak_bytes_per_node"] = info["peak"] / n
    out[name] = info
  return out


def table(r: dict) -> list[str]:
  mib = 1 << 20
  rows = [f"Memory, {r['num_nodes']} nodes: params {r['params_bytes'] / mib:.1f} MiB, optimizer state "
          f"{r['opt_state_bytes'] / mib:.1f} MiB, grads {r['params_bytes'] / mib:.1f} MiB, batch {r['batch_bytes'] / mib:.1f} MiB"]
  for k in ("donated", "not_donated"):
    v = r[k]
    rows.append(f"  {k:12s} peak {v['peak'] / mib:8.1f} MiB  x{v['ratio_to_baseline']:.3f} of params+state+grads  "
                f"{v['peak_bytes_per_node'] / mib:6.2f} MiB/node (temporaries {v['temporaries'] / mib:.1f} MiB)")
  return rows
