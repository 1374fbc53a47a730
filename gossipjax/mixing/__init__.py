"""The mixing layer: the mixer contract every backend meets, and `mix`, gossip as an optax transform.

``gj.mix(W)`` turns a local update ``u`` into a gossiped one, ``u' = W(x + u) - x``, so its
position in an ``optax.chain`` is the algorithm. `make_mixer` is how an algorithm gets a
`Mixer` for its topology on the backend it was given.
"""

from gossipjax.backend._base import Backend, Mixer, follow_placement
from gossipjax.backend._buckets import Wire
from gossipjax.mixing._contract import float_leaves_only, make_mixer, resolve_backend
from gossipjax.mixing._mix import MixState, mix

__all__ = (
    "Backend",
    "Mixer",
    "MixState",
    "Wire",
    "float_leaves_only",
    "follow_placement",
    "make_mixer",
    "mix",
    "resolve_backend",
)
