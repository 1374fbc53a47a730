"""What marks a transform as node-aware: it reads the node axis itself (it gossips, averages or runs per node)."""

from __future__ import annotations

import optax


class NodeTransformation(optax.GradientTransformationExtraArgs):
  """An optax transform over node-stacked trees that handles the node axis itself.

  Every gossipjax transform is one: the gossip step `gj.mix`, the algorithms, the averages,
  `gj.per_node` and `gj.guard_finite`, and anything wrapped in
  `gj.mixing.float_leaves_only` (how a new method written over the node axis says so).
  `gj.chain` leaves these as they are and runs every other transform per node. It is an
  ``optax.GradientTransformationExtraArgs`` in every other respect.

  Attributes:
    init: ``init(params) -> state``, as in optax.
    update: ``update(updates, state, params=None, **extra_args) -> (updates, state)``, as in optax.

  Example:
    >>> import optax, gossipjax as gj
    >>> isinstance(gj.mix(gj.topology.ring(4)), gj.NodeTransformation), isinstance(optax.adam(1e-3), gj.NodeTransformation)
    (True, False)
  """

  __slots__ = ()
