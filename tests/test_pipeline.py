"""The main job end to end with a handful of steps per stage (the CI smoke test)."""

import dataclasses
import json
import math
import os
import shutil

import numpy as np
import pytest
import testing

from distillspec_jax.data import batches
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig
from distillspec_jax.training.partitioning import MeshConfig
from distillspec_jax.studies import pipeline
from distillspec_jax.studies.pipeline import PipelineConfig, required_stages, run_pipeline


def _smoke_config(run_dir, temperatures=(0.0, 1.0), **changes):
  """The whole-pipeline tests' settings (testing.PIPELINE) at gamma 2, T = 0 and 1."""
  return testing.pipeline_config(
      run_dir, **{"grid": DecodingGrid(gammas=(2,), temperatures=temperatures), **changes})


def _mtimes(config, stages=None):
  return {s: os.path.getmtime(os.path.join(config.stage_dir(s), pipeline.DONE))
          for s in stages or config.stages}


@pytest.mark.integration
@pytest.mark.pipeline
def test_demo_pipeline_smoke_and_reuse(tmp_path, shared_stages):
  # Timed in a process pinned to one core, as the demo does.
  # T = 1 only: the T = 0 path runs in the AdaSPEC job (below) and the decoder-only job.
  # The vocab, target and raw draft are the session's (conftest.py), trained by run_pipeline's
  # real stages in one call and copied here with their markers.
  shared_dir, shared_outcome = shared_stages
  assert shared_outcome == {"vocab": "ran", "target": "ran", "draft_raw": "ran"}
  config = _smoke_config(tmp_path / "demo", temperatures=(1.0,),
                         speed=dataclasses.replace(testing.PIPELINE["speed"], cpus=1),
                         recipe_steps={"supervised_kd": 3})
  testing.copy_stages(shared_dir, config)
  outcome = run_pipeline(config)
  assert outcome == {**{s: "skipped" for s in testing.SHARED_STAGES},
                     **{s: "ran" for s in config.distill_stages + ("evaluate", "report")}}
  # recipe_steps overrides distill_steps (2) for the recipes it names only.
  assert sorted(os.listdir(config.stage_dir("distill_supervised_kd"))).count("3") == 1
  assert "2" in os.listdir(config.stage_dir("distill_gkd"))
  assert "3" not in os.listdir(config.stage_dir("distill_gkd"))

  report = json.load(open(tmp_path / "demo" / "report.json"))
  assert len(report["rows"]) == (len(config.recipes) * len(config.grid.temperatures)
                                 * len(config.grid.gammas))
  for row in report["rows"]:
    for key in ("task", "temperature", "gamma", "recipe", "tau_raw", "tau_distilled",
                "speedup_raw", "speedup_distilled"):
      assert key in row
    for key in ("tau_raw", "tau_distilled", "speedup_raw", "speedup_distilled"):
      assert math.isfinite(row[key]) and row[key] > 0
    assert 1.0 <= row["tau_raw"] <= row["gamma"] + 1
  for row in report["paired_rows"]:
    for kind in ("raw", "distilled"):
      low, high = row[f"speedup_range_{kind}"]
      assert low <= row[f"speedup_{kind}"] <= high
      assert math.isfinite(row[f"cost_model_speedup_{kind}"])
      assert row[f"tau_stderr_{kind}"] >= 0
  for row in report["draft_rows"]:
    assert set(row) >= {"speedup_range", "cost_model_speedup", "tau_stderr",
                        "end_to_end_speedup"}
  # Timed in a child pinned to one core; the report says so.
  assert report["machine"]["cpus"] == os.cpu_count()
  assert len(report["machine"]["pinned"]) == 1
  if os.cpu_count() > 1:
    assert "pinned to core" in report["measurement"]
  assert report["wall_clock_total_s"] >= sum(
      v for k, v in report["wall_clock_s"].items() if k != "report")
  assert {"target", "draft_raw"} <= set(report["target_quality"])
  assert math.isfinite(report["target_quality"]["target"]["per_token_loss"])
  # The copied stages' times are their markers' (the session run's).
  assert set(report["wall_clock_s"]) >= {"vocab", "target", "draft_raw", "evaluate"}
  for stage in testing.SHARED_STAGES:
    marker = json.load(open(os.path.join(shared_dir, stage, pipeline.DONE)))
    assert report["wall_clock_s"][stage] == marker["wall_clock_s"]
  for name in ("report.md", "tau_over_steps.png", "speedup_vs_gamma.png"):
    assert (tmp_path / "demo" / name).stat().st_size > 0

  # A second run reuses every stage.
  before = _mtimes(config)
  assert set(run_pipeline(config).values()) == {"skipped"}
  assert _mtimes(config) == before
  _check_the_eval_binary_writes_the_same_record(config, report, tmp_path / "eval")


def _check_the_eval_binary_writes_the_same_record(config, report, model_dir):
  """The eval binary's evaluation of the job's target and SupervisedKD draft (same prompts,
  grid point, budget and seed): its metrics.json row and the report's draft row are one
  record (evaluate.EvaluationRow), every quantity both measure under one key."""
  from distillspec_jax import eval as eval_lib
  from distillspec_jax.data.tasks import embedded
  from distillspec_jax.evaluation.evaluate import EvaluationRow
  eval_lib.evaluate(eval_lib.EvalConfig(
      model_dir=str(model_dir), mixture_or_task_name=config.task,
      task_feature_lengths=dict(config.task_feature_lengths), batch_size=config.eval_examples,
      target_checkpoint_path=config.stage_dir("target"),
      draft_checkpoint_path=config.stage_dir("distill_supervised_kd"),
      vocabulary=embedded.embedded_vocabulary_path(config.stage_dir("vocab"),
                                                   config.vocab_size),
      eval_examples=config.eval_examples, grid=config.grid, max_new_tokens=config.max_new_tokens,
      speed=SpeedConfig(examples=1, repeats=1, calls=1, cpus=0), seed=config.seed,
      progress_bar=False))
  (timed,) = json.load(open(model_dir / "metrics.json"))["rows"]
  assert tuple(timed) == EvaluationRow.json_keys()  # the record's keys, in its order
  (job,) = [r for r in report["draft_rows"] if r["draft"] == "supervised_kd"]
  assert set(job) == set(timed)  # report.json is written with sorted keys
  measured = lambda row: {k for k, v in row.items() if v is not None}
  # Every quantity both measure has a value under the same key in both files; the target's
  # own-sample prediction (predicted_alpha) is the eval binary's alone.
  assert measured(job) == measured(timed) - {"predicted_alpha"}
  assert {"tau", "draft_acceptance_rate", "speedup", "end_to_end_speedup",
          "typical_end_to_end_speedup", "speedup_unreliable"} <= measured(timed)
  # The same draft, prompts and keys: the same decodes, so the same block efficiency.
  assert (job["tau"], job["draft_acceptance_rate"]) == pytest.approx(
      (timed["tau"], timed["draft_acceptance_rate"]))


@pytest.mark.integration
@pytest.mark.pipeline
def test_adaspec_job_reuses_copied_stages_and_its_reference(tmp_path, shared_stages):
  # AdaSPEC's comparison job in a run directory holding copies of another run's finished
  # stages (their markers' times kept): it reuses them; once its reference (the SupervisedKD
  # draft) is done it reuses that too, and runs only its own distillation, the evaluation and
  # the report.
  ada = _smoke_config(tmp_path / "ada", temperatures=(0.0,),
                      recipes=("supervised_kd", "adaspec"), recipe_steps={"supervised_kd": 3})
  assert ada.dependencies("distill_adaspec") == ("target", "draft_raw", "distill_supervised_kd")
  testing.copy_stages(shared_stages[0], ada)
  outcome = run_pipeline(ada, stages=("distill_supervised_kd",))
  assert outcome == {"vocab": "skipped", "target": "skipped", "draft_raw": "skipped",
                     "distill_supervised_kd": "ran"}
  reused = testing.SHARED_STAGES + ("distill_supervised_kd",)
  before = _mtimes(ada, reused)
  outcome = run_pipeline(ada)
  assert {s for s, v in outcome.items() if v == "ran"} == {"distill_adaspec", "evaluate",
                                                           "report"}
  assert _mtimes(ada, reused) == before
  report = json.load(open(tmp_path / "ada" / "report.json"))
  assert {r["draft"] for r in report["rows"]} == {"raw", "distillspec", "adaspec"}
  for row in report["rows"]:
    assert set(row) >= {"task", "temperature", "gamma", "draft", "draft_acceptance_rate", "tau"}
    assert 0.0 <= row["draft_acceptance_rate"] <= 1.0 and 1.0 <= row["tau"] <= row["gamma"] + 1
  marker = json.load(open(os.path.join(ada.stage_dir("distill_adaspec"), pipeline.DONE)))
  assert marker["top_k_fraction"] == 0.4
  assert abs(marker["kept_fraction_last"] - 0.4) < 0.05


def _recording_stages(calls):
  def stage(config, name):
    calls.append(name)
    return {"stage": name}
  return {name: stage for name in ("vocab", "target", "draft_raw", "distill", "evaluate",
                                   "report", "teacher_cache")}


def test_deleting_one_stage_reruns_it_and_only_what_depends_on_it(tmp_path):
  # The stage bookkeeping alone (markers, staleness), with stage functions that only record
  # their calls; the real stages' skip-on-rerun is the smoke test's.
  config = _smoke_config(tmp_path / "demo")
  calls = []
  assert set(run_pipeline(config, _recording_stages(calls)).values()) == {"ran"}
  assert calls == list(config.stages)
  calls.clear()
  assert set(run_pipeline(config, _recording_stages(calls)).values()) == {"skipped"}
  assert calls == []
  shutil.rmtree(config.stage_dir("distill_gkd"))
  outcome = run_pipeline(config, _recording_stages(calls))
  assert {s for s, v in outcome.items() if v == "ran"} == {"distill_gkd", "evaluate", "report"}
  assert calls == ["distill_gkd", "evaluate", "report"]
  # A stage whose input finished after it is stale: it is started over (its folder cleared).
  calls.clear()
  (tmp_path / "demo" / "report" / "extra.txt").write_text("old output")
  os.utime(os.path.join(config.stage_dir("evaluate"), pipeline.DONE))  # evaluate "reran"
  outcome = run_pipeline(config, _recording_stages(calls))
  assert calls == ["report"] and not (tmp_path / "demo" / "report" / "extra.txt").exists()


def test_rerun_with_changed_training_setting_restarts_that_stage_and_its_dependents(
    tmp_path, caplog):
  # The same MODEL_DIR run again with another setting: a stage whose recorded settings (its
  # marker's) differ is stale, and so is what depends on it; evaluation settings reuse the
  # trained stages. The bookkeeping alone, with recording stage functions.
  config = _smoke_config(tmp_path / "demo")
  calls = []
  run_pipeline(config, _recording_stages(calls))
  marker = json.load(open(os.path.join(config.stage_dir("target"), pipeline.DONE)))
  assert marker["settings"]["target_steps"] == 2 and "grid" not in marker["settings"]
  calls.clear()
  caplog.set_level("INFO")
  longer = dataclasses.replace(config, target_steps=3)
  outcome = run_pipeline(longer, _recording_stages(calls))
  assert calls == ["target"] + list(config.distill_stages) + ["evaluate", "report"]
  assert outcome["vocab"] == outcome["draft_raw"] == "skipped"
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert any("Stage target" in w and "target_steps: 2 -> 3" in w and "start over" in w
             for w in warnings), warnings
  # The draft model's own stage and what depends on it; the target is reused.
  calls.clear()
  run_pipeline(dataclasses.replace(longer, draft_steps=3, distill_learning_rate=5e-4),
               _recording_stages(calls))
  assert calls == ["draft_raw"] + list(config.distill_stages) + ["evaluate", "report"]
  # Only the evaluation's settings: every trained stage is reused.
  calls.clear()
  caplog.clear()
  evaluation = dataclasses.replace(longer, draft_steps=3, distill_learning_rate=5e-4,
                                   eval_examples=3, grid=DecodingGrid(gammas=(3,),
                                                                      temperatures=(0.5,)))
  outcome = run_pipeline(evaluation, _recording_stages(calls))
  assert calls == ["evaluate", "report"]
  assert all(outcome[s] == "skipped" for s in config.stages[:-2])
  assert any("eval_examples: 4 -> 3" in r.getMessage() for r in caplog.records
             if r.levelname == "WARNING")


def test_marker_without_recorded_settings_is_reused_and_says_so(tmp_path, caplog):
  # Markers written before markers recorded settings: skipped as before, with one INFO line
  # each.
  config = _smoke_config(tmp_path / "demo")
  run_pipeline(config, _recording_stages([]))
  for stage in config.stages:
    path = os.path.join(config.stage_dir(stage), pipeline.DONE)
    mtime, marker = os.path.getmtime(path), json.load(open(path))
    del marker["settings"]
    with open(path, "w") as f:
      json.dump(marker, f)
    os.utime(path, (mtime, mtime))
  caplog.set_level("INFO")
  calls = []
  outcome = run_pipeline(dataclasses.replace(config, target_steps=3), _recording_stages(calls))
  assert calls == [] and set(outcome.values()) == {"skipped"}
  notes = [r.getMessage() for r in caplog.records if "cannot be compared" in r.getMessage()]
  assert [n.split(":")[0] for n in notes] == [f"Stage {s}" for s in config.stages], notes


def test_required_stages_follow_dependencies(tmp_path):
  config = _smoke_config(tmp_path)
  assert required_stages(config, ("distill_gkd",)) == ("vocab", "target", "draft_raw",
                                                      "distill_gkd")
  assert required_stages(config, ("target",)) == ("vocab", "target")
  with pytest.raises(ValueError, match="distill_nope"):
    required_stages(config, ("distill_nope",))


def test_bad_input_fails_before_training(tmp_path):
  with pytest.raises(ValueError, match="recipe"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd", "magic"))
  with pytest.raises(ValueError, match="recipe_steps names 'seq_kd'"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), recipe_steps={"seq_kd": 10})
  with pytest.raises(ValueError, match=r"recipe_steps\['gkd'\]=0"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), recipe_steps={"gkd": 0})
  with pytest.raises(ValueError, match=r"recipe_steps\['gkd'\]='10'"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), recipe_steps={"gkd": "10"})
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="MODEL_DIR="):
    pipeline.check_run_dir(str(blocker / "run"))


def test_adaspec_bad_input(tmp_path):
  with pytest.raises(ValueError, match="top_k_fraction=1.5"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("supervised_kd", "adaspec"), adaspec_top_k=1.5)
  with pytest.raises(ValueError, match="adaspec_reference='gkd'"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("supervised_kd", "adaspec"),
                   adaspec_reference="gkd")


def test_a_decoding_cache_too_small_for_the_requests_is_refused_before_work(tmp_path):
  """PipelineConfig.max_decode_length below a decoder-only request (1 + the prompt length +
  max_new_tokens + gamma - 1, at the grid's largest gamma or the tau curves' 5) is refused by
  check_inputs, naming the length to set; it used to be refused by the decoder at the first
  tau curve, after the vocab, target and draft_raw stages (a pretrained pair with
  TASK_FEATURE_LENGTHS inputs 128, max_new_tokens 128 and max_decode_length 160). An
  encoder-decoder's cache holds no prompt."""
  lengths = {"inputs": 40, "targets": 44}
  common = dict(run_dir=str(tmp_path / "run"), task_feature_lengths=lengths, max_new_tokens=8,
                grid=DecodingGrid(gammas=(3, 7), temperatures=(0.0,)))
  decoder = dict(common, target_model="tiny_decoder_only", draft_model="tiny_decoder_only")
  with pytest.raises(ValueError, match=r"max_decode_length=50 is smaller than the 55 "
                                       r"decoding-cache positions.*max_decode_length=55 or more"):
    PipelineConfig(**decoder, max_decode_length=50).check_inputs()
  PipelineConfig(**decoder, max_decode_length=55).check_inputs()
  with pytest.raises(ValueError, match=r"the 53 decoding-cache"):  # the tau curves' gamma 5
    PipelineConfig(**dict(decoder, grid=DecodingGrid(gammas=(2,), temperatures=(0.0,))),
                   max_decode_length=50).check_inputs()
  PipelineConfig(**common, max_decode_length=16).check_inputs()  # demo_target: enc-dec
  assert not (tmp_path / "run").exists()


def test_a_warmup_longer_than_a_stage_is_refused_before_any_stage(tmp_path):
  """warmup_steps past a training stage's schedule (DISTILL_TRAIN_STEPS=2 with the default
  100 warm-up steps) is refused when the config is made, naming the stage and the fix; it
  used to be refused by the optimiser when that stage started, after the stages before it
  (a pretrained pair's target and draft loaded, MODEL_DIR written). Stages that do not train
  (a checkpoint loaded as it is) are not held to it."""
  from distillspec_jax.studies.pair_source import PairSource
  with pytest.raises(ValueError, match=r"warmup_steps=100 .* exceeds the 2 steps of stage "
                                       r"'distill_gkd'.*PipelineConfig.warmup_steps=2 or less"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), distill_steps=2)
  with pytest.raises(ValueError, match=r"the 50 steps of stage 'target'"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), target_steps=50)
  with pytest.raises(ValueError, match=r"the 50 decay_steps of stage"):
    PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), decay_steps=50)
  loaded = PipelineConfig(run_dir=str(tmp_path), recipes=("gkd",), target_steps=50,
                          draft_steps=50, target_model=None, draft_model=None,
                          target_checkpoint_path="t", draft_checkpoint_path="d")
  assert set(loaded.training_steps()) == {"distill_gkd"}
  with pytest.raises(ValueError, match=r"stage 'draft_raw'"):
    dataclasses.replace(loaded, pair=PairSource(finetune_draft=True))


@pytest.mark.integration
@pytest.mark.pipeline
def test_decoder_only_job(tmp_path, shared_stages):
  """The same job with decoder-only models (prefix LM on the embedded task); the vocabulary
  is the session's (the same task)."""
  config = dataclasses.replace(_smoke_config(tmp_path / "dec"), target_model="tiny_decoder_only",
                               draft_model="tiny_decoder_only", recipes=("gkd",),
                               grid=DecodingGrid(gammas=(2,), temperatures=(0.0,)),
                               max_decode_length=160)
  assert config.feature_converter == "decoder"
  testing.copy_stages(shared_stages[0], config, stages=("vocab",))
  assert run_pipeline(config)["vocab"] == "skipped"
  report = json.load(open(tmp_path / "dec" / "report.json"))
  assert len(report["rows"]) == 1
  row = report["rows"][0]
  assert 1.0 <= row["tau_raw"] <= row["gamma"] + 1 and math.isfinite(row["speedup_distilled"])
  assert math.isfinite(report["target_quality"]["target"]["per_token_loss"])


@pytest.mark.parametrize("changes, message", [
    (lambda: DecodingGrid(gammas=()), "DecodingGrid.gammas=\\(\\) is empty"),
    (lambda: DecodingGrid(temperatures=()), "DecodingGrid.temperatures=\\(\\) is empty"),
    (lambda: SpeedConfig(repeats=0), "SpeedConfig.repeats=0"),
    (lambda: SpeedConfig(calls=0), "SpeedConfig.calls=0"),
    (lambda: SpeedConfig(budget_s=-5), "SpeedConfig.budget_s=-5"),
    (lambda: SpeedConfig(cpus=-1), "SpeedConfig.cpus=-1"),
    (lambda: MeshConfig(model_parallel=0), "MeshConfig.model_parallel=0"),
    (lambda: dataclasses.replace(_smoke_config(".", eval_examples=8), speed=SpeedConfig(
        examples=9)), "SpeedConfig.examples=9 exceeds PipelineConfig.eval_examples=8"),
    (lambda: _smoke_config(".", grid=DecodingGrid(temperatures=(1.0,), epsilons=(0.5,))),
     "the main job decodes losslessly"),
])
def test_speed_settings_are_checked(changes, message):
  with pytest.raises(ValueError, match=message):
    changes()


def test_more_speed_prompts_than_the_split_holds_is_refused(tmp_path):
  config = _smoke_config(tmp_path)
  examples = batches.Examples(np.zeros((2, 4), np.int32), np.full(2, 4), np.zeros((2, 4)),
                              np.full(2, 4), ["a", "b"], ["c", "d"])
  with pytest.raises(ValueError, match="SpeedConfig.examples=3 but the test split"):
    pipeline.check_speed_prompts(dataclasses.replace(config, speed=SpeedConfig(examples=3),
                                                     eval_examples=8), examples)
