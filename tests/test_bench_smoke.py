"""Every bench script runs: each one's `--smoke` mode (tiny shapes; bench/smoke.py) as a user
runs it, and writes its JSON. A library change that breaks a script fails here.

The scripts run in two processes (tests/bench_smoke_worker.py: each script's `main(argv)` in
turn, as `python bench/<script>` loads it; a failing script does not stop the others, and the
test names every one that failed), so that they share one interpreter start and one import
of JAX instead of starting one each; those that decode the smoke pair (DECODING) share one of
them, and with it the programs they compile. The scripts that set XLA's flags before JAX starts
(OWN_PROCESS) run alone, as `python bench/<script>`; so do bench/speculative.py and
bench/distill_throughput.py, through bench/device_smoke.sh.
The scripts that need a finished run (timing_budget.py, teacher_cache_study.py) start from
the suite's shared stages (conftest.py's `shared_stages`) instead of training their own."""

import ast
import importlib.util
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
IN_PROCESS = {"head_draft.py": "test_head_training.py::test_head_bench_smoke_runs_and_reports",
              "acceptance_calibration.py": "test_acceptance_signal.py::test_calibration_bench_smoke"}
NEEDS_RUN = ("teacher_cache_study.py", "timing_budget.py")
NEEDS_MODULE = {"vs_transformers.py": "transformers", "vs_trl.py": "trl"}
# Alone, as `python bench/<script>`: they set XLA's flags before JAX starts its backend (the
# device count, the memory scheduler), which a shared process has started already.
OWN_PROCESS = ("blocked_loss_memory.py", "memory_table.py")
# The scripts that decode and time the smoke pair (random weights or a smoke run), in one
# process: the scripts after the first reuse programs it compiled for the same models (their
# eager initialisation among them) instead of compiling them in another process too. The other
# scripts (training, other libraries' stacks) share the second process; pytest-xdist's two
# workers take one each.
DECODING = ("adaptive_gamma.py", "adaptive_price.py", "adaptive_priced.py",
            "calibrated_signal.py", "host_noise.py", "latency.py", "timing_budget.py",
            "verification_cost.py")
WORKER = ROOT / "tests" / "bench_smoke_worker.py"


def scripts() -> list:
  """bench/*.py with a command-line entry point (not the helpers they import), but those
  that bench/device_smoke.sh runs or another test runs in process (IN_PROCESS)."""
  def runnable(path):
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in tree.body)
  return sorted(p.name for p in (ROOT / "bench").glob("*.py")
                if runnable(p) and p.name not in THROUGH_DEVICE_SMOKE + tuple(IN_PROCESS))


def run(command: list, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHON=sys.executable)  # device_smoke.sh's interpreter
  done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                        env=env)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done


def test_the_scan_finds_the_scripts():
  found = scripts()
  assert "latency.py" in found and "vs_trl.py" in found and "smoke.py" not in found
  for script, test in IN_PROCESS.items():  # each one left out here is run there
    assert (ROOT / "bench" / script).exists() and script not in found
    path, name = test.split("::")
    assert f"def {name}(" in (ROOT / "tests" / path).read_text(), test
  assert set(DECODING) <= set(found)  # a renamed script is not left out of its group
  grouped = [script for group in groups() for script in group]
  assert sorted(grouped) == found  # each script in one process


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


def groups() -> list:
  """The scripts by process: OWN_PROCESS each alone, DECODING in one, the others in one."""
  shared = [script for script in scripts() if script not in OWN_PROCESS]
  decoding = tuple(s for s in shared if s in DECODING)
  return [decoding, tuple(s for s in shared if s not in decoding)] + [
      (s,) for s in OWN_PROCESS if s in scripts()]


def _argv(script: str, folder: pathlib.Path, source) -> list:
  """The script's command-line arguments; its output in `folder`, a copy of the shared
  stages in `folder`/run for the scripts that need a finished run."""
  run_dir = None
  folder.mkdir(parents=True)
  if script in NEEDS_RUN:
    run_dir = folder / "run"
    for stage in os.listdir(source):
      if os.path.isdir(os.path.join(source, stage)):  # copy2: the markers' times kept
        shutil.copytree(os.path.join(source, stage), run_dir / stage)
  extra = [a.format(source=source, run_dir=run_dir) for a in EXTRA.get(script, [])]
  return ["--smoke", f"--out={folder / 'out.json'}", *extra]


def _outcomes(stdout: str) -> dict:
  """script -> (exit code, its output and traceback) from bench_smoke_worker.py's output."""
  out = {}
  for part in stdout.split("BENCH_BEGIN ")[1:]:
    script, _, rest = part.partition("\n")
    text, _, end = rest.partition("BENCH_END ")
    result = json.loads(end.splitlines()[0]) if end else {"code": None, "traceback": None}
    out[script] = (result["code"], text[-3000:] + (result["traceback"] or ""))
  return out


@pytest.mark.parametrize("group", groups(), ids=lambda group: "+".join(
    script[:-3] for script in group))
def test_smoke(group, tmp_path, request):
  missing = [s for s in group if s in NEEDS_MODULE
             and importlib.util.find_spec(NEEDS_MODULE[s]) is None]
  group = [script for script in group if script not in missing]
  source = None
  if set(group) & set(NEEDS_RUN):
    source, _ = request.getfixturevalue("shared_stages")
  runs = [(script, _argv(script, tmp_path / script[:-3], source)) for script in group]
  if len(runs) == 1 and runs[0][0] in OWN_PROCESS:
    (script, argv), = runs
    done = run([sys.executable, str(ROOT / "bench" / script), *argv])
    outcomes = {script: (done.returncode, "")}
  else:
    done = run([sys.executable, str(WORKER), json.dumps(runs)], timeout=900)
    outcomes = _outcomes(done.stdout)
  failed = {}
  for script, _ in runs:
    code, text = outcomes.get(script, (None, done.stdout[-3000:] + done.stderr[-3000:]))
    try:
      assert code == 0, f"exit code {code}"
      result = json.loads((tmp_path / script[:-3] / "out.json").read_text())
      assert result
      CHECKS.get(script, lambda _: None)(result)
    except (AssertionError, OSError, ValueError) as error:
      failed[script] = f"{error!r}\n{text}"
  assert not failed, "\n\n".join(f"=== {script} failed: {why}" for script, why in failed.items())
  if missing:
    pytest.skip(f"ran {group}; not {missing}: they need {[NEEDS_MODULE[s] for s in missing]}")


def test_device_smoke_script(tmp_path):
  out = tmp_path / "device"
  run(["bash", str(ROOT / "bench" / "device_smoke.sh"), str(out), "--smoke"])
  for name in ("device.json", "speculative.json", "distill_throughput.json"):
    assert json.loads((out / name).read_text())
  rows = json.loads((out / "speculative.json").read_text())["rows"]
  assert [row["gamma"] for row in rows] == [2]  # the smoke grid, not --quick's
