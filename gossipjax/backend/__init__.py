"""Where the nodes live: one device (simulate), sharded devices, pmap, or MPI ranks."""

from gossipjax.backend._base import Backend, Mixer
from gossipjax.backend._simulate import Simulate, apply_plan, simulate

__all__ = ("Backend", "Mixer", "Simulate", "apply_plan", "simulate")
