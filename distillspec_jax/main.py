"""The main job binary, T5X style:

  python -m distillspec_jax.main --gin_file=gin/runs/demo.gin [--gin.MODEL_DIR=runs/demo]
      [--gin.TRAIN_STEPS=...] [--gin.main_job.stages="('evaluate',)"]

The run file binds a `PipelineConfig` (pipeline_config.py) through the T5X macros MODEL_DIR,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, TRAIN_STEPS, BATCH_SIZE (and, where the run file
has them, TARGET_CHECKPOINT_PATH / DRAFT_CHECKPOINT_PATH: starting weights, any format);
`main_job.stages` picks what to make (their inputs are made first when missing).
`PipelineConfig.head = @HeadStageConfig()` adds a draft head per recipe (stages
distill_head_<recipe>), evaluated beside the drafts (gin/runs/demo_head.gin).
`PipelineConfig.acceptance_head = @AcceptanceHeadStage()` distils the drafts with an
acceptance head (a calibrated stop signal for `DraftLength(signal='acceptance_head')`;
gin/runs/demo_calibrated.gin). Every bad
run file, binding, value, input path or MODEL_DIR fails here, before any training starts:
exit status 1 and the message naming the fix.

--dry_run compiles every stage's program on abstract, sharded parameters for the mesh
(DATA_PARALLEL, MODEL_PARALLEL) and the slice (SLICE) in gin, prints a table per stage, and
exits 1 naming the stage, mesh and bytes of any that does not fit (studies/pipeline_dry_run.py;
simulated CPU devices without an accelerator; nothing is read or written).

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
from distillspec_jax.decoding.speculative import DraftLength
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig
from distillspec_jax.models.precision import PrecisionConfig
from distillspec_jax.training import multihost
from distillspec_jax.studies import pipeline as pipeline_lib
from distillspec_jax.studies.acceptance_head_stage import AcceptanceHeadStage
from distillspec_jax.studies.garden import GardenConfig
from distillspec_jax.studies.pair_source import PairSource
from distillspec_jax.studies.pipeline import PipelineConfig, check_run_dir, run_pipeline
from distillspec_jax.studies.pipeline_config import HeadStageConfig
from distillspec_jax.studies.recipe_grid import RecipeGridConfig
from distillspec_jax.training.partitioning import MeshConfig

# The configs a run file binds, PipelineConfig's sub-configs after it (--help lists them
# with their fields; the studies' configs add fields to PipelineConfig's).
CONFIGS = (PipelineConfig, DecodingGrid, DraftLength, SpeedConfig, MeshConfig, PrecisionConfig,
           PairSource, HeadStageConfig, AcceptanceHeadStage)
STUDY_CONFIGS = (RecipeGridConfig, GardenConfig)


def main_job(pipeline: PipelineConfig = gin.REQUIRED, stages: Optional[tuple] = None) -> dict:
  """Runs the configured pipeline's `stages` (None = all); a study's config (recipe_grid.py,
  garden.py) brings its own stage functions."""
  stage_fns = pipeline.stage_functions() if hasattr(pipeline, "stage_functions") else None
  return run_pipeline(pipeline, stage_fns=stage_fns, stages=tuple(stages) if stages else None)


def load_pipeline(argv: Sequence[str]) -> PipelineConfig:
  """Parses the gin flags and builds the run file's PipelineConfig (nothing runs)."""
  gin_utils.register(main_job, *CONFIGS, *STUDY_CONFIGS)
  gin_utils.parse_binary_flags(argv)
  try:
    reference = gin.query_parameter("main_job.pipeline")
  except ValueError as error:
    raise gin_utils.GinConfigError(
        "The run file does not bind main_job.pipeline; use a gin/runs/ file made for "
        "distillspec_jax.main, e.g. gin/runs/demo.gin.") from error
  if not isinstance(reference, gin.config.ConfigurableReference):
    raise gin_utils.GinConfigError(
        f"main_job.pipeline={reference!r} is not a configuration; bind main_job.pipeline = "
        "@PipelineConfig() (as the run files do).")
  try:
    pipeline = reference.scoped_configurable_fn()
  except (TypeError, ValueError) as error:
    raise gin_utils.GinConfigError(f"Invalid main job configuration: {error}") from error
  # main_job (its stages) and dry_run are called after this.
  gin_utils.check_bindings_read(argv, "distillspec_jax.main", later=("main_job", "dry_run"))
  return pipeline


def prepare(argv: Sequence[str]) -> PipelineConfig:
  """Everything checked before work starts: flags, run file, values, input paths, MODEL_DIR."""
  argv = multihost.initialize_from_flags(argv)  # first: before any JAX backend starts
  pipeline = load_pipeline(argv)
  pipeline.check_inputs()
  # The mesh against the devices, the batch and both models (before the vocabulary exists:
  # at model_vocab_size, else vocab_size).
  target, draft = pipeline_lib.models(
      pipeline, vocab=pipeline.model_vocab_size or pipeline.vocab_size)
  pipeline_lib.job_mesh(pipeline, target, draft)
  if pipeline.teacher_cache_k is not None:  # refused by the teacher_cache stage, after two more
    from distillspec_jax.distill import teacher_cache
    teacher_cache.check_k(pipeline.teacher_cache_k, target.config.vocab_size)
  pipeline_lib.check_task(pipeline)
  check_stages(pipeline)
  if multihost.is_primary():
    check_run_dir(pipeline.run_dir)
  return pipeline


def check_stages(pipeline: PipelineConfig) -> None:
  """Refuses a `main_job.stages` binding that names no stage of the job, or an unknown one,
  before MODEL_DIR is made (None, the default, runs every stage)."""
  try:
    stages = gin.query_parameter("main_job.stages")
  except ValueError:  # not bound: every stage
    return
  if stages is None:
    return
  if not isinstance(stages, (tuple, list)) or not stages:
    raise gin_utils.GinConfigError(
        f"main_job.stages={stages!r} is not a non-empty tuple of stages; pass some of "
        f"this job's stages {pipeline.stages}, e.g. --gin.main_job.stages=\"('evaluate',)\", "
        "or leave it unset (None) to run them all.")
  pipeline_lib.required_stages(pipeline, tuple(stages))


def run_dry_run(argv: Sequence[str]) -> int:
  """--dry_run (module doc): 0 when every stage fits the slice, 1 when one does not."""
  from distillspec_jax.studies import pipeline_dry_run
  config = load_pipeline(argv)
  return gin_utils.run_dry_run(lambda: gin_utils.DryRunPlan(
      pipeline_dry_run.stages(config), (config.mesh.data_parallel, config.mesh.model_parallel),
      tuple(pipeline_dry_run.levers(config))))


def run(pipeline: PipelineConfig) -> int:
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  outcome = gin_utils.configurable("main_job")(pipeline=pipeline)  # main_job.stages bound
  print("stages:", ", ".join(f"{k}={v}" for k, v in outcome.items()))
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  gin_utils.exit_on_help(argv, "distillspec_jax.main", __doc__, CONFIGS)
  wanted, argv = gin_utils.take_dry_run_flag(argv)
  if wanted:
    return run_dry_run(argv)
  return run(prepare(argv))


def cli(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: `main`'s exit status (a user's mistake: 1 and the message)."""
  return gin_utils.run_binary(main, argv)


if __name__ == "__main__":
  sys.exit(cli())
