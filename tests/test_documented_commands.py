"""Every command the README, docs/, gin/ and launch/ name points at something that exists.

`python -m distillspec_jax.<module>` names a module with a command-line entry point;
`--gin_file=<path>` names a gin file of the repository; `bench/<script>` names a script (each
runs in tests/test_bench_smoke.py). The binaries' own `--help` and tiny runs are tested in
tests/test_help.py and the binaries' tests.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE = re.compile(r"python3? -m (distillspec_jax(?:\.[a-z_0-9]+)+)")
GIN_FILE = re.compile(r"--gin_file=((?:gin|\.\./gin)/[A-Za-z0-9_./-]+\.gin)")
BENCH = re.compile(r"\bbench/([a-z_0-9]+\.(?:py|sh))")


def documents() -> list:
  paths = [ROOT / "README.md", ROOT / "launch" / "README.md"]
  paths += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "gin").rglob("*.gin"))
  paths += sorted((ROOT / "launch").glob("*.sh"))
  return [p for p in paths if p.exists()]


def mentions(pattern: re.Pattern) -> dict:
  """{mentioned value: first document naming it}."""
  found = {}
  for path in documents():
    for value in pattern.findall(path.read_text()):
      found.setdefault(value, path.relative_to(ROOT))
  return found


def has_entry_point(path: pathlib.Path) -> bool:
  tree = ast.parse(path.read_text())
  return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
             for node in tree.body)


def test_documents_are_scanned():
  # The scan must be able to fail: the README names the main job and the demo run file.
  assert "distillspec_jax.main" in mentions(MODULE)
  assert "gin/runs/demo.gin" in mentions(GIN_FILE)


def test_every_documented_module_exists_and_runs_as_a_command():
  bad = []
  for module, where in mentions(MODULE).items():
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists() or not has_entry_point(path):
      bad.append(f"{where}: python -m {module}")
  assert not bad, "documented commands with no such module or no entry point:\n" + "\n".join(bad)


def test_every_documented_gin_file_exists():
  missing = [f"{where}: {path}" for path, where in mentions(GIN_FILE).items()
             if not (ROOT / path.removeprefix("../")).exists()]
  assert not missing, "documented gin files that do not exist:\n" + "\n".join(missing)


def test_every_documented_bench_script_exists():
  missing = [f"{where}: bench/{name}" for name, where in mentions(BENCH).items()
             if not (ROOT / "bench" / name).exists()]
  assert not missing, "documented bench scripts that do not exist:\n" + "\n".join(missing)
