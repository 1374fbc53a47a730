"""Splitting a data set over nodes: iid, Dirichlet label skew, a few classes per node, whole sources per node."""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def _check(labels: np.ndarray, num_nodes: int, name: str) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(f"{name}: labels must be 1-D, got shape {labels.shape}")
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)) or num_nodes < 1:
    raise ValueError(f"{name}: num_nodes must be a positive integer, got {num_nodes!r}")
  if labels.shape[0] < num_nodes:
    raise ValueError(f"{name}: cannot give each of {num_nodes} nodes a sample: only {labels.shape[0]} samples")
  return labels


def _class_labels(labels: np.ndarray, name: str) -> np.ndarray:
  """The labels as int64 class ids; ``ValueError`` for NaN, fractional, string or other non-integer labels."""
  if labels.dtype.kind in "iub":
    return labels.astype(np.int64)
  if labels.dtype.kind == "f":
    bad = ~np.isfinite(labels) | (labels != np.round(labels))
    if bad.any():
      raise ValueError(f"{name}: labels must be integer class ids, got {labels[bad][:5].tolist()} "
                       f"({int(bad.sum())} such labels); drop or relabel those samples first")
    return labels.astype(np.int64)
  raise ValueError(f"{name}: labels must be integer class ids, got an array of {labels.dtype} "
                   "(map the classes to 0 .. C - 1 first, e.g. with np.unique(labels, return_inverse=True))")


def _finish(parts: Sequence[np.ndarray], how: str) -> list[np.ndarray]:
  empty = [i for i, p in enumerate(parts) if len(p) == 0]
  if empty:
    raise ValueError(f"gj.data.{how}: left node(s) {empty[:10]} with no data; use fewer nodes or a milder skew")
  return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_iid(labels: np.ndarray, num_nodes: int, seed: int = 0) -> list[np.ndarray]:
  """Shuffles the indices and deals them out evenly (sizes differ by at most one).

  Args:
    labels: (N,) labels of the data set (only their count matters here).
    num_nodes: how many nodes to split over; at most N.
    seed: shuffling seed.

  Returns:
    A list of ``num_nodes`` sorted int64 index arrays into the data set, disjoint and
    covering it.

  Raises:
    ValueError: ``labels`` is not 1-D, or ``num_nodes`` is not a positive integer up to N.

  Example:
    >>> import numpy as np, gossipjax as gj
    >>> parts = gj.data.partition_iid(np.zeros(10, int), num_nodes=3)
    >>> [len(p) for p in parts]
    [4, 3, 3]
    >>> sorted(np.concatenate(parts).tolist()) == list(range(10))
    True
  """
  labels = _check(labels, num_nodes, "gj.data.partition_iid")
  perm = np.random.default_rng(seed).permutation(labels.shape[0])
  return _finish(np.array_split(perm, num_nodes), "partition_iid")


def partition_dirichlet(labels: np.ndarray, num_nodes: int, alpha: float, seed: int = 0) -> list[np.ndarray]:
  """Label skew: each class is split over nodes in proportions drawn from Dirichlet(alpha).

  Small ``alpha`` (0.1) gives nodes that see mostly one or two classes; large ``alpha``
  (100) approaches iid, and ``alpha = inf`` is that limit: each class is split evenly over
  the nodes. Every node is guaranteed at least one sample.

  Args:
    labels: (N,) integer class labels (integer-valued floats are accepted).
    num_nodes: how many nodes to split over; at most N.
    alpha: Dirichlet concentration, > 0 (``inf``: an even split of every class).
    seed: seed of the shuffles and of the Dirichlet draws.

  Returns:
    A list of ``num_nodes`` sorted int64 index arrays into the data set, disjoint, covering
    it, none empty.

  Raises:
    ValueError: ``alpha`` is not positive, ``labels`` is not 1-D or holds a NaN or another
      non-integer label, or ``num_nodes`` is not a positive integer up to N.

  Example:
    The number of classes each of 4 nodes sees, 10 classes of 20 samples:

    >>> import numpy as np, gossipjax as gj
    >>> labels = np.repeat(np.arange(10), 20)
    >>> [len(np.unique(labels[p])) for p in gj.data.partition_dirichlet(labels, 4, alpha=0.1)]
    [5, 5, 2, 10]
    >>> [len(np.unique(labels[p])) for p in gj.data.partition_dirichlet(labels, 4, alpha=100.0)]
    [10, 10, 10, 10]

  References:
    Yurochkin, Agarwal, Ghosh, Greenewald, Hoang, Khazaeni (2019), Bayesian Nonparametric
    Federated Learning of Neural Networks, ICML.

    Hsu, Qi, Brown (2019), Measuring the Effects of Non-Identical Data Distribution for
    Federated Visual Classification, arXiv:1909.06335.
  """
  labels = _class_labels(_check(labels, num_nodes, "gj.data.partition_dirichlet"), "gj.data.partition_dirichlet")
  if not alpha > 0:
    raise ValueError(f"gj.data.partition_dirichlet: alpha must be > 0, got {alpha}")
  rng = np.random.default_rng(seed)
  samples, owners = [], []
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    # Dirichlet(alpha) tends to equal shares as alpha grows; NumPy cannot draw at inf itself.
    props = np.full(num_nodes, 1.0 / num_nodes) if np.isinf(alpha) else rng.dirichlet(np.full(num_nodes, alpha))
    cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
    samples.append(idx)
    owners.append(np.searchsorted(cuts, np.arange(len(idx)), side="right"))  # the chunk of np.split(idx, cuts)
  # Each node's samples in the order they were dealt (class by class), one stable sort.
  samples, owners = np.concatenate(samples), np.concatenate(owners)
  order = np.argsort(owners, kind="stable")
  bounds = np.cumsum(np.bincount(owners, minlength=num_nodes))[:-1]
  parts = [chunk.tolist() for chunk in np.split(samples[order], bounds)]
  # A very small alpha can starve a node; give it the last-dealt sample of the largest node
  # (the lowest index among equals). A heap of (-size, node) finds it in O(log n) per
  # starved node, where a scan over all nodes would make this quadratic.
  heap = [(-len(p), node) for node, p in enumerate(parts)]
  heapq.heapify(heap)
  for node in range(num_nodes):
    if not parts[node]:
      while True:  # skip entries made stale by an earlier donation
        size, donor = heapq.heappop(heap)
        if -size == len(parts[donor]):
          break
      parts[node].append(parts[donor].pop())
      heapq.heappush(heap, (-len(parts[donor]), donor))
      heapq.heappush(heap, (-1, node))
  return _finish([np.array(p) for p in parts], "partition_dirichlet")


def partition_by_class(labels: np.ndarray, num_nodes: int, classes_per_node: int = 1, seed: int = 0) -> list[np.ndarray]:
  """Pathological skew: node i holds samples of ``classes_per_node`` classes only.

  Classes are assigned round-robin (node i gets classes i, i+1, ... mod C, shuffled by
  ``seed``); the samples of a class are split evenly among the nodes holding it.

  Args:
    labels: (N,) integer class labels (integer-valued floats are accepted).
    num_nodes: how many nodes to split over; at most N.
    classes_per_node: how many classes each node holds, from 1 to the number of classes.
    seed: seed of the class order.

  Returns:
    A list of ``num_nodes`` sorted int64 index arrays into the data set, none empty.
    A class held by no node (more classes than ``num_nodes * classes_per_node``) is left out.

  Raises:
    ValueError: ``classes_per_node`` is out of range, a node is left with no sample,
      ``labels`` is not 1-D or holds a NaN or another non-integer label, or ``num_nodes``
      is not a positive integer up to N.

  Example:
    >>> import numpy as np, gossipjax as gj
    >>> labels = np.repeat(np.arange(4), 3)
    >>> parts = gj.data.partition_by_class(labels, num_nodes=4, classes_per_node=2)
    >>> [np.unique(labels[p]).tolist() for p in parts]
    [[0, 2], [1, 3], [0, 2], [1, 3]]

  References:
    McMahan, Moore, Ramage, Hampson, Agüera y Arcas (2017), Communication-Efficient Learning
    of Deep Networks from Decentralized Data, AISTATS (its pathological non-IID split).
  """
  labels = _class_labels(_check(labels, num_nodes, "gj.data.partition_by_class"), "gj.data.partition_by_class")
  classes = np.random.default_rng(seed).permutation(np.unique(labels))
  if isinstance(classes_per_node, bool) or not isinstance(classes_per_node, (int, np.integer)) or \
      not 1 <= classes_per_node <= len(classes):
    raise ValueError(f"gj.data.partition_by_class: classes_per_node must be an integer in [1, {len(classes)}], "
                     f"got {classes_per_node!r}")
  owners: dict[int, list[int]] = {int(c): [] for c in classes}
  for node in range(num_nodes):
    for k in range(classes_per_node):
      owners[int(classes[(node * classes_per_node + k) % len(classes)])].append(node)
  parts: list[list[int]] = [[] for _ in range(num_nodes)]
  for c, nodes in owners.items():
    if nodes:
      for node, chunk in zip(nodes, np.array_split(np.flatnonzero(labels == c), len(nodes))):
        parts[node].extend(chunk.tolist())
  return _finish([np.array(p) for p in parts], "partition_by_class")


def partition_by_source(sources: np.ndarray, num_nodes: int, seed: int = 0) -> list[np.ndarray]:
  """Each node holds the samples of whole sources (a text's packages or files), balanced by sample count.

  The data held in different places: a source's samples stay on one node. Sources are dealt greedily, the
  largest first, each to the node with the fewest samples so far; sources of equal size are taken, and
  nodes of equal load chosen, in an order drawn from ``seed``. The most loaded node then holds at most one
  source's worth (the largest) more than the least loaded one. With fewer sources than nodes, the largest
  sources are first cut into contiguous pieces (runs of their samples in data-set order): one cut at a time,
  each to the source with the most samples per piece, until there is one piece per node; each node then
  holds one piece, none shared. For text, a window's source is ``Dataset.sources``; an iid split instead is
  ``partition_iid(np.arange(len(sources)), num_nodes)``.

  Args:
    sources: (N,) integer source id of each sample.
    num_nodes: how many nodes to split over; at most N.
    seed: seed of the tie-breaks.

  Returns:
    A list of ``num_nodes`` sorted int64 index arrays into the data set, disjoint, covering it, none empty.

  Raises:
    ValueError: ``sources`` is not 1-D or holds a non-integer id, or ``num_nodes`` is not a positive
      integer up to N.

  Example:
    Four sources of 5, 3, 2 and 2 samples over 2 nodes, then over 6 (the largest two cut in pieces):

    >>> import numpy as np, gossipjax as gj
    >>> sources = np.repeat([0, 1, 2, 3], [5, 3, 2, 2])
    >>> parts = gj.data.partition_by_source(sources, num_nodes=2)
    >>> [np.unique(sources[p]).tolist() for p in parts], [len(p) for p in parts]
    ([[1, 2], [0, 3]], [5, 7])
    >>> sorted(np.unique(sources[p]).tolist() for p in gj.data.partition_by_source(sources, num_nodes=6))
    [[0], [0], [1], [1], [2], [3]]
  """
  name = "gj.data.partition_by_source"
  sources = _class_labels(_check(sources, num_nodes, name), name)
  ids, counts = np.unique(sources, return_counts=True)
  groups = np.split(np.argsort(sources, kind="stable"), np.cumsum(counts)[:-1])  # each source's samples, in order
  pieces = np.ones(len(ids), np.int64)
  # One more piece to the source with the most samples per piece: it always has more samples than pieces,
  # since the pieces are fewer than the samples, so no piece is empty.
  heap = [(-int(c), i) for i, c in enumerate(counts)]
  heapq.heapify(heap)
  for _ in range(num_nodes - len(ids)):
    _, i = heapq.heappop(heap)
    pieces[i] += 1
    heapq.heappush(heap, (-counts[i] / pieces[i], i))
  chunks = [chunk for group, k in zip(groups, pieces) for chunk in np.array_split(group, k)]
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(chunks))
  order = order[np.argsort([-len(chunks[i]) for i in order], kind="stable")]  # largest first, equal ones seeded
  rank = rng.permutation(num_nodes)
  loads = [(0, int(rank[node]), node) for node in range(num_nodes)]
  heapq.heapify(loads)
  parts: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
  for i in order:
    load, r, node = heapq.heappop(loads)
    parts[node].append(chunks[i])
    heapq.heappush(loads, (load + len(chunks[i]), r, node))
  return _finish([np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts], "partition_by_source")
