"""The training loop of the main job: n simulated nodes, one algorithm, metrics per chunk of steps."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Hashable
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gossipjax.backend import Backend, simulate
from gossipjax.backend._network import network as parse_network, simulated_seconds
from gossipjax.backend._traffic import Traffic, counting
from gossipjax._guard import check_guard, guard_finite, nonfinite_counts
from gossipjax._stacked import check_finite, consensus_distance, init_nodes, node_mean
from gossipjax.data import (
    Dataset, node_data, partition_by_class, partition_by_source, partition_dirichlet, partition_iid, sample_batches)
from gossipjax.train._placement import Placement


@dataclasses.dataclass
class RunConfig:
  """One training run. Plain values only, so it can be written to JSON.

  Attributes:
    algorithm: a name in `gossipjax.train.ALGORITHMS` (``"dmsgd"``, ``"allreduce"``, ...).
    topology: a name in `gossipjax.train.TOPOLOGIES`, or ``None`` for the algorithms that
      need none (``allreduce``, ``easgd``).
    num_nodes: n, the number of simulated nodes.
    steps: training steps; the last chunk is shorter when ``log_every`` does not divide
      them, so the last metrics row is at ``steps``.
    batch_size: samples per node per step.
    learning_rate: the step size gamma (DiLoCo's and NoLoCo's inner AdamW's).
    beta: the momentum of the algorithms that take one (DiLoCo's and NoLoCo's inner b1).
    partition: how the training set is split over nodes: ``"iid"``, ``"dirichlet"``
      (`gossipjax.data.partition_dirichlet` with ``alpha``), ``"by_class"``
      (`gossipjax.data.partition_by_class` with ``classes_per_node``), or, for text,
      ``"by_source"`` (`gossipjax.data.partition_by_source`: each node reads its own files).
    alpha: the Dirichlet concentration of the ``"dirichlet"`` partition.
    classes_per_node: the classes per node of the ``"by_class"`` partition.
    hidden: the hidden widths of the ``"mlp"`` model.
    seed: seed of the partition, the initialisation and the minibatches.
    log_every: steps per jitted chunk; one metrics row per chunk, and one at ``steps``.
    max_bad_steps: a node whose gradient is NaN/inf this many steps in a row stops the
      run (0: never).
    model: ``"mlp"``, ``"cnn"`` or ``"gpt"``, as the main job names them.
    backend: ``"simulate"``, ``"sharded"`` or ``"mpi"``, as the main job names them.
    outer_momentum: DiLoCo's and NoLoCo's outer momentum, for the record and the legend;
      ``None`` for the other algorithms.
    network: the links of the simulated cluster whose wall clock the rows' ``sim_seconds``
      give: a name in `gossipjax.NETWORKS` or ``"BANDWIDTH,LATENCY"`` (`gossipjax.network`).
    step_time: the compute seconds of one step on one node in that cluster (an H100's, say);
      ``None`` measures it here: each chunk's compiled run over its steps and over the nodes
      this process computes (each node of the cluster computes alone on a device of its own).

  Example:
    >>> from gossipjax import train
    >>> cfg = train.RunConfig(algorithm="dpsgd", topology="torus", num_nodes=16)
    >>> cfg.name, cfg.steps
    ('dpsgd/torus', 500)
  """

  algorithm: str = "dmsgd"
  topology: str | None = "ring"
  num_nodes: int = 16
  steps: int = 500
  batch_size: int = 16
  learning_rate: float = 0.1
  beta: float = 0.9
  partition: str = "dirichlet"  # iid | dirichlet | by_class
  alpha: float = 0.5
  classes_per_node: int = 2
  hidden: tuple[int, ...] = (64,)
  seed: int = 0
  log_every: int = 25
  max_bad_steps: int = 10  # a node whose gradient is NaN/inf this many steps in a row stops the run; 0: never
  model: str = "mlp"  # mlp | cnn, as the main job names them
  backend: str = "simulate"  # simulate | sharded | mpi, as the main job names them
  outer_momentum: float | None = None  # diloco, noloco: the outer momentum (their beta is the inner AdamW's b1)
  network: str = "datacenter"  # the simulated cluster's links, for sim_seconds
  step_time: float | None = None  # one node's compute seconds a step there; None: measured here

  @property
  def name(self) -> str:
    """``algorithm/topology`` (or the algorithm alone when it needs no topology): the run's label."""
    return self.algorithm if self.topology is None else f"{self.algorithm}/{self.topology}"


def is_sequence(dataset: Dataset) -> bool:
  """Whether the data set is token windows with next-token targets (a language model's), not labelled samples."""
  return np.ndim(dataset.y_train) == 2 and np.issubdtype(np.asarray(dataset.y_train).dtype, np.integer)


def partition(dataset: Dataset, cfg: RunConfig) -> list[np.ndarray]:
  """Each node's training samples (indices into ``dataset.x_train``), as ``cfg.partition`` splits them."""
  labels = dataset.y_train
  if cfg.partition == "by_source":
    if dataset.sources is None:
      raise ValueError("partition by_source needs a data set whose samples name their source (a text corpus)")
    return partition_by_source(dataset.sources, cfg.num_nodes, cfg.seed)
  if is_sequence(dataset):
    if cfg.partition != "iid":
      raise ValueError(f"partition {cfg.partition!r} splits by class label; a text corpus takes iid or by_source")
    return partition_iid(np.arange(len(labels)), cfg.num_nodes, cfg.seed)
  if cfg.partition == "iid":
    return partition_iid(labels, cfg.num_nodes, cfg.seed)
  if cfg.partition == "dirichlet":
    return partition_dirichlet(labels, cfg.num_nodes, cfg.alpha, cfg.seed)
  if cfg.partition == "by_class":
    return partition_by_class(labels, cfg.num_nodes, cfg.classes_per_node, cfg.seed)
  raise ValueError(f"unknown partition {cfg.partition!r}; choose iid, dirichlet, by_class or by_source")


def cross_entropy(apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """The mean softmax cross-entropy of a classifier on a batch with integer labels.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits`` of shape (batch, classes), e.g. a flax
      module's ``apply``.
    params: the params of one model (no node axis).
    x: the inputs, (batch, ...).
    y: int labels, (batch,).

  Returns:
    The loss, a float scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from gossipjax import train
    >>> loss = train.cross_entropy(lambda p, x: x @ p, jnp.eye(3), jnp.eye(3), jnp.array([0, 1, 2]))
    >>> round(float(loss), 4)  # log(1 + 2 / e)
    0.5514
  """
  return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()


def accuracy(apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  """The share of a batch whose highest logit is the label.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits`` of shape (batch, classes).
    params: the params of one model (no node axis).
    x: the inputs, (batch, ...).
    y: int labels, (batch,).

  Returns:
    The accuracy in [0, 1], a float scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from gossipjax import train
    >>> acc = train.accuracy(lambda p, x: x @ p, jnp.eye(3), jnp.eye(3), jnp.array([0, 1, 1]))
    >>> round(float(acc), 4)
    0.6667
  """
  return jnp.mean(jnp.argmax(apply_fn(params, x), axis=-1) == y)


@dataclasses.dataclass
class TrainState:
  """Everything a run needs to continue: a checkpoint of this resumes exactly.

  The data position is the step counter (`run` draws step k's minibatches from the
  step), so no data-loader state is needed.

  Attributes:
    step: the training steps taken.
    params: the nodes' params this process holds (leading node axis).
    opt_state: the optimizer's state (``tx`` behind `guarded`).

  Example:
    Saved as a dict of its fields, and given back to `run` as ``state`` to continue:

    >>> import tempfile, jax.numpy as jnp, gossipjax as gj
    >>> from gossipjax import train
    >>> state = train.TrainState(step=40, params=jnp.ones((4, 3)), opt_state=(jnp.zeros((4, 3)),))
    >>> d = tempfile.mkdtemp()
    >>> _ = gj.checkpoint.save(d, vars(state), step=state.step)
    >>> back = train.TrainState(**gj.checkpoint.restore(d, like=vars(state)))
    >>> back.step, back.params.shape
    (40, (4, 3))
  """

  step: int
  params: Any
  opt_state: Any


def guarded(tx: optax.GradientTransformation, cfg: RunConfig) -> optax.GradientTransformation:
  """``tx`` behind `gj.guard_finite`: a node with a NaN/inf gradient skips its step.

  Args:
    tx: the stacked-node optimizer.
    cfg: the run; ``cfg.max_bad_steps`` is the streak of skipped steps at which
      `gj.check_guard` raises (0: never).

  Returns:
    The guarded transform; its state is a `gj.GuardFiniteState`.

  Example:
    >>> import jax.numpy as jnp, gossipjax as gj
    >>> from gossipjax import train
    >>> tx = train.guarded(gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1), train.RunConfig())
    >>> x = jnp.zeros((4, 2))
    >>> _, state = tx.update(jnp.ones((4, 2)).at[2, 0].set(jnp.nan), tx.init(x), x)
    >>> gj.nonfinite_counts(state).tolist()
    [0, 0, 1, 0]
  """
  return guard_finite(tx, max_consecutive=cfg.max_bad_steps or None)


def init_state(cfg: RunConfig, dataset: Dataset, model: Any, tx: optax.GradientTransformation,
               backend: Backend | None = None) -> TrainState:
  """Step 0: every node starts from the same initialisation, placed where ``backend`` keeps it.

  Args:
    cfg: the run (``num_nodes``, ``seed``, ``max_bad_steps``).
    dataset: the data set; one test input fixes the model's input shape.
    model: a flax module (`MLP`, `CNN`, or any with ``init`` and ``apply``).
    tx: the stacked-node optimizer (it is wrapped by `guarded`, as `run` does).
    backend: where the nodes live (default: ``gj.backend.simulate()``).

  Returns:
    A `TrainState` at step 0.

  Example:
    >>> import jax, gossipjax as gj
    >>> from gossipjax import train
    >>> cfg = train.RunConfig(algorithm="dpsgd", num_nodes=4, hidden=(16,))
    >>> tx = gj.gossip_sgd(gj.topology.ring(4), learning_rate=0.1)
    >>> state = train.init_state(cfg, gj.data.load_digits(), train.MLP(hidden=(16,)), tx)
    >>> state.step, state.params["params"]["Dense_0"]["kernel"].shape
    (0, (4, 64, 16))
  """
  tx = guarded(tx, cfg)
  key = jax.random.fold_in(jax.random.key(cfg.seed), 0)
  x = jnp.asarray(dataset.x_test[:1])
  try:
    hash(model)
  except TypeError:  # a model that does not hash: compiled for this run alone
    params = jax.jit(lambda k, x: init_nodes(lambda k1: model.init(k1, x), k, cfg.num_nodes))(key, x)
  else:
    params = _init_params(model, key, x, cfg.num_nodes)
  params = Placement(backend or simulate(), cfg.num_nodes).place(params)
  return TrainState(0, params, tx.init(params))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _init_params(model: Any, key: jax.Array, x: jax.Array, num_nodes: int) -> Any:
  # One compiled program, not one per operation of the model's init; compiled once per model
  # (flax modules hash by their fields), so the runs of a job share it.
  return init_nodes(lambda k: model.init(k, x), key, num_nodes)


def _evaluate_fn(model: Any, params: Any, node_losses: jax.Array, x_test: jax.Array, y_test: jax.Array) -> dict:
  mean = node_mean(params)
  node_acc = jax.vmap(lambda p: accuracy(model.apply, p, x_test, y_test))(params)
  return {
      "train_loss": jnp.mean(node_losses),
      "consensus_distance": consensus_distance(params),
      "test_loss": cross_entropy(model.apply, mean, x_test, y_test),
      "test_accuracy": accuracy(model.apply, mean, x_test, y_test),
      "node_accuracy_mean": jnp.mean(node_acc),
      "node_accuracy_min": jnp.min(node_acc),
  }


def _evaluate_sequence_fn(model: Any, params: Any, node_losses: jax.Array, x_test: jax.Array,
                          y_test: jax.Array) -> dict:
  """A language model's: the mean model's test loss (nats a token) and bits per token, and each node's test loss."""
  mean = node_mean(params)
  node_loss = jax.vmap(lambda p: cross_entropy(model.apply, p, x_test, y_test))(params)
  test_loss = cross_entropy(model.apply, mean, x_test, y_test)
  return {
      "train_loss": jnp.mean(node_losses),
      "consensus_distance": consensus_distance(params),
      "test_loss": test_loss,
      "test_bits_per_token": test_loss / jnp.log(2.0),
      "test_accuracy": accuracy(model.apply, mean, x_test, y_test),
      "node_test_loss_mean": jnp.mean(node_loss),
      "node_test_loss_max": jnp.max(node_loss),
      "node_test_loss": node_loss,
  }


# One program per model and shapes, which the runs of a job share (a closure per run compiled it for each run).
_evaluate = jax.jit(_evaluate_fn, static_argnums=0)
_evaluate_sequence = jax.jit(_evaluate_sequence_fn, static_argnums=0)


def run(
    cfg: RunConfig,
    dataset: Dataset,
    model: Any,
    tx: optax.GradientTransformation,
    progress: Callable[[int], None] | None = None,
    state: TrainState | None = None,
    on_chunk: Callable[[TrainState, list[dict[str, float]]], None] | None = None,
    backend: Backend | None = None,
    sent_before: float = 0.0,
    seconds_before: float = 0.0,
) -> tuple[TrainState, list[dict[str, Any]]]:
  """Trains ``cfg.num_nodes`` stacked copies of ``model`` with ``tx`` and logs metrics.

  The minibatch of step k is drawn from ``fold_in(key, k)`` for all n nodes, so the data
  position is the step counter, a run restored from ``state`` continues exactly, and every
  backend gives each node the batch the simulation gives it. ``tx`` runs behind
  `gj.guard_finite`: a node whose gradient is NaN/inf skips that step, and the run stops
  with an error naming the node and step once one has skipped ``cfg.max_bad_steps`` steps
  in a row (checked after every ``cfg.log_every`` steps).

  Args:
    cfg: the run: nodes, steps, batch size, partition, seed, ``log_every``.
    dataset: the data set; its training part is partitioned over the nodes, its test
      part scores the mean model and every node's model.
    model: a flax module (`MLP`, `CNN`, or any with ``init`` and ``apply``).
    tx: built for ``backend`` (e.g. ``gj.gossip_sgd(W, ..., backend=backend)``).
    progress: called with the chunk's steps after every chunk (a progress bar's ``update``).
    state: where to start (default: `init_state`); a restored checkpoint continues from it.
    on_chunk: called with the state and the metrics rows so far after every chunk
      (the main job saves checkpoints there).
    backend: where the nodes live (default: ``gj.backend.simulate()``). Gradients run
      through ``backend.map``, so each device or rank computes only its own nodes; the
      metrics are of all n nodes on every backend.
    sent_before: the bytes each node had sent before ``state`` (a resumed run's last row's
      ``bytes_sent``).
    seconds_before: the simulated seconds before ``state`` (a resumed run's last row's
      ``sim_seconds``).

  Returns:
    The final state (this process's nodes) and one metrics row per ``cfg.log_every`` steps
    and one at ``cfg.steps``:
    ``step``, ``train_loss`` (mean over nodes and the chunk), ``consensus_distance``,
    ``test_loss`` and ``test_accuracy`` of the mean model, ``node_accuracy_mean`` and
    ``node_accuracy_min`` over the nodes' own models, ``skipped_node_steps``, and
    ``bytes_sent``: the bytes each node has sent since step 0, on average over the nodes, as
    `gj.bytes_per_step` counts them (compact messages as sent, an all-reduce as a ring
    all-reduce sends it; the same on every backend, of this rank's nodes under MPI);
    ``sim_seconds``, the simulated wall clock since step 0 of a synchronous run on the cluster
    ``cfg.network`` with ``cfg.step_time`` of compute a step (`gj.simulated_seconds` of the
    chunks' exchanges; under MPI the slowest rank's), and ``step_time``, the compute seconds
    a step that went into it. For a language model (token windows with next-token targets)
    the rows also hold ``tokens_per_second`` (this machine's, all nodes' tokens over the
    compiled chunks' time), ``test_bits_per_token`` of the mean model, and each node's test
    loss: ``node_test_loss`` (a list), its mean and its max; ``test_accuracy`` is then the
    mean model's next-token accuracy.

  Raises:
    FloatingPointError: a node skipped ``cfg.max_bad_steps`` steps in a row, or the
      params became non-finite.

  Example:
    D-PSGD on a ring of 4 nodes, 20 steps on the bundled digits:

    >>> import gossipjax as gj
    >>> from gossipjax import train
    >>> cfg = train.RunConfig(algorithm="dpsgd", num_nodes=4, steps=20, log_every=10, hidden=(16,))
    >>> tx = train.make_algorithm("dpsgd", train.make_topology("ring", 4), cfg.learning_rate, cfg.beta)
    >>> state, history = train.run(cfg, gj.data.load_digits(), train.MLP(hidden=(16,)), tx)
    >>> state.step, [row["step"] for row in history]
    (20, [10, 20])
    >>> history[-1]["train_loss"] < history[0]["train_loss"]
    True
  """
  backend = backend or simulate()
  placement = Placement(backend, cfg.num_nodes)
  key = jax.random.key(cfg.seed)
  data = node_data(dataset.x_train, dataset.y_train, partition(dataset, cfg))
  links = parse_network(cfg.network)
  x_test, y_test = jnp.asarray(dataset.x_test), jnp.asarray(dataset.y_test)
  if state is None:
    state = init_state(cfg, dataset, model, tx, backend)
  tx = guarded(tx, cfg)
  batch_key = jax.random.fold_in(key, 1)
  loss_and_grad = backend.map(jax.value_and_grad(lambda p, x, y: cross_entropy(model.apply, p, x, y)))

  def one_step(carry, k):
    params, opt_state = carry
    xb, yb = placement.batch(sample_batches(data, jax.random.fold_in(batch_key, k), cfg.batch_size))
    loss, grads = loss_and_grad(params, xb, yb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  @functools.partial(jax.jit, static_argnums=3)
  def chunk(params, opt_state, start, length):
    (params, opt_state), losses = lax.scan(one_step, (params, opt_state), start + jnp.arange(length))
    return params, opt_state, jnp.mean(losses, axis=0)  # each node's mean training loss over the chunk

  sequence = is_sequence(dataset)
  if isinstance(model, Hashable):  # flax modules are: equal modules share the compiled evaluation
    evaluate = functools.partial(_evaluate_sequence if sequence else _evaluate, model, x_test=x_test, y_test=y_test)
  else:
    evaluate = jax.jit(functools.partial(_evaluate_sequence_fn if sequence else _evaluate_fn, model, x_test=x_test,
                                         y_test=y_test))
  compiled: dict[int, Any] = {}  # each chunk length's program, compiled ahead so that its run can be timed alone

  history: list[dict[str, Any]] = []
  params, opt_state, step = state.params, state.opt_state, state.step
  traffic = Traffic()
  local_nodes = next((jnp.shape(x)[0] for x in jax.tree.leaves(params) if jnp.ndim(x)), 1)
  tokens_per_step = local_nodes * cfg.batch_size * int(np.shape(dataset.x_train)[1]) if sequence else 0
  sim_seconds = seconds_before
  while step < cfg.steps:
    length = min(cfg.log_every, cfg.steps - step)  # the last chunk ends at cfg.steps
    start = jnp.asarray(step, jnp.int32)
    with counting(traffic):  # the chunk, traced here, counts the bytes its exchanges send as it runs
      if length not in compiled:
        compiled[length] = chunk.lower(params, opt_state, start, length).compile()
      began = time.perf_counter()
      params, opt_state, node_losses = jax.block_until_ready(compiled[length](params, opt_state, start))
      took = time.perf_counter() - began
    jax.effects_barrier()
    step_time = cfg.step_time if cfg.step_time is not None else took / length / local_nodes
    sim_seconds += placement.maximum(simulated_seconds(traffic.drain(), links, step_time, length))
    step += length
    placement.check_together(check_guard, opt_state, step, placement.first_node)
    all_params = placement.gather(params)
    placement.check_together(check_finite, all_params, step)
    metrics = evaluate(all_params, placement.gather(node_losses))
    skipped = placement.total(nonfinite_counts(opt_state).sum())
    jax.effects_barrier()
    row: dict[str, Any] = {"step": step, **{k: float(v) for k, v in metrics.items() if jnp.ndim(v) == 0},
                           "skipped_node_steps": skipped, "bytes_sent": sent_before + traffic.total / local_nodes,
                           "sim_seconds": sim_seconds, "step_time": step_time}
    if sequence:
      row["node_test_loss"] = [float(v) for v in metrics["node_test_loss"]]
      row["tokens_per_second"] = placement.total(round(tokens_per_step * length / took))
    history.append(row)
    state = TrainState(step, params, opt_state)
    if on_chunk is not None:
      on_chunk(state, history)
    if progress is not None:
      progress(length)
  return state, history


def timed_run(cfg: RunConfig, dataset: Dataset, model: Any, tx: optax.GradientTransformation, **kwargs):
  """`run`, timed: the wall-clock seconds include compilation and metrics.

  Args:
    cfg: the run.
    dataset: the data set.
    model: a flax module.
    tx: the stacked-node optimizer.
    **kwargs: the other arguments of `run` (``progress``, ``state``, ``on_chunk``,
      ``backend``).

  Returns:
    ``(state, history, seconds)``: `run`'s two results and the seconds it took.

  Example:
    >>> import gossipjax as gj
    >>> from gossipjax import train
    >>> cfg = train.RunConfig(algorithm="allreduce", topology=None, num_nodes=4, steps=5, log_every=5, hidden=(8,))
    >>> tx = train.make_algorithm("allreduce", None, 0.1, 0.0)
    >>> state, history, seconds = train.timed_run(cfg, gj.data.load_digits(), train.MLP(hidden=(8,)), tx)
    >>> len(history), seconds > 0
    (1, True)
  """
  t0 = time.perf_counter()
  state, history = run(cfg, dataset, model, tx, **kwargs)
  return state, history, time.perf_counter() - t0
