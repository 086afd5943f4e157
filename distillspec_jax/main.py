"""The main job binary, T5X style:

  python -m distillspec_jax.main --gin_file=gin/runs/demo.gin [--gin.MODEL_DIR=runs/demo]
      [--gin.TRAIN_STEPS=...] [--gin.main_job.stages="('evaluate',)"]

The run file binds a `PipelineConfig` (pipeline_config.py) through the T5X macros MODEL_DIR,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, TRAIN_STEPS, BATCH_SIZE; `main_job.stages` picks
what to make (their inputs are made first when missing). Every bad run file, binding or
MODEL_DIR fails here, before any training starts.

Multi-host: the flags --coordinator_address, --process_count, --process_index (multihost.py;
none on a TPU VM slice). Training stages run on every process; vocab, evaluate and report on
process 0, the only writer of markers and reports; the others wait at a barrier.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

import gin

from distillspec_jax import gin_utils
from distillspec_jax.training import multihost
from distillspec_jax.studies.garden import GardenConfig
from distillspec_jax.studies.pipeline import PipelineConfig, check_run_dir, run_pipeline
from distillspec_jax.studies.recipe_grid import RecipeGridConfig


@gin.configurable
def main_job(pipeline: PipelineConfig = gin.REQUIRED, stages: Optional[tuple] = None) -> dict:
  """Runs the configured pipeline's `stages` (None = all); a study's config (recipe_grid.py,
  garden.py) brings its own stage functions."""
  stage_fns = pipeline.stage_functions() if hasattr(pipeline, "stage_functions") else None
  return run_pipeline(pipeline, stage_fns=stage_fns, stages=tuple(stages) if stages else None)


_REGISTERED = []


def load_pipeline(argv: Sequence[str]) -> PipelineConfig:
  """Parses the gin flags and builds the run file's PipelineConfig (nothing runs)."""
  if not _REGISTERED:
    gin.external_configurable(PipelineConfig, name="PipelineConfig")
    gin.external_configurable(RecipeGridConfig, name="RecipeGridConfig")
    gin.external_configurable(GardenConfig, name="GardenConfig")
    _REGISTERED.append(True)
  gin_utils.parse_binary_flags(argv)
  try:
    pipeline = gin.query_parameter("main_job.pipeline").scoped_configurable_fn()
  except ValueError as error:
    raise gin_utils.GinConfigError(
        "The run file does not bind main_job.pipeline; use a gin/runs/ file made for "
        "distillspec_jax.main, e.g. gin/runs/demo.gin.") from error
  if not pipeline.run_dir:
    raise gin_utils.GinConfigError("MODEL_DIR is not set; pass --gin.MODEL_DIR=<directory> "
                                   "(a gs:// path on a TPU slice).")
  return pipeline


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  argv = multihost.initialize_from_flags(argv)  # first: before any JAX backend starts
  pipeline = load_pipeline(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  if multihost.is_primary():
    check_run_dir(pipeline.run_dir)
  outcome = main_job(pipeline=pipeline)
  print("stages:", ", ".join(f"{k}={v}" for k, v in outcome.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
