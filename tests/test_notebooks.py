"""The notebooks are executed here, so none can go stale."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors


def test_there_are_at_least_two_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"tutorial.ipynb", "new_algorithm.ipynb"}
