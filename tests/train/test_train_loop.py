"""The main job's training loop: a node fed NaN gradients skips its steps, then stops the run by name."""

import numpy as np
import pytest

import gossipjax as gj
from gossipjax.data import Dataset
from gossipjax.train import MLP, RunConfig, run


def poisoned_digits():
  ds = gj.data.load_digits()
  x = ds.x_train.copy()
  x[ds.y_train == 3] = np.nan  # every sample of class 3: its node's gradients are NaN
  return Dataset(x, ds.y_train, ds.x_test, ds.y_test, 10)


def cfg(**kw):
  return RunConfig(algorithm="dmsgd", topology="ring", num_nodes=10, steps=20, batch_size=8, log_every=5,
                   partition="by_class", classes_per_node=1, **kw)


def node_of_class_3(c):
  parts = gj.data.partition_by_class(gj.data.load_digits().y_train, c.num_nodes, 1, c.seed)
  return [i for i, p in enumerate(parts) if 3 in set(gj.data.load_digits().y_train[p])][0]


def test_bad_node_skips_its_steps_and_the_others_train():
  c = cfg(max_bad_steps=0)  # never stop
  tx = gj.gossip_sgd(gj.topology.ring(10), beta=0.9, learning_rate=0.05)
  state, history = run(c, poisoned_digits(), MLP(num_classes=10), tx)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in __import__("jax").tree.leaves(state.params))
  assert [h["skipped_node_steps"] for h in history] == [5, 10, 15, 20]  # one node, every step


def test_run_stops_naming_the_node_and_the_step():
  c = cfg(max_bad_steps=5)
  tx = gj.gossip_sgd(gj.topology.ring(10), beta=0.9, learning_rate=0.05)
  bad = node_of_class_3(c)
  with pytest.raises(FloatingPointError, match=rf"node {bad} had a NaN/inf gradient.* at 5 consecutive steps.*step 5"):
    run(c, poisoned_digits(), MLP(num_classes=10), tx)
