"""The eval binary on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL): on 8 simulated
CPU devices, a tiny target restored straight into its 'model' shards (a preset names its
shapes) gives the rows of the same evaluation on (8, 1), and each device holds less than the
whole target. In a subprocess: XLA_FLAGS must be set before JAX starts."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys
sys.path.insert(0, "tests")
import compilation
compilation.set_fast_compilation(True)
import jax
from distillspec_jax import eval as eval_lib
from distillspec_jax.data.tasks import embedded
from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints
root = sys.argv[1]
vocabulary = embedded.build_embedded_vocabulary(os.path.join(root, "vocab"))
paths = {}
for name, seed in (("target", 0), ("draft", 1)):
  paths[name] = os.path.join(root, name)
  checkpoints.save_params(paths[name], Model.from_name("tiny_encoder_decoder").init(
      jax.random.PRNGKey(seed)))
out = {}
for data, model in ((8, 1), (4, 2)):
  config = eval_lib.EvalConfig(
      model_dir=os.path.join(root, f"run_{data}x{model}"),
      mixture_or_task_name="embedded_arithmetic", task_feature_lengths={"inputs": 48,
      "targets": 6}, batch_size=4, eval_examples=4, target_checkpoint_path=paths["target"],
      draft_checkpoint_path=paths["draft"], target_model="tiny_encoder_decoder",
      draft_model="tiny_encoder_decoder", vocabulary=vocabulary, gammas=(2,),
      temperatures=(0.0, 1.0), speed_examples=0, progress_bar=False, data_parallel=data,
      model_parallel=model)
  target, target_params, _, _ = eval_lib._load_pair(config)
  first = jax.devices()[0]
  held = sum(s.data.nbytes for x in jax.tree.leaves(target_params)
             for s in x.addressable_shards if s.device == first)
  whole = sum(x.nbytes for x in jax.tree.leaves(target_params))
  metrics = eval_lib.evaluate(config)
  out[f"{data}x{model}"] = dict(held=held, whole=whole, rows=[
      {k: r[k] for k in ("temperature", "gamma", "tau", "alpha", "quality")}
      for r in metrics["rows"]], alone=metrics["target_alone"])
print("RESULT " + json.dumps(out), flush=True)
"""


def test_eval_binary_on_a_model_sharded_mesh_gives_the_rows_of_data_parallel(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  done = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  out = json.loads(done.stdout.split("RESULT ", 1)[1])
  replicated, sharded = out["8x1"], out["4x2"]
  # (8, 1): every device holds the whole target; (4, 2): a share of it (vocabulary, MLP and
  # heads split in two; norms and relative position biases whole).
  assert replicated["held"] == replicated["whole"]
  assert sharded["held"] < 0.6 * sharded["whole"]
  assert len(sharded["rows"]) == len(replicated["rows"]) == 2
  for got, want in zip(sharded["rows"], replicated["rows"]):
    assert got["tau"] == want["tau"] and got["alpha"] == want["alpha"], (got, want)
    assert got["quality"] == want["quality"]
  assert sharded["alone"] == replicated["alone"]
