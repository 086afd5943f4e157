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
NEEDS_RUN = ("teacher_cache_study.py", "timing_budget.py")
NEEDS_MODULE = {"vs_transformers.py": "transformers", "vs_trl.py": "trl"}


def scripts() -> list:
  """bench/*.py with a command-line entry point (not the helpers they import), but those
  that bench/device_smoke.sh runs."""
  def runnable(path):
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in tree.body)
  return sorted(p.name for p in (ROOT / "bench").glob("*.py")
                if runnable(p) and p.name not in THROUGH_DEVICE_SMOKE)


def run(command: list) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHON=sys.executable)  # device_smoke.sh's interpreter
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done


def test_the_scan_finds_the_scripts():
  found = scripts()
  assert "latency.py" in found and "vs_trl.py" in found and "smoke.py" not in found


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
  assert json.loads(out.read_text())


def test_device_smoke_script(tmp_path):
  out = tmp_path / "device"
  run(["bash", str(ROOT / "bench" / "device_smoke.sh"), str(out), "--smoke"])
  for name in ("device.json", "speculative.json", "distill_throughput.json"):
    assert json.loads((out / name).read_text())
  rows = json.loads((out / "speculative.json").read_text())["rows"]
  assert [row["gamma"] for row in rows] == [2]  # the smoke grid, not --quick's
