"""The conformance matrix: every public method x a backend x {float32, bfloat16} x {fresh, restored}.

Shared by ``tests/test_conformance.py`` (simulate, sharded, hierarchical, pmapped, one process
each) and ``tests/mpi/check_conformance.py`` (one ``mpiexec -n 2`` launch). A backend is a
`Harness`: how it places the global node-stacked host arrays, how it runs a step (``jax.jit``
or ``jax.pmap``), and which global rows its arrays hold. `run_all` runs every method on one
tiny least-squares problem (8 nodes, 4 parameters each in two leaves) for `STEPS` steps,
saves every state with `gj.checkpoint` at step `RESTORE_AT` (mid-round for the outer
optimizers and the periodic averages, whose rounds are 2 steps long), restores it into a
freshly initialised state and runs to the end again. `check` holds each trajectory to the
simulation's in the same dtype (float32 to a few roundings, bfloat16 to a few units in the
last place) and the restored run to the uninterrupted one on the same backend, bit for bit,
and returns every failure, each naming method, backend, dtype and run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import tempfile
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gossipjax as gj
from gossipjax import topology as T
from gossipjax.train._placement import Placement

N, D, M, STEPS, RESTORE_AT, LR = 8, 3, 4, 5, 3, 0.05
# Largest |got - want| / max(|want|, 1) allowed against the simulation: float32 differs by the
# order of a backend's sums; bfloat16 (8 significant bits, ulp 2^-8 relative) by a few roundings.
TOLERANCE = {"float32": 1e-5, "bfloat16": 4 * 2.0 ** -8}
# XLA keeps some bfloat16 intermediates of the simulation's fused program in float32 where the
# other backends' collectives round them (their runs equal the op-by-op simulation bit for bit);
# DecentLaM divides such a rounding of W(x - lr g) by the learning rate into its momentum, so a
# one-ulp difference grows to a few (its contract test bounds its bfloat16 drift 6x wider, too).
BF16_SLACK = {"decentlam": 4.0}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def methods(n: int) -> dict[str, Callable[[Any], optax.GradientTransformation]]:
  """Every public method of ``gossipjax/__init__.py``, each a function of the backend it runs on."""
  ring, pairs = T.ring(n), T.random_pairs(n, seed=1, period=4)
  exponential, directed = T.one_peer_exponential(n), T.one_peer_directed_exponential(n)
  schedule = optax.cosine_decay_schedule(LR, 10)  # its count must survive the restore
  return {
      "gossip_sgd": lambda be: gj.gossip_sgd(exponential, beta=0.9, learning_rate=schedule, backend=be),
      "decentlam": lambda be: gj.decentlam(ring, beta=0.9, learning_rate=LR, backend=be),
      "gradient_tracking": lambda be: gj.gradient_tracking(exponential, learning_rate=LR, backend=be),
      "exact_diffusion": lambda be: gj.exact_diffusion(ring, learning_rate=LR, backend=be),
      "extra": lambda be: gj.extra(ring, learning_rate=LR, backend=be),
      "sgp": lambda be: gj.sgp(directed, beta=0.5, learning_rate=LR, backend=be),
      # A random compressor: its keys are drawn from the step count and the global node index.
      "choco_sgd": lambda be: gj.choco_sgd(ring, gj.compress.random_k(0.5), learning_rate=LR, consensus_step=0.5,
                                           seed=3, backend=be),
      "qg_dmsgd": lambda be: gj.qg_dmsgd(ring, beta=0.9, learning_rate=LR, backend=be),
      "allreduce_sgd": lambda be: gj.allreduce_sgd(beta=0.9, learning_rate=LR, backend=be),
      "periodic_average": lambda be: optax.chain(optax.sgd(LR), gj.periodic_average(2, backend=be)),
      "easgd": lambda be: gj.easgd(learning_rate=LR, alpha=0.1, center_rate=0.5, every=2, backend=be),
      "diloco": lambda be: gj.diloco(optax.sgd(LR, momentum=0.9), inner_steps=2, backend=be),
      "noloco": lambda be: gj.noloco(optax.sgd(LR), pairs, inner_steps=2, backend=be),
      # Two fragments, each synchronised every 4 steps (one at the second step, one at the fourth)
      # and applied a step later: the restored run syncs and applies the second.
      "streaming_diloco": lambda be: gj.streaming_diloco(optax.sgd(LR, momentum=0.9), num_fragments=2, inner_steps=4,
                                                         overlap=1, mixing=0.5, backend=be),
      "outer_optimizer": lambda be: gj.outer_optimizer(optax.adam(LR), optax.sgd(0.7, momentum=0.5), inner_steps=2,
                                                       topology=ring, backend=be),
      "gradient_tracker": lambda be: gj.chain(gj.gradient_tracker(exponential, backend=be), optax.sgd(LR),
                                              gj.mix(exponential, backend=be), backend=be),
      "mix": lambda be: gj.chain(optax.sgd(LR, momentum=0.9), gj.mix(exponential, backend=be), backend=be),
  }


def problem(n: int, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
  """Two leaves per node (``w`` of D, ``b`` of 1) and node i's data ``A_i`` (M, D), ``y_i`` (M,), float32."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(n, D)), "b": rng.normal(size=(n,))}
  a, y = rng.normal(size=(n, M, D)), rng.normal(size=(n, M)) + np.arange(n)[:, None] / n
  return jax.tree.map(lambda v: v.astype(np.float32), params), a.astype(np.float32), y.astype(np.float32)


def node_grad(p: Any, a: jax.Array, y: jax.Array) -> Any:
  """One node's gradient, computed in float32 and rounded once to the params' dtype."""
  wide = jax.tree.map(lambda v: v.astype(jnp.float32), p)
  g = jax.grad(lambda q: 0.5 * jnp.mean((a @ q["w"] + q["b"] - y) ** 2))(wide)
  return jax.tree.map(lambda gi, pi: gi.astype(pi.dtype), g, p)


# The programs are tiny and each runs a few steps, so compiling them is the matrix's cost: with
# XLA:CPU's loop emitters instead of its fusion emitters, at LLVM's lowest optimisation level,
# they compile 3 to 6 times faster. Every backend, the simulation included, gets the same options.
COMPILE_THREADS = 2
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False}


def jit(fn: Callable) -> Any:
  """``jax.jit`` with `COMPILER_OPTIONS`."""
  return jax.jit(fn, compiler_options=COMPILER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class Harness:
  """One backend as the matrix drives it.

  Attributes:
    name: how failures name it.
    backend: the gossipjax backend.
    num_nodes: n.
    place: global host params (n, ...) -> what a step takes.
    place_data: global host data (n, M, ...) -> what a step takes.
    wrap: a step function -> the compiled form this backend runs (`jit`, ``jax.pmap``).
    wrap_init: ``tx.init`` -> how this backend calls it (default: as it is, as the main job does).
    settle: a fresh state -> the same values placed as the step returns them, so that one
      program serves every step (the main job's first step compiles once more instead).
    precompile: whether each step is compiled ahead, in a worker thread (``lower().compile()``
      fills ``jax.jit``'s cache; under ``jax.pmap`` it compiles the program twice instead).
    rows: params as the step returns them -> host float32 (rows, D + 1), the rows of `held`.
    held: the global nodes this process holds.
    directory: a checkpoint directory -> this process's own (e.g. ``gj.checkpoint.rank_directory``).
  """

  name: str
  backend: Any
  num_nodes: int
  place: Callable[[Any], Any] = lambda t: jax.tree.map(jnp.asarray, t)
  place_data: Callable[[Any], Any] = lambda t: jax.tree.map(jnp.asarray, t)
  wrap: Callable[[Callable], Any] = jit
  wrap_init: Callable[[Callable], Callable] = lambda init: init
  settle: Callable[[Any], Any] = lambda state: state
  precompile: bool = True
  rows: Callable[[Any], np.ndarray] = lambda x: flat(x)
  held: slice = dataclasses.field(default_factory=lambda: slice(None))
  directory: Callable[[str], str] = lambda d: d


def flat(x: Any) -> np.ndarray:
  """``{"w": (n, D), "b": (n,)}`` -> host float32 (n, D + 1)."""
  return np.concatenate([np.asarray(x["w"], np.float32), np.asarray(x["b"], np.float32)[:, None]], axis=1)


def settle_on(mesh: jax.sharding.Mesh, axis: str, n: int) -> Callable[[Any], Any]:
  """`Harness.settle` on a mesh: uncommitted leaves placed as a step returns them (node-sharded, or replicated)."""
  def put(v):
    if not isinstance(v, jax.Array) or v.committed:
      return v
    spec = jax.sharding.PartitionSpec(axis) if v.ndim and v.shape[0] == n else jax.sharding.PartitionSpec()
    return jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))

  return lambda state: jax.tree.map(put, state)


def misplaced(state: Any, params: Any) -> list[str]:
  """The node-stacked leaves of a fresh state not placed as the params' node axis is (on a mesh)."""
  ref = jax.tree.leaves(params)[0]
  spec = getattr(getattr(ref, "sharding", None), "spec", None)
  if not isinstance(ref, jax.Array) or not isinstance(ref.sharding, jax.sharding.NamedSharding) or not spec or \
      spec[0] is None:
    return []
  n, out = ref.shape[0], []
  for path, v in jax.tree_util.tree_leaves_with_path(state):
    if isinstance(v, jax.Array) and v.ndim and v.shape[0] == n:
      s = v.sharding
      if not (isinstance(s, jax.sharding.NamedSharding) and s.spec and s.spec[0] == spec[0]):
        out.append(jax.tree_util.keystr(path))
  return out


@dataclasses.dataclass
class _Case:
  """One method in one dtype as it runs on a harness."""

  key: str
  step: Any = None  # the jitted step (a `jax.jit` object: it also lowers)
  compiled: Any = None  # the step's compilation, running in a worker thread
  x0: Any = None
  like: Any = None
  x: Any = None
  state: Any = None
  data: Any = None
  saved: Any = None
  fresh: list = dataclasses.field(default_factory=list)
  restored: list = dataclasses.field(default_factory=list)
  error: str | None = None
  placement: str | None = None

  def guarded(self, stage: str, fn: Callable[[], Any]) -> None:
    if self.error is None:
      try:
        fn()
      except Exception as e:  # noqa: BLE001 -- reported with the case and the stage it belongs to
        self.error = f"{stage}: {_raised(e)}"

  def advance(self, rows: Callable[[Any], np.ndarray], into: list, steps: int) -> None:
    assert self.step is not None
    for _ in range(steps):
      self.x, self.state = self.step(self.x, self.state, *self.data)
      into.append(rows(self.x))


Outcome = dict[str, Any]  # "fresh", "restored": (steps, rows, D + 1); or "error"; and "placement"


def run_all(h: Harness, names: list[str] | None = None) -> dict[tuple[str, str], Outcome]:
  """Every method x dtype on ``h``: a fresh run of `STEPS` steps, and one restored at `RESTORE_AT`.

  The states of step `RESTORE_AT` of all cases are saved in one checkpoint, restored with
  each case's freshly initialised state as ``like`` and placed as `gossipjax train --resume`
  places them, and run again to `STEPS`. Where the shared checkpoint fails, each case is saved and restored alone, so
  the one at fault is named.
  """
  cases, out = methods(h.num_nodes), {}
  params, a, y = problem(h.num_nodes)
  data = (h.place_data(a), h.place_data(y))
  todo = [_Case(f"{name}/{dtype_name}") for name in names or list(cases) for dtype_name in DTYPES]
  # Compiling is most of the cost: each case's step compiles in a worker thread (XLA releases the
  # GIL) while the next case is traced, and the jitted step then finds its program compiled.
  pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS)
  for case in todo:
    name, dtype_name = case.key.split("/")

    def start(case=case, make=cases[name], dtype=DTYPES[dtype_name]):
      tx = make(h.backend)
      grad = h.backend.map(node_grad)

      def step(x, state, a, y):
        updates, state = tx.update(grad(x, a, y), state, x)
        return optax.apply_updates(x, updates), state

      case.step, case.data = h.wrap(step), data
      case.x0 = h.place(jax.tree.map(lambda v: v.astype(dtype), params))
      state = h.wrap_init(tx.init)(case.x0)
      wrong = misplaced(state, case.x0)
      if wrong:
        case.placement = f"the fresh state's node-stacked leaves {', '.join(wrong)} are not placed as the params are"
      case.x, case.state = case.x0, h.settle(state)
      case.like = {"params": case.x0, "opt_state": state}  # as the main job's fresh state is placed
      if h.precompile:
        case.compiled = pool.submit(case.step.lower(case.x, case.state, *data).compile)

    case.guarded("init", start)
  pool.shutdown(wait=False)
  for case in todo:
    if case.compiled is not None:
      case.guarded("compile", lambda case=case: case.compiled.result())
    case.guarded("fresh run", lambda case=case: case.advance(h.rows, case.fresh, RESTORE_AT))
    if case.error is None:
      case.saved = {"params": case.x, "opt_state": case.state}
    case.guarded("fresh run", lambda case=case: case.advance(h.rows, case.fresh, STEPS - RESTORE_AT))

  live = [c for c in todo if c.error is None]
  with tempfile.TemporaryDirectory() as tmp:
    try:
      directory = h.directory(tmp)
      gj.checkpoint.save(directory, {c.key: c.saved for c in live}, step=RESTORE_AT)
      back = gj.checkpoint.restore(directory, like={c.key: c.like for c in live}, step=RESTORE_AT)
    except Exception:  # noqa: BLE001 -- then each case alone, to name the one at fault
      back = {}
      for i, c in enumerate(live):
        def alone(c=c, sub=f"{tmp}/{i}"):
          gj.checkpoint.save(h.directory(sub), c.saved, step=RESTORE_AT)
          back[c.key] = gj.checkpoint.restore(h.directory(sub), like=c.like, step=RESTORE_AT)

        c.guarded(f"checkpoint of step {RESTORE_AT}", alone)
  placement = Placement(h.backend, h.num_nodes)
  for c in live:
    if c.key in back:
      # As `gossipjax train --resume` places a restored state (what left scalar counters on one
      # device of a sharded job once); settled as the fresh run's was, so the step's program serves.
      placed = placement.like(back[c.key], c.like)
      c.x, c.state = placed["params"], h.settle(placed["opt_state"])
      c.guarded(f"run restored at step {RESTORE_AT}", lambda c=c: c.advance(h.rows, c.restored, STEPS - RESTORE_AT))
  for c in todo:
    name, dtype_name = c.key.split("/")
    outcome: Outcome = {"placement": c.placement}
    if c.error is not None:
      outcome["error"] = c.error
    else:
      outcome["fresh"], outcome["restored"] = np.stack(c.fresh), np.stack(c.restored)
    out[name, dtype_name] = outcome
  return out


def _compare(got: np.ndarray, want: np.ndarray, tol: float, first: int = 0) -> str | None:
  err = np.abs(got - want) / np.maximum(np.abs(want), 1.0)
  if np.isfinite(got).all() and float(np.max(err)) <= tol:
    return None
  k, i, j = np.unravel_index(np.argmax(np.where(np.isfinite(err), err, np.inf)), err.shape)
  return (f"max relative |got - simulation| = {float(np.max(np.where(np.isfinite(err), err, np.inf))):.3g} > {tol:.3g} "
          f"(step {first + k + 1}, node row {i}, coordinate {j}: {got[k, i, j]!r} vs {want[k, i, j]!r})")


def _raised(e: Exception) -> str:
  last = traceback.extract_tb(e.__traceback__)[-1]
  return (f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]} "
          f"(at {last.filename.rsplit('/', 1)[-1]}:{last.lineno})")


def check(backend: str, got: dict[tuple[str, str], Outcome], simulation: dict[tuple[str, str], Outcome],
          held: slice = slice(None)) -> list[str]:
  """Every method x dtype x {fresh, restored}; one line per failure, each ``method / backend / dtype / ...``.

  Args:
    backend: the backend's name, for the lines.
    got: the backend's outcomes (`run_all`).
    simulation: the simulation's outcomes on all n nodes (`run_all` on the simulate backend).
    held: the global rows the backend's runs hold.
  """
  errors = []
  for (name, dtype_name), outcome in got.items():
    where = f"{name} / {backend} / {dtype_name}"
    want = simulation[name, dtype_name]
    if outcome["placement"]:
      errors.append(f"{where} / init: {outcome['placement']}")
    if "error" in want:
      errors.append(f"{where}: the simulation, {want['error']}")
      continue
    if "error" in outcome:
      errors.append(f"{where} / {outcome['error']}")
      continue
    want = want["fresh"][:, held]
    tol = TOLERANCE[dtype_name] * (BF16_SLACK.get(name, 1.0) if dtype_name == "bfloat16" else 1.0)
    fresh, restored = outcome["fresh"], outcome["restored"]
    if (problem_ := _compare(fresh, want, tol)) is not None:
      errors.append(f"{where} / fresh: {problem_}")
    if (problem_ := _compare(restored, want[RESTORE_AT:], tol, RESTORE_AT)) is not None:
      errors.append(f"{where} / restored at step {RESTORE_AT}: {problem_}")
    elif not np.array_equal(restored, fresh[RESTORE_AT:]):
      diff = float(np.max(np.abs(restored - fresh[RESTORE_AT:])))
      errors.append(f"{where} / restored at step {RESTORE_AT}: differs from the uninterrupted run on the same "
                    f"backend by up to {diff:.3g}")
  return errors
