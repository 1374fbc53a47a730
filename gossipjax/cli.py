"""``gossipjax train``: compare decentralized algorithms and topologies on real data, no network needed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence


class _Parser(argparse.ArgumentParser):
  """Bad input ends with one line naming the option and what it allows, and exit status 2 (no usage dump)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _names(kind: str, allowed: Sequence[str]):
  """A comma-separated list of names, each one of ``allowed``."""

  def parse(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
      raise argparse.ArgumentTypeError(f"give at least one {kind}, from: {', '.join(allowed)}")
    unknown = [x for x in names if x not in allowed]
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(map(repr, unknown))}; choose from: {', '.join(allowed)}")
    return names

  return parse


def _integer(low: int, what: str):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer; it must be {what}") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"{value} is out of range; it must be {what}")
    return value

  return parse


def _real(what: str, low: float, high: float = float("inf"), low_open: bool = False, high_open: bool = True):
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number; it must be {what}") from None
    ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok or value != value:  # NaN compares false to everything
      raise argparse.ArgumentTypeError(f"{value} is out of range; it must be {what}")
    return value

  return parse


# What must match between a checkpointed job and a --resume of it: the runs, and what each run computes.
RESUME_OPTIONS = ("algorithms", "topologies", "nodes", "lr", "beta", "seed", "batch_size", "partition", "alpha",
                  "model", "log_every", "backend", "compressor", "compress_fraction", "consensus_step", "average_every")


def build_parser() -> argparse.ArgumentParser:
  from gossipjax.train import ALGORITHMS, TOPOLOGIES
  from gossipjax.train._registry import COMPRESSORS

  p = _Parser(prog="gossipjax", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
  t = sub.add_parser("train", help="train a model on the bundled handwritten digits with n decentralized nodes",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  t.add_argument("--backend", choices=["simulate", "sharded", "mpi"], default="simulate",
                 help="where the nodes live: all on one device, split over this host's devices "
                      "(shard_map + ppermute), or over MPI ranks (launch with `mpiexec -n K gossipjax train "
                      "--backend mpi`); every backend reports the simulation's numbers")
  t.add_argument("--devices", type=_integer(1, "a positive integer"), default=None,
                 help="sharded: how many devices to split the nodes over (default: all; on a CPU host, "
                      "that many CPU devices are made)")
  t.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="an MLP with one hidden layer, or a small CNN")
  t.add_argument("--algorithms", type=_names("algorithm", tuple(ALGORITHMS)),
                 default=["allreduce", "dpsgd", "dmsgd", "decentlam"], help=f"comma-separated, from: {', '.join(ALGORITHMS)}")
  t.add_argument("--topologies", type=_names("topology", tuple(TOPOLOGIES)),
                 default=["ring", "exponential", "symmetric_exponential"], help=f"comma-separated, from: {', '.join(TOPOLOGIES)}")
  t.add_argument("--nodes", type=_integer(2, "an integer of at least 2"), default=16, help="number of nodes")
  t.add_argument("--steps", type=_integer(1, "a positive integer"), default=500, help="training steps per run")
  t.add_argument("--batch-size", type=_integer(1, "a positive integer"), default=16, help="per node")
  t.add_argument("--lr", type=_real("a finite number > 0", 0.0, low_open=True), default=0.1, help="learning rate")
  t.add_argument("--beta", type=_real("a number in [0, 1)", 0.0, 1.0), default=0.9, help="momentum (dpsgd uses 0)")
  t.add_argument("--compressor", choices=list(COMPRESSORS), default="top_k", help="choco: the compressor")
  t.add_argument("--compress-fraction", type=_real("a number in (0, 1]", 0.0, 1.0, low_open=True, high_open=False),
                 default=0.1, help="choco with top_k or random_k: the fraction of entries each message keeps")
  t.add_argument("--consensus-step", type=_real("a number in (0, 1]", 0.0, 1.0, low_open=True, high_open=False),
                 default=0.3, help="choco: the consensus step size (too large for the compressor diverges)")
  t.add_argument("--average-every", type=_integer(1, "a positive integer"), default=10,
                 help="dmsgd_pga: steps between global averages")
  t.add_argument("--partition", choices=["iid", "dirichlet", "by_class"], default="dirichlet",
                 help="how the training set is split over the nodes")
  t.add_argument("--alpha", type=_real("a finite number > 0", 0.0, low_open=True), default=0.5,
                 help="Dirichlet label-skew concentration")
  t.add_argument("--log-every", type=_integer(1, "a positive integer"), default=25,
                 help="steps per jitted chunk and metrics row")
  t.add_argument("--seed", type=_integer(0, "a non-negative integer"), default=0,
                 help="seeds the init, the partition and the batches")
  t.add_argument("--max-bad-steps", type=_integer(0, "a non-negative integer"), default=10,
                 help="stop when a node's gradient is NaN/inf this many steps in a row (it skips those steps); 0: never")
  t.add_argument("--out", default="runs/train", help="directory for metrics.json and plot.png")
  t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  t.add_argument("--checkpoint-every", type=_integer(0, "a non-negative integer"), default=0,
                 help="save each run's full state in OUT/checkpoints every this many steps (a multiple of "
                      "--log-every), for --resume; 0: never")
  t.add_argument("--resume", action="store_true",
                 help="continue every run from its newest checkpoint in OUT/checkpoints (bit-for-bit the same "
                      "as an uninterrupted run); runs without one start from step 0. Refused when the "
                      f"checkpoints were written with other values of: {', '.join('--' + o.replace('_', '-') for o in RESUME_OPTIONS)}")
  t.add_argument("--allow-changed-options", action="store_true",
                 help="with --resume: continue even where those options differ from the checkpointed job's")
  p.set_defaults(parser=t)
  return p


def _check_args(args: argparse.Namespace) -> None:
  """Checks between options; errors go through the parser (one line, exit status 2)."""
  fail = args.parser.error
  if args.steps % args.log_every:
    fail(f"argument --steps: {args.steps} must be a multiple of --log-every ({args.log_every})")
  if args.checkpoint_every % args.log_every:
    fail(f"argument --checkpoint-every: {args.checkpoint_every} must be a multiple of --log-every ({args.log_every})")
  if args.devices is not None and args.backend != "sharded":
    fail(f"argument --devices: only the sharded backend takes it, not --backend {args.backend}")
  if args.allow_changed_options and not args.resume:
    fail("argument --allow-changed-options: only with --resume")


def _check_resume(args: argparse.Namespace, is_main: bool) -> None:
  """Refuses a --resume whose options differ from those the checkpoints were written with."""
  import json

  path = os.path.join(args.out, "checkpoints", "job.json")
  now = {k: getattr(args, k) for k in RESUME_OPTIONS}
  if args.resume and os.path.exists(path):
    with open(path) as f:
      then = json.load(f)
    differ = [k for k in RESUME_OPTIONS if k in then and then[k] != now[k]]
    if differ and not args.allow_changed_options:
      show = lambda v: ",".join(map(str, v)) if isinstance(v, list) else str(v)
      was = ", ".join(f"--{k.replace('_', '-')} {show(then[k])}" for k in differ)
      asked = ", ".join(f"--{k.replace('_', '-')} {show(now[k])}" for k in differ)
      args.parser.error(f"argument --resume: the checkpoints in {args.out} were written with {was}, not {asked}; "
                        "pass the same options, or add --allow-changed-options to continue anyway")
  if is_main and args.checkpoint_every:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(now, f)
    os.replace(path + ".tmp", path)


def _make_backend(args: argparse.Namespace):
  import jax

  import gossipjax as gj

  if args.backend == "simulate":
    return gj.backend.simulate()
  if args.backend == "mpi":
    return gj.backend.mpi(abort_on_error=True)  # a failing rank ends the job instead of hanging it
  devices = jax.devices()
  k = args.devices or len(devices)
  if k > len(devices):
    args.parser.error(f"argument --devices: {k} asked for, but only {len(devices)} {jax.default_backend()} "
                      "device(s) are visible")
  mesh = jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:k])
  return gj.backend.sharded(mesh)


class _RunCheckpoints:
  """One run's checkpoints: the training state via gj.checkpoint, its metrics rows beside it."""

  def __init__(self, directory: str, every: int, placement):
    self.directory, self.every, self.placement = directory, every, placement

  def save(self, state, rows) -> None:
    import json

    from gossipjax import checkpoint

    if not self.every or state.step % self.every:
      return
    checkpoint.save(self.directory, {"step": state.step, "params": state.params, "opt_state": state.opt_state},
                    step=state.step, keep=2)
    tmp = os.path.join(self.directory, "history.json.tmp")
    with open(tmp, "w") as f:
      json.dump(rows, f)
    os.replace(tmp, os.path.join(self.directory, "history.json"))

  def restore(self, fresh):
    import json

    from gossipjax import checkpoint
    from gossipjax.train import TrainState

    if not os.path.isdir(self.directory) or checkpoint.latest_step(self.directory) is None:
      return None, []
    like = {"params": fresh.params, "opt_state": fresh.opt_state}
    tree = checkpoint.restore(self.directory, like={"step": 0, **like})
    with open(os.path.join(self.directory, "history.json")) as f:
      rows = [r for r in json.load(f) if r["step"] <= tree["step"]]
    placed = self.placement.like({"params": tree["params"], "opt_state": tree["opt_state"]}, like)
    return TrainState(int(tree["step"]), placed["params"], placed["opt_state"]), rows


def train(args: argparse.Namespace) -> dict:
  import jax
  from tqdm.auto import tqdm

  from gossipjax.checkpoint import rank_directory
  from gossipjax.data import load_digits
  from gossipjax.train import (ALGORITHMS, CNN, MLP, RunConfig, init_state, make_algorithm, make_topology, plot,
                               result_table, timed_run)
  from gossipjax.train._placement import Placement
  from gossipjax.train._registry import NEEDS_NO_TOPOLOGY, AlgorithmOptions

  _check_args(args)
  backend = _make_backend(args)
  try:
    placement = Placement(backend, args.nodes)
  except ValueError as e:
    args.parser.error(f"argument --nodes: {e}")
  _check_resume(args, placement.is_main)
  dataset = load_digits(seed=args.seed)
  if args.model == "cnn":
    model = CNN(num_classes=dataset.num_classes, image_shape=(8, 8, 1))
  else:
    model = MLP(hidden=(64,), num_classes=dataset.num_classes)
  runs = []
  for alg in args.algorithms:
    for topo in ([None] if alg in NEEDS_NO_TOPOLOGY else args.topologies):
      cfg = RunConfig(algorithm=alg, topology=topo, num_nodes=args.nodes, steps=args.steps,
                      batch_size=args.batch_size, learning_rate=args.lr, beta=args.beta,
                      partition=args.partition, alpha=args.alpha, seed=args.seed, log_every=args.log_every,
                      max_bad_steps=args.max_bad_steps, model=args.model, backend=args.backend)
      runs.append(cfg)
  # Build every transform first so that a bad name or size fails before any training; a pair the
  # algorithm cannot run on (DecentLaM on a directed graph) is skipped with its reason.
  txs, skipped = [], {}
  for c in list(runs):
    try:
      topo = make_topology(c.topology, c.num_nodes) if c.topology else None
    except ValueError as e:
      args.parser.error(f"argument --topologies: {c.topology} on --nodes {c.num_nodes}: {e}")
    try:
      options = AlgorithmOptions(args.compressor, args.compress_fraction, args.consensus_step, args.average_every)
      txs.append(make_algorithm(c.algorithm, topo, c.learning_rate, c.beta, backend, options))
    except ValueError as e:
      if topo is None or c.algorithm not in ALGORITHMS:
        raise
      skipped[c.name] = str(e)
      runs.remove(c)

  if placement.is_main:
    os.makedirs(args.out, exist_ok=True)
  results = {}
  quiet = args.no_progress or not placement.is_main
  with tqdm(total=sum(c.steps for c in runs), unit="step", disable=quiet, file=sys.stderr) as bar:
    for cfg, tx in zip(runs, txs):
      bar.set_description(cfg.name)
      directory = os.path.join(args.out, "checkpoints", cfg.name.replace("/", "__"))
      if args.backend == "mpi":  # each rank checkpoints its own block of nodes
        directory = str(rank_directory(directory, backend.rank))
      ckpt = _RunCheckpoints(directory, args.checkpoint_every, placement)
      fresh = init_state(cfg, dataset, model, tx, backend)
      state, previous = ckpt.restore(fresh) if args.resume else (None, [])
      if state is not None:
        bar.update(state.step)
      try:
        _, history, seconds = timed_run(cfg, dataset, model, tx, progress=bar.update, state=state or fresh,
                                        on_chunk=lambda st, rows: ckpt.save(st, previous + rows), backend=backend)
      except FloatingPointError as e:
        raise SystemExit(f"{cfg.name}: {e}; try a smaller --lr") from e
      history = previous + history
      results[cfg.name] = {"config": dataclasses.asdict(cfg), "history": history, "seconds": seconds}

  if not placement.is_main:
    return results
  from gossipjax.train import write_metrics

  metrics_path, plot_path = os.path.join(args.out, "metrics.json"), os.path.join(args.out, "plot.png")
  config = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
  config["devices"] = placement.num_devices
  write_metrics(metrics_path, {**config, "skipped": skipped}, results)
  where = (f"{args.backend} on {placement.num_devices} {placement.unit}" if placement.num_devices > 1
           else args.backend)
  plot(plot_path, results, title=f"{args.nodes} nodes, {args.model} on digits, {args.partition} partition, "
                                 f"{where} ({jax.default_backend()})")
  print(result_table(results))
  for name, reason in skipped.items():
    print(f"skipped {name}: {reason}")
  print(f"\nwrote {metrics_path} and {plot_path}")
  return results


def _request_cpu_devices(args: argparse.Namespace) -> None:
  """``--devices K`` on a CPU host: XLA makes K CPU devices if told so before its first computation."""
  if args.backend != "sharded" or not args.devices:
    return
  import jax

  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return  # the user's own setting wins
  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError:
    return  # jax has already computed in this process (the CLI called from Python): use the devices it has
  from gossipjax.backend import _cpu_threads

  _cpu_threads.reserve_collective_threads()  # gossipjax's import saw one device; size the pool for these


def main(argv: Sequence[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  if args.command == "train":
    _request_cpu_devices(args)
    train(args)


if __name__ == "__main__":
  main()
