"""The documentation site builds with no warning, so no page can go stale.

The build executes every guide and both notebooks (myst-nb), so a code cell that fails,
an API name without a page, or a docstring that does not render fails this test.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
  for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
    pytest.importorskip(module, reason="the docs extra is not installed: pip install -e '.[docs]'")
  html = tmp_path / "html"
  proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                         str(ROOT / "docs"), str(html)],
                        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:]

  assert (html / "index.html").exists()
  api = (html / "api" / "gossipjax.html").read_text()
  assert "gossip_sgd" in api and "init_nodes" in api
  for module in ("topology", "backend", "asynchrony", "compress", "data", "checkpoint", "train"):
    assert (html / "api" / f"gossipjax.{module}.html").exists(), module
  assert "learning_rate" in (html / "api" / "_autosummary" / "gossipjax.gossip_sgd.html").read_text()
  # The notebooks and the executed guides render with their outputs (figures among them).
  for page in ("notebooks/tutorial", "notebooks/new_algorithm", "guides/nnx", "guides/topologies"):
    text = (html / f"{page}.html").read_text()
    assert "cell_output" in text, page
  assert "<img" in (html / "notebooks" / "tutorial.html").read_text()
  assert "<img" in (html / "results" / "benchmarks.html").read_text()
  gallery = (html / "results" / "experiments" / "index.html").read_text()
  for study in (ROOT / "experiments").glob("*/README.md"):
    assert f"{study.parent.name}.html" in gallery, study.parent.name
    assert (html / "results" / "experiments" / f"{study.parent.name}.html").exists(), study.parent.name
