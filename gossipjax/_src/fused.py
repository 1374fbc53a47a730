"""DmSGD as one fused, in-place step: the fast path for simulating many nodes on a CPU."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gossipjax import _native
from gossipjax._src.mixing import check_learning_rate, check_momentum, check_node_axis, make_mixer
from gossipjax.topology import MixingPlan


class GossipSGDStepState(NamedTuple):
  count: jax.Array  # steps taken: picks W(k) and the learning rate of a schedule
  momentum: Any


def _circulant(plan: MixingPlan) -> tuple[list[int], list[float], float] | None:
  """(shifts, weights, self weight) when W is uniform cyclic shifts, else None."""
  uniform = lambda w: bool(np.all(w == w[0]))
  if not uniform(plan.self_weight) or any(r.shift is None or not uniform(r.weight) for r in plan.rounds):
    return None
  return [int(r.shift) for r in plan.rounds], [float(r.weight[0]) for r in plan.rounds], float(plan.self_weight[0])


@dataclasses.dataclass(frozen=True, eq=False)
class GossipSGDStep:
  """``(params, state, grads) -> (params, state)``; built by ``gj.gossip_sgd_step``."""

  mixer: Any
  beta: float
  learning_rate: optax.ScalarOrSchedule
  native: bool | None
  block: int | None

  @property
  def num_nodes(self) -> int:
    return self.mixer.topology.num_nodes

  def native_status(self) -> _native.NativeStatus:
    """Whether ``__call__`` runs float32 leaves through the native kernel, and if not, why."""
    if self.native is False:
      return _native.NativeStatus(False, "native=False")
    if jax.default_backend() != "cpu":
      return _native.NativeStatus(False, f"the native kernel is for the CPU (default backend: {jax.default_backend()})")
    if self._rounds() is None:
      return _native.NativeStatus(False, f"{self.mixer.topology.name} is not a circulant graph")
    return _native.load()

  def _rounds(self) -> list[tuple[list[int], list[float], float]] | None:
    """Every step of the period as (shifts, weights, self weight), or None if one is not circulant."""
    rounds = [_circulant(plan) for plan in self.mixer.topology.plans()]
    return None if any(r is None for r in rounds) else rounds

  def init(self, params: Any) -> GossipSGDStepState:
    check_node_axis(params, self.num_nodes, self.mixer.topology.name)
    return GossipSGDStepState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def __call__(self, params: Any, state: GossipSGDStepState, grads: Any) -> tuple[Any, GossipSGDStepState]:
    check_node_axis(params, self.num_nodes, self.mixer.topology.name)
    check_node_axis(grads, self.num_nodes, self.mixer.topology.name, what="grads")
    lr = self.learning_rate(state.count) if callable(self.learning_rate) else self.learning_rate
    status = self.native_status()
    if self.native and not status.available:
      raise RuntimeError(f"gj.gossip_sgd_step(native=True): the native kernel is unavailable: {status.reason}")
    leaves, treedef = jax.tree.flatten(params)
    m_leaves, g_leaves = treedef.flatten_up_to(state.momentum), treedef.flatten_up_to(grads)
    out_x, out_m, rest = [None] * len(leaves), [None] * len(leaves), []
    for i, (x, m, g) in enumerate(zip(leaves, m_leaves, g_leaves)):
      if status.available and x.dtype == jnp.float32 and x.size:
        out_x[i], out_m[i] = self._native_leaf(x, m, g, lr, state.count)
      else:
        rest.append(i)
    if rest:  # the same step in JAX: other dtypes, other graphs, other devices
      new_m = [self.beta * m_leaves[i] + g_leaves[i] for i in rest]
      y = [leaves[i] - jnp.asarray(lr, leaves[i].dtype) * mi for i, mi in zip(rest, new_m)]
      mixed = self.mixer.mix(y, state.count)
      for i, xi, mi in zip(rest, mixed, new_m):
        out_x[i], out_m[i] = xi, mi.astype(leaves[i].dtype)
    return treedef.unflatten(out_x), GossipSGDStepState(state.count + 1, treedef.unflatten(out_m))

  def _native_leaf(self, x, m, g, lr, count):
    rounds = self._rounds()  # the kernel picks round count mod period: no recompile per step
    call = jax.ffi.ffi_call(
        _native.TARGET,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(m.shape, m.dtype)),
        input_output_aliases={0: 0, 1: 1},
    )
    hyper = jnp.stack([jnp.asarray(lr, jnp.float32), jnp.asarray(self.beta, jnp.float32)])
    return call(x, m.astype(jnp.float32), g.astype(jnp.float32), hyper, jnp.asarray(count, jnp.int32),
                shifts=np.asarray([s for r in rounds for s in r[0]], np.int64),
                weights=np.asarray([w for r in rounds for w in r[1]], np.float32),
                num_shifts=np.asarray([len(r[0]) for r in rounds], np.int64),
                self_weights=np.asarray([r[2] for r in rounds], np.float32), block=np.int64(self.block or 0))


def gossip_sgd_step(
    topology: Any,
    beta: float = 0.9,
    learning_rate: optax.ScalarOrSchedule = 0.1,
    *,
    native: bool | None = None,
    block: int | None = None,
) -> GossipSGDStep:
  r"""DmSGD (D-PSGD at ``beta = 0``) as one fused step that updates params and momentum in place.

  The same update as ``gj.gossip_sgd(topology, beta, learning_rate)`` followed by
  ``optax.apply_updates``,

  .. math::
    m_i \leftarrow \beta m_i + g_i, \qquad x_i \leftarrow \sum_j w_{ij} (x_j - \gamma m_j),

  written as one call so that the simulation of many nodes on a CPU runs at memory speed.
  For float32 leaves on the CPU and a circulant graph (ring, exponential, any graph whose W
  is uniform cyclic shifts; time-varying ones too, such as the one-peer exponential graph,
  whose step count picks W(k) inside the kernel), it runs a native kernel (``gossipjax/_native``, built with
  the system C++ compiler at first use): it reads params, momentum and grads once and writes
  params and momentum once, in place when the step is jitted with ``donate_argnums=(0, 1)``.
  XLA's own version of this step (and ``gj.gossip_sgd``'s) mixes through a fresh buffer and
  copies it back; ``benchmarks/optimizer_bandwidth.py`` times both. Everything else (other
  dtypes, non-circulant graphs, GPUs, no compiler) runs the same step in JAX.

  Args:
    topology: doubly stochastic mixing (``gj.topology.*``, a matrix or a networkx graph).
    beta: momentum coefficient.
    learning_rate: a float or an optax schedule (of the step count kept in the state).
    native: ``None`` uses the native kernel where it applies; ``True`` raises if it cannot;
      ``False`` always runs the JAX version.
    block: columns per cache block of the native kernel. ``None`` picks it from the graph:
      16,384 on a ring (or any graph with shifts -s, 0, +s only, such as each step of the
      one-peer exponential graph); on other graphs, enough that the rows the kernel keeps in scratch
      (up to n) fill about 1 MiB of cache, between 256 and 16,384 columns.

  Example:
    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> step = gj.gossip_sgd_step(gj.topology.ring(8), beta=0.9, learning_rate=0.1)
    >>> x = jnp.ones((8, 3), jnp.float32)
    >>> state = step.init(x)
    >>> x, state = jax.jit(step, donate_argnums=(0, 1))(x, state, jnp.ones((8, 3), jnp.float32))
    >>> print(x[0].round(4), x.dtype, int(state.count))
    [0.9 0.9 0.9] float32 1
  """
  check_learning_rate(learning_rate, "gj.gossip_sgd_step")
  check_momentum(beta, "gj.gossip_sgd_step")
  if block is not None and int(block) < 1:
    raise ValueError(f"gj.gossip_sgd_step: block must be a positive number of columns, got {block}")
  return GossipSGDStep(make_mixer(topology), float(beta), learning_rate, native,
                       None if block is None else int(block))
