"""A plan compiled to device blocks applies W exactly, read back in plain NumPy; compiling is array work."""

import time

import numpy as np
import pytest

from gossipjax import topology as T
from gossipjax.backend._block_plan import compile_plan


def apply_blocks(bp, x):
  """``W x`` from a ``BlockPlan``: each device reads its block and the rows the exchanges deliver."""
  k, b = bp.num_devices, bp.block
  blocks = x.reshape((k, b) + x.shape[1:])
  out = []
  for d in range(k):
    bufs = [blocks[d]]
    for ex in bp.exchanges:
      s = ex.source[d]  # the device that sends to d in this exchange
      bufs.append(blocks[s][ex.send_rows[s, :ex.count[s]]] if s >= 0 else blocks[d][:0])
    y = bp.self_weight[d][:, None] * blocks[d]
    for r in bp.rounds:
      received = np.stack([bufs[r.buffer[d, i]][r.row[d, i]] for i in range(b)])
      y = y + r.weight[d][:, None] * received
    for t in bp.rank_one:
      y = y + t.u[d][:, None] * np.tensordot(t.v.ravel(), x, axes=1)[None]
    out.append(y)
  return np.concatenate(out)


TOPOLOGIES = [T.ring(16), T.exponential(64), T.torus(4, 6), T.erdos_renyi(48, 0.3, seed=1), T.directed_exponential(40),
              T.random_pairs(24, seed=3, period=3), T.hypercube(32), T.grid(6, 8, "metropolis"), T.star(16),
              T.complete(24)]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_compiled_blocks_apply_w_exactly(topo, k):
  assert topo.num_nodes % k == 0  # every topology above splits over 8 devices
  x = np.random.default_rng(k).normal(size=(topo.num_nodes, 2))
  for step, plan in enumerate(topo.plans()):
    bp = compile_plan(plan, k)
    np.testing.assert_allclose(apply_blocks(bp, x), topo.matrix(step) @ x, rtol=0, atol=1e-14)
    # Only rows a neighbour reads travel, each once per exchange; an exchange is a partial
    # permutation of devices (each sends to one and receives from one at most).
    for ex in bp.exchanges:
      for s in range(k):
        rows = ex.send_rows[s, :ex.count[s]]
        assert len(set(rows.tolist())) == len(rows)
      senders, receivers = [s for s, _ in ex.pairs], [t for _, t in ex.pairs]
      assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
      assert all(ex.dest[s] == t and ex.source[t] == s and ex.count[s] > 0 for s, t in ex.pairs)


def test_compiling_65536_nodes_over_two_devices_is_array_work():
  plan = T.exponential(65_536).plans()[0]
  start = time.perf_counter()
  bp = compile_plan(plan, 2)
  assert time.perf_counter() - start < 2.0  # about 0.2 s; a loop over the 1M edges took 3 s
  assert [ex.pairs for ex in bp.exchanges] == [((0, 1), (1, 0))]
  # Shift h sends the last h rows of each block to the other device; the largest shift is 32,768.
  assert int(bp.exchanges[0].count[0]) == 32_768


@pytest.mark.parametrize("topo, k, average", [(T.random_pairs(16), 8, 2.0), (T.random_pairs(48, seed=2), 8, None),
                                              (T.erdos_renyi(48, 0.3, seed=1), 8, None), (T.ring(16), 8, 2.0)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_a_plan_uses_no_more_exchanges_than_its_busiest_device_needs(topo, k, average):
  """As many exchanges as the most device pairs one device sends or receives (Konig): no fewer can do."""
  counts = []
  for plan in topo.plans():
    bp = compile_plan(plan, k)
    pairs = {pair for ex in bp.exchanges for pair in ex.pairs}
    degree = max(np.bincount([s for s, _ in pairs], minlength=k).max(),
                 np.bincount([t for _, t in pairs], minlength=k).max()) if pairs else 0
    assert len(bp.exchanges) == degree
    counts.append(len(bp.exchanges))
  if average is not None:  # random_pairs(16) on 8 devices: 2 nodes a device, at most 2 partners, 2.69 before
    assert np.mean(counts) == average
