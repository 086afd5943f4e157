"""The package's architecture as a checked rule: layers import only lower layers, no loops.

Every import of the package's own modules is scanned from the source (module level and inside
functions alike), so a loop hidden in a function body fails here too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distillspec_jax"

# Lowest first. The binaries (main, train, eval, convert) and gin_utils form the top layer.
LAYERS = ("core", "models", "decoding", "data", "distill", "training", "interop", "evaluation",
          "studies")
TOP = len(LAYERS)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
  return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(name: str) -> int:
  parts = name.split(".")
  return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def imported(name: str, path: pathlib.Path, known: dict) -> set:
  """Our modules that `name` imports anywhere in its source (package parents excluded)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name in known}
    elif isinstance(node, ast.ImportFrom) and node.module:
      assert node.level == 0, f"{name}: relative import of {node.module}"
      for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        if submodule in known:
          found.add(submodule)
        elif node.module in known:  # a name defined in the module (or a package's __init__)
          found.add(node.module)
  found.discard(name)
  return found


def graph() -> dict:
  known = modules()
  return {name: imported(name, path, known) for name, path in known.items()}


def test_every_module_belongs_to_a_layer():
  for name in modules():
    parts = name.split(".")
    if len(parts) > 2:
      assert parts[1] in LAYERS, f"{name} is in a subpackage that is not a layer: {LAYERS}"


def test_no_module_imports_a_higher_layer():
  upward = [(a, b) for a, deps in graph().items() for b in deps if layer(b) > layer(a)]
  assert not upward, f"upward imports (module -> imported): {upward}"


def test_no_import_loop():
  edges = graph()
  state = {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(edges[node]):
      if state.get(nxt) == "open":
        loop = stack[stack.index(nxt):] + [nxt]
        pytest.fail(f"import loop: {' -> '.join(loop)}")
      if nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for name in sorted(edges):
    if name not in state:
      visit(name, [name])


def test_tasks_live_inside_the_package():
  assert (PACKAGE / "data" / "tasks" / "__init__.py").exists()
  assert not (PACKAGE.parent / "tasks").exists()


def test_scan_sees_imports_inside_functions(tmp_path):
  # The scan must be able to fail: an import inside a function counts.
  source = "def f():\n  from distillspec_jax.studies import pipeline\n"
  path = tmp_path / "x.py"
  path.write_text(source)
  known = {"distillspec_jax.studies.pipeline": PACKAGE / "studies" / "pipeline.py"}
  assert imported("distillspec_jax.models.x", path, known) == {"distillspec_jax.studies.pipeline"}
