"""The stateful transforms on `jax.make_mesh`'s Explicit axes, and on Auto ones, give the simulation's numbers.

Each transform below keeps per-node state through steps that branch (an outer step, a
fragment's sync), cuts leaves into fragments, or selects per node (a skipped step). On Explicit
axes each runs on params placed by the node axis alone (a 1-D mesh) and on a 2 x 2 mesh where a
node's leaves are split over a 'model' axis too (one leaf on its last axis, one on its first),
eagerly and under `jax.jit`; on Auto axes, the control, on the 2 x 2 mesh under `jax.jit`. Params
and state must equal the same transform's on unplaced params to round-off. The transforms run
side by side in one ``optax.multi_transform`` (each on a tree of its own), bare on node-stacked
trees and inside `gj.chain`, so that a case compiles one program, not one per transform.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gossipjax as gj

N = 4
W = gj.topology.ring(N)
AXIS_TYPES = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
# Specs written out in full, as the steps return them (a jitted step is keyed on the spec as written).
LAYOUTS = {"node_split": {"w": P("nodes", None, None), "b": P("nodes", None)},
           "model_split": {"w": P("nodes", None, "model"), "b": P("nodes", "model")}}

# Each transform, from a backend, on node-stacked trees ("bare") and inside gj.chain ("chain").
STATEFUL = {
    "choco_sgd": lambda be: gj.choco_sgd(W, gj.compress.top_k(0.5), learning_rate=0.1, consensus_step=0.5,
                                         backend=be),
    "diloco": lambda be: gj.diloco(optax.sgd(0.1), inner_steps=1, backend=be),
    "noloco": lambda be: gj.noloco(optax.sgd(0.1), gj.topology.random_pairs(N), inner_steps=1, backend=be),
    "streaming_diloco": lambda be: gj.streaming_diloco(optax.sgd(0.1), num_fragments=2, inner_steps=2,
                                                       fragment_split="balanced", backend=be),
}
FORMS = {
    "bare": {
        **STATEFUL,
        "per_node_diloco_rates": lambda be: gj.diloco(optax.sgd(0.1), inner_steps=1, backend=be,
                                                      outer_learning_rate=jnp.linspace(0.4, 1.0, N)),
        "guard_finite": lambda be: gj.guard_finite(gj.gossip_sgd(W, learning_rate=0.1, backend=be)),
    },
    "chain": {
        **STATEFUL,
        "reduce_on_plateau": lambda be: optax.chain(gj.gossip_sgd(W, learning_rate=0.1, backend=be),
                                                    optax.contrib.reduce_on_plateau(patience=0, factor=0.5)),
    },
}


def _transform(form, be):
  tx = optax.multi_transform({k: make(be) for k, make in FORMS[form].items()}, {k: k for k in FORMS[form]})
  return tx if form == "bare" else gj.chain(tx, backend=be, per_node_args=("value",))


_RNG = np.random.default_rng(0)
# Each transform's tree; a node's 6 + 4 entries, so that the balanced fragments cut "w" at its fifth entry.
HOST = {form: {k: {"w": _RNG.normal(size=(N, 3, 2)), "b": _RNG.normal(size=(N, 4))} for k in FORMS[form]}
        for form in FORMS}
# Two steps, the gradients pulling each node to a target of its own; under gj.guard_finite node 1's first is NaN.
TARGETS = {form: [jax.tree.map(lambda v: _RNG.normal(size=v.shape), HOST[form]) for _ in range(2)] for form in FORMS}
TARGETS["bare"][0]["guard_finite"]["w"][1, 0, 0] = np.nan
VALUES = [jnp.arange(N, dtype=float), jnp.arange(N, dtype=float) % 2]  # reduce_on_plateau's losses, one per node

# The test's own arithmetic, compiled once for each layout and shared by the cases.
_gradients = jax.jit(lambda x, target: jax.tree.map(lambda p, t: p - t, x, target))
_apply = jax.jit(optax.apply_updates)


def _run(tx, form, x, jit):
  """Two steps, eagerly or with ``init`` and ``update`` under `jax.jit`: the params and state after them, and ``update``."""
  init, update = (jax.jit(tx.init), jax.jit(tx.update)) if jit else (tx.init, tx.update)
  state = init(x)
  for k, target in enumerate(TARGETS[form]):
    extra = {"value": VALUES[k]} if form == "chain" else {}
    u, state = update(_gradients(x, target), state, x, **extra)
    x = _apply(x, u)
  return x, state, update


@functools.cache
def _backend(kind, split):
  shape, names = ((N,), ("nodes",)) if split == "node_split" else ((2, 2), ("nodes", "model"))
  mesh = jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[kind],) * len(names), devices=jax.devices()[:N])
  return gj.backend.sharded(mesh)


@functools.cache
def _simulated(form):
  return _run(_transform(form, gj.backend.simulate()), form, jax.tree.map(jnp.asarray, HOST[form]), jit=True)


# Explicit axes on either mesh, eagerly and under jit; Auto ones, the control, on the model-split mesh under jit.
# (Each case compiles its programs for its own mesh; eagerly, bare transforms compile op by op.)
CASES = [("explicit", split, jit) for split in LAYOUTS for jit in (False, True)] + [("auto", "model_split", True)]


@pytest.mark.parametrize("kind, split, jit", CASES, ids=lambda v: {False: "eager", True: "jit"}.get(v, v))
@pytest.mark.parametrize("form", list(FORMS))
def test_stateful_transforms_on_a_mesh_equal_the_simulation(form, kind, split, jit):
  be = _backend(kind, split)
  x = jax.tree.map(lambda v, spec: jax.device_put(v, NamedSharding(be.mesh, spec)), HOST[form],
                   {k: LAYOUTS[split] for k in HOST[form]})
  got, state, update = _run(_transform(form, be), form, x, jit)
  want, want_state, _ = _simulated(form)
  if jit and kind == "explicit":  # the state keeps its layout from step to step: one program
    assert update._cache_size() == 1
  assert jax.tree.structure(state) == jax.tree.structure(want_state)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=f"{form} state {jax.tree_util.keystr(path)}")
  for (path, a), b, placed in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(x)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=f"{form} {jax.tree_util.keystr(path)}")
    if kind == "explicit":  # the params keep their layout, a node's split over 'model' included
      assert a.sharding.is_equivalent_to(placed.sharding, a.ndim), (jax.tree_util.keystr(path), a.sharding)
