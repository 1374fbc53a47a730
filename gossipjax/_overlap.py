"""How many steps of compute the exchanges traced now overlap: an algorithm says so, the traffic count reads it.

Streaming DiLoCo sends a fragment at its sync step and applies the result ``overlap`` steps
later, so the exchange runs behind that many inner steps. The algorithm marks the exchange
with `overlapping` where it traces it, and the count of ``gossipjax/backend/_traffic.py``
records the figure with the exchange, for ``gj.time_per_step`` to charge only what compute
does not hide. It lives here, below both layers, as algorithms import no backend.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_OVERLAP: contextvars.ContextVar[int] = contextvars.ContextVar("gossipjax_overlap", default=0)


@contextlib.contextmanager
def overlapping(steps: int) -> Iterator[None]:
  """Exchanges traced inside the block overlap ``steps`` steps of compute (Streaming DiLoCo's tau)."""
  token = _OVERLAP.set(int(steps))
  try:
    yield
  finally:
    _OVERLAP.reset(token)


def current_overlap() -> int:
  """The steps of compute an exchange traced here overlaps: 0 outside `overlapping`."""
  return _OVERLAP.get()
