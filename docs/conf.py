"""Sphinx configuration of the gossipjax documentation (`make docs`)."""

import importlib
import inspect
import os
import pathlib
import sys

# The tutorial notebook asks for 8 CPU devices before it imports jax; so do the guides that
# shard. Set here as well so autodoc's import of gossipjax does not fix the device count first.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import gossipjax  # noqa: E402

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
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
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
  """Writes ``api/<module>.rst``: the module's docstring and an autosummary of its ``__all__``."""
  out = DOCS / "api"
  out.mkdir(exist_ok=True)
  for name, blurb in PUBLIC_MODULES.items():
    module = importlib.import_module(name)
    title = f"``{name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {name}", "   :no-members:", ""]
    if blurb:
      lines += [blurb, ""]
    lines += [f".. currentmodule:: {name}", "", ".. autosummary::", "   :toctree: _autosummary", "   :nosignatures:", ""]
    lines += [f"   {n}" for n in _public_names(module)]
    text = "\n".join(lines) + "\n"
    page = out / f"{name}.rst"
    if not page.exists() or page.read_text() != text:
      page.write_text(text)
  index = ["API reference", "=============", "",
           "Every public name of gossipjax, one page per module, generated from the docstrings.", "",
           ".. toctree::", "   :maxdepth: 1", ""] + [f"   {name}" for name in PUBLIC_MODULES]
  text = "\n".join(index) + "\n"
  if not (out / "index.rst").exists() or (out / "index.rst").read_text() != text:
    (out / "index.rst").write_text(text)


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
