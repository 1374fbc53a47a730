"""Every public name carries an API-reference docstring (issue #24).

The API pages are generated from the docstrings, so this walks the ``__all__`` of
``gossipjax`` and of each subpackage and checks, name by name, the Google-style sections
the reference relies on: ``Args:`` when the signature has parameters (each one named),
``Returns:`` for a function, an ``Example:`` section with ``>>>`` lines (which the doctest
run executes), ``Attributes:`` for a NamedTuple state, and ``References:`` for a name that
comes from a paper.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import gossipjax as gj

SUBPACKAGES = ("layers", "topology", "backend", "compress", "data", "checkpoint", "asynchrony", "train", "mixing",
               "algorithms")

# Names that implement a method from a paper: their docstring cites it.
FROM_PAPERS = {
    "gossipjax.algorithms": {"allreduce_sgd", "choco_sgd", "decentlam", "easgd", "exact_diffusion", "extra",
                             "gossip_sgd", "gradient_tracker", "gradient_tracking", "periodic_average", "qg_dmsgd", "sgp"},
    "gossipjax.topology": {"exponential", "one_peer_exponential", "directed_exponential",
                           "one_peer_directed_exponential"},
    "gossipjax.asynchrony": {"adpsgd", "mpi_adpsgd", "sgp_bounded_staleness"},
    "gossipjax.compress": {"top_k", "random_k", "qsgd", "sign", "threshold_mean"},
}


def _public_names():
  modules = {"gossipjax": gj}
  modules.update({f"gossipjax.{name}": importlib.import_module(f"gossipjax.{name}") for name in SUBPACKAGES})
  seen = set()
  for module_name, module in modules.items():
    for name in module.__all__:
      obj = getattr(module, name)
      # Subpackages are documented by their module docstring; constants (ints, dicts) carry
      # no docstring of their own.
      if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
        continue
      # A name re-exported in several namespaces (gj.mix, gj.mixing.mix) is checked once, under
      # the first; it is a paper-derived name if any namespace lists it as one.
      key = (obj.__module__, obj.__qualname__)
      if key in seen:
        continue
      seen.add(key)
      yield pytest.param(module_name, name, id=f"{module_name}.{name}")


def _is_namedtuple(obj) -> bool:
  return inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields")


def _documented_parameters(obj) -> list[str]:
  """The parameters a caller passes: named, not ``self``, ``*args``/``**kwargs`` or flax's plumbing."""
  try:
    signature = inspect.signature(obj)
  except (TypeError, ValueError):  # a builtin base class (an exception) has none
    return []
  skip = {"self"}
  if inspect.isclass(obj) and any(c.__module__.startswith("flax.") for c in obj.__mro__[1:]):
    skip |= {"parent", "name"}  # every flax Module takes these
  return [p.name for p in signature.parameters.values()
          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in skip]


def _section(doc: str, title: str) -> str | None:
  """The body of the Google-style section ``title`` (its indented lines), or ``None``."""
  match = re.search(rf"^(\s*){title}:\s*$", doc, re.MULTILINE)
  if match is None:
    return None
  indent = len(match.group(1))
  body = []
  for line in doc[match.end():].splitlines()[1:]:
    if line.strip() and len(line) - len(line.lstrip()) <= indent:
      break
    body.append(line)
  return "\n".join(body)


def _missing(module_name: str, name: str) -> list[str]:
  obj = getattr(importlib.import_module(module_name), name)
  doc = inspect.getdoc(obj) or ""
  # A class without a docstring of its own inherits its base's, which documents the base.
  if inspect.isclass(obj) and "__doc__" not in vars(obj):
    doc = ""
  if not doc.strip():
    return ["a docstring"]
  missing = []
  if _is_namedtuple(obj):
    attributes = _section(doc, "Attributes")
    if attributes is None:
      missing.append("an Attributes: section")
    else:
      missing += [f"field {f!r} in Attributes:" for f in obj._fields if not re.search(rf"^\s*{f}\b", attributes,
                                                                                      re.MULTILINE)]
    return missing
  parameters = _documented_parameters(obj)
  if parameters:
    args = _section(doc, "Args")
    if args is None and inspect.isclass(obj):
      args = _section(doc, "Attributes")  # a dataclass's fields are its constructor's arguments
    if args is None:
      missing.append("an Args: section")
    else:
      missing += [f"parameter {p!r} in Args:" for p in parameters
                  if not re.search(rf"^\s*\**{p}\b", args, re.MULTILINE)]
  if inspect.isfunction(obj) and _section(doc, "Returns") is None:
    # A function that returns nothing (annotated ``-> None``) has no Returns section, as
    # the Google style asks.
    if inspect.signature(obj).return_annotation not in (None, "None"):
      missing.append("a Returns: section")
  example = _section(doc, "Examples?")
  if example is None or ">>>" not in example:
    missing.append("an Example: section with >>> lines")
  from_paper = any(obj is getattr(importlib.import_module(m), n) for m, names in FROM_PAPERS.items() for n in names)
  if from_paper and _section(doc, "References") is None:
    missing.append("a References: section")
  return missing


@pytest.mark.parametrize("module_name, name", list(_public_names()))
def test_docstring(module_name, name):
  missing = _missing(module_name, name)
  assert not missing, f"{module_name}.{name}: the docstring lacks " + "; ".join(missing)


def test_paper_names_are_public():
  """The list of paper-derived names above names only public names, so none is checked for nothing."""
  for module_name, names in FROM_PAPERS.items():
    module = importlib.import_module(module_name)
    assert names <= set(module.__all__), names - set(module.__all__)


def test_the_mapping_collectives_do_not_speak_of_a_string_node_axis():
  """The node axis that gj.nodes binds is a private axis object, not an axis named "nodes"."""
  from gossipjax.mixing import _collectives, _node_mixer, _stacked_adapter  # noqa: PLC0415

  docs = {"_collectives": _collectives.__doc__, "_node_mixer": _node_mixer.__doc__,
          "NodeMixer": _node_mixer.NodeMixer.__doc__, "_stacked_adapter": _stacked_adapter.__doc__,
          "stacked_transform": _stacked_adapter.stacked_transform.__doc__, "make_mixer": gj.mixing.make_mixer.__doc__}
  for name, doc in docs.items():
    text = " ".join((doc or "").split())
    assert not re.search(r'(?:axis|over) ``"nodes"``|named node axis', text), name
