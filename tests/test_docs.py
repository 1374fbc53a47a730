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
  # A table a code cell prints as Markdown renders as a table, not as a paragraph of pipes.
  topologies = (html / "guides" / "topologies.html").read_text()
  section = topologies[topologies.index('id="messages-and-spectral-gaps"'):topologies.index('id="consensus-decay"')]
  assert '<th class="head"><p>topology</p></th>' in section and "<td><p>one-peer exponential</p></td>" in section
  assert "<p>| topology |" not in section
  assert "<img" in (html / "results" / "benchmarks.html").read_text()
  gallery = (html / "results" / "experiments" / "index.html").read_text()
  for study in (ROOT / "experiments").glob("*/README.md"):
    assert f"{study.parent.name}.html" in gallery, study.parent.name
    assert (html / "results" / "experiments" / f"{study.parent.name}.html").exists(), study.parent.name


def test_the_benchmarks_page_opens_with_its_headline_table_and_stays_short():
  """A reader sees every benchmark's headline first and reaches its details by section; long tables have pages."""
  import importlib.util
  import re

  spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
  assert spec is not None and spec.loader is not None
  conf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conf)
  pages = conf.benchmark_pages()
  page = pages[ROOT / "docs" / "results" / "benchmarks.md"].splitlines()
  assert len(page) <= 260, len(page)
  sections = [line for line in page if line.startswith("### ")]
  assert sections[0] == "### Headline figures"
  table = page[page.index(sections[0]):page.index(sections[1])]
  slug = lambda title: re.sub(r"[^\w\- ]", "", title.lower().replace(" ", "-"))
  anchors = {slug(s[4:]) for s in sections[1:]}
  linked = set(re.findall(r"^\| \[[^]]+\]\(#([^)]+)\)", "\n".join(table), re.M))
  assert linked == anchors  # one row per section, and each row reaches its section
  for name in ("communication", "scale", "lm_step"):
    assert f"(benchmarks_{name}.md)" in "\n".join(page)
    assert pages[ROOT / "docs" / "results" / f"benchmarks_{name}.md"].startswith("# ")


def test_the_adaptive_recipes_of_the_algorithms_guide_compute_what_it_states():
  """Adam before gradient tracking is as biased as decentralized Adam; tracking then Adam is exact; CHOCO with
  AdamW and the identity compressor is decentralized AdamW (the guide's section, on a smaller run)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import gossipjax as gj

  n, m, d, lr, steps = 8, 30, 4, 0.02, 1500
  rng = np.random.default_rng(0)
  a = rng.normal(size=(n, m, d))
  b = np.einsum("nmd,nd->nm", a, rng.normal(size=d) + rng.normal(size=(n, d)))  # every node its own minimiser
  x_star = np.linalg.solve(np.einsum("nmd,nme->de", a, a), np.einsum("nmd,nm->d", a, b))
  grad = jax.vmap(lambda x, a, b: a.T @ (a @ x - b) / m)
  w = gj.topology.ring(n)

  def final(tx):
    def body(carry, _):
      x, state = carry
      updates, state = tx.update(grad(x, a, b), state, x)
      return (optax.apply_updates(x, updates), state), None
    x = jnp.zeros((n, d))
    return np.asarray(jax.jit(lambda x: jax.lax.scan(body, (x, tx.init(x)), None, length=steps)[0][0])(x))

  error = lambda x: float(np.mean(np.sum((x - x_star) ** 2, axis=1)))
  tracked_then_adam = final(gj.chain(gj.gradient_tracker(w), optax.adam(lr), gj.mix(w)))
  adam_then_tracked = final(gj.chain(optax.scale_by_adam(), gj.gradient_tracking(w, learning_rate=lr)))
  decentralized_adam = final(gj.chain(optax.adam(lr), gj.mix(w)))
  assert error(tracked_then_adam) < 1e-10
  assert error(adam_then_tracked) > 1e-3 and error(decentralized_adam) > 1e-3
  assert error(adam_then_tracked) < 10 * error(decentralized_adam)  # the same kind of bias, not a divergence
  choco = final(gj.chain(optax.scale_by_adam(), optax.add_decayed_weights(1e-3),
                         gj.choco_sgd(w, gj.compress.identity(), learning_rate=lr, consensus_step=1.0)))
  np.testing.assert_allclose(choco, final(gj.chain(optax.adamw(lr, weight_decay=1e-3), gj.mix(w))), rtol=1e-10,
                             atol=1e-12)
