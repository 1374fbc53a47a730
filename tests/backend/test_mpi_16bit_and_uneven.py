"""Under ``mpiexec -n 2``: 16-bit params cross as raw 16-bit words, uneven blocks get the true mean, and the outer step takes the live nodes."""

import re
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from gossipjax.backend import _mpi


def test_16bit_leaves_cross_as_words_of_their_width_bit_for_bit():
  for dtype, words in ((jnp.bfloat16, jnp.uint16), (jnp.float16, jnp.uint16), (jnp.float8_e4m3fn, jnp.uint8)):
    x = jnp.asarray([1.5, -2.25, 3e-3], dtype)
    sent = _mpi.as_words(x)
    assert sent.dtype == words and sent.nbytes == x.nbytes  # the bytes on the wire are the leaf's own
    assert (_mpi.from_words(sent, dtype) == x).all()
  x = jnp.ones(3, jnp.float32)
  assert _mpi.as_words(x) is x and _mpi.from_words(x, jnp.float32) is x


@pytest.mark.mpi
def test_mpi_16bit_params_equal_the_simulation_and_uneven_blocks_get_the_true_mean():
  from _launch import mpiexec, run

  script = Path(__file__).parents[1] / "mpi" / "check_16bit_and_uneven.py"
  res = run([*mpiexec(2), sys.executable, script], timeout=240, cwd=script.parent)
  assert res.returncode == 0, res.stdout[-4000:]
  assert sorted(re.findall(r"^rank (\d)/2: OK", res.stdout, flags=re.MULTILINE)) == ["0", "1"], res.stdout[-4000:]
