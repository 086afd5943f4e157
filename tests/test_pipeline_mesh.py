"""The main job on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL): the shortened
pipeline (testing.PIPELINE: two steps per stage, four test prompts) on (4, 2) over 8 simulated
CPU devices gives the losses of (1, 1) on one device (rtol 1e-5) and the same tau and alpha;
its report has one set of rows. Each mesh runs in its own process (XLA_FLAGS must be set
before JAX starts)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys
sys.path.insert(0, "tests")
import compilation, testing
compilation.set_fast_compilation(True)
import jax
from distillspec_jax.core.files import read_json
from distillspec_jax.studies.pipeline import run_pipeline
data, model, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
config = testing.pipeline_config(run_dir, gammas=(2,), temperatures=(0.0, 1.0),
                                 data_parallel=data, model_parallel=model)
run_pipeline(config)
out = {"devices": jax.device_count()}
for stage in ("target", "draft_raw") + config.distill_stages:
  marker = read_json(os.path.join(config.stage_dir(stage), "DONE.json"))
  out[stage] = {"final_loss": marker["final_loss"], "tau_curve": marker.get("tau_curve")}
evaluation = read_json(os.path.join(config.stage_dir("evaluate"), "eval.json"))
out["speculative"] = [{k: r[k] for k in ("draft", "gamma", "temperature", "tau", "alpha")}
                      for r in evaluation["speculative"]]
out["quality"] = {k: v["per_token_loss"] for k, v in evaluation["quality"].items()}
out["report_rows"] = len(read_json(os.path.join(run_dir, "report.json"))["rows"])
# What the evaluate and distill stages load: the target restored into model-axis shards.
from distillspec_jax.studies import pipeline
target = pipeline._eval_models_and_params(config)[2]["target"]
out["target_model_sharded"] = sum("model" in str(x.sharding.spec)
                                  for x in jax.tree.leaves(target))
out["target_leaves"] = len(jax.tree.leaves(target))
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(shape, run_dir):
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={shape[0] * shape[1]}")
  done = subprocess.run([sys.executable, "-c", WORKER, str(shape[0]), str(shape[1]),
                         str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.mark.pipeline
def test_demo_pipeline_on_a_4_by_2_mesh_equals_one_device(tmp_path):
  one = _run((1, 1), tmp_path / "one")
  mesh = _run((4, 2), tmp_path / "mesh")
  assert (one["devices"], mesh["devices"]) == (1, 8)
  # On (4, 2) the kernels, embeddings and logits layer are split over 'model' (not the norms
  # and relative position biases); on one device nothing is.
  assert one["target_model_sharded"] == 0
  assert 0 < mesh["target_model_sharded"] < mesh["target_leaves"]
  for stage in ("target", "draft_raw", "distill_gkd", "distill_supervised_kd"):
    assert mesh[stage]["final_loss"] == pytest.approx(one[stage]["final_loss"], rel=1e-5), stage
  for stage in ("distill_gkd", "distill_supervised_kd"):
    for got, want in zip(mesh[stage]["tau_curve"], one[stage]["tau_curve"]):
      assert (got["tau"], got["alpha"]) == pytest.approx((want["tau"], want["alpha"]),
                                                         rel=1e-6), stage
  assert len(mesh["speculative"]) == len(one["speculative"]) == 2 * 3
  for got, want in zip(mesh["speculative"], one["speculative"]):
    assert [got[k] for k in ("draft", "gamma", "temperature")] == [
        want[k] for k in ("draft", "gamma", "temperature")]
    assert (got["tau"], got["alpha"]) == pytest.approx((want["tau"], want["alpha"]),
                                                       rel=1e-6), (got, want)
  for name, loss in one["quality"].items():
    assert mesh["quality"][name] == pytest.approx(loss, rel=1e-5), name
  # One set of report rows (recipes x temperatures x gammas), however many devices.
  assert mesh["report_rows"] == one["report_rows"] == 2 * 2 * 1
