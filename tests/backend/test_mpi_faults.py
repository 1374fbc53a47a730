"""MPI jobs never hang: a rank that raises, dies or leaves early ends the whole job; ranks that disagree are told so."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gossipjax as gj
from _launch import mpiexec, run
from gossipjax.backend._mpi_fault import check_same_topology

HERE = Path(__file__).parents[1]  # tests/, where the MPI scripts live in mpi/
HANG_LIMIT = 90  # seconds; a healthy abort takes a few


def launch(args: list[str], ranks: int, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
  """``mpiexec -n ranks python args...``; a run past ``timeout`` is killed (process group) and fails the test."""
  res = run([*mpiexec(ranks), sys.executable, *args], timeout, cwd=HERE)
  return res, res.seconds


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["mpi4py", "mpi4jax", "gossip", "kill"])
def test_a_failing_rank_ends_the_job(mode):
  """Rank 2 of 4 raises (or is killed) while ranks 0, 1, 3 wait for it in a collective."""
  res, elapsed = launch([str(HERE / "mpi" / "fault_rank_raises.py"), mode], ranks=4, timeout=HANG_LIMIT)
  assert res.returncode != 0, res.stdout[-3000:]
  assert "got past the collective" not in res.stdout
  if mode != "kill":
    assert "RuntimeError: injected failure on rank 2" in res.stdout, res.stdout[-3000:]
    assert "gossipjax: uncaught exception on rank 2 of 4: MPI_Abort(1) ends every rank" in res.stdout, res.stdout[-3000:]
  assert elapsed < HANG_LIMIT


def test_abort_on_error_is_a_no_op_in_a_single_process():
  hook = sys.excepthook
  gj.backend.mpi_abort_on_error()
  assert sys.excepthook is hook


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["exit", "return"])
def test_a_rank_that_leaves_early_ends_the_job(mode):
  """Rank 2 calls sys.exit(1), or returns from main, while ranks 1 and 3 wait for its message."""
  res, elapsed = launch([str(HERE / "mpi" / "fault_rank_exits.py"), mode], ranks=4, timeout=HANG_LIMIT)
  assert res.returncode != 0, res.stdout[-3000:]
  assert "got past the exchange" not in res.stdout, res.stdout[-3000:]
  if mode == "exit":  # a failure: within seconds, not after the minute a rank that finished waits for the others
    assert "gossipjax: rank 2 of 4 exited with status 1 while other ranks still run: MPI_Abort(1)" in res.stdout, (
        res.stdout[-3000:])
    assert elapsed < 30, elapsed
  else:
    assert "gossipjax: rank 2 of 4 is exiting, but not every rank reached its exit within 3 s" in res.stdout, (
        res.stdout[-3000:])
    assert elapsed < HANG_LIMIT


@pytest.mark.mpi
def test_ranks_with_different_topologies_are_told_which_ranks_differ():
  """Every rank raises, naming rank 1 and the others; a later staggered finish still exits 0."""
  res, _ = launch([str(HERE / "mpi" / "fault_topologies_differ.py")], ranks=4, timeout=HANG_LIMIT)
  assert res.returncode == 0, res.stdout[-3000:]
  for r in range(4):
    family, size = re.findall(rf"^rank {r}: (.*)$", res.stdout, flags=re.MULTILINE)
    assert re.search(r"exponential\(4\) with n=4 on ranks 0, 2, 3; ring\(4\) with n=4 on rank 1\b", family), family
    assert re.search(r"ring\(16\) with n=16 on ranks 0, 2, 3; ring\(20\) with n=20 on rank 1\b", size), size
  # mpiexec forwards each rank's writes as they come, so two ranks' lines may share one line of the output.
  assert sorted(re.findall(r"rank (\d) finished", res.stdout)) == ["0", "1", "2", "3"], res.stdout[-3000:]
  assert "MPI_Abort" not in res.stdout, res.stdout[-3000:]



class _Ranks:
  """A stand-in communicator: ``allgather`` returns what each rank would send, from its own topology."""

  def __init__(self, topologies):
    self.topologies = topologies

  def Get_size(self):
    return len(self.topologies)

  def allgather(self, _):
    return [(t.fingerprint(), t.name, t.num_nodes) for t in self.topologies]


def test_topologies_that_differ_only_in_weights_are_told_apart():
  """Same name and n, other weights: the message tells them apart by digest; long rank lists become ranges."""
  ring = gj.topology.ring(8)
  lazy = gj.topology.Topology(0.5 * ring.matrix() + 0.5 * np.eye(8), name=ring.name)
  check_same_topology(_Ranks([ring, gj.topology.ring(8)]), ring)
  with pytest.raises(ValueError, match=r"ring\(8\) with n=8 \(weights \w{8}\) on ranks 0-6, 8; "
                                       r"ring\(8\) with n=8 \(weights \w{8}\) on rank 7\."):
    check_same_topology(_Ranks([ring] * 7 + [lazy, ring]), ring)
