"""The main job on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL): the shortened
pipeline (testing.PIPELINE: two steps per stage, four test prompts) on (4, 2) and on (8, 1)
over 8 simulated CPU devices gives the losses of (1, 1) on one device (rtol 1e-5) and the same
tau and alpha (the teacher cache's top-k log-probs within 1e-5, so the SupervisedKD it feeds
trains alike); its report has one set of rows.

The two 8-device arms run in one child process (XLA_FLAGS must be set before JAX starts); the
one-device arm runs here on copies of the session's trained vocab, target and raw draft
(conftest.py's `shared_stages`, the same settings on one device), so their losses are the
(1, 1) losses of those stages."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import testing

pytestmark = pytest.mark.usefixtures("fast_compilation")  # conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ((4, 2), (8, 1))
# gamma 2 at both temperatures, the least timing the job allows (timing is not what is
# compared); SupervisedKD from the teacher cache, as in the demo, so the cache stage runs on
# each mesh too.
SETTINGS = dict(gammas=(2,), temperatures=(0.0, 1.0), speed_repeats=1, speed_calls=1,
                teacher_cache_k=8, teacher_cache_recipes=["supervised_kd"])

WORKER = r"""
import json, os, sys
sys.path.insert(0, "tests")
import compilation, testing
compilation.set_fast_compilation(True)
import jax
from distillspec_jax.studies.pipeline import run_pipeline
vocab_from, settings = sys.argv[1], json.loads(sys.argv[2])
out = {"devices": jax.device_count()}
for data, model, run_dir in json.loads(sys.argv[3]):
  for name in ("temperatures", "gammas", "teacher_cache_recipes"):
    settings[name] = tuple(settings[name])
  config = testing.pipeline_config(run_dir, data_parallel=data, model_parallel=model, **settings)
  testing.copy_stages(vocab_from, config, stages=("vocab",))  # the task's; no mesh in it
  run_pipeline(config)
  out[f"{data}x{model}"] = testing.pipeline_outcome(config)
print("RESULT " + json.dumps(out), flush=True)
"""


def _run_meshes(vocab_from: str, tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  arms = [(d, m, str(tmp_path / f"{d}x{m}")) for d, m in SHAPES]
  done = subprocess.run([sys.executable, "-c", WORKER, vocab_from, json.dumps(SETTINGS),
                         json.dumps(arms)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  return json.loads(done.stdout.split("RESULT ", 1)[1])


def _close(got: dict, want: dict, where: str) -> None:
  for stage in ("target", "draft_raw", "distill_gkd", "distill_supervised_kd"):
    assert got[stage]["final_loss"] == pytest.approx(want[stage]["final_loss"], rel=1e-5), (
        where, stage)
  for stage in ("distill_gkd", "distill_supervised_kd"):
    for a, b in zip(got[stage]["tau_curve"], want[stage]["tau_curve"]):
      assert (a["tau"], a["alpha"]) == pytest.approx((b["tau"], b["alpha"]), rel=1e-6), (
          where, stage)
  assert len(got["speculative"]) == len(want["speculative"]) == 2 * 3
  for a, b in zip(got["speculative"], want["speculative"]):
    assert [a[k] for k in ("draft", "gamma", "temperature")] == [
        b[k] for k in ("draft", "gamma", "temperature")]
    assert (a["tau"], a["alpha"]) == pytest.approx((b["tau"], b["alpha"]), rel=1e-6), (where, a)
  assert "cache_log_probs" in got and "cache_log_probs" in want
  np.testing.assert_allclose(got["cache_log_probs"], want["cache_log_probs"], rtol=1e-5,
                             atol=1e-5, err_msg=where)
  for name, loss in want["quality"].items():
    assert got["quality"][name] == pytest.approx(loss, rel=1e-5), (where, name)
  # One set of report rows (recipes x temperatures x gammas), however many devices.
  assert got["report_rows"] == want["report_rows"] == 2 * 2 * 1


@pytest.mark.pipeline
def test_demo_pipeline_on_4_by_2_and_8_by_1_meshes_equals_one_device(tmp_path, shared_stages):
  shared_dir, _ = shared_stages
  assert jax.device_count() == 1
  one = testing.pipeline_config(tmp_path / "1x1", data_parallel=1, model_parallel=1,
                                **dict(SETTINGS, teacher_cache_recipes=("supervised_kd",)))
  testing.copy_stages(shared_dir, one)
  from distillspec_jax.studies.pipeline import run_pipeline
  run_pipeline(one)
  single = testing.pipeline_outcome(one)
  meshes = _run_meshes(shared_dir, tmp_path)
  assert meshes["devices"] == 8
  # On (4, 2) the kernels, embeddings and logits layer are split over 'model' (not the norms
  # and relative position biases); on (8, 1) and on one device nothing is.
  assert single["target_model_sharded"] == meshes["8x1"]["target_model_sharded"] == 0
  assert 0 < meshes["4x2"]["target_model_sharded"] < meshes["4x2"]["target_leaves"]
  for shape in ("4x2", "8x1"):
    _close(meshes[shape], single, shape)
