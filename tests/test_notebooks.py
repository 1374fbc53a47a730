"""The notebooks are executed here, so none can go stale.

Where the docs extra is installed (`make test` installs it), tests/test_docs.py builds the
site, which executes both notebooks with myst-nb and fails on any cell that raises; running
them here too would only repeat that work, so the execution test is skipped there.
"""

import importlib.util
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


DOCS_BUILD_EXECUTES_THEM = all(importlib.util.find_spec(m) for m in ("sphinx", "myst_nb", "sphinx_book_theme"))


@pytest.mark.slow
@pytest.mark.skipif(DOCS_BUILD_EXECUTES_THEM, reason="tests/test_docs.py executes the notebooks in the docs build")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors


def test_there_are_at_least_two_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"tutorial.ipynb", "new_algorithm.ipynb"}
