"""Time-varying topologies (W(k) cycles through a period) and the push-form directed graphs."""

from __future__ import annotations

import math

import numpy as np

from gossipjax.topology._families import _check_n, exponential
from gossipjax.topology._plan import MixingPlan, circulant_plan, make_round, reversed_plan
from gossipjax.topology._topology import Topology, is_strongly_connected


def one_peer_exponential(n: int) -> Topology:
  """One-peer exponential graph (Ying et al. 2021).

  At step k node i averages ``1/2 x_i + 1/2 x_{(i + 2^(k mod tau)) mod n}`` with
  ``tau = ceil(log2 n)``: one message per node per step. For n a power of 2 the product
  of the tau matrices of one period is exact averaging, ``11^T / n``.

  Node i receives from ``i + 2^k``; in BlueFog's dynamic one-peer schedule it receives from
  ``i - 2^k``. The schedules are transposes of each other; BlueFog's orientation is
  `one_peer_directed_exponential`.

  Args:
    n: the number of nodes (at least 2).

  Returns:
    A time-varying, doubly stochastic `Topology` of period ``ceil(log2 n)``, named
    ``one_peer_exponential(n)``.

  Example:
    Over one period of 4 nodes, the two steps average exactly:

    >>> from gossipjax import topology as T
    >>> g = T.one_peer_exponential(4)
    >>> g.period, g.matrix(0)[0].tolist(), g.matrix(1)[0].tolist()
    (2, [0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0])
    >>> print(g.matrix(1) @ g.matrix(0))
    [[0.25 0.25 0.25 0.25]
     [0.25 0.25 0.25 0.25]
     [0.25 0.25 0.25 0.25]
     [0.25 0.25 0.25 0.25]]

  References:
    Ying, Yuan, Chen, Hu, Pan, Yin (2021), Exponential Graph is Provably Efficient for
    Decentralized Deep Training, NeurIPS.
  """
  n = _check_n(n, "one_peer_exponential", minimum=2)
  tau = max(1, math.ceil(math.log2(n)))
  return Topology.from_plans([circulant_plan(n, [2**k % n], 0.5, 0.5) for k in range(tau)],
                             name=f"one_peer_exponential({n})")


def directed_exponential(n: int) -> Topology:
  """Static directed exponential graph in push form (Assran et al. 2019, SGP).

  Node i *sends* to ``(i + 2^k) mod n`` for every ``2^k < n`` and keeps an equal share, so
  each sender splits its mass ``1 / (1 + number of peers)`` ways: W is column stochastic by
  construction (push-sum's requirement). The graph is circulant, so W is also row
  stochastic; it is ``exponential(n)`` with every edge reversed.

  Args:
    n: the number of nodes.

  Returns:
    A static, doubly stochastic `Topology` named ``directed_exponential(n)``.

  Example:
    Column j lists whom node j sends to:

    >>> import numpy as np
    >>> from gossipjax import topology as T
    >>> w = T.directed_exponential(8).matrix()
    >>> np.flatnonzero(w[:, 0]).tolist(), float(w[:, 0].sum())
    ([0, 1, 2, 4], 1.0)

  References:
    Assran, Loizou, Ballas, Rabbat (2019), Stochastic Gradient Push for Distributed Deep
    Learning, ICML.
  """
  n = _check_n(n, "directed_exponential")
  return _reversed(exponential(n), f"directed_exponential({n})")


def one_peer_directed_exponential(n: int) -> Topology:
  """Time-varying directed exponential graph, one message per node per step (SGP's default).

  At step k node i pushes half of its mass to ``(i + 2^(k mod tau)) mod n`` and keeps the
  other half, ``tau = ceil(log2 n)`` (Assran et al. 2019, Sec. 5). Column stochastic (and,
  being circulant, doubly stochastic); for n a power of 2 the product of one period is
  ``11^T / n``. It is ``one_peer_exponential(n)`` with every edge reversed.

  Args:
    n: the number of nodes (at least 2).

  Returns:
    A time-varying `Topology` of period ``ceil(log2 n)``, named
    ``one_peer_directed_exponential(n)``.

  Example:
    Node 0 pushes half its mass to node 1, then to node 2:

    >>> from gossipjax import topology as T
    >>> g = T.one_peer_directed_exponential(4)
    >>> g.matrix(0)[:, 0].tolist(), g.matrix(1)[:, 0].tolist()
    ([0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0])

  References:
    Assran, Loizou, Ballas, Rabbat (2019), Stochastic Gradient Push for Distributed Deep
    Learning, ICML.
  """
  n = _check_n(n, "one_peer_directed_exponential", minimum=2)
  return _reversed(one_peer_exponential(n), f"one_peer_directed_exponential({n})")


def _reversed(topology: Topology, name: str) -> Topology:
  """Every edge reversed (W^T at every step): the push form of a pull graph."""
  return Topology.from_plans([reversed_plan(p) for p in topology.plans()], name=name)


def random_pairs(n: int, seed: int = 0, period: int = 16) -> Topology:
  """Random pairwise averaging: at every step each node averages with one random peer.

  Step k draws a random perfect matching of the nodes (seeded, so reproducible); matched
  nodes i, j both move to ``(x_i + x_j) / 2``; with n odd one node sits the step out.
  This is the random-peer gossip of Cui (2019, "Decentralized Deep Learning with Gradient
  Compression") and of AD-PSGD (Lian et al. 2018), made
  synchronous. W(k) is symmetric and doubly stochastic, one message per node per step.

  Args:
    n: number of nodes (at least 2).
    seed: seeds the matchings; the same seed gives the same sequence.
    period: how many matchings are drawn before the sequence repeats. Each W(k) is stored
      as one exchange round (O(n)), and backends that exchange with ``ppermute`` or
      ``sendrecv`` compile one branch per matching, so a long period costs compile time
      there (the simulate backend gathers from a table instead, one program for any period).

  Returns:
    A time-varying, symmetric, doubly stochastic `Topology` of period ``period``, named
    ``random_pairs(n, seed=seed)``.

  Raises:
    ValueError: if the union of the ``period`` matchings does not connect the nodes.

  Example:
    >>> from gossipjax import topology as T
    >>> g = T.random_pairs(4, seed=0)
    >>> g.period
    16
    >>> print(g.matrix(0))  # step 0 pairs nodes 0 and 2, 1 and 3
    [[0.5 0.  0.5 0. ]
     [0.  0.5 0.  0.5]
     [0.5 0.  0.5 0. ]
     [0.  0.5 0.  0.5]]

  References:
    Cui (2019), Decentralized Deep Learning with Gradient Compression, Bulletin of the
    Graduate School of Computer and Information Sciences, Hosei University.

    Boyd, Ghosh, Prabhakar, Shah (2006), Randomized Gossip Algorithms, IEEE Transactions on
    Information Theory.
  """
  n = _check_n(n, "random_pairs", minimum=2)
  if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
    raise ValueError(f"random_pairs: period must be a positive integer, got {period!r}")
  rng = np.random.default_rng(seed)
  plans = []
  for _ in range(int(period)):
    perm = rng.permutation(n)
    a, b = perm[0:n - 1:2], perm[1::2]
    self_w = np.ones(n)
    self_w[a] = self_w[b] = 0.5
    self_w.setflags(write=False)
    rnd = make_round(n, np.concatenate([a, b]), np.concatenate([b, a]), np.full(2 * len(a), 0.5))
    plans.append(MixingPlan(self_weight=self_w, rounds=(rnd,)))
  topo = Topology.from_plans(plans, name=f"random_pairs({n}, seed={seed})")
  if not is_strongly_connected(topo.union_graph()):
    raise ValueError(f"random_pairs({n}, seed={seed}): {period} random matchings do not connect "
                     "all nodes; raise period or try another seed")
  return topo
