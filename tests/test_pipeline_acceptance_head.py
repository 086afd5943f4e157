"""The main job with `PipelineConfig.acceptance_head`: the distilled draft is trained with an
acceptance head, its checkpoint carries the head, the evaluation runs the grid's adaptive rule
on the head's signal, and the report holds both stop signals' calibration."""

import json
import math
import os

import jax
import numpy as np
import pytest
import testing

from distillspec_jax.decoding.speculative import DraftLength
from distillspec_jax.evaluation import report as report_lib
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.models.acceptance_head import PARAMS_KEY, AcceptanceHeadConfig
from distillspec_jax.studies import pipeline
from distillspec_jax.studies.acceptance_head_stage import AcceptanceHeadStage
from distillspec_jax.studies.pipeline import PipelineConfig, run_pipeline

HEAD_RULE = DraftLength("confidence", 0.5, signal="acceptance_head")


@pytest.mark.integration
@pytest.mark.pipeline
def test_job_distils_a_draft_with_an_acceptance_head_and_reports_its_calibration(
    tmp_path, shared_stages):
  from distillspec_jax import eval as eval_lib
  config = testing.pipeline_config(
      tmp_path / "calibrated", recipes=("supervised_kd",), distill_steps=3,
      acceptance_head=AcceptanceHeadStage(width=8),
      grid=DecodingGrid(gammas=(2,), temperatures=(0.0,), draft_length=HEAD_RULE))
  testing.copy_stages(shared_stages[0], config)
  run_pipeline(config)

  # The checkpoint carries the head: the eval binary's loader reads it as a Model with one.
  stage_dir = config.stage_dir("distill_supervised_kd")
  draft, params = eval_lib.load_model(stage_dir, "DRAFT_CHECKPOINT_PATH", None, None)
  assert draft.acceptance_head == AcceptanceHeadConfig(8)
  raw = pipeline.load_params(config, "draft_raw", pipeline.models(config)[1])
  assert jax.tree.structure(params[PARAMS_KEY]) == jax.tree.structure(
      jax.device_get(draft.init(jax.random.PRNGKey(0)))[PARAMS_KEY])
  # The network part moved away from the raw draft (jointly trained, not frozen).
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves({k: v for k, v in params.items() if k != PARAMS_KEY}),
      jax.tree.leaves(jax.device_get(raw))))

  # The stage's record: the head's loss term was logged and is finite, its calibration was
  # measured beside the top probability's on held-out rows.
  marker = json.load(open(os.path.join(stage_dir, pipeline.DONE)))
  head = marker["acceptance_head"]
  assert (head["width"], head["weight"], head["temperature"]) == (8, 1.0, 0.0)
  assert math.isfinite(head["bce_first"]) and math.isfinite(head["bce_last"])
  assert 0.0 < head["bce_last"]
  for signal in ("acceptance_head", "top_probability"):
    table = head["calibration"][signal]
    assert 0.0 <= table["ece"] <= 1.0 and table["positions"] == sum(table["count"]) > 0

  report = json.load(open(tmp_path / "calibrated" / "report.json"))
  assert report["acceptance_heads"]["supervised_kd"] == head
  # The adaptive rule on the head's signal ran (and was timed) on the draft with a head only;
  # the fixed rows keep their tables.
  (adaptive,) = report["adaptive_rows"]
  assert (adaptive["draft"], adaptive["signal"], adaptive["gamma"]) == (
      "supervised_kd", "acceptance_head", 2)
  assert adaptive["end_to_end_speedup"] > 0 and adaptive["best_fixed_gamma"] == 2
  assert 1.0 <= adaptive["tau"] <= 3.0
  assert {(r["draft"], r["draft_length"]) for r in report["draft_rows"]} == {
      ("raw", "fixed"), ("supervised_kd", "fixed"), ("supervised_kd", "confidence")}
  assert len(report["paired_rows"]) == 1
  markdown = (tmp_path / "calibrated" / "report.md").read_text()
  assert "## Stop signal calibration" in markdown and "## Adaptive draft length" in markdown
  assert (tmp_path / "calibrated" / "reliability_supervised_kd.png").stat().st_size > 0


def test_acceptance_head_settings_are_refused_before_work(tmp_path):
  for changes, named in ((dict(weight=-1.0), "AcceptanceHeadStage.weight=-1.0"),
                         (dict(weight=0.0), "AcceptanceHeadStage.weight=0.0"),
                         (dict(width=0), "AcceptanceHeadStage.width=0"),
                         (dict(width="8"), "'8'"),
                         (dict(temperature=-0.5), "AcceptanceHeadStage.temperature=-0.5"),
                         (dict(recipes=()), "AcceptanceHeadStage.recipes=()")):
    with pytest.raises((TypeError, ValueError), match=named.replace("(", r"\(").replace(
        ")", r"\)")):
      AcceptanceHeadStage(**changes)
  grid = DecodingGrid(gammas=(2,), draft_length=HEAD_RULE)
  with pytest.raises(ValueError, match="acceptance_head=None trains none"):
    PipelineConfig(run_dir=str(tmp_path), grid=grid)
  # The teacher cache's recipes cannot label acceptance: named, not silently skipped.
  with pytest.raises(ValueError, match="names 'supervised_kd', which trains on the teacher"):
    PipelineConfig(run_dir=str(tmp_path), teacher_cache_k=4,
                   acceptance_head=AcceptanceHeadStage(recipes=("supervised_kd",)))
  with pytest.raises(ValueError, match="names 'seq_kd', which is not in recipes"):
    PipelineConfig(run_dir=str(tmp_path), acceptance_head=AcceptanceHeadStage(recipes=("seq_kd",)))
  # A study's own stages run neither: refused, not ignored.
  from distillspec_jax.studies.recipe_grid import RecipeGridConfig
  with pytest.raises(ValueError, match="RecipeGridConfig trains and evaluates with its own"):
    RecipeGridConfig(run_dir=str(tmp_path), acceptance_head=AcceptanceHeadStage())
  # None = every live recipe; an adaptive rule on the top probability needs no head.
  config = PipelineConfig(run_dir=str(tmp_path), teacher_cache_k=4, grid=grid,
                          acceptance_head=AcceptanceHeadStage())
  assert config.acceptance_head_recipes == ("gkd",)
  PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(
      gammas=(2,), draft_length=DraftLength("confidence", 0.5)))


def test_adaptive_rows_pair_the_rule_with_the_drafts_best_fixed_gamma():
  row = lambda draft, gamma, rule, speedup: dict(
      draft=draft, temperature=0.0, gamma=gamma, draft_length=rule, threshold=0.5,
      signal="acceptance_head" if rule != "fixed" else "top_probability", tau=2.0,
      tau_stderr=0.1, draft_acceptance_rate=0.5, end_to_end_speedup=speedup,
      end_to_end_speedup_range=[speedup - 0.1, speedup + 0.1])
  rows = [row("gkd", 3, "fixed", 1.2), row("gkd", 5, "fixed", 1.5), row("raw", 5, "fixed", 9.0),
          row("gkd", 5, "confidence", 1.4)]
  (adaptive,) = report_lib.adaptive_rows(rows)
  assert (adaptive["best_fixed_gamma"], adaptive["best_fixed_end_to_end_speedup"]) == (5, 1.5)
  assert adaptive["end_to_end_speedup"] == 1.4


def test_demo_calibrated_run_file_heads_the_live_recipe_and_adapts_on_its_signal():
  import gin
  from distillspec_jax import main
  gin.clear_config()
  try:
    config = main.load_pipeline(["--gin_file=gin/runs/demo_calibrated.gin"])
  finally:
    gin.clear_config()
  assert config.acceptance_head == AcceptanceHeadStage()  # the documented defaults
  assert config.acceptance_head_recipes == ("gkd",)  # SupervisedKD reads the teacher cache
  assert config.grid.draft_length == HEAD_RULE and config.grid.gammas == (3, 5, 7)
  assert pipeline.job_draft_lengths(config) == (DraftLength(), HEAD_RULE)
  assert config.run_dir == "runs/demo_calibrated"
