"""What the paper's studies (recipe_grid.py, garden.py) share on top of the main job's stages.

- Reusing another run's finished stages: a study names `reuse_run_dir` (e.g. runs/demo) and
  its vocab / target / draft_raw stages are copied from there instead of retrained (the copy's
  marker keeps the source's summary and says where it came from).
- Distilling one student toward one teacher with the study's budget, recording tau over the
  training steps (the same curve as pipeline.stage_distill).

Run through the main binary: `python -m distillspec_jax.main --gin_file=gin/runs/<study>.gin`;
a study config's `stage_functions()` gives run_pipeline its stages.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

from distillspec_jax.studies import pipeline
from distillspec_jax.decoding.plain import prompt_inputs
from distillspec_jax.distill.objectives import DistillationConfig, make_speculative_eval_fn
from distillspec_jax.core.files import read_json
from distillspec_jax.core.validation import check_path
from distillspec_jax.training.trainer import distill

REUSABLE_STAGES = ("vocab", "target", "draft_raw")
# Held-out (validation) prompts of the in-training tau curve, as in pipeline.stage_distill.
CURVE_PROMPTS = 32


def copy_stage(source_run_dir: str, config, stage: str) -> dict:
  """Copies `<source_run_dir>/<stage>/` (checkpoints, arrays) into this run's stage folder.

  Returns the source marker's summary plus `copied_from` and `source_wall_clock_s` (the new
  marker's wall_clock_s is the copy's).
  """
  source = os.path.join(source_run_dir, stage)
  marker = os.path.join(source, pipeline.DONE)
  if not os.path.exists(marker):
    raise ValueError(f"reuse_run_dir={source_run_dir!r} has no finished stage {stage!r} "
                     f"({marker} is missing); run that job first, or set reuse_run_dir=None "
                     "to train the stage here.")
  destination = config.stage_dir(stage)
  for name in os.listdir(source):
    if name == pipeline.DONE:
      continue  # run_pipeline writes this run's marker last
    path = os.path.join(source, name)
    if os.path.isdir(path):
      shutil.copytree(path, os.path.join(destination, name), dirs_exist_ok=True)
    else:
      shutil.copy2(path, os.path.join(destination, name))
  summary = dict(read_json(marker))
  summary["source_wall_clock_s"] = summary.pop("wall_clock_s", None)
  summary["copied_from"] = source
  return summary


def check_reuse_run_dir(reuse_run_dir: Optional[str]) -> None:
  """Refuses, before work starts, a `reuse_run_dir` without the finished stages a study
  copies (REUSABLE_STAGES); None passes."""
  if reuse_run_dir is None:
    return
  check_path(reuse_run_dir, "reuse_run_dir", kind="dir",
             fix="pass a finished main job's MODEL_DIR (e.g. runs/demo), or None to train "
                 "the stages here.")
  for stage in REUSABLE_STAGES:
    if not os.path.exists(os.path.join(reuse_run_dir, stage, pipeline.DONE)):
      raise ValueError(f"reuse_run_dir={reuse_run_dir!r} has no finished stage {stage!r} "
                       f"({os.path.join(reuse_run_dir, stage, pipeline.DONE)} is missing); "
                       "run that job first, or set reuse_run_dir=None to train it here.")


def reusing(stage_fn: Callable, reuse_run_dir: Optional[str]) -> Callable:
  """`stage_fn`, or a copy from `reuse_run_dir` when one is given."""
  if not reuse_run_dir:
    return stage_fn
  return lambda config, stage: copy_stage(reuse_run_dir, config, stage)


def distill_toward(config, stage: str, teacher, teacher_params, student, student_params,
                   distillation: DistillationConfig, *, reference=None,
                   reference_params=None) -> dict:
  """Distils `student` (starting from `student_params`) toward the frozen `teacher` for
  `config.distill_steps` steps into `config.stage_dir(stage)`, with tau (gamma=5, T=0, on the
  first CURVE_PROMPTS validation prompts) every `config.eval_every` steps.

  `reference` / `reference_params`: AdaSPEC's reference model (with
  distillation.top_k_fraction).

  Returns the stage summary: recipe fields, final_loss and tau_curve [{step, tau, tau_stderr,
  draft_acceptance_rate}] starting at step 0.
  """
  prompts = pipeline.heldout_prompts(config, CURVE_PROMPTS).prompts
  eval_fn = make_speculative_eval_fn(teacher, teacher_params, student,
                                     prompt_inputs(student, prompts),
                                     max_new_tokens=config.max_new_tokens,
                                     gamma=pipeline.TAU_CURVE_GAMMA,
                                     temperature=0.0, seed=config.seed)
  train_config = pipeline.stage_train_config(config, stage, config.distill_steps,
                                             config.distill_learning_rate,
                                             eval_every=config.eval_every)
  start = eval_fn(student_params, 0)
  result = distill(train_config, teacher, teacher_params, student, pipeline.train_data(config),
                   distillation, init_params=student_params, eval_fn=eval_fn,
                   reference=reference, reference_params=reference_params)
  curve = pipeline.tau_curve(start, result.full_history)
  losses = [r["loss"] for r in result.history if "loss" in r]
  return {"divergence": distillation.divergence, "lambda1": distillation.lambda1,
          "lambda2": distillation.lambda2,
          "final_loss": float(losses[-1]) if losses else float("nan"), "tau_curve": curve}
