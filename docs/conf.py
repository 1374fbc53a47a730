"""Sphinx configuration of the gossipjax documentation (`make docs`)."""

import importlib
import inspect
import os
import pathlib
import re
import sys

# The tutorial notebook asks for 8 CPU devices before it imports jax; so do the guides that
# shard. Set here as well so autodoc's import of gossipjax does not fix the device count first.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import gossipjax  # noqa: E402

# Every page's kernel inherits this environment: their collectives over the 8 CPU devices need
# 16 XLA:CPU client threads, sized before any JAX computation.
gossipjax.backend.reserve_cpu_threads()

project = "gossipjax"
author = "the gossipjax authors"
copyright = "2026, the gossipjax authors"
release = version = gossipjax.__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
]

# No intersphinx: the docs build with no network.
exclude_patterns = ["_build", "**.ipynb_checkpoints", "jupyter_execute"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

html_theme = "sphinx_book_theme"
html_title = "gossipjax"
# The sidebar shows the sections of the page's own branch, not every page of the site: the
# full tree (250 pages, most of them API pages) rendered into every page costs half of the
# build's page writing and makes each page's sidebar hundreds of links long.
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
  "collapse_navbar": True,
}

# MyST: $...$ maths, ::: fences, headings usable as link targets.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Every notebook and every MyST notebook guide is executed at each build, so no output can
# be stale; a cell that raises fails the build.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 600
nb_merge_streams = True
# A Markdown output of a code cell (IPython.display.Markdown) is parsed as MyST, so a table
# printed by a cell renders as a table; the default, CommonMark, has no tables.
nb_render_markdown_format = "myst"

# API reference: one page per public module, generated from its ``__all__`` so that a name
# added to the package is documented without editing the docs.
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes sections as fields of the class, so a NamedTuple's fields are not described twice.
napoleon_use_ivar = True
add_module_names = False

PUBLIC_MODULES = {
  "gossipjax": "Algorithms, mixing and node helpers: the top-level namespace ``gj``.",
}
for _name in gossipjax.__all__:
  if inspect.ismodule(getattr(gossipjax, _name)):
    PUBLIC_MODULES[f"gossipjax.{_name}"] = ""
PUBLIC_MODULES["gossipjax.train"] = ""


def _public_names(module):
  return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]


def _write_api_pages(app, config):
  """Writes ``api/<module>.rst``: the module's docstring and an autosummary of its ``__all__``.

  A class or function re-exported by several public modules is documented once, at its first
  home in ``PUBLIC_MODULES`` order (the top level first); the other modules link to it.
  """
  out = DOCS / "api"
  out.mkdir(exist_ok=True)
  home = {}
  for name, blurb in PUBLIC_MODULES.items():
    module = importlib.import_module(name)
    title = f"``{name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {name}", "   :no-members:", ""]
    if blurb:
      lines += [blurb, ""]
    own, elsewhere = [], []
    for n in _public_names(module):
      obj = getattr(module, n)
      documented = home.get(id(obj)) if inspect.isclass(obj) or inspect.isroutine(obj) else None
      if documented:
        elsewhere.append((n, documented))
      else:
        own.append(n)
        if inspect.isclass(obj) or inspect.isroutine(obj):
          home[id(obj)] = f"{name}.{n}"
    lines += [f".. currentmodule:: {name}", ""]
    if own:
      lines += [".. autosummary::", "   :toctree: _autosummary", "   :nosignatures:", ""]
      lines += [f"   {n}" for n in own] + [""]
    if elsewhere:
      lines += ["Also exported here, and documented at:", ""]
      lines += [f"- ``{name}.{n}``: :py:obj:`{target}`" for n, target in elsewhere] + [""]
    _write_if_changed(out / f"{name}.rst", "\n".join(lines))
  index = ["API reference", "=============", "",
           "Every public name of gossipjax, one page per module, generated from the docstrings.", "",
           ".. toctree::", "   :maxdepth: 1", ""] + [f"   {name}" for name in PUBLIC_MODULES]
  _write_if_changed(out / "index.rst", "\n".join(index) + "\n")


_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _page_from(source, page, heading_offset=0, pages=None):
  """The Markdown of ``source`` as a page at ``page``: headings moved down ``heading_offset``
  levels, and relative links and images pointing at the files next to ``source`` (a file that
  ``pages`` maps to its generated page links to that page; another file that exists becomes a
  download link; a link to anything else becomes plain code text)."""
  pages = pages or {}
  out, fenced = [], False
  for line in source.read_text().splitlines():
    if line.lstrip().startswith("```"):
      fenced = not fenced
    elif not fenced:
      if line.startswith("#"):
        line = "#" * heading_offset + line

      def relink(m):
        target = m.group(2)
        if re.match(r"[a-z]+:|#", target):
          return m.group(0)
        path = (source.parent / target.split("#")[0]).resolve()
        if path in pages:
          return m.group(1) + os.path.relpath(pages[path], page.parent) + m.group(3)
        if path.is_file():
          return m.group(1) + os.path.relpath(path, page.parent) + m.group(3)
        return f"`{target}`" if not m.group(1).startswith("!") else ""

      line = _LINK.sub(relink, line)
    out.append(line)
  return "\n".join(out) + "\n"


def _first_table(text):
  """The first Markdown table of ``text`` (its consecutive ``|`` lines), or ``None``."""
  table = []
  for line in text.splitlines():
    if line.startswith("|"):
      table.append(line)
    elif table:
      break
  return "\n".join(table) if len(table) > 2 else None


def _question(readme):
  """The first paragraph after a README's title: the study's question."""
  paragraphs = [p.strip() for p in readme.split("\n\n")]
  body = [p for p in paragraphs[1:] if p and not p.startswith(("#", "```", "|", "!", "-"))]
  return body[0] if body else ""


def _write_if_changed(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def benchmark_pages():
  """The benchmarks page from ``benchmarks/RESULTS.md`` and, each on a page of its own, the parts
  with long tables that it links to: ``{page path: Markdown}``."""
  out = DOCS / "results"
  bench = out / "benchmarks.md"
  parts = {(ROOT / "benchmarks" / "results" / f"{name}.md").resolve(): out / f"benchmarks_{name}.md"
           for name in ("communication", "scale", "lm_step", "per_node_conv")}
  links = {(ROOT / "benchmarks" / "RESULTS.md").resolve(): bench, **parts}
  intro = ["# Benchmarks", "",
           "`python -m benchmarks` runs the suite in `benchmarks/` (`--quick` for a smoke run, `--only NAME ...`",
           "for a part of it) and writes its figures as JSON. `benchmarks/RESULTS.md`, shown below, holds the",
           "latest figures with the machine and the conditions they were taken under.", "",
           "```{toctree}", ":hidden:", ""] + [p.stem for p in parts.values()] + ["```", "", ""]
  pages = {bench: "\n".join(intro) + _page_from(ROOT / "benchmarks" / "RESULTS.md", bench, 1, links)}
  for source, page in parts.items():
    pages[page] = _page_from(source, page, 0, links)
  return pages


def _write_result_pages(app, config):
  """Writes ``results/``: the benchmarks page from ``benchmarks/RESULTS.md``, and a gallery of
  every study in ``experiments/`` (its question, figures and main table) with one page per
  study holding its whole README. Generated at each build, so they show the current results."""
  out = DOCS / "results"
  for page, text in benchmark_pages().items():
    _write_if_changed(page, text)

  studies = sorted(p.parent for p in (ROOT / "experiments").glob("*/README.md"))
  gallery = ["# Experiments gallery", "",
             "Each study in `experiments/` reproduces a result of the papers gossipjax is built from, has a",
             "`--quick` mode that runs in minutes on 2 CPU cores, and keeps its figures and tables in",
             "`experiments/<study>/results/`. Below, each study's question, figures and main table; its page",
             "has the setup, the commands and every table.", "",
             "```{toctree}", ":hidden:", ""] + [s.name for s in studies] + ["```", ""]
  for study in studies:
    readme = (study / "README.md").read_text()
    title = next((line[2:].strip() for line in readme.splitlines() if line.startswith("# ")), study.name)
    page = out / "experiments" / f"{study.name}.md"
    _write_if_changed(page, _page_from(study / "README.md", page))
    gallery += [f"## {title}", "", f"`experiments/{study.name}`: {{doc}}`the whole study <{study.name}>`", "",
                _question(readme), ""]
    for png in sorted((study / "results").glob("*.png")):
      gallery += [f"```{{image}} {os.path.relpath(png, page.parent)}", f":alt: {png.stem}", "```", ""]
    tables = [_first_table(f.read_text()) for f in sorted((study / "results").glob("*.md"))]
    table = next((t for t in tables if t), None) or _first_table(readme)
    if table:
      gallery += [table, ""]
  _write_if_changed(out / "experiments" / "index.md", "\n".join(gallery))


def _describe_data(app, what, name, obj, options, lines):
  """A constant has no docstring of its own: say what it holds instead of its type's docstring."""
  if what not in ("data", "attribute") or inspect.isroutine(obj) or inspect.isclass(obj):
    return
  type_doc = getattr(type(obj), "__doc__", None)
  if lines and isinstance(type_doc, str) and type_doc and lines[0] == type_doc.splitlines()[0]:
    lines.clear()
    if isinstance(obj, dict):
      keys = ", ".join(f"``{k}``" for k in obj)
      lines.append(f"A ``dict`` of {len(obj)} entries, keyed by {keys}.")
    else:
      lines.append(f"``{obj!r}``")


def setup(app):
  app.connect("autodoc-process-docstring", _describe_data)
  app.connect("config-inited", _write_api_pages)
  app.connect("config-inited", _write_result_pages)
