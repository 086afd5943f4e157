"""`--dry_run` (training/dry_run.py through the binaries): every stage compiled on abstract,
sharded parameters for the gin mesh and slice on simulated CPU devices; a table per stage; exit
1 naming the stage, the mesh and the bytes when one does not fit; bad meshes, batches, model
axes, remat policies and dtypes refused with the value and the fix before any compile.

One subprocess (XLA_FLAGS must be set before JAX starts) runs the binaries' `main` on several
argument lists and prints one JSON line per run. It compiles quickly, as the rest of the suite
does (compilation.py): these checks read the table's rows, the fit and the refusals, not the
optimised program's bytes (test_remat_precision.py and test_memory_table.py measure those,
compiled as a user compiles)."""

import json
import os
import subprocess
import sys

import pytest

from distillspec_jax.training import dry_run

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

XXL_GIN = """
include 'gin/recipes/train_base.gin'
include 'gin/recipes/gkd.gin'
run.target = @target/model_by_name()
target/model_by_name.name = 't5_1_1_xxl'
run.model = @draft/model_by_name()
draft/model_by_name.name = 't5_1_1_small'
MIXTURE_OR_TASK_NAME = 'synthetic_reverse'
TASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 8}
BATCH_SIZE = 8
SLICE = 'v5e-4'
"""

WORKER = r"""
import contextlib, io, json, sys
import gin
from distillspec_jax import gin_utils, train
runs = json.loads(sys.argv[1])
for name, argv in runs:
  gin.clear_config()
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = train.main(argv)
    except (gin_utils.GinConfigError, ValueError) as error:
      code, message = 2, str(error)
    else:
      message = ""
  print("RUN " + json.dumps({"name": name, "code": code, "message": message,
                             "stdout": out.getvalue(), "stderr": err.getvalue()}), flush=True)
"""

TINY = ["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/nonexistent/never_written",
        "--gin.TRAIN_STEPS=1", "--dry_run"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  xxl = tmp_path_factory.mktemp("gin") / "xxl_on_v5e.gin"
  xxl.write_text(XXL_GIN)
  cases = [
      ("tiny (2, 2)", TINY + ["--gin.MODEL_PARALLEL=2"]),
      ("xxl on v5e-4", [f"--gin_file={xxl}", "--gin.MODEL_DIR=/nonexistent", "--dry_run",
                        "--gin.TRAIN_STEPS=1", "--gin.TARGET_CHECKPOINT_PATH=/nonexistent"]),
      ("mesh 3", TINY + ["--gin.MODEL_PARALLEL=3"]),
      ("model axis 4", TINY + ["--gin.MODEL_PARALLEL=4"]),
      ("batch 6", TINY + ["--gin.BATCH_SIZE=6"]),
      ("remat", TINY + ["--gin.REMAT_POLICY=everything"]),
      ("dtype", TINY + ["--gin.ACTIVATION_DTYPE=bf16"]),
      ("param dtype", TINY + ["--gin.TARGET_PARAM_DTYPE=float16"]),
      ("slice", TINY + ["--gin.SLICE=v9-8"]),
      ("blocked loss", TINY + ["--gin.LOSS_BLOCK_SIZE=3"]),
      ("block size", TINY + ["--gin.LOSS_BLOCK_SIZE=16"]),
  ]
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cases)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  results = [json.loads(line[4:]) for line in done.stdout.splitlines()
             if line.startswith("RUN ")]
  return {r["name"]: r for r in results}


def _row(stdout, stage):
  return next(line for line in stdout.splitlines() if line.startswith(f"| {stage} |"))


def test_tiny_distillation_fits_and_prints_one_row_per_stage(runs):
  run = runs["tiny (2, 2)"]
  assert run["code"] == 0, run
  assert "Dry run for v4-8 (4 x TPU v4, 32 GiB HBM" in run["stdout"]
  for stage in ("distill", "eval (tau)"):
    cells = [c.strip() for c in _row(run["stdout"], stage).split("|")]
    assert cells[3] == "(2, 2)" and cells[11] == "32" and cells[12] == "yes", cells
    assert float(cells[13].replace(",", "")) > 0  # FLOPs from the compiled cost analysis
    assert "at 40% of peak" in cells[14]
  assert "DOES NOT FIT" not in run["stderr"]


def test_the_blocked_loss_step_compiles_when_configured(runs):
  run = runs["blocked loss"]  # 8 target positions in blocks of 3 (the last one padded)
  assert run["code"] == 0, run
  assert "yes" in _row(run["stdout"], "distill")


def test_a_target_that_cannot_fit_exits_1_naming_stage_mesh_and_bytes(runs):
  run = runs["xxl on v5e-4"]
  assert run["code"] == 1, run
  # T5 1.1 XXL's 11.1e9 fp32 parameters on (4, 1): 41.48 GiB per device > 16 GiB.
  assert ("DOES NOT FIT: stage 'distill' (train step (distill)) does not fit on mesh (data, "
          "model) = (4, 1) of 4 TPU v5e: arguments alone 41.") in run["stderr"]
  assert "GiB per device > 16 GiB of HBM" in run["stderr"]
  assert "Its arguments alone fit on none of this slice's meshes" in run["stderr"]
  assert "--gin.TARGET_PARAM_DTYPE=bfloat16" in run["stderr"]
  assert "arguments only (they alone exceed HBM: not compiled)" in run["stdout"]


@pytest.mark.parametrize("name,words", [
    ("mesh 3", "model=3 must be >= 1 and divide the 4 available devices; set the "
     "model-parallel size to one of [1, 2, 4]"),
    ("model axis 4", "Stage 'distill': MODEL_PARALLEL=4 does not divide the draft's "
     "num_heads=2; the model axis splits heads, MLP and vocabulary. Use a model axis of [1, 2]"),
    ("batch 6", "Stage 'distill': batch_size=6 is not divisible by the data-parallel mesh size 4"),
    ("remat", "PrecisionConfig.remat_policy='everything' is not one of 'none', 'minimal', "
     "'full' or None"),
    ("dtype", "PrecisionConfig.activation_dtype='bf16' is not one of 'float32', 'bfloat16', "
     "'float16' or None"),
    ("param dtype", "PrecisionConfig.target_param_dtype='float16' is not one of 'float32', "
     "'bfloat16' or None"),
    ("slice", "slice='v9-8' is not a slice name; use <chip>-<count>"),
    ("block size", "LOSS_BLOCK_SIZE=16 is larger than the sequence (8 positions); pass a "
     "block size in [1, 8]"),
])
def test_bad_input_is_refused_before_any_compile(runs, name, words):
  run = runs[name]
  assert run["code"] == 2, run
  assert words in run["message"], run["message"]
  assert "dry run: " not in run["stdout"]  # no stage was compiled


def test_slices_and_flags():
  assert dry_run.parse_slice("v4-32")[2] == 16 and dry_run.parse_slice("v5e-16")[2] == 16
  assert dry_run.parse_slice("h100-8")[1].hbm_gib == 80
  flags = dry_run.simulation_xla_flags(16, "--xla_force_host_platform_device_count=8")
  assert flags.split() == ["--xla_force_host_platform_device_count=8",
                           dry_run.MEMORY_SCHEDULER_FLAG]
  assert dry_run.proxy_shape((16, 2), 32, 2) == ((2, 2), 4)
  assert dry_run.proxy_shape((2, 4), 32, 2) == ((2, 4), 32)


def test_the_main_jobs_stages_include_the_teacher_cache(tmp_path):
  """The main job's dry-run stages follow its plan; the teacher cache's program (the target's
  forward and top-k) compiles on the rules' shardings and holds the whole target on one
  device."""
  import jax
  import testing
  from distillspec_jax.models import precision
  from distillspec_jax.studies import pipeline_dry_run
  from distillspec_jax.training import partitioning
  config = testing.pipeline_config(tmp_path, recipes=("gkd", "supervised_kd"),
                                   teacher_cache_k=8, teacher_cache_recipes=("supervised_kd",),
                                   vocab_size=64)
  stages = pipeline_dry_run.stages(config)
  assert [s.name for s in stages] == ["target", "draft_raw", "teacher_cache", "distill_gkd",
                                      "evaluate"]
  cache = stages[2]
  program = cache.build(partitioning.make_mesh(1, 1, devices=jax.devices()[:1]), 8)
  compiled, _ = dry_run.compile_program(program)
  target_bytes = precision.param_bytes(cache.models["target"].param_shapes())
  assert dry_run.local_bytes(program.parts["frozen"]) == target_bytes
  assert compiled.memory_analysis().argument_size_in_bytes >= target_bytes
  no_cache = pipeline_dry_run.stages(testing.pipeline_config(
      tmp_path, recipes=("gkd",), vocab_size=64))
  assert "teacher_cache" not in [s.name for s in no_cache]
