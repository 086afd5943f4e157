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
from distillspec_jax.models.head import Head, HeadConfig
from distillspec_jax.models.model import Model

pytestmark = pytest.mark.usefixtures("fast_compilation")  # conftest.py


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
