"""The main job on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL), in one process and
across two: the shortened pipeline (testing.PIPELINE: two steps per stage, four test prompts)
on (4, 2) over 8 simulated CPU devices gives the one-device (1, 1) losses (rtol 1e-5) and the
same tau and draft acceptance rate (the teacher cache's top-k log-probs within 1e-5, so the
SupervisedKD it feeds trains alike); its report has one set of rows. Then the same job on
(4, 2) over two processes x 4 CPU devices (jax.distributed on localhost, the binaries'
flags), from the (4, 2) run's vocab, target and raw draft: its teacher cache, SupervisedKD
from that cache, evaluation and report give the 8-device (4, 2) process's cache, loss, tau,
draft acceptance rate and per-token losses; one report, written by process 0, and the
timing in a process of its own (a job of several processes never times in its own).

What the mesh changes is trained on it: the raw draft's fine-tuning (the cross-entropy
stage), the teacher cache and SupervisedKD from it, the evaluation. The target is the
session's trained one on every arm (conftest.py's `shared_stages`): fine-tuning it on the
mesh would run the raw draft's stage again with the other model of the pair. The one recipe
is SupervisedKD from the cache; GKD's on-policy distillation step on meshes is compared with
one device in tests/mesh_worker.py (and over two processes in tests/test_multihost.py). The
grid has one temperature, T = 1 (sampled, so the rows depend on every process drawing the
same keys); greedy speculative decoding is compared at every point of the tau curves (their
evaluation is at T = 0), and the eval binary compares both temperatures on (4, 2) over two
processes (tests/test_eval_multihost.py).

Pure data parallelism, (8, 1), is covered by the eval binary's mesh test and the checkpoint
restores of mesh_worker.py; the whole job runs on the mesh that has both axes. The 8-device
arm runs in a child process (XLA_FLAGS must be set before JAX starts), the one-device arm
here, on copies of the session's trained stages (the same settings on one device). Both
multi-device arms are tests/pipeline_multihost_worker.py: alone on 8 devices, then as two
processes."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import testing
from test_multihost import _env, _finish, _flags, _free_port

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTIHOST_WORKER = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
# gamma 2 at T = 1, the least timing the job allows (timing is not what is compared);
# SupervisedKD from the teacher cache, as in the demo, so the cache stage runs on each mesh.
SETTINGS = dict(grid=dict(gammas=(2,), temperatures=(1.0,)),
                speed=dict(repeats=1, calls=1), recipes=("supervised_kd",), teacher_cache_k=8,
                teacher_cache_recipes=("supervised_kd",))
# Copied from the session's trained stages into each run; the others run on its mesh.
COPIED = ("vocab", "target")


def _copy(source_dir: str, run_dir, stages) -> None:
  """Finished stages as they are (file times kept: the job reuses them)."""
  for stage in stages:
    shutil.copytree(os.path.join(source_dir, stage), os.path.join(run_dir, stage))


def _run_mesh(shared_dir: str, tmp_path) -> dict:
  """The job on (4, 2) in one process of 8 CPU devices; its RESULT."""
  run_dir = tmp_path / "4x2"
  _copy(shared_dir, run_dir, COPIED)
  done = subprocess.run([sys.executable, MULTIHOST_WORKER, str(run_dir), json.dumps(SETTINGS)],
                        cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  return json.loads(done.stdout.split("RESULT ", 1)[1])


def _close_rows(got: list, want: list, where: str) -> None:
  """Evaluation rows in the same order (draft, gamma, temperature), tau and draft acceptance rate to 1e-6."""
  for a, b in zip(got, want, strict=True):
    assert [a[k] for k in ("draft", "gamma", "temperature")] == [
        b[k] for k in ("draft", "gamma", "temperature")]
    assert (a["tau"], a["draft_acceptance_rate"]) == pytest.approx((b["tau"], b["draft_acceptance_rate"]), rel=1e-6), (where, a)


def _close(got: dict, want: dict, where: str) -> None:
  """The 8-device (4, 2) run against the one-device run (the same target: COPIED)."""
  assert got["processes"] == 1
  assert got["ran"] == ["distill_supervised_kd", "draft_raw", "evaluate", "report",
                        "teacher_cache"], where
  for stage in ("draft_raw", "distill_supervised_kd"):
    assert got[stage]["final_loss"] == pytest.approx(want[stage]["final_loss"], rel=1e-5), (
        where, stage)
  stage = "distill_supervised_kd"
  assert len(got[stage]["tau_curve"]) == len(want[stage]["tau_curve"]) == 3  # steps 0, 1, 2
  for a, b in zip(got[stage]["tau_curve"], want[stage]["tau_curve"]):
    assert (a["tau"], a["draft_acceptance_rate"]) == pytest.approx((b["tau"], b["draft_acceptance_rate"]), rel=1e-6), (
        where, stage)
  assert len(got["speculative"]) == len(want["speculative"]) == 2  # raw and distilled, T = 1
  _close_rows(got["speculative"], want["speculative"], where)
  assert "cache_log_probs" in got and "cache_log_probs" in want
  np.testing.assert_allclose(got["cache_log_probs"], want["cache_log_probs"], rtol=1e-5,
                             atol=1e-5, err_msg=where)
  assert set(got["quality"]) == set(want["quality"]) == {"target", "draft_raw", stage}
  for name, loss in want["quality"].items():
    assert got["quality"][name] == pytest.approx(loss, rel=1e-5), (where, name)
  # One set of report rows (recipes x temperatures x gammas), however many devices.
  assert got["report_rows"] == want["report_rows"] == 1 * 1 * 1


def _run_two_processes(mesh_run_dir: str, tmp_path) -> list:
  """The job on (4, 2) over two processes from the 8-device (4, 2) run's first stages; each
  process's RESULT."""
  run_dir = tmp_path / "2_processes"
  _copy(mesh_run_dir, run_dir, testing.SHARED_STAGES)  # vocab, target, draft_raw
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, MULTIHOST_WORKER, str(run_dir),
                             json.dumps(SETTINGS)] + _flags(port, index), env=_env(4),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
           for index in (0, 1)]
  outs = _finish(procs, timeout=600)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return [json.loads(out.split("RESULT ", 1)[1]) for out in outs]


def _close_across_processes(got: dict, want: dict, process: int) -> None:
  """Process `process`'s view of the two-process run against the 8-device (4, 2) run."""
  where = f"process {process}"
  assert got["process"] == process and got["processes"] == 2
  assert got["ran"] == ["distill_supervised_kd", "evaluate", "report", "teacher_cache"], where
  # The evaluate stage read and tokenized only this process's rows of the four test prompts
  # (one row per data shard, two shards per process); nothing read them all.
  prompts = testing.PIPELINE["eval_examples"]
  assert prompts == 4
  eval_reads = [r for r in got["reads"] if r[0] == prompts]
  assert eval_reads == [[prompts, [2 * process, 2 * process + 1]]], where
  np.testing.assert_allclose(got["cache_log_probs"], want["cache_log_probs"], rtol=1e-5,
                             atol=1e-5, err_msg=where)
  stage = "distill_supervised_kd"
  assert got[stage]["final_loss"] == pytest.approx(want[stage]["final_loss"], rel=1e-5), where
  for a, b in zip(got[stage]["tau_curve"], want[stage]["tau_curve"], strict=True):
    assert (a["tau"], a["draft_acceptance_rate"]) == pytest.approx((b["tau"], b["draft_acceptance_rate"]), rel=1e-6), where
  assert len(got["speculative"]) == 2
  _close_rows(got["speculative"], want["speculative"], where)
  assert set(got["quality"]) == {"target", "draft_raw", stage}
  for name, loss in got["quality"].items():
    assert loss == pytest.approx(want["quality"][name], rel=1e-5), (where, name)
  assert got["report_rows"] == 1 * 1 * 1  # one recipe x one temperature x one gamma
  assert 0 < got["target_model_sharded"] < got["target_leaves"]


@pytest.mark.pipeline
def test_demo_pipeline_on_meshes_and_two_processes_equals_one_device(tmp_path, shared_stages):
  shared_dir, _ = shared_stages
  assert jax.device_count() == 1
  one = testing.pipeline_config(tmp_path / "1x1", mesh=(1, 1), **SETTINGS)
  testing.copy_stages(shared_dir, one)
  from distillspec_jax.studies.pipeline import run_pipeline
  run_pipeline(one)
  single = testing.pipeline_outcome(one)
  mesh = _run_mesh(shared_dir, tmp_path)
  # On (4, 2) the kernels, embeddings and logits layer are split over 'model' (not the norms
  # and relative position biases); on one device nothing is.
  assert single["target_model_sharded"] == 0
  assert 0 < mesh["target_model_sharded"] < mesh["target_leaves"]
  _close(mesh, single, "4x2")
  processes = _run_two_processes(str(tmp_path / "4x2"), tmp_path)
  for index, result in enumerate(processes):
    _close_across_processes(result, mesh, index)
