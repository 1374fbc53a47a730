"""A node-level mixing plan compiled to device-level exchanges over a block layout.

With n nodes on K devices (or MPI ranks), device d holds the block of B = n / K nodes
``d*B ... d*B + B - 1``. A node-level round is a partial permutation over nodes; its edges
that cross devices are grouped by (device offset ``o = (dst_device - src_device) mod K``,
source device), and those groups are coloured into **exchanges**, partial permutations of
devices in which every device sends to at most one other and receives from at most one.
An exchange is one ``ppermute`` (one ``sendrecv`` per rank), and it carries only the rows a
neighbour reads, merged over all rounds of the plan. A cyclic node shift ``h`` therefore
needs at most two exchanges, a matching of nodes across devices one, and the data a device
sends is O(degree * B * d), never an all-gather.

A rank-one term ``u v^T`` of the plan (a star's hub, exact averaging) is no exchange: it is
split into the devices' blocks (`BlockRankOne`), and applying it is one all-reduce.

A time-varying topology whose step is traced compiles one ``lax.switch`` branch per
distinct device-level **exchange pattern** (offsets, sending pairs and message rows), and
each branch only moves rows; which rows are sent, which received row each node reads and
with what weight are tables indexed by the step. Compile time then follows the number of
distinct patterns, and every step sends only its own exchanges. Where the patterns are
many (a long random period with several nodes per device), the period is compiled to a
**fixed** set of exchanges instead (`fixed_slots`): each ordered pair of devices always
travels in the same exchange, a branch per message length, so compile time follows the
devices and the node block, not the period, and a step sends its rows in up to K - 1
exchanges, each padded to its longest message (`step_table_or_none` says when).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from gossipjax.topology import MixingPlan, Topology

# A round read as more separate slices than this is one gather instead (a faster trace and compile).
_MAX_SLICES = 8


@dataclasses.dataclass(frozen=True, eq=False)
class Exchange:
  """One partial permutation of devices: device ``s`` sends ``send_rows[s, :count[s]]`` to ``dest[s]``.

  Attributes:
    index: the exchange's place in its plan (the MPI tag).
    pairs: ``(source device, destination device)`` for every device that sends (the ppermute perm).
    send_rows: int (K, m), the local rows each device sends, padded with 0 to the longest, m.
    count: int (K,), how many rows each device really sends (0 where it sends nothing).
    dest: int (K,), the device each one sends to (-1: none).
    source: int (K,), the device each one receives from (-1: none).
  """

  index: int
  pairs: tuple[tuple[int, int], ...]
  send_rows: np.ndarray
  count: np.ndarray
  dest: np.ndarray
  source: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class BlockRound:
  """A node-level round seen by each device: local receiver ``i`` reads row ``row[d, i]`` of buffer ``buffer[d, i]``.

  Buffer 0 is the device's own block, buffer ``1 + e`` what exchange ``e`` delivered.
  Receivers with weight 0 read their own row (as the simulator's gather does).

  Attributes:
    slices: per device, the round's reads as runs ``(buffer, first row, length)`` of
      consecutive rows, or ``None`` where there are more than a few (then one gather);
      found once, when the plan is compiled, so tracing a step does no per-row work.
  """

  buffer: np.ndarray
  row: np.ndarray
  weight: np.ndarray
  slices: tuple[tuple[tuple[int, int, int], ...] | None, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class BlockRankOne:
  """A rank-one term ``u v^T`` split into the devices' blocks: ``u`` and ``v`` of shape (K, B)."""

  u: np.ndarray
  v: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPlan:
  """A ``MixingPlan`` for K devices with B nodes each."""

  num_devices: int
  block: int
  self_weight: np.ndarray  # (K, B)
  exchanges: tuple[Exchange, ...]
  rounds: tuple[BlockRound, ...]
  rank_one: tuple[BlockRankOne, ...] = ()

  @property
  def pattern(self) -> tuple:
    """The device-level exchanges (pairs, rows each device sends): equal patterns compile to one branch."""
    return tuple((ex.pairs, tuple(ex.count.tolist())) for ex in self.exchanges)


def check_divisible(topology: Topology, num_devices: int, where: str, name: str = "gj.backend") -> int:
  """Returns B = n / K, or raises ``ValueError`` (starting with ``name``) saying how to fix an uneven split."""
  n = topology.num_nodes
  if num_devices < 1 or n % num_devices:
    raise ValueError(
        f"{name}: {topology.name} has {n} nodes, which do not split evenly over the {num_devices} {where}: "
        f"every one must hold the same number of nodes, so use a node count that is a multiple of "
        f"{num_devices} (or run on a number of {where.split()[-1]} that divides {n})"
    )
  return n // num_devices


def _slices(buffer: np.ndarray, row: np.ndarray) -> tuple[tuple[tuple[int, int, int], ...] | None, ...]:
  """Per device, the runs of consecutive rows of one buffer that a round reads (array work, no row loop)."""
  k, b = buffer.shape
  breaks = np.ones((k, b), bool)
  breaks[:, 1:] = (buffer[:, 1:] != buffer[:, :-1]) | (row[:, 1:] != row[:, :-1] + 1)
  per_device = []
  for d in range(k):
    starts = np.flatnonzero(breaks[d])
    if len(starts) > _MAX_SLICES:
      per_device.append(None)
      continue
    ends = np.append(starts[1:], b)
    per_device.append(tuple((int(buffer[d, s]), int(row[d, s]), int(e - s)) for s, e in zip(starts, ends)))
  return tuple(per_device)


def _colour_pairs(offset: np.ndarray, device: np.ndarray, k: int) -> np.ndarray:
  """Edge colouring of device pairs ``device -> (device + offset) % k`` with as few colours as there can be.

  Each colour is a partial permutation (one ppermute): no device sends twice or receives
  twice in it, so at least the most pairs one device sends or receives (the degree) are
  needed, and by Konig's theorem that many suffice. Greedy in the given order first (on a
  circulant graph, one colour per offset, the degree); where greedy needs more (a random
  matching with several nodes per device: 2.69 exchanges a step against 2 for
  ``random_pairs(16)`` on 8 devices), `_konig_colouring`. Loops are over device pairs, at
  most K per offset, never over rows.
  """
  colour = _greedy_colouring(offset, device, k)
  targets = (device + offset) % k
  degree = max(np.bincount(device, minlength=k).max(), np.bincount(targets, minlength=k).max()) if len(device) else 0
  if len(colour) and colour.max() + 1 > degree:
    colour = _konig_colouring(device, targets, int(degree))
  return colour


def _konig_colouring(source: np.ndarray, target: np.ndarray, degree: int) -> np.ndarray:
  """Colours the edges ``source[i] -> target[i]`` of a bipartite graph with ``degree`` colours (Konig).

  Each edge takes a colour free at both ends; where the free colours differ (``a`` free at the
  source, ``b`` at the target), the path from the target that alternates ``a`` and ``b``
  edges swaps its two colours first, which frees ``a`` at the target and cannot reach the
  source (the graph has no odd cycle). O(edges x devices) at worst.
  """
  colour = np.full(len(source), -1, np.int64)
  sends: list[dict[int, int]] = [dict() for _ in range(int(max(source.max(), target.max())) + 1)]
  gets: list[dict[int, int]] = [dict() for _ in range(len(sends))]
  for e, (u, v) in enumerate(zip(source.tolist(), target.tolist())):
    a = next(c for c in range(degree) if c not in sends[u])
    b = next(c for c in range(degree) if c not in gets[v])
    if a != b and a in gets[v]:
      path, node, receiving, want = [], v, True, a  # the a/b path from v: v -a- u1 -b- v2 -a- ...
      while True:
        edge = (gets if receiving else sends)[node].get(want)
        if edge is None:
          break
        path.append(edge)
        node = int(source[edge]) if receiving else int(target[edge])
        receiving, want = not receiving, b if want == a else a
      for edge in path:
        del sends[int(source[edge])][int(colour[edge])], gets[int(target[edge])][int(colour[edge])]
      for edge in path:
        colour[edge] = b if colour[edge] == a else a
        sends[int(source[edge])][int(colour[edge])] = gets[int(target[edge])][int(colour[edge])] = edge
    colour[e] = a
    sends[u][a] = gets[v][a] = e
  return colour


def _greedy_colouring(offset: np.ndarray, device: np.ndarray, k: int) -> np.ndarray:
  """Greedy edge colouring of device pairs ``device -> (device + offset) % k``, in the given order."""
  colour = np.zeros(len(offset), np.int64)
  sending: list[set[int]] = []
  receiving: list[set[int]] = []
  for i, (o, d) in enumerate(zip(offset.tolist(), device.tolist())):
    t = (d + o) % k
    c = 0
    while c < len(sending) and (d in sending[c] or t in receiving[c]):
      c += 1
    if c == len(sending):
      sending.append(set())
      receiving.append(set())
    sending[c].add(d)
    receiving[c].add(t)
    colour[i] = c
  return colour


def compile_plan(plan: MixingPlan, num_devices: int, slot_of: np.ndarray | None = None) -> BlockPlan:
  """Groups a plan's cross-device edges into exchanges, partial permutations of devices (module docstring).

  Array operations over all edges at once, O(edges log edges): at 65,536 nodes of an
  exponential graph on 2 devices this is about 0.1 s, where a loop over edges took seconds.
  With ``slot_of`` (K, K), the rows device s sends device t travel in exchange
  ``slot_of[s, t]`` (a fixed set of exchanges, `fixed_slots`), every one kept, even empty.
  """
  n, k = plan.num_nodes, num_devices
  b = n // k
  live = [np.flatnonzero(r.weight) for r in plan.rounds]
  dst = np.concatenate(live or [np.zeros(0, np.int64)])
  src = np.concatenate([r.src[i] for r, i in zip(plan.rounds, live)] or [np.zeros(0, np.int64)]).astype(np.int64)
  off = (dst // b - src // b) % k
  # Every row a device sends at an offset, once, sorted by (offset, source device, local row).
  cross = off != 0
  sent = np.unique((off[cross] * k + src[cross] // b) * b + src[cross] % b)
  sent_off, sent_dev, sent_row = sent // (k * b), (sent // b) % k, sent % b
  # The (offset, source device) groups of sent rows, coloured into partial permutations of
  # devices: a device sends at most once and receives at most once per exchange. Taken in
  # offset order, a circulant graph gets one exchange per offset; a matching gets one in all.
  group_key = np.unique(sent_off * k + sent_dev)
  group = np.searchsorted(group_key, sent_off * k + sent_dev)  # the group each sent row travels in
  position = np.arange(len(sent)) - np.searchsorted(group, group)  # its slot in that group's send buffer
  if slot_of is None:
    colour = _colour_pairs(group_key // k, group_key % k, k)
    num_ex = int(colour.max()) + 1 if len(colour) else 0
  else:
    colour = slot_of[group_key % k, (group_key // k + group_key % k) % k]
    num_ex = int(slot_of.max()) + 1
  which = colour[group]  # the exchange each sent row travels in
  exchanges = []
  for e in range(num_ex):
    mine = np.flatnonzero(colour == e)
    devices, targets = group_key[mine] % k, (group_key[mine] // k + group_key[mine] % k) % k
    count = np.zeros(k, np.int64)
    count[devices] = np.bincount(group, minlength=len(group_key))[mine]
    send = np.zeros((k, int(count.max())), np.int64)
    rows = which == e
    send[sent_dev[rows], position[rows]] = sent_row[rows]
    dest, source = np.full(k, -1, np.int64), np.full(k, -1, np.int64)
    dest[devices], source[targets] = targets, devices
    pairs = tuple((int(a), int(t)) for a, t in sorted(zip(devices.tolist(), targets.tolist())))
    exchanges.append(Exchange(e, pairs, send, count, dest, source))
  rounds = []
  bounds = np.cumsum([0] + [len(i) for i in live])
  for r, a, z in zip(plan.rounds, bounds[:-1], bounds[1:]):
    d, j, o = dst[a:z], src[a:z], off[a:z]
    buffer = np.zeros((k, b), np.int64)
    row = np.tile(np.arange(b), (k, 1))
    weight = np.zeros((k, b))
    slot = np.searchsorted(sent, (o * k + j // b) * b + j % b)  # meaningful where o != 0
    far = o != 0
    buffer[d // b, d % b] = np.where(far, 1 + which[np.minimum(slot, len(sent) - 1)] if len(sent) else 0, 0)
    row[d // b, d % b] = np.where(far, position[np.minimum(slot, len(sent) - 1)] if len(sent) else 0, j % b)
    weight[d // b, d % b] = r.weight[d]
    rounds.append(BlockRound(buffer, row, weight, _slices(buffer, row)))
  rank_one = tuple(BlockRankOne(t.u.reshape(k, b).copy(), t.v.reshape(k, b).copy()) for t in plan.rank_one)
  return BlockPlan(k, b, plan.self_weight.reshape(k, b).copy(), tuple(exchanges), tuple(rounds), rank_one)


@dataclasses.dataclass(frozen=True, eq=False)
class StepTable:
  """The plans of a period as data indexed by the step, for a traced step (module docstring).

  Attributes:
    patterns: one representative plan per distinct exchange pattern.
    pattern_of: int (period,), the pattern of each step.
    send_rows: int (period, E, K, M), the rows exchange ``e`` of the step's pattern sends.
    source: int (period, E, K), the device each one receives from in exchange ``e`` (-1: none).
    rows: int (period, R, K, B), for each round the row of ``concat(own block, E received
      buffers of M rows)`` each node reads (its own row where the round has no edge for it).
    weight: (period, R, K, B), the rounds' weights (0 where a step has fewer rounds).
    self_weight: (period, K, B).
    slots: in the fixed form (`fixed_slots`), for each exchange slot, one exchange per
      number of rows it carries in some step of the period; ``patterns`` is then empty.
    slot_size: int (period, E), in the fixed form, which of its slot's exchanges each step uses.
  """

  patterns: tuple[BlockPlan, ...]
  pattern_of: np.ndarray
  send_rows: np.ndarray
  source: np.ndarray
  rows: np.ndarray
  weight: np.ndarray
  self_weight: np.ndarray
  slots: tuple[tuple[Exchange, ...], ...] = ()
  slot_size: np.ndarray | None = None

  @property
  def max_rows(self) -> int:
    return self.send_rows.shape[3]

  def rows_sent(self) -> np.ndarray:
    """Rows the busiest device sends in each step of the period, as the exchanges pad them, shape (period,)."""
    if self.slots:
      assert self.slot_size is not None
      return np.array([sum(options[i].send_rows.shape[1] for options, i in zip(self.slots, sizes))
                       for sizes in self.slot_size])
    per_pattern = [sum(int(ex.count.max()) for ex in p.exchanges if ex.count.size) for p in self.patterns]
    return np.asarray(per_pattern)[self.pattern_of]

  @property
  def branches(self) -> int:
    """The exchange branches the period compiles: one per pattern, or per slot and size in the fixed form."""
    return len(self.patterns) + sum(len(options) for options in self.slots)


def step_table(plans: Sequence[BlockPlan], slot_pairs: Sequence[Sequence[tuple[int, int]]] | None = None) -> StepTable:
  """Stacks a period of compiled plans (without rank-one terms) into a `StepTable`.

  With ``slot_pairs`` (the plans compiled to the fixed exchanges of `fixed_slots`), the
  table holds, per slot, one exchange for each number of rows it sends in the period.
  """
  k, b = plans[0].num_devices, plans[0].block
  keys, patterns, pattern_of = {}, [], []
  for p in plans if slot_pairs is None else ():  # the fixed form has no patterns
    if p.pattern not in keys:
      keys[p.pattern] = len(patterns)
      patterns.append(p)
    pattern_of.append(keys[p.pattern])
  num_ex = max(len(p.exchanges) for p in plans)
  m = max([ex.send_rows.shape[1] for p in plans for ex in p.exchanges] or [1])
  num_rounds = max(1, max(len(p.rounds) for p in plans))
  period = len(plans)
  send_rows = np.zeros((period, max(1, num_ex), k, m), np.int64)
  source = np.full((period, max(1, num_ex), k), -1, np.int64)
  rows = np.tile(np.arange(b), (period, num_rounds, k, 1))
  weight = np.zeros((period, num_rounds, k, b))
  for s, p in enumerate(plans):
    for e, ex in enumerate(p.exchanges):
      send_rows[s, e, :, :ex.send_rows.shape[1]] = ex.send_rows
      source[s, e] = ex.source
    for r, rnd in enumerate(p.rounds):
      start = np.where(rnd.buffer == 0, 0, b + (rnd.buffer - 1) * m)  # received buffers are padded to m rows
      rows[s, r] = start + rnd.row
      weight[s, r] = rnd.weight
  self_weight = np.stack([p.self_weight for p in plans])
  if slot_pairs is None:
    return StepTable(tuple(patterns), np.asarray(pattern_of, np.int32), send_rows, source, rows, weight, self_weight)
  sizes = np.array([[int(ex.count.max()) if ex.count.size else 0 for ex in p.exchanges] for p in plans], np.int64)
  slots, slot_size = [], np.zeros(sizes.shape, np.int32)
  for e, pairs in enumerate(slot_pairs):
    options = sorted(set(sizes[:, e].tolist()))
    slot_size[:, e] = np.searchsorted(options, sizes[:, e])
    dest, src = np.full(k, -1, np.int64), np.full(k, -1, np.int64)
    for a, t in pairs:
      dest[a], src[t] = t, a
    # Every device of the slot sends the step's longest message: the pairs are code, the rows data.
    slots.append(tuple(Exchange(e, tuple(pairs), np.zeros((k, m_e), np.int64), np.where(dest >= 0, m_e, 0), dest,
                                src) for m_e in options))
  return StepTable((), np.zeros(len(plans), np.int32), send_rows, source, rows, weight, self_weight, tuple(slots),
                   slot_size)


def fixed_slots(num_devices: int, form: str) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
  """A fixed set of exchanges that covers every ordered pair of devices once: ``slot_of`` (K, K) and each one's pairs.

  ``"offsets"``: exchange ``o - 1`` sends from device d to ``(d + o) % K``, for o = 1 ... K - 1.
  ``"matchings"``: a round-robin tournament's rounds (K - 1 perfect matchings for even K, K
  for odd K, one device out in each): the two devices of a pair send each other in one exchange.
  """
  k = num_devices
  slot_of = np.full((k, k), -1, np.int64)
  if form == "offsets":
    for o in range(1, k):
      for d in range(k):
        slot_of[d, (d + o) % k] = o - 1
  else:
    m = k - 1 if k % 2 == 0 else k  # the devices that rotate; with even K, device K - 1 meets one each round
    for r in range(m):
      for a in range(m):
        b = (2 * r - a) % m  # a + b = 2r (mod m): every pair of rotating devices meets in one round
        if a != b:
          slot_of[a, b] = r
      if k % 2 == 0:
        slot_of[r, k - 1] = slot_of[k - 1, r] = r
  pairs = [[(int(a), int(t)) for a, t in zip(*np.nonzero(slot_of == e))] for e in range(int(slot_of.max()) + 1)]
  return slot_of, pairs


def check_rounds_apart(topology: Topology) -> None:
  """Raises ``ValueError`` unless ``topology``'s rounds can be taken apart: one plan, no rank-one terms."""
  if topology.is_time_varying or topology.plans()[0].rank_one:
    raise ValueError(f"gj.backend: mix_rounds takes the rounds of a static W without rank-one terms; "
                     f"{topology.name} is " + ("time-varying" if topology.is_time_varying else
                                               "a sum with rank-one terms (mix it whole with mix)"))


def rounds_alone(topology: Topology) -> list[MixingPlan]:
  """Each round of a static W as a plan of its own (no self weight): what ``mix_rounds`` returns, one at a time."""
  check_rounds_apart(topology)
  plan = topology.plans()[0]
  return [MixingPlan(self_weight=np.zeros_like(plan.self_weight), rounds=(r,)) for r in plan.rounds]


def compile_topology(topology: Topology, num_devices: int) -> tuple[BlockPlan, ...]:
  return tuple(compile_plan(p, num_devices) for p in topology.plans())


# The exchanges (permutes per bucket) a period's pattern branches may hold before the fixed form is tried.
_BRANCH_BUDGET = 64
# The most the fixed form may send, against the patterns' rows, to save their compile time.
_FIXED_ROWS_AT_MOST = 1.5


def _rows_sent(plans: Sequence[BlockPlan], slot_of: np.ndarray) -> int:
  """Rows the busiest device would send over the period in the fixed exchanges ``slot_of``, each padded to its longest."""
  k = plans[0].num_devices
  total = 0
  for p in plans:
    counts = np.zeros((k, k), np.int64)
    for ex in p.exchanges:
      senders = np.flatnonzero(ex.dest >= 0)
      counts[senders, ex.dest[senders]] += ex.count[senders]
    longest = np.zeros(int(slot_of.max()) + 1, np.int64)
    np.maximum.at(longest, slot_of[counts > 0], counts[counts > 0])
    total += int(longest.sum())
  return total


def step_table_or_none(plans: Sequence[BlockPlan], topology: Topology) -> StepTable | None:
  """The `StepTable` of a period of plans, or ``None`` for one plan or plans with rank-one terms.

  Where the period's distinct patterns would compile more than a few dozen exchanges (a
  long random period with several nodes per device, where nearly every step is a pattern of
  its own), the plans are compiled again to a fixed set of exchanges (`fixed_slots`: the
  device offsets, or the rounds of a round-robin tournament, whichever sends fewer rows),
  each with a branch per message length: compile time then follows the node block, not the
  period. It is taken only where it sends at most 1.5x the patterns' rows.
  """
  if len(plans) == 1 or any(p.rank_one for p in plans):
    return None
  table = step_table(plans)
  k = plans[0].num_devices
  if sum(len(p.exchanges) for p in table.patterns) <= _BRANCH_BUDGET or k < 3:
    return table
  forms = [fixed_slots(k, form) for form in ("matchings", "offsets")]
  rows = [_rows_sent(plans, slot_of) for slot_of, _ in forms]
  slot_of, pairs = forms[int(np.argmin(rows))]
  if min(rows) > _FIXED_ROWS_AT_MOST * table.rows_sent().sum():
    return table
  fixed = [compile_plan(p, k, slot_of) for p in topology.plans()]
  return step_table(fixed, pairs)
