"""Time-varying topologies: W(k) cycles through a period."""

from __future__ import annotations

import math

import numpy as np

from gossipjax.topology._families import _check_n
from gossipjax.topology._topology import Topology


def one_peer_exponential(n: int) -> Topology:
  """One-peer exponential graph (Ying et al. 2021; BlueFog's dynamic default).

  At step k node i averages ``1/2 x_i + 1/2 x_{(i + 2^(k mod tau)) mod n}`` with
  ``tau = ceil(log2 n)``: one message per node per step. For n a power of 2 the product
  of the tau matrices of one period is exact averaging, ``11^T / n``.
  """
  n = _check_n(n, "one_peer_exponential", minimum=2)
  tau = max(1, math.ceil(math.log2(n)))
  mats = np.zeros((tau, n, n))
  for k in range(tau):
    h = (2**k) % n
    for i in range(n):
      mats[k, i, i] += 0.5
      mats[k, i, (i + h) % n] += 0.5
  return Topology(mats, name=f"one_peer_exponential({n})")
