"""The package's layers, read from the imports: topology -> backend -> mixing -> algorithms -> train."""

import ast
import pathlib

import pytest

import gossipjax as gj

PACKAGE = pathlib.Path(gj.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
  return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "algorithms").glob("*.py")), ids=lambda p: p.name)
def test_an_algorithm_imports_no_backend(path):
  assert not {m for m in _imports(path) if m.startswith("gossipjax.backend")}


@pytest.mark.parametrize("layer, below", [
    ("topology", {"gossipjax.backend", "gossipjax.mixing", "gossipjax.algorithms", "gossipjax.train"}),
    ("backend", {"gossipjax.mixing", "gossipjax.algorithms", "gossipjax.train"}),
    ("mixing", {"gossipjax.algorithms", "gossipjax.train"}),
])
def test_lower_layers_do_not_import_higher_ones(layer, below):
  for path in (PACKAGE / layer).glob("*.py"):
    bad = {m for m in _imports(path) if any(m == b or m.startswith(b + ".") for b in below)}
    assert not bad, f"{path.name} imports {bad}"


def test_the_cli_registry_uses_public_names():
  for path in [PACKAGE / "train" / "_registry.py"]:
    private = {m for m in _imports(path) if m.startswith("gossipjax.") and any(
        part.startswith("_") for part in m.split(".")[1:])}
    assert not private, f"{path.name} imports {private}"


def test_every_public_name_resolves():
  import gossipjax.train

  for module in (gj, gj.algorithms, gj.mixing, gj.topology, gj.backend, gj.compress, gj.data, gj.checkpoint,
                 gj.asynchrony, gossipjax.train):
    for name in module.__all__:
      assert getattr(module, name) is not None, (module.__name__, name)
  assert not {"all_reduce", "random_pairs", "abort_on_error", "apply_plan"} & (set(gj.__all__) | set(gj.backend.__all__))
