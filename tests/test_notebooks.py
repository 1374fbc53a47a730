"""The notebooks, which the documentation build executes.

``tests/test_docs.py`` builds the site with myst-nb, which runs every cell of both notebooks
and fails on any cell that raises, then checks that they render with their outputs: that is
the notebooks' execution test, so they are not run a second time here.
"""

import pathlib

import nbformat

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_at_least_two_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"tutorial.ipynb", "new_algorithm.ipynb"}


def test_notebooks_are_stored_without_outputs():
  """Outputs come from the docs build's run of the current code, never from a stale copy in git."""
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name
