"""The eval binary across two processes (jax.distributed on localhost, 4 CPU devices each, a
(4, 2) mesh spanning both) against one process of 8 devices on the same mesh shape: the same
metrics.json rows and target-alone quality at T = 0 and T = 1 (fixed seed), one metrics.json
written (by process 0), each process handing the decoders only its rows of every evaluation
batch, and the whole run bounded in time.

The processes are tests/eval_multihost_worker.py: the binary's `main` with its own flags.
The second test does the same for the shortened main job's distillation, evaluate and report
stages (tests/pipeline_multihost_worker.py: run_pipeline after the binaries' flag parsing).
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints
from test_multihost import _env, _finish, _flags, _free_port

pytestmark = pytest.mark.usefixtures("fast_compilation")  # conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "eval_multihost_worker.py")
PRESET = "tiny_encoder_decoder"
EXAMPLES, BATCH = 6, 4  # two batches, the second padded: 2 real rows and 2 copies


def _eval_flags(root, model_dir) -> list:
  return ["--gin_file=gin/runs/eval_demo.gin", f"--gin.MODEL_DIR='{model_dir}'",
          f"--gin.TARGET_CHECKPOINT_PATH='{root / 'target'}'",
          f"--gin.DRAFT_CHECKPOINT_PATH='{root / 'draft'}'",
          f"--gin.VOCABULARY='{root / 'vocab' / 'embedded_arithmetic_v2_bpe256.model'}'",
          f"--gin.EvalConfig.target_model='{PRESET}'", f"--gin.EvalConfig.draft_model='{PRESET}'",
          f"--gin.EVAL_EXAMPLES={EXAMPLES}", f"--gin.BATCH_SIZE={BATCH}", "--gin.GAMMAS=(2,)",
          "--gin.TEMPERATURES=(0.0, 1.0)", "--gin.SPEED_EXAMPLES=0",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 48, 'targets': 6}",
          "--gin.DATA_PARALLEL=4", "--gin.MODEL_PARALLEL=2",
          "--gin.EvalConfig.progress_bar=False"]


def test_eval_binary_on_two_processes_gives_one_process_rows(tmp_path):
  from distillspec_jax.data.tasks import embedded
  vocabulary = embedded.build_embedded_vocabulary(str(tmp_path / "vocab"))
  assert vocabulary.endswith("embedded_arithmetic_v2_bpe256.model"), vocabulary
  for name, seed in (("target", 0), ("draft", 1)):  # preset shapes: restored into shards
    checkpoints.save_params(str(tmp_path / name),
                            Model.from_name(PRESET).init(jax.random.PRNGKey(seed)))
  port = _free_port()
  single, multi = tmp_path / "single", tmp_path / "multi"
  # The reference and the pair at the same time (the machine's cores are shared anyway).
  procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path / "rows_single.json")]
                            + _eval_flags(tmp_path, single), env=_env(8), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
  for index in (0, 1):
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path / f"rows_{index}.json")]
        + _eval_flags(tmp_path, multi) + _flags(port, index), env=_env(4), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = _finish(procs, timeout=600)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  assert "WORKER_OK process 0 of 1" in outs[0]
  assert "WORKER_OK process 0 of 2" in outs[1] and "WORKER_OK process 1 of 2" in outs[2]
  reference = json.loads((single / "metrics.json").read_text())
  got = json.loads((multi / "metrics.json").read_text())
  assert len(reference["rows"]) == 2  # T = 0 and T = 1 at gamma 2
  assert got == reference  # every row's tau, alpha, quality, predicted_alpha; target alone
  # One writer: process 0's outputs only (one metrics.json, one inferences file per task).
  assert sorted(os.listdir(multi / "inferences")) == ["embedded_arithmetic.jsonl"]
  assert (multi / "inferences" / "embedded_arithmetic.jsonl").read_text() == (
      single / "inferences" / "embedded_arithmetic.jsonl").read_text()
  # Rows handed to the decoders: the reference every row of each batch; process 0 rows 0-1
  # and process 1 rows 2-3 (the (4, 2) mesh's data axis spans both, 2 rows per process).
  calls = json.loads((tmp_path / "rows_single.json").read_text())
  assert calls and all(c == [0, BATCH, BATCH] for c in calls)
  for index, rows in enumerate(([0, 2, BATCH], [2, 4, BATCH])):
    mine = json.loads((tmp_path / f"rows_{index}.json").read_text())
    assert len(mine) == len(calls) and all(c == rows for c in mine), mine


# The shortened main job's settings for the two-process run: one recipe, distilled live (no
# teacher cache), gamma 2 at both temperatures, the least timing.
PIPELINE_SETTINGS = dict(recipes=["supervised_kd"], gammas=[2], temperatures=[0.0, 1.0],
                         speed_repeats=1, speed_calls=1)


@pytest.mark.pipeline
def test_main_job_on_two_processes_gives_one_process_results(tmp_path, shared_stages):
  """The shortened main job from the session's vocab, target and raw draft: its distillation
  and evaluation stages on a (4, 2) mesh spanning two processes give one 8-device process's
  losses (rtol 1e-5), tau and alpha (rtol 1e-6) and per-token losses; one report."""
  import shutil
  shared_dir, _ = shared_stages
  single, multi = tmp_path / "single", tmp_path / "multi"
  for run_dir in (single, multi):
    for stage in ("vocab", "target", "draft_raw"):  # file times kept: reused as done
      shutil.copytree(os.path.join(shared_dir, stage), run_dir / stage)
  worker = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
  settings = json.dumps(PIPELINE_SETTINGS)
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, worker, str(single), settings], env=_env(8),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)]
  for index in (0, 1):
    procs.append(subprocess.Popen([sys.executable, worker, str(multi), settings]
                                  + _flags(port, index), env=_env(4), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = _finish(procs, timeout=600)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  want, *got = [json.loads(out.split("RESULT ", 1)[1]) for out in outs]
  assert (want["processes"], [g["process"] for g in got]) == (1, [0, 1])
  assert want["ran"] == got[0]["ran"] == got[1]["ran"] == [
      "distill_supervised_kd", "evaluate", "report"]
  for result in got:
    for stage in ("target", "draft_raw", "distill_supervised_kd"):
      assert result[stage]["final_loss"] == pytest.approx(want[stage]["final_loss"],
                                                          rel=1e-5), stage
    assert len(result["speculative"]) == len(want["speculative"]) == 2 * 2
    for a, b in zip(result["speculative"], want["speculative"]):
      assert [a[k] for k in ("draft", "gamma", "temperature")] == [
          b[k] for k in ("draft", "gamma", "temperature")]
      assert (a["tau"], a["alpha"]) == pytest.approx((b["tau"], b["alpha"]), rel=1e-6), a
    for name, loss in want["quality"].items():
      assert result["quality"][name] == pytest.approx(loss, rel=1e-5), name
    assert result["report_rows"] == want["report_rows"] == 2  # one recipe x 2 T x 1 gamma
    assert 0 < result["target_model_sharded"] < result["target_leaves"]
