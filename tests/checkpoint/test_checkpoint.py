import os
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gossipjax as gj
from gossipjax import checkpoint as ckpt
from gossipjax.checkpoint import _checkpoint


def _leaves_equal(a, b):
  def data(x):
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      return np.asarray(jax.random.key_data(x))
    return np.asarray(x)

  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
    np.testing.assert_array_equal(data(x), data(y))
    assert np.asarray(data(x)).dtype == np.asarray(data(y)).dtype


def _state():
  x = jax.random.normal(jax.random.key(0), (8, 3))
  tx = gj.gossip_sgd(gj.topology.one_peer_exponential(8), beta=0.9, learning_rate=0.1)
  return {"params": {"w": x, "b": jnp.zeros((8,), jnp.float32)}, "opt": tx.init(x), "key": jax.random.key(7),
          "rbg": jax.random.key(1, impl="rbg"), "data_pos": 12, "lr": 0.5, "np": np.arange(4, dtype=np.int32),
          "scalar": np.float32(2.5), "weak": jnp.asarray(0.25), "nothing": None}


def test_round_trip_keeps_values_types_and_prng_keys(tmp_path):
  tree = _state()
  path = ckpt.save(tmp_path, tree, step=3)
  assert path == tmp_path / "3" and ckpt.all_steps(tmp_path) == [3] and ckpt.latest_step(tmp_path) == 3
  out = ckpt.restore(tmp_path, like=tree)
  _leaves_equal(out, tree)
  assert isinstance(out["data_pos"], int) and isinstance(out["lr"], float) and isinstance(out["np"], np.ndarray)
  assert str(jax.random.key_impl(out["rbg"])) == "rbg" and out["weak"].weak_type
  # A restored key draws the same numbers as the saved one.
  np.testing.assert_array_equal(jax.random.normal(out["key"], (3,)), jax.random.normal(tree["key"], (3,)))


def test_restore_into_abstract_like(tmp_path):
  tree = {"w": jnp.arange(6.0).reshape(2, 3), "k": jax.random.key(2)}
  ckpt.save(tmp_path, tree, step=0)
  out = ckpt.restore(tmp_path, like=jax.eval_shape(lambda: tree))
  _leaves_equal(out, tree)


def test_keep_latest_and_explicit_steps(tmp_path):
  for s in (1, 2, 3, 4):
    ckpt.save(tmp_path, {"s": jnp.asarray(s)}, step=s, keep=2)
  assert ckpt.all_steps(tmp_path) == [3, 4]
  assert int(ckpt.restore(tmp_path, like={"s": jnp.asarray(0)})["s"]) == 4
  assert int(ckpt.restore(tmp_path, like={"s": jnp.asarray(0)}, step=3)["s"]) == 3
  ckpt.save(tmp_path, {"s": jnp.asarray(40)}, step=4)  # re-saving a step replaces it
  assert int(ckpt.restore(tmp_path, like={"s": jnp.asarray(0)})["s"]) == 40
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 1"):
    ckpt.restore(tmp_path, like={"s": jnp.asarray(0)}, step=1)
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    ckpt.restore(tmp_path / "empty", like={"s": jnp.asarray(0)})
  assert ckpt.latest_step(tmp_path / "empty") is None


def test_rotation_replacement_and_remove_delete_only_what_saves_wrote(tmp_path):
  """A user's files inside a step, beside the steps, or in a step being replaced stay; the steps' own files go."""
  tree = {"s": jnp.asarray(1)}
  for s in (1, 2):
    ckpt.save(tmp_path, tree, step=s, keep=2)
  users = {"1/my_eval.txt": "eval of step 1", "1/state/mine.bin": "x", "2/notes.txt": "on step 2", "mine.pt": "model"}
  for rel, text in users.items():
    (tmp_path / rel).write_text(text)
  assert ckpt.foreign_files(tmp_path) == sorted(users)
  ckpt.save(tmp_path, tree, step=3, keep=2)  # rotates step 1 out
  ckpt.save(tmp_path, tree, step=2, keep=2)  # replaces step 2
  assert ckpt.all_steps(tmp_path) == [2, 3]
  assert {rel: (tmp_path / rel).read_text() for rel in users} == users
  assert sorted(str(p.relative_to(tmp_path / "1")) for p in (tmp_path / "1").rglob("*")) == \
      ["my_eval.txt", "state", "state/mine.bin"]  # nothing of the save's is left in step 1
  assert ckpt.foreign_files(tmp_path) == sorted(users)
  ckpt.remove(tmp_path)
  assert ckpt.all_steps(tmp_path) == [] and {rel: (tmp_path / rel).read_text() for rel in users} == users
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "mine.pt"]
  assert sorted(p.name for p in (tmp_path / "2").iterdir()) == ["notes.txt"]


def test_crash_mid_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
  ckpt.save(tmp_path, {"w": jnp.ones(3)}, step=1)

  def crash(*args, **kwargs):
    raise KeyboardInterrupt("killed while writing")

  # The arrays of step 2 are on disk, the manifest is not: the state of a crash mid-save.
  monkeypatch.setattr(_checkpoint, "_body_digest", crash)
  with pytest.raises(KeyboardInterrupt):
    ckpt.save(tmp_path, {"w": jnp.full(3, 2.0)}, step=2)
  monkeypatch.undo()
  assert any(p.name.startswith(".tmp-2-") for p in tmp_path.iterdir())
  assert ckpt.latest_step(tmp_path) == 1
  np.testing.assert_array_equal(ckpt.restore(tmp_path, like={"w": jnp.zeros(3)})["w"], np.ones(3))
  ckpt.save(tmp_path, {"w": jnp.full(3, 3.0)}, step=3)  # the next save clears the debris
  assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
  assert ckpt.all_steps(tmp_path) == [1, 3]


def test_save_of_a_step_that_keep_would_delete_is_refused(tmp_path):
  for s in (10, 20):
    ckpt.save(tmp_path, {"s": jnp.asarray(s)}, step=s, keep=2)
  with pytest.raises(ValueError, match=r"step 5 is older than the newest 2 step\(s\).*\(10, 20\)"):
    ckpt.save(tmp_path, {"s": jnp.asarray(5)}, step=5, keep=2)
  assert ckpt.all_steps(tmp_path) == [10, 20]
  assert ckpt.save(tmp_path, {"s": jnp.asarray(15)}, step=15, keep=3).name == "15"  # kept: it is returned
  assert ckpt.all_steps(tmp_path) == [10, 15, 20]


def test_failed_write_cleans_up_and_leaves_the_previous_step(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp

  ckpt.save(tmp_path, {"w": jnp.ones(3)}, step=1)

  def disk_full(self, directory, *args, **kwargs):  # tensorstore's report of a full disk
    pathlib.Path(directory).mkdir(parents=True)
    (pathlib.Path(directory) / "part").write_bytes(b"x" * 100)
    raise ValueError("OUT_OF_RANGE: Error writing file: No space left on device")

  monkeypatch.setattr(ocp.Checkpointer, "save", disk_full)
  with pytest.raises(OSError, match=r"writing step 2 to .* failed \(ValueError: OUT_OF_RANGE.*intact"):
    ckpt.save(tmp_path, {"w": jnp.full(3, 2.0)}, step=2)
  monkeypatch.undo()
  assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "1"]  # no temporary files left
  np.testing.assert_array_equal(ckpt.restore(tmp_path, like={"w": jnp.zeros(3)})["w"], np.ones(3))


def _written_files(step_dir):
  return sorted(p for p in pathlib.Path(step_dir).rglob("*") if p.is_file())


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_every_damaged_file_raises_instead_of_returning_garbage(tmp_path, damage):
  tree = {"w": jnp.arange(64.0).reshape(8, 8), "k": jax.random.key(0), "n": 3}
  ref = ckpt.save(tmp_path / "ref", tree, step=5)
  roles = sorted({_role(p.relative_to(ref)) for p in _written_files(ref)})
  assert "gossipjax_manifest.json" in roles and "state/ocdbt.process_0/d/<chunk>" in roles
  # orbax names its chunk files at random (and how many varies), so each file role is
  # damaged in a fresh save: every metadata file, a data chunk, the manifest.
  for i, role in enumerate(roles):
    d = tmp_path / f"{damage}-{i}"
    step_dir = ckpt.save(d, tree, step=5)
    target = next(p for p in _written_files(step_dir) if _role(p.relative_to(step_dir)) == role)
    raw = target.read_bytes()
    if damage == "truncate":
      target.write_bytes(raw[: len(raw) // 2])
    else:
      j = len(raw) // 2
      target.write_bytes(raw[:j] + bytes([raw[j] ^ 0x10]) + raw[j + 1:])
    with pytest.raises(ckpt.CorruptCheckpointError, match="corrupted|unreadable|modified|truncated"):
      ckpt.restore(d, like=tree)


def _role(rel):
  return "/".join("<chunk>" if len(part) == 32 and all(c in "0123456789abcdef" for c in part) else part
                  for part in pathlib.PurePath(rel).parts)


def test_missing_file_raises(tmp_path):
  tree = {"w": jnp.ones((4, 4))}
  step_dir = ckpt.save(tmp_path, tree, step=0)
  victim = next(p for p in _written_files(step_dir) if p.parent.name == "d")
  victim.unlink()
  with pytest.raises(ckpt.CorruptCheckpointError, match="missing"):
    ckpt.restore(tmp_path, like=tree)


def test_restore_with_a_different_like_raises_clearly(tmp_path):
  tree = {"params": {"w": jnp.ones((8, 3))}, "step": jnp.asarray(0, jnp.int32), "key": jax.random.key(0)}
  ckpt.save(tmp_path, tree, step=1)
  with pytest.raises(ValueError, match=r"\['params'\]\['w'\] was saved as float64\(8, 3\) but like has float64\(8, 4\)"):
    ckpt.restore(tmp_path, like={**tree, "params": {"w": jnp.ones((8, 4))}})
  with pytest.raises(ValueError, match=r"was saved as float64\(8, 3\) but like has float32\(8, 3\)"):
    ckpt.restore(tmp_path, like={**tree, "params": {"w": jnp.ones((8, 3), jnp.float32)}})
  with pytest.raises(ValueError, match=r"in like but not in the checkpoint: \['extra'\]"):
    ckpt.restore(tmp_path, like={**tree, "extra": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"in the checkpoint but not in like: \['key'\]"):
    ckpt.restore(tmp_path, like={k: v for k, v in tree.items() if k != "key"})
  with pytest.raises(ValueError, match="threefry2x32 PRNG key but like has a rbg key"):
    ckpt.restore(tmp_path, like={**tree, "key": jax.random.key(0, impl="rbg")})
  other = {**tree, "params": optax.TraceState(trace=jnp.ones((8, 3)))}
  ckpt.save(tmp_path / "nt", other, step=1)
  # Same leaf paths (".trace"), another NamedTuple class: a different tree.
  with pytest.raises(ValueError, match="different node types"):
    ckpt.restore(tmp_path / "nt", like={**tree, "params": _Trace(trace=jnp.ones((8, 3)))})


class _Trace(NamedTuple):
  trace: jax.Array


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="step must be a non-negative integer"):
    ckpt.save(tmp_path, {"w": jnp.ones(2)}, step=-1)
  with pytest.raises(ValueError, match="keep must be a positive integer"):
    ckpt.save(tmp_path, {"w": jnp.ones(2)}, step=1, keep=0)
  with pytest.raises(TypeError, match=r"the leaf at \['name'\] is a str"):
    ckpt.save(tmp_path, {"name": "ring"}, step=1)
  assert ckpt.save(tmp_path, {"w": jnp.ones(2)}, step=jnp.asarray(9, jnp.int32)).name == "9"


def _training(seed, backend=None):
  """A jitted DmSGD training step on a time-varying graph, with data drawn from the state's key."""
  rng = np.random.default_rng(seed)
  inputs = rng.normal(size=(96, 5))
  targets = inputs @ rng.normal(size=5) + 0.1 * rng.normal(size=96)
  parts = gj.data.partition_iid(np.zeros(96, int), 8, seed=seed)
  data = gj.data.node_data(inputs, targets, parts)
  lr = optax.cosine_decay_schedule(0.05, 40)
  tx = gj.gossip_sgd(gj.topology.one_peer_exponential(8), beta=0.9, learning_rate=lr, backend=backend)

  def loss(w, xb, yb):
    return jnp.mean((xb @ w - yb) ** 2)

  def init(key):
    k_init, k_data = jax.random.split(key)
    params = gj.init_nodes(lambda k: jax.random.normal(k, (5,)), k_init, 8, same_init=False)
    if backend is not None:
      params = backend.shard(params)
    return {"params": params, "opt": tx.init(params), "key": k_data, "step": jnp.asarray(0, jnp.int32)}

  @jax.jit
  def step(state):
    key, sub = jax.random.split(state["key"])
    xb, yb = gj.data.sample_batches(data, sub, 4)
    grads = jax.vmap(jax.grad(loss))(state["params"], xb, yb)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "key": key,
            "step": state["step"] + 1}

  return init, step


def test_resume_continues_bit_for_bit(tmp_path):
  init, step = _training(0)
  state = init(jax.random.key(0))
  for _ in range(12):
    state = step(state)
  uninterrupted = state

  state = init(jax.random.key(0))
  for _ in range(6):
    state = step(state)
  ckpt.save(tmp_path, state, step=int(state["step"]))
  del state
  # A fresh "process": new transform and jitted step, a differently seeded template state.
  init2, step2 = _training(0)
  resumed = ckpt.restore(tmp_path, like=init2(jax.random.key(123)))
  assert int(resumed["step"]) == 6 and int(resumed["opt"][-1].count) == 6  # W(k) resumes at k = 6
  for _ in range(6):
    resumed = step2(resumed)
  _leaves_equal(resumed, uninterrupted)


@pytest.mark.parametrize("sharded", [False, True], ids=["simulate", "sharded"])
def test_restore_then_step_runs_the_compiled_step_without_compiling_again(tmp_path, sharded, caplog):
  backend = None
  if sharded:
    if 8 % jax.device_count():
      pytest.skip("needs a device count dividing 8")
    backend = gj.backend.sharded(jax.make_mesh((jax.device_count(),), ("nodes",),
                                               axis_types=(jax.sharding.AxisType.Auto,)))
  init, step = _training(0, backend=backend)
  fresh = init(jax.random.key(0))
  state = step(step(fresh))
  ckpt.save(tmp_path, state, step=2)
  for like in (fresh, state, init(jax.random.key(1))):  # the template of a new run, and the live state
    restored = ckpt.restore(tmp_path, like=like)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
      assert got.committed == want.committed and got.sharding == want.sharding
    caplog.clear()
    with jax.log_compiles(), caplog.at_level("WARNING"):
      after = step(restored)
      jax.block_until_ready(after)
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert not compiled, compiled
    _leaves_equal(after, step(state))


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_under_mpi_is_bit_for_bit(tmp_path):
  """mpiexec -n 2: each rank saves its block of nodes at step 6; a second launch resumes to step 12."""
  import sys

  from _launch import mpiexec, run

  script = pathlib.Path(__file__).parents[1] / "mpi" / "ckpt_resume.py"
  out = tmp_path / "out"
  out.mkdir()
  for mode in ("first", "resume"):
    res = run([*mpiexec(2), sys.executable, script, mode, tmp_path / "ckpt", out], timeout=240)
    assert res.returncode == 0, res.stdout[-4000:]
  assert ckpt.all_steps(ckpt.rank_directory(tmp_path / "ckpt", 0)) == [6]
  assert ckpt.all_steps(ckpt.rank_directory(tmp_path / "ckpt", 1)) == [6]
  for rank in (0, 1):
    full, resumed = np.load(out / f"first_rank{rank}.npz"), np.load(out / f"resume_rank{rank}.npz")
    assert len(full.files) == len(resumed.files) >= 6
    for name in full.files:
      np.testing.assert_array_equal(resumed[name], full[name])
      assert resumed[name].dtype == full[name].dtype


def test_latest_step_with_comm_is_the_newest_step_every_rank_has(tmp_path):
  class FakeComm:  # allgather over three "ranks" whose directories hold these steps
    def allgather(self, steps):
      return [steps, [2, 4, 6], [4, 6, 8]]

  for s in (2, 4, 6, 8):
    ckpt.save(tmp_path, {"s": jnp.asarray(s)}, step=s)
  assert ckpt.latest_step(tmp_path) == 8
  assert ckpt.latest_step(tmp_path, comm=FakeComm()) == 6
  assert ckpt.latest_step(tmp_path, comm=FakeComm(), before=6) == 4
  assert ckpt.latest_step(tmp_path, before=2) is None


_DETERMINISM = """
import hashlib, sys
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, sys.argv[1])
from test_checkpoint import _training
init, step = _training(0)
state = init(jax.random.key(0))
for _ in range(10):
  state = step(state)
h = hashlib.sha256()
for x in jax.tree.leaves(state):
  x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  h.update(np.asarray(x).tobytes())
print("digest", h.hexdigest())
"""


def test_same_seed_same_result_in_separate_processes():
  import subprocess
  import sys

  here = str(pathlib.Path(__file__).parent)
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", _DETERMINISM, here], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=180) for p in procs]
  digests = [next(line for line in out.splitlines() if line.startswith("digest")) for out, _ in outs]
  assert digests[0] == digests[1]


def test_same_seed_same_result_sharded_and_equal_to_simulate():
  mesh = jax.make_mesh((jax.device_count(),), ("nodes",), axis_types=(jax.sharding.AxisType.Auto,))
  if 8 % jax.device_count():
    pytest.skip("needs a device count dividing 8")
  backend = gj.backend.sharded(mesh)
  runs = []
  for _ in range(2):
    init, step = _training(0, backend=backend)  # a fresh transform and compilation each time
    state = init(jax.random.key(0))
    for _ in range(6):
      state = step(state)
    runs.append(state)
  _leaves_equal(runs[0], runs[1])
  init, step = _training(0)
  state = init(jax.random.key(0))
  for _ in range(6):
    state = step(state)
  np.testing.assert_allclose(runs[0]["params"], state["params"], rtol=0, atol=1e-12)
