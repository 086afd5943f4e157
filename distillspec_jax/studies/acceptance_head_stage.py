"""The main job's acceptance heads (`PipelineConfig.acceptance_head`; None = none): each
distilled draft of the named recipes is built with an acceptance head
(models/acceptance_head.py) and trained jointly with it, so the one command gives drafts
that carry a calibrated stop signal for the adaptive draft-length rules
(`DraftLength(signal="acceptance_head")`).

gin: `PipelineConfig.acceptance_head = @AcceptanceHeadStage()`,
`AcceptanceHeadStage.weight = ...` (gin/runs/demo_calibrated.gin).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from distillspec_jax.core.validation import check_field_types, check_positive_int, check_real
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.models.acceptance_head import AcceptanceHeadConfig


@dataclasses.dataclass(frozen=True)
class AcceptanceHeadStage:
  """Which distillation stages train an acceptance head beside the draft, and how.

  Attributes:
    weight: DistillationConfig.acceptance_weight, the head's binary cross-entropy in the
      loss, > 0. 1.0: the head reads the draft's hidden state through a stop-gradient, so the
      term moves the head alone and its weight only scales the head's gradient, which Adam
      and Adafactor normalise away (the main job clips no gradient); 1.0 leaves the logged
      loss the divergence plus the head's cross-entropy.
    width: the head's hidden width (AcceptanceHeadConfig.width), an int >= 1. 64: 4,225
      parameters on the demo draft (emb 64, 3% of it); bench/calibrated_signal.py
      calibrated with 64.
    temperature: DistillationConfig.acceptance_temperature, the decoding temperature whose
      acceptance the head learns (0 = greedy: the argmaxes agree; T > 0: sum_v min(p, q) at
      T), >= 0. 0.0: the paper's headline setting and the demo's first temperature; one head
      serves one temperature, and the report gives its calibration at this one.
    recipes: the distillation recipes whose drafts get a head (each in PipelineConfig.recipes
      and run live: the teacher cache's objective has no target logits to label with); None
      = every recipe the job runs live.
  """

  weight: float = 1.0
  width: int = 64
  temperature: float = 0.0
  recipes: Optional[tuple] = None

  def __post_init__(self):
    check_field_types(self)
    check_real(self.weight, "AcceptanceHeadStage.weight", minimum=0.0, above=True,
               fix="the head's cross-entropy weight must be > 0 (1.0 is the default); set "
                   "PipelineConfig.acceptance_head = None for drafts without a head.")
    check_positive_int(self.width, "AcceptanceHeadStage.width")
    check_real(self.temperature, "AcceptanceHeadStage.temperature", minimum=0.0,
               fix="pass the decoding temperature the head predicts acceptance at, >= 0 "
                   "(0 = greedy).")
    if self.recipes is not None:
      if not self.recipes:
        raise ValueError("AcceptanceHeadStage.recipes=() is empty; name the recipes whose "
                         "drafts get a head, None for every live recipe, or set "
                         "PipelineConfig.acceptance_head = None.")
      if len(set(self.recipes)) != len(self.recipes):
        raise ValueError(f"AcceptanceHeadStage.recipes={self.recipes} repeats a recipe.")

  @property
  def head(self) -> AcceptanceHeadConfig:
    return AcceptanceHeadConfig(self.width)

  def distillation(self, config: DistillationConfig) -> DistillationConfig:
    """`config` with this head's loss term."""
    return dataclasses.replace(config, acceptance_weight=float(self.weight),
                               acceptance_temperature=float(self.temperature))

  def chosen_recipes(self, recipes: tuple, cached: tuple) -> tuple:
    """The job's recipes (run order) whose drafts get a head, or a ValueError naming a
    recipe the job does not run or runs on the teacher cache (before any work)."""
    if self.recipes is None:
      return tuple(r for r in recipes if r not in cached)
    for recipe in self.recipes:
      if recipe not in recipes:
        raise ValueError(f"AcceptanceHeadStage.recipes names {recipe!r}, which is not in "
                         f"recipes={tuple(recipes)}; list only recipes the job runs.")
      if recipe in cached:
        raise ValueError(f"AcceptanceHeadStage.recipes names {recipe!r}, which trains on the "
                         "teacher cache (teacher_cache_recipes), whose objective has no "
                         "target logits to label acceptance with; drop it from "
                         "AcceptanceHeadStage.recipes or from teacher_cache_recipes.")
    return tuple(r for r in recipes if r in self.recipes)
