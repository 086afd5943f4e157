"""The main job on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL), in one process and
across two: the shortened pipeline (testing.PIPELINE: two steps per stage, four test prompts)
on (4, 2) over 8 simulated CPU devices gives the losses of (1, 1) on one device
(rtol 1e-5) and the same tau and draft acceptance rate (the teacher cache's top-k log-probs
within 1e-5, so the SupervisedKD it feeds trains alike); its report has one set of rows. Then the same job on
(4, 2) over two processes x 4 CPU devices (jax.distributed on localhost, the binaries'
flags), from the (4, 2) run's vocab, target and raw draft: its teacher cache, SupervisedKD
from that cache, evaluation and report give the 8-device (4, 2) process's cache, loss, tau,
draft acceptance rate and per-token losses; one report, written by process 0.

Pure data parallelism, (8, 1), is covered by the eval binary's mesh test
(test_eval_multihost.py) and the checkpoint restores of mesh_worker.py; the whole job runs on
the mesh that has both axes. The 8-device arm runs in a child process (XLA_FLAGS must be set
before JAX starts); the
one-device arm runs here on copies of the session's trained vocab, target and raw draft
(conftest.py's `shared_stages`, the same settings on one device), so their losses are the
(1, 1) losses of those stages. The two processes are tests/pipeline_multihost_worker.py."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import testing
from compilation import xla_flags
from test_multihost import _env, _finish, _flags, _free_port

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTIHOST_WORKER = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
SHAPES = ((4, 2),)
# gamma 2 at both temperatures, the least timing the job allows (timing is not what is
# compared); SupervisedKD from the teacher cache, as in the demo, so the cache stage runs on
# each mesh too.
SETTINGS = dict(grid=dict(gammas=(2,), temperatures=(0.0, 1.0)),
                speed=dict(repeats=1, calls=1), teacher_cache_k=8,
                teacher_cache_recipes=["supervised_kd"])

WORKER = r"""
import json, os, sys
sys.path.insert(0, "tests")
import compilation, testing
compilation.set_fast_compilation(True)
import jax
from distillspec_jax.studies.pipeline import run_pipeline
from collector import freeze_long_lived
freeze_long_lived()
vocab_from, settings = sys.argv[1], json.loads(sys.argv[2])
out = {"devices": jax.device_count()}
for data, model, run_dir in json.loads(sys.argv[3]):
  settings["teacher_cache_recipes"] = tuple(settings["teacher_cache_recipes"])
  config = testing.pipeline_config(run_dir, mesh=(data, model), **settings)
  testing.copy_stages(vocab_from, config, stages=("vocab",))  # the task's; no mesh in it
  run_pipeline(config)
  out[f"{data}x{model}"] = testing.pipeline_outcome(config)
print("RESULT " + json.dumps(out), flush=True)
"""


def _run_meshes(vocab_from: str, tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"))
  arms = [(d, m, str(tmp_path / f"{d}x{m}")) for d, m in SHAPES]
  done = subprocess.run([sys.executable, "-c", WORKER, vocab_from, json.dumps(SETTINGS),
                         json.dumps(arms)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  return json.loads(done.stdout.split("RESULT ", 1)[1])


def _close_rows(got: list, want: list, where: str) -> None:
  """Evaluation rows in the same order (draft, gamma, temperature), tau and draft acceptance rate to 1e-6."""
  for a, b in zip(got, want, strict=True):
    assert [a[k] for k in ("draft", "gamma", "temperature")] == [
        b[k] for k in ("draft", "gamma", "temperature")]
    assert (a["tau"], a["draft_acceptance_rate"]) == pytest.approx((b["tau"], b["draft_acceptance_rate"]), rel=1e-6), (where, a)


def _close(got: dict, want: dict, where: str) -> None:
  for stage in ("target", "draft_raw", "distill_gkd", "distill_supervised_kd"):
    assert got[stage]["final_loss"] == pytest.approx(want[stage]["final_loss"], rel=1e-5), (
        where, stage)
  for stage in ("distill_gkd", "distill_supervised_kd"):
    for a, b in zip(got[stage]["tau_curve"], want[stage]["tau_curve"]):
      assert (a["tau"], a["draft_acceptance_rate"]) == pytest.approx((b["tau"], b["draft_acceptance_rate"]), rel=1e-6), (
          where, stage)
  assert len(got["speculative"]) == len(want["speculative"]) == 2 * 3
  _close_rows(got["speculative"], want["speculative"], where)
  assert "cache_log_probs" in got and "cache_log_probs" in want
  np.testing.assert_allclose(got["cache_log_probs"], want["cache_log_probs"], rtol=1e-5,
                             atol=1e-5, err_msg=where)
  for name, loss in want["quality"].items():
    assert got["quality"][name] == pytest.approx(loss, rel=1e-5), (where, name)
  # One set of report rows (recipes x temperatures x gammas), however many devices.
  assert got["report_rows"] == want["report_rows"] == 2 * 2 * 1


def _run_two_processes(mesh_run_dir: str, tmp_path) -> list:
  """The job on (4, 2) over two processes from the 8-device (4, 2) run's first stages, with
  SupervisedKD from the teacher cache as its one recipe; each process's RESULT."""
  run_dir = tmp_path / "2_processes"
  for stage in testing.SHARED_STAGES:  # vocab, target, draft_raw: file times kept, reused
    shutil.copytree(os.path.join(mesh_run_dir, stage), run_dir / stage)
  settings = json.dumps(dict(SETTINGS, recipes=["supervised_kd"]))
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, MULTIHOST_WORKER, str(run_dir), settings]
                            + _flags(port, index), env=_env(4), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
  drafts = ("draft_raw", "distill_supervised_kd")
  rows = [r for r in want["speculative"] if r["draft"] in drafts]
  assert len(got["speculative"]) == len(rows) == 2 * 2
  _close_rows(got["speculative"], rows, where)
  assert set(got["quality"]) == {"target", *drafts}
  for name, loss in got["quality"].items():
    assert loss == pytest.approx(want["quality"][name], rel=1e-5), (where, name)
  assert got["report_rows"] == 1 * 2 * 1  # one recipe x 2 temperatures x 1 gamma
  assert 0 < got["target_model_sharded"] < got["target_leaves"]


@pytest.mark.pipeline
def test_demo_pipeline_on_meshes_and_two_processes_equals_one_device(tmp_path, shared_stages):
  shared_dir, _ = shared_stages
  assert jax.device_count() == 1
  one = testing.pipeline_config(tmp_path / "1x1", mesh=(1, 1),
                                **dict(SETTINGS, teacher_cache_recipes=("supervised_kd",)))
  testing.copy_stages(shared_dir, one)
  from distillspec_jax.studies.pipeline import run_pipeline
  run_pipeline(one)
  single = testing.pipeline_outcome(one)
  meshes = _run_meshes(shared_dir, tmp_path)
  assert meshes["devices"] == 8
  # On (4, 2) the kernels, embeddings and logits layer are split over 'model' (not the norms
  # and relative position biases); on one device nothing is.
  assert single["target_model_sharded"] == 0
  assert 0 < meshes["4x2"]["target_model_sharded"] < meshes["4x2"]["target_leaves"]
  _close(meshes["4x2"], single, "4x2")
  processes = _run_two_processes(str(tmp_path / "4x2"), tmp_path)
  for index, result in enumerate(processes):
    _close_across_processes(result, meshes["4x2"], index)
