r"""The simulated wall clock of a synchronous run: each step's compute, and the time its exchanges take.

A message of b bytes over a link takes ``latency + b / bandwidth`` (the link model of
``gj.asynchrony.cluster``). From the exchanges a step runs (the events a `Traffic` count
records, ``backend/_traffic.py``), a step of a synchronous run takes ``step_time`` (one
node's compute) plus, for each exchange in turn:

* a gossip round where node j sends a message of b bytes to each of its :math:`k_j`
  out-neighbours: :math:`\max_j (\mathrm{latency} + b / \mathrm{bandwidth})` when the
  messages go out in parallel (each link its own bandwidth), :math:`\max_j k_j
  (\mathrm{latency} + b / \mathrm{bandwidth})` when they go out one after another; the
  round waits for the slowest node, the max over the nodes of this process;
* a ring all-reduce of M bytes per node over n nodes (a reduce-scatter, then an
  all-gather, each n - 1 rounds of a chunk of M / n): :math:`2 (n - 1) (\mathrm{latency} +
  M / (n\, \mathrm{bandwidth}))`;
* a ring all-gather of a part of P bytes per node: :math:`(n - 1) (\mathrm{latency} + P /
  \mathrm{bandwidth})`;
* an all-to-all of pieces of p bytes (n - 1 rounds of pairwise exchange, one piece each):
  :math:`(n - 1) (\mathrm{latency} + p / \mathrm{bandwidth})`.

The collectives keep their schedule of one message per node per round whatever
``Network.parallel`` says; it concerns only a gossip round's k messages. An exchange that
overlaps :math:`\tau` steps of compute (Streaming DiLoCo's ``overlap``) costs only what
compute does not hide, :math:`\max(0, T - \tau\, \mathrm{step\_time})`, charged at the step
where it starts (its sync step, where `Traffic` sees it), not :math:`\tau` steps later where
its result is needed: so each step's time is a function of that step's exchanges alone, and
a run's total is the same either way when no exchange is still in flight at its end.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import numpy as np
import optax

from gossipjax.backend._traffic import Exchange, each_step


@dataclasses.dataclass(frozen=True)
class Network:
  """The links between the nodes: every link alike.

  Attributes:
    bandwidth: bytes per second of a link (``inf``: transfers cost only latency).
    latency: seconds per message on a link.
    parallel: whether a node's k gossip messages go out at once, each over its own link
      at its full bandwidth (``latency + b / bandwidth`` a round), or one after another
      (``k (latency + b / bandwidth)``, e.g. one network card shared by all k). The
      default, ``True``, reads ``bandwidth`` as `gj.asynchrony.cluster` does, per link,
      and gives a gossip round the cost decentralized methods are credited with (one
      message time whatever the degree); ``False`` is the right model where a node's
      own uplink is the bottleneck.

  Example:
    >>> import gossipjax as gj
    >>> net = gj.Network(bandwidth=1.25e9, latency=0.005)  # 10 Gbit/s, 5 ms
    >>> net.parallel, gj.network("10Gbit,5ms") == net
    (True, True)
  """

  bandwidth: float
  latency: float
  parallel: bool = True

  def __post_init__(self) -> None:
    if not self.bandwidth > 0:
      raise ValueError(f"gj.Network: bandwidth must be > 0 bytes per second (inf: free transfers), "
                       f"got {self.bandwidth!r}")
    if not (math.isfinite(self.latency) and self.latency >= 0):
      raise ValueError(f"gj.Network: latency must be finite and >= 0 seconds, got {self.latency!r}")


# Bits per second over 8; each preset's figures and where they come from are in `network`'s docstring.
NETWORKS: dict[str, Network] = {
    "infiniband": Network(bandwidth=400e9 / 8, latency=2e-6),
    "datacenter": Network(bandwidth=100e9 / 8, latency=10e-6),
    "regional": Network(bandwidth=1.12e9 / 8, latency=0.011),
    "cross_region": Network(bandwidth=0.79e9 / 8, latency=0.067),
    "internet": Network(bandwidth=0.328e9 / 8, latency=0.265),
}

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BANDWIDTH = re.compile(r"([0-9.eE+\-]+|inf)\s*(?:([kKMGT]?)(bit(?:/s)?|bps|B(?:/s)?))?")
_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divisors: 50ms is 0.05 exactly
_LATENCY = re.compile(r"([0-9.eE+\-]+)\s*(s|ms|us|µs|ns)?")


def network(spec: str, parallel: bool = True) -> Network:
  """The `Network` of a preset's name or of ``"BANDWIDTH,LATENCY"``.

  ``BANDWIDTH`` is bytes per second when it is a bare number (``1.25e9``), as in
  `Network`; with a unit it is bits (``kbit``, ``Mbit``, ``Gbit``, or ``Gbps``...) or bytes
  (``kB``, ``MB``, ``GB``, optionally ``/s``) per second, with decimal prefixes (1 Gbit/s
  = 1.25e8 bytes/s). ``LATENCY`` is seconds when bare, or ends in ``s``, ``ms``, ``us`` or
  ``ns``.

  The presets (``gj.NETWORKS``), one link's figures and where they come from:

  * ``"infiniband"``: 400 Gbit/s, 2 us. NDR InfiniBand, 400 Gb/s a port (NVIDIA's
    ConnectX-7 and Quantum-2 specifications); the latency is the order of an RDMA
    message's, an estimate, not a vendor figure.
  * ``"datacenter"``: 100 Gbit/s, 10 us. The 100 Gbps links of the data-center scenario of
    Yuan et al. (2022), which takes no delay; 10 us is an order of magnitude of a message
    within one data center.
  * ``"regional"``: 1.12 Gbit/s, 11 ms. AWS Virginia to Ohio, as Yuan et al. (2022)
    measured it for their regional scenarios.
  * ``"cross_region"``: 0.79 Gbit/s, 67 ms. AWS Oregon to Virginia (Yuan et al. 2022).
  * ``"internet"``: 0.328 Gbit/s, 265 ms. Across the world: AWS Sydney to Frankfurt, the
    slowest pair of the world-wide scenario of Yuan et al. (2022).

  Args:
    spec: a preset's name, or ``"BANDWIDTH,LATENCY"`` such as ``"10Gbit,5ms"``.
    parallel: `Network.parallel`: whether a node's gossip messages go out in parallel.

  Returns:
    The `Network`.

  Raises:
    ValueError: ``spec`` is neither a preset's name nor ``"BANDWIDTH,LATENCY"`` (a
      one-line message naming the accepted forms), or its figures are out of range.

  Example:
    >>> import gossipjax as gj
    >>> gj.network("cross_region").latency
    0.067
    >>> gj.network("1Gbit,50ms")  # bits per second, as the unit says: 1.25e8 bytes per second
    Network(bandwidth=125000000.0, latency=0.05, parallel=True)
    >>> gj.network("125e6,0.05", parallel=False).bandwidth  # a bare number: bytes per second
    125000000.0

  References:
    Yuan, He, Davis, Zhang, Dao, Chen, Liang, Ré, Zhang (2022), Decentralized Training of
    Foundation Models in Heterogeneous Environments, NeurIPS.
  """
  text = spec.strip() if isinstance(spec, str) else None
  if text in NETWORKS:
    return dataclasses.replace(NETWORKS[text], parallel=parallel)
  parts = [p.strip() for p in text.split(",")] if text else []
  bandwidth = _BANDWIDTH.fullmatch(parts[0]) if len(parts) == 2 else None
  latency = _LATENCY.fullmatch(parts[1]) if len(parts) == 2 else None
  try:
    if bandwidth is None or latency is None:
      raise ValueError
    value = float(bandwidth.group(1)) * _PREFIX[bandwidth.group(2) or ""]
    per_second = value / 8 if (bandwidth.group(3) or "B").startswith("b") else value
    return Network(bandwidth=per_second, latency=float(latency.group(1)) / _PER_SECOND[latency.group(2) or ""],
                   parallel=parallel)
  except ValueError as e:
    reason = f" ({e})" if str(e) else ""
    raise ValueError(f"gj.network: expected a preset ({', '.join(NETWORKS)}) or \"BANDWIDTH,LATENCY\" such as "
                     f"\"10Gbit,5ms\" (bandwidth in bytes/s, or with a unit: kbit, Mbit, Gbit, Gbps, kB, MB, GB; "
                     f"latency in s, or with a unit: ms, us, ns), got {spec!r}{reason}") from None


def _seconds(exchange: Exchange, net: Network) -> float:
  """The seconds one exchange takes, before any overlap with compute (see the module docstring)."""
  message = net.latency + exchange.message_bytes / net.bandwidth
  if exchange.kind == "gossip":
    return message if net.parallel else exchange.out_degree * message
  rounds = {"all_reduce": 2 * (exchange.num_nodes - 1), "all_gather": exchange.num_nodes - 1,
            "all_to_all": exchange.num_nodes - 1}[exchange.kind]
  return rounds * message


def _check_step_time(step_time: float, name: str) -> None:
  if not (math.isfinite(step_time) and step_time >= 0):
    raise ValueError(f"{name}: step_time must be finite and >= 0 seconds, got {step_time!r}")


def simulated_seconds(events: Mapping[Exchange, int], network: Network, step_time: float, steps: int) -> float:
  r"""The simulated seconds of ``steps`` steps of a synchronous run that ran the exchanges ``events``.

  ``steps * step_time`` of compute plus the time of each exchange (the formulas of
  `time_per_step`), each exposed only past what the compute of the steps it overlaps hides,
  :math:`\max(0, T - \tau\, \mathrm{step\_time})`. The exchanges of the steps are taken one
  after another, none overlapping another.

  Args:
    events: each exchange and how many times it ran: a `Traffic` count's ``events``, or what
      its ``drain()`` returns after a chunk of steps (``gossipjax.backend._traffic``).
    network: the links.
    step_time: simulated seconds of one step's compute on one node.
    steps: how many steps ran.

  Returns:
    The seconds, a float.

  Example:
    A training loop's chunk: drain the count after it ran, and time the chunk's exchanges:

    >>> import jax, jax.numpy as jnp, gossipjax as gj
    >>> from gossipjax.backend._traffic import Traffic, counting
    >>> tx, x = gj.allreduce_sgd(learning_rate=0.1), jnp.zeros((4, 10), jnp.float32)
    >>> traffic, state = Traffic(), tx.init(x)
    >>> with counting(traffic):
    ...   for _ in range(3):
    ...     u, state = jax.jit(tx.update)(x, state, x)
    >>> jax.effects_barrier()
    >>> # 3 steps of 0.1 s, and 3 all-reduces of 40 bytes: 2 * 3 * (0.01 + 10 / 1000) s each
    >>> round(gj.simulated_seconds(traffic.drain(), gj.Network(1e3, 0.01), 0.1, steps=3), 6)
    0.66
  """
  _check_step_time(step_time, "gj.simulated_seconds")
  communication = sum(count * max(0.0, _seconds(e, network) - e.overlap * step_time) for e, count in events.items())
  return steps * step_time + communication


def time_per_step(tx: optax.GradientTransformation, params: Any, network: Network, step_time: float,
                  steps: int = 1, updates: Any = None) -> np.ndarray:
  r"""The simulated seconds of each of the first ``steps`` steps of ``tx`` in a synchronous run on ``network``.

  Runs ``tx`` as `gj.bytes_per_step` does and adds to each step's ``step_time`` of compute
  the time of the exchanges it ran (a node's gossip message of b bytes to each of its k
  out-neighbours, an all-reduce of M bytes per node over n nodes, ...):

  .. math::
    T_\text{gossip} = \max_j
      \begin{cases} \mathrm{latency} + b / \mathrm{bandwidth} & \text{parallel} \\
                    k_j (\mathrm{latency} + b / \mathrm{bandwidth}) & \text{in sequence,}
      \end{cases} \qquad
    T_\text{all-reduce} = 2 (n - 1) \left(\mathrm{latency} + \frac{M}{n\, \mathrm{bandwidth}}\right),

  an all-gather of a part P per node :math:`(n - 1)(\mathrm{latency} + P / \mathrm{bandwidth})`,
  an all-to-all of pieces p :math:`(n - 1)(\mathrm{latency} + p / \mathrm{bandwidth})`
  (the max over the nodes of this process: a synchronous round waits for the slowest; under
  MPI, take the max over the ranks). DiLoCo's inner steps send nothing and cost only
  ``step_time``. An exchange that overlaps :math:`\tau` steps of compute (Streaming
  DiLoCo's ``overlap``) adds :math:`\max(0, T - \tau\, \mathrm{step\_time})`, at the step
  where it starts (the fragment's sync step), not where its result lands.

  Args:
    tx: a gossipjax transform (or a chain holding some) over node-stacked params.
    params: the node-stacked params (this process's nodes under MPI).
    network: the links (`Network`, or ``gj.network("cross_region")``).
    step_time: simulated seconds of one step's compute on one node.
    steps: how many steps to time.
    updates: the gradients given at every step (default: zeros like ``params``).

  Returns:
    A float array of shape ``(steps,)``: the seconds of each step.

  Example:
    4 nodes of 10 float32 (40 bytes), links of 1000 bytes/s and 10 ms, 0.1 s of compute a
    step. Gossip on a ring: 2 messages of 40 bytes, 0.01 + 0.04 s in parallel, twice that
    in sequence; DiLoCo: 2 steps of compute, then a ring all-reduce, 2 * 3 * (0.01 + 10 / 1000) s:

    >>> import jax.numpy as jnp, optax, gossipjax as gj
    >>> x, net = jnp.zeros((4, 10), jnp.float32), gj.Network(bandwidth=1e3, latency=0.01)
    >>> ring = gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1)
    >>> gj.time_per_step(ring, x, net, step_time=0.1).round(6).tolist()
    [0.15]
    >>> gj.time_per_step(ring, x, gj.Network(1e3, 0.01, parallel=False), step_time=0.1).round(6).tolist()
    [0.2]
    >>> gj.time_per_step(gj.diloco(optax.sgd(0.1), inner_steps=3), x, net, 0.1, steps=3).round(6).tolist()
    [0.1, 0.1, 0.22]
  """
  _check_step_time(step_time, "gj.time_per_step")
  return np.asarray([simulated_seconds(events, network, step_time, 1)
                     for _, events in each_step(tx, params, steps, updates)], dtype=np.float64)
