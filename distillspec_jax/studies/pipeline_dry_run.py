"""The main job's `--dry_run`: every stage's compiled program on the job's mesh, before launch.

Stages compiled (training/dry_run.py: abstract sharded parameters, the trainer's own step):
  target, draft_raw   the fine-tuning step of each model (fp32 parameters, Adafactor/AdamW
                      state, the model's remat policy);
  teacher_cache       the target's forward pass and top-k over a training batch (when a
                      recipe reads the cache);
  distill_<recipe>    each live recipe's distillation step (the frozen target in
                      TARGET_PARAM_DTYPE; AdaSPEC adds its frozen reference draft; the draft
                      with its acceptance head where `acceptance_head` gives it one);
  evaluate            the speculative engine (target + draft + both decoding caches) at the
                      grid's largest gamma and temperature, on `eval_batch_size` prompts (all
                      `eval_examples` at once when None).
Not compiled: vocab and report (no device program), the recipes that read the cache
(their step holds the draft and a batch of cached top-k features, not the target), and the
draft-head stages distill_head_<recipe> (a head is one decoder layer; its step holds the
frozen target as a live recipe's does).
"""

from __future__ import annotations

from typing import Optional

from distillspec_jax.distill.objectives import DistillationObjective, FinetuneObjective
from distillspec_jax.studies import pipeline
from distillspec_jax.studies.pipeline_config import PipelineConfig, distillation_config
from distillspec_jax.training import dry_run


def _lengths(config: PipelineConfig) -> dict:
  lengths = dict(config.task_feature_lengths)
  lengths.setdefault("inputs", config.lm_prompt_length)
  return lengths


def _train_stage(config: PipelineConfig, stage: str, objective, steps: int,
                 learning_rate: float, models: dict,
                 frozen_dtype: Optional[str] = None) -> dry_run.Stage:
  train_config = pipeline.stage_train_config(
      config, stage, steps, learning_rate)
  spec = train_config.optimizer_spec
  lengths = _lengths(config)
  return dry_run.Stage(stage, lambda mesh, batch: dry_run.train_step_program(
      objective, spec, mesh, batch, lengths, frozen_param_dtype=frozen_dtype),
      config.batch_size, models)


def stages(config: PipelineConfig) -> list:
  """The job's dry-run stages, in run order (module doc). The models take the vocabulary's
  size as `model_vocab_size`, else `vocab_size` (the vocab stage has not run)."""
  target, draft = pipeline.models(config, vocab=config.model_vocab_size or config.vocab_size)
  both = {"target": target, "draft": draft}
  target_rate = config.target_learning_rate or config.learning_rate
  blocks = config.loss_block_size
  out = [_train_stage(config, "target", FinetuneObjective(target, blocks), config.target_steps,
                      target_rate, both),
         _train_stage(config, "draft_raw", FinetuneObjective(draft, blocks), config.draft_steps,
                      config.learning_rate, both)]
  if config.cached_recipes:
    k, temperature = config.teacher_cache_k, distillation_config(
        config, config.cached_recipes[0]).target_temperature
    out.append(dry_run.Stage("teacher_cache", lambda mesh, batch: dry_run.teacher_cache_program(
        target, mesh, batch, _lengths(config), k=k, temperature=temperature,
        target_param_dtype=config.precision.target_param_dtype), config.batch_size,
        {"target": target}))
  for recipe in config.recipes:
    if recipe in config.cached_recipes:
      continue
    reference = (pipeline.distilled_draft(config, f"distill_{config.adaspec_reference}", draft)
                 if recipe == "adaspec" else None)
    distillation = distillation_config(config, recipe)
    if recipe in config.acceptance_head_recipes:  # the draft and its acceptance head
      distillation = config.acceptance_head.distillation(distillation)
    trained = pipeline.distilled_draft(config, f"distill_{recipe}", draft)
    objective = DistillationObjective(target, trained, distillation, reference)
    out.append(_train_stage(config, f"distill_{recipe}", objective,
                            config.distill_steps_of(recipe), config.distill_learning_rate,
                            {"target": target, "draft": trained},
                            config.precision.target_param_dtype))
  lengths = _lengths(config)
  out.append(dry_run.Stage("evaluate", lambda mesh, batch: dry_run.speculative_program(
      target, draft, mesh, batch, lengths["inputs"], config.max_new_tokens,
      gamma=max(config.grid.gammas), temperature=max(config.grid.temperatures),
      target_param_dtype=config.precision.target_param_dtype),
      config.eval_batch_size or config.eval_examples, both))
  return out


def levers(config: PipelineConfig) -> list:
  """The memory settings this job does not use yet, as flags."""
  out = []
  precision = config.precision  # None: the presets' float32 and no remat
  if precision.remat_of("draft") in (None, "none"):
    out.append("--gin.REMAT_POLICY=minimal (or full)")
  if precision.target_param_dtype != "bfloat16":
    out.append("--gin.TARGET_PARAM_DTYPE=bfloat16")
  if config.eval_batch_size is None or config.eval_batch_size > 32:
    out.append("--gin.PipelineConfig.eval_batch_size=32")
  if precision.activation_dtype in (None, "float32"):
    out.append("--gin.ACTIVATION_DTYPE=bfloat16 (on TPU; the CPU dry run cannot show its "
               "saving)")
  out.append("a larger slice (--gin.SLICE=...)")
  return out
