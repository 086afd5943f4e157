"""A draft head in the evaluation: timed by speed.measure_speed beside a draft model (its own
per-call costs, its first call gamma + 1 positions wide in the cost model), and the eval
binary's predicted alpha of a head."""

import math

import jax
import numpy as np
import pytest

from distillspec_jax.decoding.plain import SamplingConfig, prompt_inputs
from distillspec_jax.decoding.speculative import speculative_decode
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.evaluate import SpeedConfig
from distillspec_jax.models.head import Head, HeadConfig
from distillspec_jax.models.model import Model



@pytest.fixture(scope="module")
def trio():
  target = Model.from_name("tiny_encoder_decoder", max_decode_length=32)
  draft = Model.from_name("tiny_encoder_decoder", max_decode_length=32, num_decoder_layers=1,
                          num_encoder_layers=1)
  target_params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, mlp_dim=48))
  return (target, target_params, draft, draft.init(jax.random.PRNGKey(1)), head,
          head.init(jax.random.PRNGKey(2), target_params))


def _prompts(count, vocab=512, length=6):
  prompts = np.random.default_rng(0).integers(3, vocab, size=(count, length)).astype(np.int32)
  prompts[0, 4:] = 0
  return prompts


@pytest.mark.slow
def test_speed_rows_for_a_head_beside_a_draft_model(trio):
  target, target_params, draft, draft_params, head, head_params = trio
  prompts = _prompts(2)
  plan = speed.TimingPlan(gammas=(3,), temperatures=(0.0,), max_new_tokens=8, repeats=1,
                          timed_per_turn=1)
  measured = speed.measure_speed(target, target_params,
                                 {"draft": (draft, draft_params), "head": (head, head_params)},
                                 prompts, plan, progress=False)
  out = measured.to_json()
  assert {(r["draft"], r["gamma"]) for r in out["rows"]} == {
      (name, 3) for name in ("draft", "head")}
  # A draft model's first call of a round is 2 tokens; a head's is gamma + 1 positions.
  costs = out["per_call_s"]
  assert {"draft:draft_step_1", "draft:draft_step_2", "head:draft_step_1",
          "head:draft_step_4"} <= set(costs)
  assert "draft:draft_step_4" not in costs and "head:draft_step_2" not in costs
  assert all(costs[k] > 0 for k in costs)
  plain = out["plain"]["0.0"]
  for row in out["rows"]:
    for key in ("speedup", "end_to_end_speedup", "cost_model_speedup"):
      assert math.isfinite(row[key]) and row[key] > 0, key
    gamma = row["gamma"]
    model = head if row["draft"] == "head" else draft
    first = f"{row['draft']}:draft_step_{speed.first_call_width(model, gamma)}"
    # The cost model: per round the first call, gamma - 1 one-token calls, a verification.
    predicted = row["rounds"] * (costs[first] + (gamma - 1) * costs[f"{row['draft']}:draft_step_1"]
                                 + costs[f"verification_{gamma}"])
    expected = (row["tokens"] / predicted) / (plain["tokens"] / plain["cost_model_decode_seconds"])
    assert row["cost_model_speedup"] == pytest.approx(expected)
  # The head's timed rows decode each prompt alone with the same engine: tau at T = 0 is that
  # of decoding the prompts one by one.
  for gamma in (3,):
    produced = calls = 0
    for i in range(len(prompts)):
      result = speculative_decode(target, target_params, head, head_params, max_new_tokens=8,
                                  gamma=gamma, sampling=SamplingConfig(0.0),
                                  **prompt_inputs(target, prompts[i:i + 1]))
      produced, calls = produced + int(result.produced[0]), calls + int(result.target_calls[0])
    (row,) = [r for r in out["rows"] if r["draft"] == "head" and r["gamma"] == gamma]
    assert row["timed_tau"] == pytest.approx(produced / calls)


@pytest.mark.slow
def test_predicted_alpha_of_a_head_is_its_first_draft_step_along_target_samples(trio):
  target, target_params, _, _, head, head_params = trio
  prompts = _prompts(3)
  samples = np.random.default_rng(1).integers(3, 512, size=(3, 7)).astype(np.int32)
  samples[1, 4:] = 0
  alpha = quality.predicted_alpha(target, target_params, head, head_params, prompts, samples,
                                  0.0)
  # At T = 0: the fraction of sample positions t >= 1 where the head's first draft step (reading
  # the target's features at t - 1 and the token at t) proposes the target's argmax at t.
  batch, sequence, mask = quality._teacher_forcing(target, prompts, samples)
  target_logits, features, encoded = target.layer_features(target_params, batch,
                                                           head.feature_layers)
  (head_logits,) = head.unroll(head_params, sequence, features, 1, encoded,
                               batch["encoder_input_tokens"] > 0)
  agree = np.asarray(np.argmax(head.to_target_logits(head_logits), -1)[:, :-1]
                     == np.argmax(target_logits, -1)[:, 1:])
  weights = np.asarray(mask)[:, 1:]
  assert alpha == pytest.approx(float(np.sum(agree * weights) / np.sum(weights)))
  assert 0.0 <= alpha <= 1.0
  sampled = quality.predicted_alpha(target, target_params, head, head_params, prompts, samples,
                                    1.0)
  assert 0.0 < sampled < 1.0


@pytest.mark.integration
@pytest.mark.pipeline
def test_main_job_with_a_head_and_the_eval_binary_on_its_checkpoint(tmp_path, shared_stages):
  import json
  import os

  import testing
  from distillspec_jax import eval as eval_lib
  from distillspec_jax.data.tasks import embedded
  from distillspec_jax.evaluation.evaluate import EvaluationRow
  from distillspec_jax.studies.pipeline import run_pipeline
  from distillspec_jax.studies.pipeline_config import HeadStageConfig
  shared_dir, _ = shared_stages
  config = testing.pipeline_config(
      tmp_path / "job", recipes=("supervised_kd",), grid=dict(gammas=(2,), temperatures=(0.0,)),
      head=HeadStageConfig(recipes=("supervised_kd",), steps=2, mlp_dim=32, unroll_steps=2))
  testing.copy_stages(shared_dir, config)
  outcome = run_pipeline(config)
  assert outcome["distill_head_supervised_kd"] == "ran" and outcome["report"] == "ran"
  marker = json.load(open(os.path.join(config.stage_dir("distill_head_supervised_kd"),
                                       "DONE.json")))
  assert marker["tau_curve"][0]["step"] == 0 and marker["num_params"] > 0
  assert marker["unroll_steps"] == 2  # None: unrolled as deep as the largest gamma
  report = json.load(open(tmp_path / "job" / "report.json"))
  rows = {r["draft"]: r for r in report["draft_rows"]}
  # The raw draft, the distilled draft and the head: one record, the same keys, all measured.
  assert set(rows) == {"raw", "supervised_kd", "head_supervised_kd"}
  assert len({tuple(sorted(r)) for r in rows.values()}) == 1
  for row in rows.values():
    assert 1.0 <= row["tau"] <= row["gamma"] + 1 and row["tau_stderr"] >= 0
    for key in ("speedup", "end_to_end_speedup", "cost_model_speedup",
                "draft_acceptance_rate"):
      assert row[key] is not None and row[key] >= 0, key
  # The head paired with the raw draft, as the distilled draft is.
  assert {r["recipe"] for r in report["paired_rows"]} == {"supervised_kd", "head_supervised_kd"}
  drafts = report["drafts"]
  assert drafts["head_supervised_kd"]["kind"] == "head"
  assert drafts["raw"]["kind"] == drafts["supervised_kd"]["kind"] == "model"
  assert drafts["head_supervised_kd"]["num_params"] == marker["num_params"]
  assert drafts["head_supervised_kd"]["first_call_s"]["2"] == report["per_call_s"][
      "distill_head_supervised_kd:draft_step_3"]
  assert drafts["raw"]["first_call_s"]["2"] == report["per_call_s"]["draft_raw:draft_step_2"]
  assert "head_supervised_kd" in report["tau_curves"]
  markdown = open(tmp_path / "job" / "report.md").read()
  assert "| head_supervised_kd | head |" in markdown

  # The eval binary on the head's folder: tau, acceptance and timing in the same record.
  head_dir = config.stage_dir("distill_head_supervised_kd")
  settings = dict(
      model_dir=str(tmp_path / "eval"), mixture_or_task_name=config.task,
      task_feature_lengths=dict(config.task_feature_lengths), batch_size=config.eval_examples,
      target_checkpoint_path=config.stage_dir("target"), draft_checkpoint_path=head_dir,
      vocabulary=embedded.embedded_vocabulary_path(config.stage_dir("vocab"),
                                                   config.vocab_size),
      eval_examples=config.eval_examples, grid=config.grid, max_new_tokens=config.max_new_tokens,
      speed=SpeedConfig(examples=1, repeats=1, calls=1, cpus=0), seed=config.seed,
      progress_bar=False)
  with pytest.raises(ValueError, match="DRAFT_KIND"):  # a head's folder as a draft model
    eval_lib.EvalConfig(**settings).check_inputs()
  eval_lib.evaluate(eval_lib.EvalConfig(**settings, draft_kind="head"))
  (timed,) = json.load(open(tmp_path / "eval" / "metrics.json"))["rows"]
  assert tuple(timed) == EvaluationRow.json_keys()
  assert 0.0 <= timed["predicted_alpha"] <= 1.0
  # The same head, prompts, grid point and seed as the job's evaluation: the same decodes.
  job = rows["head_supervised_kd"]
  assert (timed["tau"], timed["draft_acceptance_rate"]) == pytest.approx(
      (job["tau"], job["draft_acceptance_rate"]))
  assert timed["speedup"] > 0 and timed["cost_model_speedup"] > 0


@pytest.mark.parametrize("changes, message", [
    (dict(recipes=()), "recipes=\\(\\) is empty"),
    (dict(recipes=("adaspec",)), "reference head"),
    (dict(recipes=("gkd", "gkd")), "repeats"),
    (dict(steps=0), "steps"),
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(mlp_dim=0), "mlp_dim"),
    (dict(unroll_steps=0), "HeadStageConfig.unroll_steps=0 must be an integer >= 1"),
    (dict(unroll_steps=-3), "HeadStageConfig.unroll_steps=-3 must be an integer >= 1"),
    (dict(step_weights=()), "step_weights=\\(\\) is empty"),
    (dict(unroll_steps=3, step_weights=(1.0,)), "one weight per step")])
def test_head_stage_settings_are_refused_naming_the_value(changes, message):
  from distillspec_jax.studies.pipeline_config import HeadStageConfig
  with pytest.raises(ValueError, match=message):
    HeadStageConfig(**changes)


def test_head_unroll_defaults_to_the_largest_gamma(tmp_path, caplog):
  from distillspec_jax.evaluation.decoding_grid import DecodingGrid
  from distillspec_jax.studies.pipeline_config import HeadStageConfig, PipelineConfig
  with pytest.raises(TypeError, match="unroll_steps=True"):
    HeadStageConfig(unroll_steps=True)
  config = PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(3, 7, 5)), head=HeadStageConfig())
  assert config.head.training(config.grid.gammas).unroll_steps == 7
  assert len(config.head.training(config.grid.gammas).weights) == 7
  with pytest.raises(ValueError, match="3 entries for unroll_steps=7"):
    PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(7,)),
                   head=HeadStageConfig(step_weights=(1.0, 1.0, 1.0)))
  with caplog.at_level("WARNING"):
    config = PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(5, 7)),
                            head=HeadStageConfig(unroll_steps=3))
  assert config.head.training(config.grid.gammas).unroll_steps == 3
  assert "not trained for draft positions 4..7" in caplog.text


def test_a_head_layer_outside_the_target_is_refused_before_any_work(tmp_path):
  from distillspec_jax.studies.pipeline_config import HeadStageConfig, PipelineConfig
  head = HeadStageConfig(feature_layers=(0, 9))
  with pytest.raises(ValueError, match="feature layer index 9 is outside the target"):
    PipelineConfig(run_dir=str(tmp_path), target_model="demo_target", head=head)
  config = PipelineConfig(run_dir=str(tmp_path), head=HeadStageConfig(recipes=("gkd", "seqkd")))
  assert config.head_stages == ("distill_head_gkd", "distill_head_seqkd")
  assert config.dependencies("distill_head_gkd") == ("target",)
  assert set(config.head_stages) <= set(config.dependencies("evaluate"))
  assert PipelineConfig(run_dir=str(tmp_path)).head_stages == ()


def test_demo_head_run_file_adds_a_head_stage_at_gamma_5_and_7():
  from distillspec_jax import main
  config = main.load_pipeline(["--gin_file=gin/runs/demo_head.gin"])
  assert config.head_stages == ("distill_head_supervised_kd",) and config.grid.gammas == (5, 7)
  assert config.grid.temperatures == (0.0, 1.0) and config.head.mlp_dim == 256
  assert config.head.training(config.grid.gammas).unroll_steps == 7
  assert config.stages.index("distill_head_supervised_kd") < config.stages.index("evaluate")


def test_the_eval_binary_refuses_a_head_setting_that_does_not_fit(tmp_path):
  from distillspec_jax import eval as eval_lib
  from distillspec_jax.models.head import HEAD_CONFIG_FILE
  with pytest.raises(ValueError, match="draft_model"):
    eval_lib.EvalConfig(model_dir=str(tmp_path), mixture_or_task_name="x",
                        task_feature_lengths={"targets": 4}, target_checkpoint_path="t",
                        draft_checkpoint_path="d", draft_kind="head", draft_model="demo_draft")
  with pytest.raises(ValueError, match="draft_kind"):
    eval_lib.EvalConfig(model_dir=str(tmp_path), mixture_or_task_name="x",
                        task_feature_lengths={"targets": 4}, target_checkpoint_path="t",
                        draft_checkpoint_path="d", draft_kind="heads")
  # A head's folder without head.json: named, with the fix.
  from distillspec_jax.models.head import read_head_config
  target = Model.from_name("tiny_encoder_decoder")
  with pytest.raises(ValueError, match=f"{HEAD_CONFIG_FILE} is missing"):
    read_head_config(str(tmp_path), target.config, "DRAFT_CHECKPOINT_PATH")
  head = HeadConfig(target.config, mlp_dim=24, feature_layers=(0, 2))
  from distillspec_jax.models.head import write_head_config
  write_head_config(str(tmp_path), head)
  assert read_head_config(str(tmp_path), target.config, "DRAFT_CHECKPOINT_PATH") == head


def test_a_head_unrolled_past_its_training_sequences_is_refused_before_any_work(tmp_path):
  """The training-time test compares step s with the target at positions t + s < T: a job
  unrolling the head as deep as its training rows (T = the targets length on an
  encoder-decoder) failed only at the head stage's first step."""
  from distillspec_jax.evaluation.decoding_grid import DecodingGrid
  from distillspec_jax.studies.pipeline_config import HeadStageConfig, PipelineConfig
  with pytest.raises(ValueError, match=r"unroll_steps=7 .* 6 positions"):
    PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(7,)),
                   task_feature_lengths={"inputs": 40, "targets": 6}, head=HeadStageConfig())
  PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(5,)),
                 task_feature_lengths={"inputs": 40, "targets": 6}, head=HeadStageConfig())
