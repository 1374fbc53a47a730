"""``gossipjax train``: compare decentralized algorithms and topologies on real data, no network needed."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys
import time
from typing import Any, Callable, NoReturn, Sequence


class _Parser(argparse.ArgumentParser):
  """Bad input ends with one line naming the option and what it allows, and exit status 2 (no usage dump)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Each option's default said once: where its help says it, or as argparse shows it; none for flags and unset ones."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if "(default:" in text or action.default is None or action.default is False or not action.option_strings:
      return text
    if action.default is argparse.SUPPRESS:
      return text
    shown = ",".join(map(str, action.default)) if isinstance(action.default, list) else "%(default)s"
    return f"{text} (default: {shown})"


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


def _integer(low: int, what: str, high: int | None = None):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer; it must be {what}") from None
    if value < low or (high is not None and value > high):
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


_NETWORKS = ("infiniband", "datacenter", "regional", "cross_region", "internet")


def _network_spec(text: str) -> str:
  """A --network value that `gossipjax.network` reads (the spec itself is kept: plain values, for job.json)."""
  from gossipjax.backend._network import network

  try:
    network(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


# What must match between a checkpointed job and a --resume of it: the runs, and what each run computes.
# Where the runs go when no --out is given: a fresh folder per run, so a repeated command never meets its past.
DEFAULT_ROOT = os.path.join("runs", "train")

RESUME_OPTIONS = ("algorithms", "topologies", "nodes", "lr", "beta", "seed", "batch_size", "partition", "alpha",
                  "model", "log_every", "backend", "compressor", "compress_fraction", "consensus_step", "average_every",
                  "inner_steps", "outer_lr", "outer_momentum", "inner_lr", "fragments", "overlap", "mixing",
                  "fragment_split", "text", "context", "layers", "width", "heads", "compute_dtype", "network",
                  "step_time")


DEFAULT_TOPOLOGIES = ("ring", "exponential", "symmetric_exponential")

# The methods that train locally for --inner-steps steps between outer steps.
OUTER_ALGORITHMS = ("diloco", "noloco", "streaming_diloco")


def build_parser() -> argparse.ArgumentParser:
  from gossipjax._limits import MAX_PERIOD
  from gossipjax.train import ALGORITHM_NAMES as ALGORITHMS  # names only: no JAX is imported
  from gossipjax.train import COMPRESSOR_NAMES as COMPRESSORS
  from gossipjax.train import TOPOLOGY_NAMES as TOPOLOGIES

  p = _Parser(prog="gossipjax", description="gossipjax train: compare decentralized algorithms and topologies on "
                                             "real data, no network needed.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
  t = sub.add_parser("train", help="train a model (a classifier of the bundled handwritten digits, or a GPT on text "
                                    "every Python ships) with n decentralized nodes",
                     formatter_class=_HelpFormatter)
  t.add_argument("--backend", choices=["simulate", "sharded", "mpi"], default="simulate",
                 help="where the nodes live: all on one device, split over this host's devices "
                      "(shard_map + ppermute), or over MPI ranks (launch with `mpiexec -n K gossipjax train "
                      "--backend mpi`); every backend reports the simulation's numbers: to round-off in float64, and within "
                      "float32 rounding in float32, except where a selection flips on it (choco's top_k keeps other "
                      "entries, and the runs part)")
  t.add_argument("--devices", type=_integer(1, "a positive integer"), default=None,
                 help="sharded: how many devices to split the nodes over (default: all; on a CPU host, "
                      "that many CPU devices are made)")
  t.add_argument("--devices-per-node", type=_integer(1, "a positive integer"), default=1,
                 help="sharded: devices that make one node (a node's batch is split over them and its "
                      "gradient averaged inside it; only nodes gossip): --devices / this many nodes are spread "
                      "over the devices")
  t.add_argument("--model", choices=["mlp", "cnn", "gpt"], default="mlp",
                 help="an MLP with one hidden layer or a small CNN on the bundled digits, or a byte-level GPT "
                      "(gossipjax.train.GPT) on text: the Python standard library's own source files unless --text")
  t.add_argument("--text", default=None,
                 help="gpt: a text file or a folder of them to train on instead (split into train and test parts "
                      "as gossipjax.data.load_text says; a folder's top-level entries are its sources)")
  t.add_argument("--context", type=_integer(2, "an integer of at least 2"), default=64,
                 help="gpt: tokens (bytes) per training window, and the model's context")
  t.add_argument("--layers", type=_integer(1, "a positive integer"), default=2, help="gpt: transformer blocks")
  t.add_argument("--width", type=_integer(1, "a positive integer"), default=64,
                 help="gpt: the residual width, a multiple of --heads")
  t.add_argument("--heads", type=_integer(1, "a positive integer"), default=4, help="gpt: attention heads")
  t.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                 help="gpt: the dtype its matrix products compute in (params stay float32)")
  t.add_argument("--algorithms", type=_names("algorithm", tuple(ALGORITHMS)),
                 default=["allreduce", "dpsgd", "dmsgd", "decentlam"], help=f"comma-separated, from: {', '.join(ALGORITHMS)}")
  t.add_argument("--topologies", type=_names("topology", tuple(TOPOLOGIES)), default=None,
                 help=f"comma-separated, from: {', '.join(TOPOLOGIES)} (default: {','.join(DEFAULT_TOPOLOGIES)}; "
                      "noloco, which needs a pairing of the nodes, runs on random_pairs unless this names topologies)")
  t.add_argument("--nodes", type=_integer(2, "an integer of at least 2"), default=16, help="number of nodes")
  t.add_argument("--steps", type=_integer(1, "a positive integer"), default=500, help="training steps per run")
  t.add_argument("--batch-size", type=_integer(1, "a positive integer"), default=16, help="per node")
  t.add_argument("--lr", type=_real("a finite number > 0", 0.0, low_open=True), default=0.1,
                 help="learning rate of every method but diloco, noloco and streaming_diloco (their inner AdamW "
                      "takes --inner-lr)")
  t.add_argument("--beta", type=_real("a number in [0, 1)", 0.0, 1.0), default=0.9, help="momentum (dpsgd uses 0)")
  t.add_argument("--compressor", choices=list(COMPRESSORS), default="top_k", help="choco: the compressor")
  t.add_argument("--compress-fraction", type=_real("a number in (0, 1]", 0.0, 1.0, low_open=True, high_open=False),
                 default=0.1, help="choco with top_k or random_k: the fraction of entries each message keeps")
  t.add_argument("--consensus-step", type=_real("a number in (0, 1]", 0.0, 1.0, low_open=True, high_open=False),
                 default=0.3, help="choco: the consensus step size (too large for the compressor diverges)")
  period = _integer(1, f"a positive integer of at most 2**31 - 1 = {MAX_PERIOD}", high=MAX_PERIOD)
  t.add_argument("--average-every", type=period, default=10,
                 help="dmsgd_pga: steps between global averages")
  t.add_argument("--inner-steps", type=period, default=10,
                 help="diloco, noloco, streaming_diloco: local AdamW steps (learning rate --inner-lr, b1 --beta) "
                      "per outer step (streaming_diloco: between two syncs of one fragment)")
  t.add_argument("--inner-lr", type=_real("a finite number > 0", 0.0, low_open=True), default=3e-3,
                 help="diloco, noloco, streaming_diloco: the learning rate of their inner AdamW (every other method "
                      "steps at --lr)")
  t.add_argument("--outer-lr", type=_real("a number in (0, 1000]", 0.0, 1e3, low_open=True, high_open=False),
                 default=0.7, help="diloco, noloco, streaming_diloco: the outer learning rate")
  t.add_argument("--outer-momentum", type=_real("a number in [0, 1)", 0.0, 1.0), default=None,
                 help="diloco, noloco, streaming_diloco: the outer momentum (default: 0.9, Nesterov, for diloco "
                      "and streaming_diloco; 0.5 for noloco)")
  t.add_argument("--fragments", type=_integer(1, "a positive integer"), default=4,
                 help="streaming_diloco: F, the fragments of the params (see --fragment-split) that "
                      "synchronise in turn, one every --inner-steps / F steps; at most --inner-steps and, with "
                      "--fragment-split layers, the model's leaves (mlp: 4, cnn: 6)")
  t.add_argument("--fragment-split", choices=["layers", "balanced"], default="layers",
                 help="streaming_diloco: fragments of whole leaves in order (the paper's; the peak sync is the "
                      "largest fragment's), or of equal bytes, cutting leaves (the peak is 1/F of diloco's)")
  t.add_argument("--overlap", type=_integer(0, "a non-negative integer"), default=1,
                 help="streaming_diloco: tau, the inner steps a fragment's all-reduce overlaps before its outer "
                      "step is applied; below --inner-steps / --fragments")
  t.add_argument("--mixing", type=_real("a number in [0, 1]", 0.0, 1.0, high_open=False), default=0.5,
                 help="streaming_diloco: alpha, the weight of a node's own params when a fragment's outer result "
                      "is merged in (0: take the result, as diloco does)")
  t.add_argument("--partition", choices=["iid", "dirichlet", "by_class", "by_source"], default=None,
                 help="how the training set is split over the nodes: digits by label skew (iid, dirichlet, by_class; "
                      "default dirichlet), text iid or by_source, each node reading files of its own "
                      "(gossipjax.data.partition_by_source; the default for gpt)")
  t.add_argument("--alpha", type=_real("a finite number > 0", 0.0, low_open=True), default=0.5,
                 help="Dirichlet label-skew concentration")
  t.add_argument("--log-every", type=_integer(1, "a positive integer"), default=None,
                 help="steps per jitted chunk and metrics row of each run, and a last row at --steps (default: 25; "
                      "for the runs of diloco, noloco and streaming_diloco, the multiple of --inner-steps nearest 25, "
                      "so that every row falls at a round's end, after the outer step; a run's numbers never depend "
                      "on the job's other runs)")
  t.add_argument("--seed", type=_integer(0, "an integer in [0, 2**63)", high=2**63 - 1), default=0,
                 help="seeds the init, the partition and the batches")
  t.add_argument("--max-bad-steps", type=_integer(0, "a non-negative integer"), default=10,
                 help="stop when a node's gradient is NaN/inf this many steps in a row (it skips those steps); 0: never")
  t.add_argument("--out", default=None,
                 help="the job's folder: metrics.json, plot.png, job.json and checkpoints/ (default: a fresh folder "
                      f"{DEFAULT_ROOT}/<date>_<time> for every run). One job at a time holds it; a new job is "
                      "refused where another job's files are, unless --overwrite or --resume, and where files are "
                      "that no job recorded writing (job.json records a job's paths, and job.log its details)")
  t.add_argument("--overwrite", action="store_true",
                 help="a new job into an --out that holds another job's files: remove what that job recorded "
                      "writing first, nothing else")
  t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  t.add_argument("--x-axis", choices=["step", "bytes", "time"], default="step",
                 help="plot.png against the step, the MB each node has sent (every metrics row's bytes_sent: compact "
                      "messages as sent, an all-reduce counted as a ring all-reduce sends it; log scale), or the "
                      "simulated wall clock of a synchronous run on --network (sim_seconds; log scale)")
  t.add_argument("--network", type=_network_spec, default="datacenter",
                 help="the cluster whose wall clock every row's sim_seconds simulates: a preset "
                      f"({', '.join(_NETWORKS)}; gossipjax.NETWORKS gives their figures and sources) or "
                      "BANDWIDTH,LATENCY, e.g. 1Gbit,50ms")
  t.add_argument("--step-time", type=_real("a finite number >= 0", 0.0), default=None,
                 help="seconds of compute one step takes on one node of that cluster, e.g. 0.35 (default: measured "
                      "here, each chunk's compiled time over its steps and over the nodes this process computes)")
  t.add_argument("--checkpoint-every", type=_integer(0, "a non-negative integer"), default=0,
                 help="save each run's full state in OUT/checkpoints every this many steps (a multiple of "
                      "each run's --log-every), for --resume; 0: never")
  t.add_argument("--resume", action="store_true",
                 help="continue the job in --out: every run from its newest intact checkpoint in OUT/checkpoints "
                      "(bit-for-bit the same as an uninterrupted run, every metrics row once); runs without one "
                      "start from step 0. Refused when the job was started with other values of: "
                      f"{', '.join('--' + o.replace('_', '-') for o in RESUME_OPTIONS)}; --steps must reach the "
                      "checkpoints' step; --max-bad-steps, --checkpoint-every and --devices take their new values")
  t.add_argument("--allow-changed-options", action="store_true",
                 help="with --resume: continue even where those options differ from the checkpointed job's "
                      "(job.json and metrics.json record each launch's options, and each row its launch)")
  p.set_defaults(parser=t)
  return p


def _check_args(args: argparse.Namespace) -> None:
  """Checks between options; errors go through the parser (one line, exit status 2)."""
  fail = args.parser.error
  text_model = args.model == "gpt"
  if args.partition is None:
    args.partition = "by_source" if text_model else "dirichlet"
  if text_model and args.partition not in ("iid", "by_source"):
    fail(f"argument --partition: {args.partition} splits by class label; a text corpus takes iid or by_source")
  if not text_model and args.partition == "by_source":
    fail(f"argument --partition: by_source splits a text corpus by file; the {args.model} trains on the digits "
         "(iid, dirichlet or by_class)")
  if args.text is not None and not text_model:
    fail(f"argument --text: only --model gpt trains on text, not --model {args.model}")
  if text_model and args.width % args.heads:
    fail(f"argument --heads: {args.heads} does not divide --width {args.width}")
  args.topologies_given = args.topologies is not None
  if args.topologies is None:
    args.topologies = list(DEFAULT_TOPOLOGIES)
  outer = [a for a in args.algorithms if a in OUTER_ALGORITHMS]
  if "streaming_diloco" in args.algorithms:
    if args.fragments > args.inner_steps:
      fail(f"argument --fragments: streaming_diloco syncs one of {args.fragments} fragments every --inner-steps / "
           f"--fragments steps; give --inner-steps ({args.inner_steps}) at least --fragments")
    if args.overlap * args.fragments >= args.inner_steps:
      fail(f"argument --overlap: {args.overlap} must be below --inner-steps / --fragments = "
           f"{args.inner_steps / args.fragments:.3g} (a fragment's outer step lands before the next fragment syncs)")
  if outer and args.inner_steps > args.steps:
    fail(f"argument --inner-steps: {args.inner_steps} is more than --steps {args.steps}, so {', '.join(outer)} would "
         "never end a round (they communicate once every --inner-steps steps); give --inner-steps at most --steps")
  if args.log_every is not None and outer and args.log_every % args.inner_steps:
    sys.stderr.write(f"gossipjax train: warning: --log-every {args.log_every} is not a multiple of --inner-steps "
                     f"{args.inner_steps}: {', '.join(outer)}'s rows fall inside a round and measure the nodes' "
                     "local models there (their consensus distance is 0 only at a round's end)\n")
  cadences: dict[int, list[str]] = {}
  for alg in args.algorithms:
    cadences.setdefault(_run_log_every(args.log_every, alg, args.inner_steps), []).append(alg)
  if any(args.checkpoint_every % c for c in cadences):
    if len(cadences) == 1:
      fail(f"argument --checkpoint-every: {args.checkpoint_every} must be a multiple of --log-every ({next(iter(cadences))})")
    each = "; ".join(f"{c} for {', '.join(algs)}" for c, algs in cadences.items())
    fail(f"argument --checkpoint-every: {args.checkpoint_every} must be a multiple of each run's --log-every ({each})")
  if args.devices is not None and args.backend != "sharded":
    fail(f"argument --devices: only the sharded backend takes it, not --backend {args.backend}")
  if args.devices_per_node > 1 and args.backend != "sharded":
    fail(f"argument --devices-per-node: only the sharded backend takes it, not --backend {args.backend}")
  if args.batch_size % args.devices_per_node:
    fail(f"argument --devices-per-node: a node's batch of {args.batch_size} (--batch-size) must split evenly over "
         f"its {args.devices_per_node} devices")
  if args.allow_changed_options and not args.resume:
    fail("argument --allow-changed-options: only with --resume")
  if args.resume and args.out is None:
    fail("argument --resume: give --out, the folder of the job to continue")
  if args.resume and args.overwrite:
    fail("argument --overwrite: not with --resume, which continues the job in --out")
  if args.out == "":
    fail("argument --out: give a folder, not an empty string")


def _run_log_every(log_every: int | None, algorithm: str, inner_steps: int) -> int:
  """A run's steps per metrics row, whatever the job's other runs are.

  --log-every when given; else 25, or for an outer method the multiple of --inner-steps
  nearest 25, so that every row of its ends a round.
  """
  if log_every is not None:
    return log_every
  if algorithm not in OUTER_ALGORITHMS:
    return 25
  return inner_steps * max(1, round(25 / inner_steps))


def _resume_options(args: argparse.Namespace) -> dict:
  return {k: getattr(args, k) for k in RESUME_OPTIONS}


def _claim_out(args: argparse.Namespace, folder) -> None:
  """Takes the output folder for this job; refuses a folder with the user's own files in it, another job's folder
  (unless --overwrite or --resume), and a --resume with other options."""
  from gossipjax.train._job import UsageError, warn

  _refuse_foreign(args, folder)  # before the claim: a folder of the user's own gets no job.lock either
  folder.claim()
  _refuse_foreign(args, folder)  # again under the lock, where no other job is writing
  changed = folder.changed()
  if changed:
    it, them = ("it", "is") if len(changed) == 1 else ("them", "are")
    raise UsageError(f"argument --out: {args.out} holds {', '.join(changed)}, which {them} not what its job wrote "
                     f"there (replaced since); move {it} out of the folder, or choose another --out")
  if args.resume:
    then, now = folder.read_options() or {}, _resume_options(args)
    if not then:  # a missing or empty folder: the first launch of a command that always says --resume
      warn(f"argument --resume: {args.out} holds no job yet; starting one, every run from step 0")
    differ = [k for k in RESUME_OPTIONS if k in then and _differs(k, then, now)]
    if differ and not args.allow_changed_options:
      show = lambda v: ",".join(map(str, v)) if isinstance(v, list) else "(default)" if v is None else str(v)
      flags = lambda options, keys: ", ".join(f"--{k.replace('_', '-')} {show(options[k])}" for k in keys)
      was, asked = flags(then, differ), flags(now, differ)
      first = (folder.launches() or [then])[0]
      started = [k for k in differ if k in first and _differs(k, first, then)]
      how = (f"last ran with {was} (started with {flags(first, started)})" if started else f"was started with {was}")
      raise UsageError(f"argument --resume: the job in {args.out} {how}, not {asked}; "
                       "pass the same options, or add --allow-changed-options to continue anyway")
  elif folder.outputs() and not args.overwrite:
    raise UsageError(f"argument --out: {args.out} holds another job's {', '.join(folder.outputs())}; continue "
                     "that job with --resume, choose another --out, or add --overwrite to remove them")


def _differs(option: str, then: dict, now: dict) -> bool:
  """Whether a resumed job's option differs from the job's; --log-every by the rows each run gets from it."""
  if option != "log_every" or then[option] == now[option]:
    return then[option] != now[option]
  try:
    rows = lambda o: [_run_log_every(o["log_every"], a, o["inner_steps"]) for a in o["algorithms"]]
    return then["algorithms"] != now["algorithms"] or rows(then) != rows(now)
  except (KeyError, TypeError):
    return True


def _refuse_foreign(args: argparse.Namespace, folder) -> None:
  """A job writes only into a folder of jobs' files (new, --overwrite or --resume): nothing of the user's is touched."""
  from gossipjax.train._job import UsageError

  foreign = folder.foreign()
  if foreign:
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    raise UsageError(f"argument --out: {args.out} holds {shown}, which no gossipjax job recorded writing; choose "
                     "a new or empty --out (a job's folder holds that job's files only)")


def _start_job(args: argparse.Namespace, folder, runs) -> int:
  """Once every check has passed: clears the folder when asked to, and records the job's options and paths.

  Returns the index of this launch's options in job.json's ``launches``.
  """
  from gossipjax.train._job import JOB_FILES, run_folder

  if args.overwrite:
    folder.clear()
  return folder.write_options(_resume_options(args), list(JOB_FILES) + [run_folder(c.name) for c in runs],
                              resume=args.resume)


def _on_main(placement, comm, fn: Callable[[], Any]) -> Any:
  """``fn()`` on the main process; its result, or its UsageError / JobError, on every process.

  The other processes raise the same error quietly: the main process says it once.
  """
  from gossipjax.train._job import JobError, UsageError

  result = error = None
  if placement.is_main:
    try:
      result = fn()
    except (UsageError, JobError) as e:
      error = e
  if comm is not None:
    result, error = comm.bcast((result, error), root=0)
    if error is not None and not placement.is_main:
      error.quiet = True
  if error is not None:
    raise error
  return result


def _make_backend(args: argparse.Namespace):
  import jax

  import gossipjax as gj

  if args.backend == "simulate":
    return gj.backend.simulate()
  if args.backend == "mpi":
    from gossipjax.train._job import UsageError

    try:
      return gj.backend.mpi()  # a failing rank ends the job instead of hanging it (its default)
    except ImportError as e:
      raise UsageError(f"argument --backend: mpi: {e}") from None
  devices = jax.devices()
  k = args.devices or len(devices)
  if k > len(devices):
    args.parser.error(f"argument --devices: {k} asked for, but only {len(devices)} {jax.default_backend()} "
                      "device(s) are visible")
  per_node = args.devices_per_node
  if k % per_node:
    args.parser.error(f"argument --devices-per-node: {per_node} does not divide the {k} devices")
  if per_node > 1:
    return gj.backend.hierarchical(per_node, devices=devices[:k])
  mesh = jax.make_mesh((k,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:k])
  return gj.backend.sharded(mesh)


def train(args: argparse.Namespace) -> dict:
  """Runs the job of ``gossipjax train``: every algorithm on every topology, into the folder ``args.out``.

  Raises:
    UsageError: options the job cannot run with (the CLI exits with status 2).
    JobError: a failure while it runs (status 1).
  """
  from gossipjax.backend import Mpi
  from gossipjax.train._job import LOG, JobLog, OutputFolder, fresh_folder
  from gossipjax.train._placement import Placement

  _check_args(args)
  parser: argparse.ArgumentParser = args.parser
  backend = _make_backend(args)
  try:
    placement = Placement(backend, args.nodes)
  except ValueError as e:
    parser.error(f"argument --nodes: {e}")
  comm = backend.comm if isinstance(backend, Mpi) else None
  dataset = _load_dataset(args)
  if args.nodes > len(dataset.y_train):
    what = "digits' training set has" if args.model != "gpt" else "text's training part has"
    unit = "samples" if args.model != "gpt" else f"windows of {args.context + 1} bytes"
    parser.error(f"argument --nodes: {args.nodes} nodes, but the {what} {len(dataset.y_train)} {unit}; every "
                 f"node needs one (use at most {len(dataset.y_train)})")
  _check_fragments(args, dataset)
  fresh = args.out is None
  if fresh:
    args.out = _on_main(placement, comm, lambda: fresh_folder(DEFAULT_ROOT))
  folder = OutputFolder(args.out)
  started = False
  try:
    _on_main(placement, comm, lambda: _claim_out(args, folder))
    runs, txs, skipped = _build_runs(args, backend)
    args.launch = _on_main(placement, comm, lambda: _start_job(args, folder, runs))
    started = True
    log = JobLog(args.out, on_first=(lambda: folder.record(LOG)) if placement.is_main else None)
    try:
      with log:
        return _train_runs(args, backend, placement, comm, dataset, runs, txs, skipped)
    finally:
      args.log_file = log.path if log.records else None
  finally:
    folder.release()
    if fresh and not started and placement.is_main:  # a fresh folder of a job that never began
      shutil.rmtree(args.out, ignore_errors=True)


def _build_runs(args: argparse.Namespace, backend):
  """Every run's config and transform, built before any training so that a bad name or size fails first.

  A pair the algorithm cannot run on (DecentLaM on a directed graph, NoLoCo on a graph that
  does not pair the nodes) is skipped with its reason; a job left with no run is refused.
  """
  from gossipjax.train import ALGORITHMS, RunConfig, make_algorithm, make_topology
  from gossipjax.train._registry import MOMENTUM, NEEDS_NO_TOPOLOGY, OWN_TOPOLOGY, AlgorithmOptions

  parser: argparse.ArgumentParser = args.parser
  given = getattr(args, "topologies_given", args.topologies is not None)
  if args.topologies is None:
    args.topologies = list(DEFAULT_TOPOLOGIES)
  runs = []
  for alg in args.algorithms:
    topologies = [None] if alg in NEEDS_NO_TOPOLOGY else args.topologies
    topologies = [OWN_TOPOLOGY[alg]] if alg in OWN_TOPOLOGY and not given else topologies
    outer = alg in OUTER_ALGORITHMS
    for topo in topologies:
      runs.append(RunConfig(algorithm=alg, topology=topo, num_nodes=args.nodes, steps=args.steps,
                            batch_size=args.batch_size, learning_rate=args.inner_lr if outer else args.lr,
                            beta=MOMENTUM.get(alg, args.beta), partition=args.partition, alpha=args.alpha,
                            seed=args.seed, log_every=_run_log_every(args.log_every, alg, args.inner_steps),
                            max_bad_steps=args.max_bad_steps,
                            model=args.model, backend=args.backend,
                            outer_momentum=_outer_momentum(args, alg) if outer else None,
                            network=args.network, step_time=args.step_time))
  txs, skipped = [], {}
  options = AlgorithmOptions(args.compressor, args.compress_fraction, args.consensus_step, args.average_every,
                             args.inner_steps, args.outer_lr, args.outer_momentum, args.fragments, args.overlap,
                             args.mixing, args.fragment_split)
  for c in list(runs):
    try:
      topo = make_topology(c.topology, c.num_nodes) if c.topology else None
      if c.algorithm == "noloco" and c.topology == "random_pairs":
        topo = noloco_pairs(c.num_nodes, args.steps, args.inner_steps)
    except ValueError as e:
      parser.error(f"argument --topologies: {c.topology} on --nodes {c.num_nodes}: {e}")
    try:
      txs.append(make_algorithm(c.algorithm, topo, c.learning_rate, c.beta, backend, options))
    except ValueError as e:
      if topo is None or c.algorithm not in ALGORITHMS:
        raise
      skipped[c.name] = str(e)
      runs.remove(c)
  if not runs:
    name, why = next(iter(skipped.items()))
    parser.error(f"argument --topologies: no run is left, every algorithm is skipped on "
                 f"{', '.join(args.topologies)} ({name}: {why})")
  return runs, txs, skipped


def noloco_pairs(num_nodes: int, steps: int, inner_steps: int):
  """NoLoCo's topology in the main job: a fresh random matching in every round of the run, as its authors draw.

  ``random_pairs`` repeats its matchings after ``period`` steps of W, and NoLoCo advances W
  once per round: the period covers every round of the run (at least 16, which connects).
  """
  from gossipjax import topology as T

  return T.random_pairs(num_nodes, period=max(16, -(-steps // inner_steps)))


def _outer_momentum(args: argparse.Namespace, alg: str) -> float:
  """The outer momentum an outer method runs with: --outer-momentum, else 0.5 (noloco) or 0.9 (the others)."""
  if args.outer_momentum is not None:
    return args.outer_momentum
  return 0.5 if alg == "noloco" else 0.9


def _load_dataset(args: argparse.Namespace) -> Any:
  """The digits, or for the gpt the text of --text (default: the Python standard library's sources)."""
  from gossipjax.data import load_digits, load_python_stdlib, load_text

  if args.model != "gpt":
    return load_digits(seed=args.seed)
  if args.text is None:
    return load_python_stdlib(context=args.context)
  try:
    return load_text(args.text, context=args.context)
  except (OSError, ValueError) as e:
    parser: argparse.ArgumentParser = args.parser
    parser.error(f"argument --text: {e}")


def _data_name(args: argparse.Namespace) -> str:
  if args.model != "gpt":
    return "digits"
  return os.path.basename(os.path.normpath(args.text)) if args.text else "the Python standard library's source"


def _make_model(args: argparse.Namespace, dataset):
  import jax.numpy as jnp

  from gossipjax.train import CNN, GPT, MLP

  if args.model == "gpt":
    return GPT(vocab_size=dataset.num_classes, context=args.context, num_layers=args.layers, width=args.width,
               num_heads=args.heads, dtype=jnp.bfloat16 if args.compute_dtype == "bfloat16" else jnp.float32)
  if args.model == "cnn":
    return CNN(num_classes=dataset.num_classes, image_shape=(8, 8, 1))
  return MLP(hidden=(64,), num_classes=dataset.num_classes)


def _check_fragments(args: argparse.Namespace, dataset) -> None:
  """Streaming DiLoCo splits the model by leaves: --fragments may not exceed them."""
  import jax

  if "streaming_diloco" not in args.algorithms or args.fragment_split == "balanced":  # balanced cuts leaves
    return
  shapes = jax.eval_shape(_make_model(args, dataset).init, jax.random.key(0), dataset.x_test[:1])
  leaves = len(jax.tree.leaves(shapes))
  if args.fragments > leaves:
    args.parser.error(f"argument --fragments: {args.fragments} fragments, but the {args.model}'s params have "
                      f"{leaves} leaves (streaming_diloco splits them by leaves); give at most {leaves}, or "
                      "--fragment-split balanced")


def _train_runs(args, backend, placement, comm, dataset, runs, txs, skipped) -> dict:
  import jax
  from tqdm.auto import tqdm

  from gossipjax.checkpoint import rank_directory
  from gossipjax.train import init_state, plot, result_table, timed_run, write_metrics
  from gossipjax.train._job import JobError, OutputFolder, RunCheckpoints, UsageError, run_folder

  model = _make_model(args, dataset)
  results = {}
  # Each row records the launch whose options made it (job.json's "launches", metrics.json's config).
  launched = lambda rows: [{**row, "launch": args.launch} for row in rows]
  _PROGRESS.update(out=args.out if placement.is_main else None, checkpoint_every=args.checkpoint_every)

  def on_chunk(ckpt, previous, began, state, rows):
    rows[-1]["wall_seconds"] = began + time.perf_counter()  # the run's seconds since its step 0, resumes included
    ckpt.save(state, previous + launched(rows))
    _PROGRESS["step"] = state.step
    if args.checkpoint_every and state.step % args.checkpoint_every == 0:
      _PROGRESS["saved"] = state.step
  quiet = args.no_progress or not placement.is_main
  with tqdm(total=sum(c.steps for c in runs), unit="step", disable=quiet, file=sys.stderr) as bar:
    for cfg, tx in zip(runs, txs):
      bar.set_description(cfg.name)
      directory = os.path.join(args.out, *run_folder(cfg.name).split("/"))
      if comm is not None:  # each rank checkpoints its own block of nodes
        directory = str(rank_directory(directory, backend.rank))
      ckpt = RunCheckpoints(directory, args.checkpoint_every, placement, cfg.name, comm, placement.is_main)
      fresh = init_state(cfg, dataset, model, tx, backend)
      _PROGRESS.update(run=cfg.name, step=None, saved=None)  # step None: restoring
      state, previous = ckpt.restore(fresh) if args.resume else (None, [])
      previous = [{**row, "launch": row.get("launch", 0)} for row in previous]  # rows of a version that tagged none
      if state is not None:
        if state.step > cfg.steps:
          error = UsageError(f"argument --steps: {cfg.steps} is below step {state.step}, where {cfg.name} was "
                             f"checkpointed in {args.out}; give --steps {state.step} or more")
          error.quiet = not placement.is_main
          raise error
        # The limit lives in the optimizer state; the option given now is the one that applies.
        state.opt_state = state.opt_state._replace(max_consecutive=fresh.opt_state.max_consecutive)
        bar.update(state.step)
      _PROGRESS.update(run=cfg.name, step=state.step if state else 0, saved=state.step if state else None)
      before = previous[-1].get("wall_seconds", 0.0) if previous else 0.0
      began = before - time.perf_counter()
      try:
        _, history, seconds = timed_run(cfg, dataset, model, tx, progress=bar.update, state=state or fresh,
                                        on_chunk=functools.partial(on_chunk, ckpt, previous, began),
                                        backend=backend,
                                        sent_before=previous[-1].get("bytes_sent", 0.0) if previous else 0.0,
                                        seconds_before=previous[-1].get("sim_seconds", 0.0) if previous else 0.0)
      except FloatingPointError as e:
        error = JobError(f"{cfg.name}: {e}; try a smaller --lr")
        error.quiet = comm is not None and not placement.is_main  # every rank raises it together
        raise error from e
      results[cfg.name] = {"config": dataclasses.asdict(cfg), "history": previous + launched(history),
                           "seconds": before + seconds}

  if not placement.is_main:
    return results
  metrics_path, plot_path = os.path.join(args.out, "metrics.json"), os.path.join(args.out, "plot.png")
  config = {k: v for k, v in vars(args).items() if k not in ("func", "parser")}
  devices = placement.num_devices * args.devices_per_node  # every device the job uses, however they group
  config["devices"] = devices
  folder = OutputFolder(args.out)
  config["launches"] = folder.launches()
  if args.resume:  # the job's runs that this launch does not continue keep their results
    results = {**{k: v for k, v in folder.results().items() if k not in results}, **results}
  config["devices_per_node"] = args.devices_per_node
  where = (f"{args.backend} on {devices} {placement.unit}" if devices > 1 else args.backend)
  if args.devices_per_node > 1:
    where += f", {args.devices_per_node} a node"
  title = (f"{args.nodes} nodes, {args.model} on {_data_name(args)}, {args.partition} partition, {where} "
           f"({jax.default_backend()})" + (f", time on {args.network}" if args.x_axis == "time" else ""))
  folder.write_results({
      "metrics.json": lambda path: write_metrics(path, {**config, "skipped": skipped}, results),
      "plot.png": lambda path: plot(path, results, title=title, x=args.x_axis)})
  print(result_table(results))
  for name, reason in skipped.items():
    print(f"skipped {name}: {reason}")
  print(f"\nwrote {metrics_path} and {plot_path}")
  return results


def _request_cpu_devices(args: argparse.Namespace) -> None:
  """``--devices K`` on a CPU host: XLA makes K CPU devices if told so before its first computation.

  Then XLA's CPU client gets the threads that collectives over those devices need.
  """
  import jax

  from gossipjax.backend import reserve_cpu_threads

  user_flag = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")  # the user's own wins
  if args.backend == "sharded" and args.devices and not user_flag:
    try:
      jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:
      pass  # jax has already computed in this process (the CLI called from Python): use the devices it has
  reserve_cpu_threads()


# Where the job is, for the line that Ctrl-C prints: the run, its step, its newest checkpoint, the folder.
_PROGRESS: dict[str, Any] = {}


def _interrupted() -> str:
  """The line for Ctrl-C: where the job was, and what ``--resume`` continues from."""
  run, step, saved, out = (_PROGRESS.get(k) for k in ("run", "step", "saved", "out"))
  where = f" at step {step} of {run}" if run is not None else " before its first run began"
  if run is not None and step is None:
    return f"gossipjax train: interrupted while restoring {run}; add --resume to the same command to continue"
  if out is None or run is None:
    then = "nothing to resume"
  elif saved:
    then = f"add --resume to the same command to continue {run} from its checkpoint at step {saved}"
  elif _PROGRESS.get("checkpoint_every"):
    then = f"add --resume to the same command to continue (from step 0: {run} had no checkpoint yet)"
  else:
    then = "no checkpoints were written (--checkpoint-every 0): a new job starts from step 0"
  return f"gossipjax train: interrupted{where}; {then}"


def main(argv: Sequence[str] | None = None) -> None:
  """``gossipjax``: a failure is one line on stderr and an exit status, 2 for bad usage, 1 while running.

  From the command line (``argv`` not given), Ctrl-C is one line too, and the process ends
  within seconds whatever it is doing (`gossipjax._interrupt`); called from Python, it
  raises ``KeyboardInterrupt`` as usual.
  """
  from gossipjax._interrupt import Interruption

  interruption = Interruption(_interrupted)
  caught = argv is None and interruption.install()
  args = build_parser().parse_args(argv)
  if args.command == "train":
    from gossipjax.checkpoint import CorruptCheckpointError
    from gossipjax.train._job import JobError, UsageError

    try:
      _request_cpu_devices(args)
      train(args)
    except UsageError as e:
      _fail(e, 2)
    except (JobError, CorruptCheckpointError, OSError) as e:
      _fail(e, 1, getattr(args, "log_file", None))
    except BaseException:  # a KeyboardInterrupt, or what it became (an ImportError of a module it cut short)
      if not (caught and interruption.fired):
        raise
      interruption.exit()


def _fail(error: Exception, status: int, log_file: str | None = None) -> None:
  if not getattr(error, "quiet", False):
    details = f" (details in {log_file})" if log_file else ""
    sys.stderr.write(f"gossipjax train: error: {error}{details}\n")
    sys.stderr.flush()
  sys.exit(status)  # through sys.exit, which an MPI job's exit hook watches (gj.backend.mpi_abort_on_error)


if __name__ == "__main__":
  main()
