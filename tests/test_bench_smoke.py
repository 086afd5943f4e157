"""Every bench script runs: each one's `--smoke` mode (tiny shapes; bench/smoke.py) as a user
runs it, in its own process, and writes its JSON. A library change that breaks a script fails
here. bench/speculative.py and bench/distill_throughput.py run through bench/device_smoke.sh.
The scripts that need a finished run (timing_budget.py, teacher_cache_study.py) start from
the suite's shared stages (conftest.py's `shared_stages`) instead of training their own."""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration

# Arguments beside --smoke and --out, by script: {source} the shared stages, {run_dir} a copy.
EXTRA = {
    "distill_throughput.py": ["--teacher_cache", "8"],  # its default mode: device_smoke.sh
    "teacher_cache_study.py": ["--source", "{source}"],
    "timing_budget.py": ["--gin.MODEL_DIR='{run_dir}'"],
}
THROUGH_DEVICE_SMOKE = ("speculative.py",)
# Run whole in another test's process (the same `main(["--smoke", ...])` a user runs, with its
# checks of the report), so not a second time here: script -> that test.
IN_PROCESS = {"head_draft.py": "test_head_training.py::test_head_bench_smoke_runs_and_reports"}
NEEDS_RUN = ("teacher_cache_study.py", "timing_budget.py")
NEEDS_MODULE = {"vs_transformers.py": "transformers", "vs_trl.py": "trl"}


def scripts() -> list:
  """bench/*.py with a command-line entry point (not the helpers they import), but those
  that bench/device_smoke.sh runs or another test runs in process (IN_PROCESS)."""
  def runnable(path):
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in tree.body)
  return sorted(p.name for p in (ROOT / "bench").glob("*.py")
                if runnable(p) and p.name not in THROUGH_DEVICE_SMOKE + tuple(IN_PROCESS))


def run(command: list) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHON=sys.executable)  # device_smoke.sh's interpreter
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done


def test_the_scan_finds_the_scripts():
  found = scripts()
  assert "latency.py" in found and "vs_trl.py" in found and "smoke.py" not in found
  for script, test in IN_PROCESS.items():  # each one left out here is run there
    assert (ROOT / "bench" / script).exists() and script not in found
    path, name = test.split("::")
    assert f"def {name}(" in (ROOT / "tests" / path).read_text(), test


def _check_blocked_loss_memory(result: dict) -> None:
  """Two real trainer steps compiled (no run): the blocked one needs fewer temporary bytes
  for the same arguments."""
  rows = {row["block_size"]: row for row in result["rows"]}
  assert set(rows) == {None, 16}
  assert rows[16]["temp_bytes"] < rows[None]["temp_bytes"]
  assert rows[16]["argument_bytes"] == rows[None]["argument_bytes"]
  assert result["temp_reduction"] == rows[None]["temp_bytes"] / rows[16]["temp_bytes"]


def _check_calibrated_signal(result: dict) -> None:
  """Both signals' ECE in [0, 1]; the fixed gamma and the rule on each signal timed in the
  same session; the verdict names rows that were timed."""
  entry = result["temperatures"]["0"]
  assert set(entry["ece"]) == {"top_probability", "acceptance_head"}
  assert all(0.0 <= value <= 1.0 for value in entry["ece"].values())
  kinds = {(row["draft_length"], row["signal"]) for row in entry["rows"]}
  assert kinds == {("fixed", "top_probability"), ("confidence", "top_probability"),
                   ("confidence", "acceptance_head")}
  verdict = entry["verdict"]
  assert verdict["best_head_rule"]["signal"] == "acceptance_head"
  assert verdict["head_reaches_fixed"] == (verdict["head_minus_fixed"] >= 0)


# Checks of a script's JSON beyond "it was written", by script.
CHECKS = {"blocked_loss_memory.py": _check_blocked_loss_memory,
          "calibrated_signal.py": _check_calibrated_signal}


@pytest.mark.parametrize("script", scripts())
def test_smoke(script, tmp_path, request):
  if script in NEEDS_MODULE:
    pytest.importorskip(NEEDS_MODULE[script])
  source = run_dir = None
  if script in NEEDS_RUN:
    source, _ = request.getfixturevalue("shared_stages")
    run_dir = tmp_path / "run"
    for stage in os.listdir(source):
      if os.path.isdir(os.path.join(source, stage)):  # copy2: the markers' times kept
        shutil.copytree(os.path.join(source, stage), run_dir / stage)
  out = tmp_path / "out.json"
  extra = [a.format(source=source, run_dir=run_dir) for a in EXTRA.get(script, [])]
  run([sys.executable, str(ROOT / "bench" / script), "--smoke", f"--out={out}", *extra])
  result = json.loads(out.read_text())
  assert result
  CHECKS.get(script, lambda _: None)(result)


def test_device_smoke_script(tmp_path):
  out = tmp_path / "device"
  run(["bash", str(ROOT / "bench" / "device_smoke.sh"), str(out), "--smoke"])
  for name in ("device.json", "speculative.json", "distill_throughput.json"):
    assert json.loads((out / name).read_text())
  rows = json.loads((out / "speculative.json").read_text())["rows"]
  assert [row["gamma"] for row in rows] == [2]  # the smoke grid, not --quick's
