"""NoLoCo: H local steps per node, then one exchange with a random peer and a modified momentum step."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.typing import DTypeLike

from gossipjax.algorithms._outer_optimizer import _outer_optimizer, check_outer_rates, check_transform
from gossipjax.compress import Compressor
from gossipjax.mixing import Backend
from gossipjax.topology import as_topology
from gossipjax.algorithms._node_hyperparams import node_hyperparameters


def _check_pairing(topology: Any, name: str) -> None:
  """Raises unless every W(k) pairs the nodes: each averages with at most one peer, weight 1/2."""
  topo = as_topology(topology)
  if topo.max_degree() > 1:
    raise ValueError(f"{name}: topology must pair the nodes (each averages with at most one peer per step), "
                     f"but in {topo.name} a node receives from {topo.max_degree()} peers; "
                     f"use gj.topology.random_pairs({topo.num_nodes})")
  for k in range(topo.period):
    w = topo.sparse(k).tocoo()
    off = w.row != w.col
    rows, cols, vals = w.row[off], w.col[off], w.data[off]
    bad = ~np.isclose(vals, 0.5)
    pairs = set(zip(rows.tolist(), cols.tolist()))
    unpaired = [(i, j) for i, j in pairs if (j, i) not in pairs]
    if bad.any() or unpaired:
      i, j = (int(rows[bad][0]), int(cols[bad][0])) if bad.any() else unpaired[0]
      raise ValueError(f"{name}: topology must pair the nodes (i and j average, each with weight 1/2), but in "
                       f"{topo.name} at step {k} node {i} receives from {j} with weight {topo.sparse(k)[i, j]:g} "
                       f"and node {j} from {i} with weight {topo.sparse(k)[j, i]:g}; "
                       f"use gj.topology.random_pairs({topo.num_nodes})")


@node_hyperparameters("outer_learning_rate", "outer_momentum")
def noloco(
    inner: optax.GradientTransformation,
    topology: Any,
    *,
    inner_steps: int = 50,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.5,
    backend: Backend | None = None,
    state_dtype: DTypeLike | None = None,
    compressor: Compressor | None = None,
    error_feedback: bool = True,
    key: jax.Array | int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""NoLoCo: H local steps of ``inner``, then one exchange with a random peer and a modified momentum step.

  Kolehmainen et al. (2025). No all-reduce: at the end of a round each node i averages with
  the one peer j that ``topology`` pairs it with in that round, and its outer momentum
  carries, next to the pair's averaged pseudo-gradient, a term that pulls its outer params
  towards the pair's:

  .. math::
    \delta_i &\leftarrow \mu \delta_i - \eta \Big(\tfrac12(\Delta_i + \Delta_j)
              + \phi_i - \tfrac12(\phi_i + \phi_j)\Big), \qquad \Delta = \phi - \theta, \\
    \phi_i &\leftarrow \phi_i + \delta_i, \qquad \theta_i \leftarrow \phi_i.

  The bracket is :math:`\phi_i - \frac12(\theta_i + \theta_j)`, so one exchange of the
  end-of-round models suffices. This is the rule of the authors' code (its
  ``SparseOptimizerC`` with groups of 2, which the paper's NoLoCo runs select), where the
  weight of the consensus term equals the outer learning rate; defaults are theirs
  (H = 50, :math:`\eta = 0.7`, :math:`\mu = 0.5`, inner Adam). Built as `outer_optimizer`
  with heavy-ball ``optax.sgd(eta, momentum=mu)`` over ``topology``.

  Round r pairs the nodes by W(r): ``gj.topology.random_pairs(n, period=P)`` draws P
  matchings and repeats them, so round P pairs as round 0 did. The authors draw a fresh
  matching every round: give P at least the number of rounds (``gossipjax train`` does).

  With a schedule :math:`\eta_r` (r the outer round) the rate scales the whole momentum, as
  optax's ``sgd`` applies it after the trace: :math:`m_i \leftarrow \mu m_i + b_i`,
  :math:`\phi_i \leftarrow \phi_i - \eta_r m_i`, with :math:`b_i` the bracket above. For a
  constant :math:`\eta` this is the recurrence above (:math:`\delta_i = -\eta m_i`); for a
  varying one it is not the authors' :math:`\delta_i \leftarrow \mu \delta_i - \eta_r b_i`,
  which applies each rate to its own round's term only.

  Args:
    inner: the local optimizer, e.g. ``optax.adam(2e-4)``.
    topology: a pairing of the nodes at every step, e.g. ``gj.topology.random_pairs(n,
      period=rounds)``; W advances one step of its period per outer round.
    inner_steps: H, a positive integer, the local steps per round.
    outer_learning_rate: :math:`\eta`, or an optax schedule, called with the outer round
      (see above for the recurrence it then computes).
    outer_momentum: :math:`\mu` in [0, 1).
    backend: where the nodes live (default: simulate). ``update`` takes ``up`` (a bool per
      node): a live node whose peer is down keeps its own model for the peer's half (see
      `outer_optimizer`).
    state_dtype: the dtype of :math:`\phi` and :math:`\delta` (as in `outer_optimizer`);
      ``None`` keeps the params'.
    compressor: ``None``, or a ``gj.compress`` compressor: each node then sends its compressed
      pseudo-gradient :math:`\Delta_i` (top-k with error feedback, as the authors offer) in
      its compact form, and the bracket becomes the pair's mean of the decoded messages,
      without the pull towards :math:`\frac12(\phi_i + \phi_j)` (see `outer_optimizer`).
    error_feedback: with a ``compressor``, carry what it did not send into the next round.
    key: the PRNG key or int seed of a random ``compressor``.

  Returns:
    An optax transform over node-stacked params (its ``update`` needs ``params``) whose
    state is an `OuterState`.

  Raises:
    TypeError: ``inner`` is not an optax transform, or its state cannot be stacked per node.
    ValueError: ``topology`` is not a pairing, ``inner_steps`` is not a positive integer,
      or a rate is out of range.

  Example:
    Four nodes from 0, 1, 2, 3 with zero gradients: one round of one step, and each node
    moves half way towards its random peer (0 with 2, 1 with 3):

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> tx = gj.noloco(optax.sgd(0.1), gj.topology.random_pairs(4), inner_steps=1, outer_learning_rate=1.0)
    >>> x = jnp.arange(4.0)[:, None]
    >>> u, state = tx.update(jnp.zeros_like(x), tx.init(x), x)
    >>> (x + u).ravel().tolist()
    [1.0, 2.0, 1.0, 2.0]

  References:
    Kolehmainen, Blagoev, Donaghy, Ersoy, Nies (2025), NoLoCo: No-all-reduce Low
    Communication Training Method for Large Models, arXiv:2506.10911 (code:
    github.com/jkolehm/noloco).
  """
  check_outer_rates(outer_learning_rate, outer_momentum, "gj.noloco")
  check_transform(inner, "gj.noloco", "inner", "optax.adam(2e-4)")
  _check_pairing(topology, "gj.noloco")
  outer = optax.sgd(outer_learning_rate, momentum=outer_momentum)
  return _outer_optimizer(inner, outer, inner_steps, topology, backend, "gj.noloco", state_dtype, compressor,
                          error_feedback, key)
