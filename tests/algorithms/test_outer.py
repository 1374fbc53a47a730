"""DiLoCo, NoLoCo and the outer-optimizer transform, against NumPy transcriptions of the papers' algorithms.

The problem has node-specific minimisers (least squares with a different target per node)
and a different deterministic gradient noise per node and step, so nodes drift apart inside
a round and the outer step has something to do.
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import topology as T

N, D, H, ROUNDS = 8, 4, 3, 4
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.99, 1e-8, 0.01


def problem(n=N, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, 6, D))
  b = rng.normal(size=(n, 6)) + 2.0 * np.arange(n)[:, None]
  noise = 0.1 * rng.normal(size=(ROUNDS * H + 1, n, D))
  x0 = rng.normal(size=D)
  return a, b, noise, x0


def numpy_grad(a, b, noise, x, i, k):
  """Node i's gradient of 1/(2m) ||A_i x - b_i||^2 at step k, with its noise."""
  return a[i].T @ (a[i] @ x - b[i]) / a.shape[1] + noise[k, i]


class NumpyAdamW:
  """AdamW with decoupled weight decay, as optax.adamw (bias-corrected moments, eps outside the root)."""

  def __init__(self, d):
    self.m, self.v, self.t = np.zeros(d), np.zeros(d), 0

  def step(self, x, g):
    self.t += 1
    self.m = B1 * self.m + (1 - B1) * g
    self.v = B2 * self.v + (1 - B2) * g * g
    m_hat, v_hat = self.m / (1 - B1 ** self.t), self.v / (1 - B2 ** self.t)
    return x - LR * (m_hat / (np.sqrt(v_hat) + EPS) + WD * x)


def adamw():
  return optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def make_step(tx, a, b, noise):
  """The jitted step ``(x, state, k) -> (x, state)`` on node i's least squares plus its noise at step k."""
  grads = lambda x, k: (jax.vmap(jax.grad(lambda xi, ai, bi: 0.5 * jnp.mean((ai @ xi - bi) ** 2)))(x, a, b)
                        + jnp.asarray(noise)[k])
  return jax.jit(lambda x, s, k: (lambda u, s: (x + u, s))(*tx.update(grads(x, k), s, x)))


def run_library(tx, a, b, noise, x0, steps=ROUNDS * H, n=N, resume=None, step=None):
  """Params after each step; ``resume=(x, state, k)`` continues a run from step k."""
  step = make_step(tx, a, b, noise) if step is None else step
  x = jnp.tile(jnp.asarray(x0), (n, 1))
  state, first, out = tx.init(x), 0, []
  if resume is not None:
    x, state, first = resume
  for k in range(first, steps):
    x, state = step(x, state, k)
    out.append(np.asarray(x))
  return np.stack(out), state


def diloco_numpy(a, b, noise, x0, outer_lr, mu):
  """Douillard et al. (2023), Algorithm 1: one global theta, H AdamW steps per worker, mean pseudo-gradient, Nesterov."""
  theta, buf = x0.copy(), np.zeros(D)
  inner = [NumpyAdamW(D) for _ in range(N)]  # each worker keeps its inner optimizer across rounds
  out = np.zeros((ROUNDS * H, N, D))
  for t in range(ROUNDS):
    deltas = []
    for i in range(N):
      th = theta.copy()
      for h in range(H):
        th = inner[i].step(th, numpy_grad(a, b, noise, th, i, t * H + h))
        out[t * H + h, i] = th
      deltas.append(theta - th)
    delta = np.mean(deltas, axis=0)  # the all-reduce of the outer gradients
    buf = mu * buf + delta  # torch.optim.SGD(nesterov=True), the paper's outer optimizer
    theta = theta - outer_lr * (delta + mu * buf)
    out[t * H + H - 1] = theta
  return out


def noloco_numpy(a, b, noise, x0, topo, outer_lr, mu, schedule=None):
  """Kolehmainen et al. (2025), the authors' SparseOptimizerC with groups of 2: pair means of phi and theta - phi.

  With ``schedule`` (round -> rate), the documented recurrence of gj.noloco: m <- mu m + bracket,
  phi <- phi - eta_r m (optax applies the rate after the momentum).
  """
  phi, theta, mom = np.tile(x0, (N, 1)), np.tile(x0, (N, 1)), np.zeros((N, D))
  inner = [NumpyAdamW(D) for _ in range(N)]
  out = np.zeros((ROUNDS * H, N, D))
  for t in range(ROUNDS):
    for h in range(H):
      for i in range(N):
        theta[i] = inner[i].step(theta[i], numpy_grad(a, b, noise, theta[i], i, t * H + h))
      out[t * H + h] = theta
    w = topo.matrix(t)
    new_phi = phi.copy()
    for i in range(N):
      group = [i] + [j for j in range(N) if j != i and w[i, j] > 0]
      assert len(group) == 2
      mean_phi = phi[group].mean(axis=0)
      mean_step = (theta[group] - phi[group]).mean(axis=0)
      if schedule is None:
        lr = outer_lr(t) if callable(outer_lr) else outer_lr  # the authors' form: each round's rate on its term
        mom[i] = mu * mom[i] + lr * mean_step + lr * (mean_phi - phi[i])
        new_phi[i] = phi[i] + mom[i]
      else:
        mom[i] = mu * mom[i] + (phi[i] - mean_phi) - mean_step
        new_phi[i] = phi[i] - schedule(t) * mom[i]
    phi, theta = new_phi, new_phi.copy()
    out[t * H + H - 1] = theta
  return out


def test_diloco_matches_the_papers_algorithm():
  a, b, noise, x0 = problem()
  got, _ = run_library(gj.diloco(adamw(), inner_steps=H), a, b, noise, x0)
  want = diloco_numpy(a, b, noise, x0, outer_lr=0.7, mu=0.9)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  assert np.ptp(got[H - 2], axis=0).max() > 0.01  # the nodes drift apart inside a round ...
  assert np.ptp(got[H - 1], axis=0).max() < 1e-12  # ... and the outer step gives them one model


def test_noloco_matches_the_authors_rule():
  a, b, noise, x0 = problem()
  topo = T.random_pairs(N, seed=3, period=ROUNDS)
  got, state = run_library(gj.noloco(adamw(), topo, inner_steps=H), a, b, noise, x0)
  want = noloco_numpy(a, b, noise, x0, topo, outer_lr=0.7, mu=0.5)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  np.testing.assert_allclose(state.anchor, got[-1], rtol=0, atol=1e-12)
  assert np.ptp(got[-1], axis=0).max() > 1e-3  # no all-reduce: the nodes are close, not equal


def test_noloco_with_a_schedule_computes_the_documented_recurrence():
  a, b, noise, x0 = problem()
  topo = T.random_pairs(N, seed=3, period=ROUNDS)
  schedule = lambda r: 0.7 * 0.5 ** r
  got, _ = run_library(gj.noloco(adamw(), topo, inner_steps=H, outer_learning_rate=schedule), a, b, noise, x0)
  want = noloco_numpy(a, b, noise, x0, topo, outer_lr=None, mu=0.5, schedule=schedule)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  authors = noloco_numpy(a, b, noise, x0, topo, outer_lr=schedule, mu=0.5)  # a per-round eta transcription differs
  assert np.abs(got[-1] - authors[-1]).max() > 1e-3


def test_main_jobs_noloco_draws_a_fresh_matching_every_round():
  from gossipjax.cli import noloco_pairs

  topo = noloco_pairs(8, steps=500, inner_steps=10)  # 50 rounds
  matchings = {tuple(np.argmax(topo.matrix(r) - 0.5 * np.eye(8), axis=1)) for r in range(50)}
  assert topo.period >= 50 and len(matchings) > 40  # 105 matchings of 8 nodes: a few repeat by chance


def test_outer_sgd_with_rate_one_is_periodic_averaging_of_the_inner_optimizer():
  a, b, noise, x0 = problem()
  got, _ = run_library(gj.diloco(adamw(), inner_steps=H, outer_learning_rate=1.0, outer_momentum=0.0), a, b, noise, x0)
  want, _ = run_library(optax.chain(adamw(), gj.periodic_average(H)), a, b, noise, x0)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_one_inner_step_with_outer_sgd_and_the_average_is_allreduce_sgd():
  a, b, noise, x0 = problem()
  tx = gj.outer_optimizer(optax.sgd(LR), optax.sgd(1.0, momentum=0.9), inner_steps=1)
  got, _ = run_library(tx, a, b, noise, x0)
  want, _ = run_library(gj.allreduce_sgd(0.9, learning_rate=LR), a, b, noise, x0)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_one_inner_step_with_outer_sgd_over_a_topology_is_dpsgd():
  """The gossip form with H = 1 and outer SGD at rate 1: x <- W (x - lr g), D-PSGD."""
  a, b, noise, x0 = problem()
  topo = T.one_peer_exponential(N)
  got, _ = run_library(gj.outer_optimizer(optax.sgd(LR), optax.sgd(1.0), inner_steps=1, topology=topo),
                       a, b, noise, x0)
  want, _ = run_library(gj.gossip_sgd(topo, learning_rate=LR), a, b, noise, x0)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def sharded_backend():
  return gj.backend.sharded(jax.make_mesh((8,), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,)))


_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")


def _computations(hlo: str) -> dict[str, str]:
  """The compiled module's computations by name, with their bodies."""
  blocks, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
      blocks[name] = ""
    elif name is not None:
      blocks[name] += line + "\n"
  return blocks


def _reachable(blocks: dict[str, str], start: str, skip: frozenset = frozenset()) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    c = todo.pop()
    if c in seen or c in skip or c not in blocks:
      continue
    seen.add(c)
    todo += re.findall(r"%([\w.\-]+)", " ".join(re.findall(
        r"(?:to_apply|calls|body|condition|branch_computations|true_computation|false_computation)=\{?([^}\s]*(?:,\s*%[\w.\-]+)*)",
        blocks[c])))
  return seen


@pytest.mark.parametrize("method, collective", [("diloco", "all-reduce"), ("noloco", "collective-permute")])
def test_sharded_inner_steps_send_nothing(method, collective):
  """Compiled for 16 nodes on 8 devices: every collective sits in the outer branch of the one conditional."""
  be = sharded_backend()
  n = 16
  tx = (gj.diloco(optax.adamw(1e-3), inner_steps=5, backend=be) if method == "diloco" else
        gj.noloco(optax.adam(1e-3), T.random_pairs(n, period=4), inner_steps=5, backend=be))
  x = be.shard(np.ones((n, 32)))
  hlo = jax.jit(lambda g, s, x: tx.update(g, s, x)).lower(x, tx.init(x), x).compile().as_text()
  blocks = _computations(hlo)
  conds = re.findall(r"conditional\(.*?branch_computations=\{%([\w.\-]+),\s*%([\w.\-]+)\}", hlo)
  conds += re.findall(r"conditional\(.*?true_computation=%([\w.\-]+),\s*false_computation=%([\w.\-]+)", hlo)
  assert len(conds) == 1, conds
  collectives = {c: set(_COLLECTIVE.findall(body)) for c, body in blocks.items()}
  sends = lambda comps: set().union(*(collectives[c] for c in comps))
  first, second = (_reachable(blocks, c) for c in conds[0])
  inner, outer = (first, second) if not sends(first) else (second, first)
  assert not sends(inner), sends(inner)
  assert sends(outer) == {collective}, sends(outer)
  assert not sends(_reachable(blocks, "ENTRY", skip=frozenset(conds[0]))), "a collective outside the conditional"


def test_sharded_backend_equals_the_simulation():
  """NoLoCo on 16 nodes over 8 devices gives the simulated trajectory."""
  be = sharded_backend()
  n = 16
  a, b, noise, x0 = problem(n)
  make = lambda be: gj.noloco(optax.adam(0.05), T.random_pairs(n, seed=1, period=4), inner_steps=H, backend=be)
  want, _ = run_library(make(None), a, b, noise, x0, steps=2 * H, n=n)
  got, _ = run_library(make(be), be.shard(a), be.shard(b), noise, x0, steps=2 * H, n=n)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_checkpoint_round_trip_carries_the_outer_state(tmp_path):
  a, b, noise, x0 = problem()
  tx = gj.noloco(adamw(), T.random_pairs(N, seed=2), inner_steps=H)
  step = make_step(tx, a, b, noise)
  full, _ = run_library(tx, a, b, noise, x0, step=step)
  half = H + 1  # mid-round: the anchor, outer momentum and inner moments all matter
  x_half, state = run_library(tx, a, b, noise, x0, steps=half, step=step)
  gj.checkpoint.save(tmp_path, {"params": jnp.asarray(x_half[-1]), "opt_state": state}, step=half)
  like = {"params": jnp.zeros((N, D)), "opt_state": tx.init(jnp.zeros((N, D)))}
  restored = gj.checkpoint.restore(tmp_path, like)
  assert isinstance(restored["opt_state"], gj.OuterState)
  rest, _ = run_library(tx, a, b, noise, x0, resume=(restored["params"], restored["opt_state"], half), step=step)
  np.testing.assert_allclose(rest, full[half:], rtol=0, atol=1e-12)


def test_int_leaves_dtypes_and_eval_shape():
  params = {"w": jnp.ones((N, 3), jnp.float32), "b": jnp.zeros((N,), jnp.bfloat16),
            "count": jnp.arange(N, dtype=jnp.int32)}
  tx = gj.noloco(optax.adam(0.1), T.random_pairs(N), inner_steps=2)
  state = tx.init(params)
  assert jax.tree.structure(jax.eval_shape(tx.init, params)) == jax.tree.structure(state)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(jax.tree.map(jnp.ones_like, p), s, p)))
  for _ in range(4):
    params, state = step(params, state)
  assert step._cache_size() == 1
  assert params["w"].dtype == jnp.float32 and params["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(params["count"], np.arange(N))


def test_float32_outer_state_for_bfloat16_params():
  """``state_dtype=jnp.float32``: the anchor and the outer momentum in float32, the updates in
  bfloat16, and with zero gradients the node average drifts less than with a bfloat16 anchor."""
  x0 = jnp.asarray(1 + np.random.default_rng(0).normal(size=(N, D)), jnp.bfloat16)
  zeros = jnp.zeros_like(x0)

  def run(state_dtype):
    tx = gj.outer_optimizer(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9), inner_steps=2, topology=T.ring(N),
                            state_dtype=state_dtype)
    body = lambda _, c: (lambda u, s: (c[0] + u, s, u))(*tx.update(zeros, c[1], c[0]))
    return jax.jit(lambda x, s: jax.lax.fori_loop(0, 20, body, (x, s, zeros)))(x0, tx.init(x0))

  x, state, updates = run(jnp.float32)
  assert state.anchor.dtype == jnp.float32 and jax.tree.leaves(state.outer_state)[0].dtype == jnp.float32
  assert x.dtype == updates.dtype == jnp.bfloat16
  drift = lambda x: float(jnp.linalg.norm(jnp.mean(x - x0, axis=0, dtype=jnp.float64)))
  assert drift(x) < drift(run(None)[0])
  for tx in (gj.diloco(optax.adam(0.1), state_dtype=jnp.float32),
             gj.noloco(optax.adam(0.1), T.random_pairs(N), state_dtype=jnp.float32)):
    assert tx.init(x0).anchor.dtype == jnp.float32


def test_bad_input_names_the_argument():
  topo = T.random_pairs(N)
  with pytest.raises(ValueError, match=r"^gj\.diloco: inner_steps must be a positive integer, got 0"):
    gj.diloco(optax.adam(0.1), inner_steps=0)
  with pytest.raises(ValueError, match=r"^gj\.noloco: inner_steps must be a positive integer"):
    gj.noloco(optax.adam(0.1), topo, inner_steps=-1)
  with pytest.raises(TypeError, match=r"^gj\.outer_optimizer: outer must be an optax transform"):
    gj.outer_optimizer(optax.adam(0.1), lambda u: u, inner_steps=2)
  with pytest.raises(TypeError, match=r"^gj\.diloco: inner must be an optax transform"):
    gj.diloco("adamw")
  with pytest.raises(ValueError, match=r"^gj\.noloco: topology must pair the nodes.*ring\(8\)"):
    gj.noloco(optax.adam(0.1), T.ring(N))
  with pytest.raises(ValueError, match=r"^gj\.noloco: topology must pair the nodes.*random_pairs\(8\)"):
    gj.noloco(optax.adam(0.1), T.one_peer_exponential(N))
  with pytest.raises(ValueError, match=r"^gj\.diloco: outer_momentum must be in \[0, 1\)"):
    gj.diloco(optax.adam(0.1), outer_momentum=1.0)
  with pytest.raises(ValueError, match=r"^gj\.noloco: outer_learning_rate must be non-negative"):
    gj.noloco(optax.adam(0.1), topo, outer_learning_rate=-0.1)
  with pytest.raises(ValueError, match=r"^gj\.diloco: outer_learning_rate must be at most 3\.403e\+38, got 1e\+300"):
    gj.diloco(optax.adam(0.1), outer_learning_rate=1e300)  # inf in float32: every outer step would be skipped
  for shape in [(3,), (4, 1)]:
    with pytest.raises(ValueError, match=rf"^gj\.noloco: outer_learning_rate is a schedule that returns an array of "
                                         rf"shape {re.escape(str(shape))}"):
      gj.noloco(optax.adam(0.1), topo, outer_learning_rate=lambda t, shape=shape: 0.7 * jnp.ones(shape))
  gj.diloco(optax.adam(0.1), outer_learning_rate=optax.cosine_decay_schedule(0.7, 10))  # a scalar schedule is fine
  labelled = optax.GradientTransformation(lambda p: {"name": "adam"}, lambda u, s, p=None: (u, s))
  tx = gj.diloco(labelled, inner_steps=2)
  with pytest.raises(TypeError, match=r"^gj\.diloco: the state of inner cannot be stacked per node"):
    tx.init(jnp.ones((N, 2)))


@pytest.mark.mpi
def test_mpi_ranks_equal_the_simulation():
  from _launch import mpiexec, run

  script = Path(__file__).parents[1] / "mpi" / "check_outer.py"
  res = run([*mpiexec(2), sys.executable, script], timeout=180, cwd=script.parent)
  assert res.returncode == 0, res.stdout[-4000:]
  assert sorted(re.findall(r"^rank (\d)/2: OK", res.stdout, flags=re.MULTILINE)) == ["0", "1"], res.stdout[-4000:]
