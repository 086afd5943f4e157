"""The acceptance statistics of decoding/stats.py, each under its own name: the serving
engines' (mean acceptance length, draft acceptance rate, per-position rates) beside the
paper's (tau, DistillSpec's alpha, conditional acceptance by position), pinned on hand-made
counts and on a tiny pair; DistillSpec's alpha measured by the engine agrees with
`predicted_alpha` = 1 - E[TVD] at T = 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.decoding import stats
from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.decoding.speculative import DraftLength, speculative_decode
from distillspec_jax.evaluation.quality import predicted_alpha
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model


VOCAB = 64


def test_definitions_on_hand_made_counts():
  # Two rows, gamma 3: row 0 ran rounds accepting 3, 1, 0 (two rejections, both in the
  # output); row 1 rounds accepting 2 (a rejection in the output) then 3 by the test, the
  # length limit keeping 1 of the last round's 3.
  out = stats.block_statistics(produced=[7, 4], target_calls=[3, 2], accepted=[4, 3],
                               drafted=[9, 6], accepted_proposed=[4, 5],
                               output_rejections=[2, 1])
  assert out["tau"] == pytest.approx(11 / 5)
  assert out["mean_acceptance_length"] == pytest.approx(1 + 7 / 5)  # vLLM, llama.cpp
  assert out["draft_acceptance_rate"] == pytest.approx(7 / 15) == out["alpha"]  # vLLM
  assert out["alpha_proposed"] == pytest.approx(9 / 15)
  # Tests at output positions: the 7 accepted tokens in the output and the 3 rejections.
  assert out["alpha_distillspec"] == pytest.approx(7 / (7 + 3))
  # mean acceptance length = 1 + gamma x draft acceptance rate, by definition.
  assert out["mean_acceptance_length"] == pytest.approx(1 + 3 * out["draft_acceptance_rate"])
  assert stats.block_statistics([0], [0], [0], [0], [0], [0])["alpha_distillspec"] is None
  assert "alpha_distillspec" not in stats.block_statistics([1], [1], [0], [3])


def test_per_position_rates_conditional_and_unconditional():
  rounds = np.array([[2, 0, -1], [1, 2, -1]])  # rounds accepting 2, 0, 1, 2 (gamma 2)
  # DistillSpec's: position 1 accepted in 3 of 4 rounds, position 2 in 2 of the 3 reaching it.
  assert stats.acceptance_by_position(rounds, 2) == [0.75, pytest.approx(2 / 3)]
  # vLLM's: of all 4 rounds, 3 accepted position 1 and 2 accepted position 2.
  by_position = stats.draft_acceptance_rate_by_position(rounds, 2)
  assert by_position == [0.75, 0.5]
  assert sum(by_position) == pytest.approx(5 / 4)  # = mean acceptance length - 1
  assert stats.draft_acceptance_rate_by_position(np.array([[-1]]), 2) == [None, None]
  # Under an adaptive draft length the round accepting 1 of 1 proposed never tested
  # position 2: of the two rounds that did, both accepted it.
  tested = np.array([[2, 1, -1], [1, 2, -1]])
  assert stats.acceptance_by_position(rounds, 2, tested_per_round=tested) == [0.75, 1.0]


def test_every_statistic_on_a_hand_computed_batch_with_eos_and_length_cuts():
  """Gamma 3, two rows of three rounds. Row 0: accepts all 3; accepts 1 and rejects the 2nd
  (the correction is output); accepts 2 of 3 by the test, the 2nd an EOS (the round keeps 2
  drafts, tests past the EOS do not count). Row 1: rejects the 1st; accepts all 3; accepts 2
  by the test and the length limit keeps 1 token."""
  accepted = np.array([[3, 1, 2], [0, 3, 1]])
  tested = np.array([[3, 2, 2], [1, 3, 1]])
  # produced: row 0 4 + 2 + 2 (up to the EOS), row 1 1 + 4 + 1 (the length cut).
  out = stats.block_statistics(produced=[8, 6], target_calls=[3, 3], accepted=[6, 4],
                               drafted=[9, 9], accepted_proposed=[7, 5],
                               output_rejections=[1, 1])
  assert out["tau"] == pytest.approx(14 / 6)
  assert out["mean_acceptance_length"] == pytest.approx(1 + 10 / 6)
  assert out["draft_acceptance_rate"] == pytest.approx(10 / 18) == out["alpha"]
  assert out["alpha_proposed"] == pytest.approx(12 / 18)
  assert out["alpha_distillspec"] == pytest.approx(10 / 12)
  # Position 1: 6 tests, 5 accepted; position 2: 4 tests (3, 2, 2, 3), 3 accepted; position 3:
  # 2 tests, both accepted. The cut rounds test no position past their output.
  by_position = stats.acceptance_by_position(accepted, 3, tested_per_round=tested)
  assert by_position == [pytest.approx(5 / 6), 0.75, 1.0]
  # The tests per position add up to alpha_distillspec's denominator: 6 + 4 + 2 = 10 + 2.
  assert int(tested.sum()) == 10 + 2
  # Reading the cut rounds as rejections (no tested counts) is the fault this replaces.
  assert stats.acceptance_by_position(accepted, 3)[2] == pytest.approx(2 / 3)
  assert stats.draft_acceptance_rate_by_position(accepted, 3) == pytest.approx(
      [5 / 6, 3 / 6, 2 / 6])
  with pytest.raises(ValueError, match="accepted <= tested <= accepted \\+ 1"):
    stats.acceptance_by_position(accepted, 3, tested_per_round=accepted + 2)


def _pair(noise: float):
  """A decoder-only target with peaked next-token distributions and a draft that is the
  target with noise added to its output layer (how far apart: `noise`)."""
  config = TransformerConfig(kind="decoder_only", vocab_size=VOCAB, emb_dim=16, num_heads=2,
                             num_encoder_layers=0, num_decoder_layers=1, head_dim=8,
                             mlp_dim=32, dropout_rate=0.0, max_decode_length=32)
  model = Model(config)
  target = jax.tree.map(lambda x: x, model.init(jax.random.PRNGKey(0)))
  kernel = target["decoder"]["logits_dense"]["kernel"] * 3.0
  target["decoder"]["logits_dense"]["kernel"] = kernel
  draft = jax.tree.map(lambda x: x, target)
  draft["decoder"]["logits_dense"]["kernel"] = kernel + noise * jax.random.normal(
      jax.random.PRNGKey(9), kernel.shape)
  return model, target, draft


def _prompts(count: int) -> np.ndarray:
  return np.random.default_rng(0).integers(2, VOCAB, (count, 4)).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_counts_match_both_definitions(temperature):
  model, target, draft = _pair(noise=1.0)
  gamma, new = 3, 12
  result = jax.device_get(speculative_decode(
      model, target, model, draft, prompt_tokens=jnp.asarray(_prompts(32)), max_new_tokens=new,
      gamma=gamma, sampling=SamplingConfig(temperature, eos_id=-1), rng=jax.random.PRNGKey(1)))
  out = stats.block_efficiency_stats(result)
  accepted, drafted = np.sum(result.accepted), np.sum(result.drafted)
  rounds, tested = np.sum(result.target_calls), np.sum(result.accepted_proposed)
  assert out["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
  assert out["mean_acceptance_length"] == pytest.approx(1 + accepted / rounds)
  assert out["alpha_distillspec"] == pytest.approx(
      accepted / (accepted + np.sum(result.output_rejections)))
  # A rejection reaches the output unless the length limit cut its round (no EOS here).
  assert np.all(result.output_rejections <= result.rejections)
  assert np.all(result.rejections - result.output_rejections <= 1)
  assert tested >= accepted
  # The draft tokens after a rejection are proposed but never tested: the rate per proposed
  # token is the lower one.
  assert out["draft_acceptance_rate"] < out["alpha_distillspec"] < 1.0
  np.testing.assert_array_equal(np.asarray(result.proposed_per_round) >= 0,
                                np.asarray(result.accepted_per_round) >= 0)
  assert set(np.unique(result.proposed_per_round)) <= {-1, gamma}
  # Recount the rejections from each round's accepted tokens: every round but a row's last
  # rejected exactly when it accepted fewer than gamma (only the last can be cut).
  per_round = np.asarray(result.accepted_per_round)
  for row in range(len(per_round)):
    kept = per_round[row][per_round[row] >= 0]
    earlier = int(np.sum(kept[:-1] < gamma))
    assert result.rejections[row] - earlier in (0, 1), (row, kept, result.rejections[row])
    if kept[-1] < min(gamma, new - 1 - np.sum(kept[:-1] + 1)):  # not cut: a real rejection
      assert result.rejections[row] == earlier + 1


@pytest.mark.slow
def test_distillspec_alpha_counts_only_tests_at_output_positions():
  """With an EOS, a round can accept the EOS and test (and reject) draft tokens after it:
  those tests score contexts the output never has, so alpha_distillspec leaves them out.
  Every rejection that counts is one whose correction token is in the output."""
  model, target, draft = _pair(noise=0.5)
  result = jax.device_get(speculative_decode(
      model, target, model, draft, prompt_tokens=jnp.asarray(_prompts(64)), max_new_tokens=16,
      gamma=5, sampling=SamplingConfig(1.0, eos_id=11), rng=jax.random.PRNGKey(1)))
  out = stats.block_efficiency_stats(result)
  accepted, kept = np.sum(result.accepted), np.sum(result.output_rejections)
  assert out["alpha_distillspec"] == pytest.approx(accepted / (accepted + kept))
  # Each row's tests at output positions, round by round, are the same tests.
  np.testing.assert_array_equal(np.asarray(result.tested_per_round).clip(0).sum(1),
                                np.asarray(result.accepted) + result.output_rejections)
  # Rows that ended on an accepted EOS ran tests past it; the statistic leaves them out.
  assert np.sum(result.rejections) > kept and np.sum(result.accepted_proposed) > accepted
  # A rejection in the output ends its round with a correction token: a row's rounds number
  # at least its kept rejections (each round rejects at most once).
  assert np.all(result.output_rejections <= result.target_calls)


@pytest.mark.slow
def test_an_identical_draft_is_never_rejected_though_the_length_limit_cuts_its_rate():
  model, target, _ = _pair(noise=0.0)
  gamma, new = 4, 13  # 12 tokens after the prefill's: two full rounds and one cut to 2
  result = jax.device_get(speculative_decode(
      model, target, model, target, prompt_tokens=jnp.asarray(_prompts(4)),
      max_new_tokens=new, gamma=gamma, sampling=SamplingConfig(1.0, eos_id=-1),
      rng=jax.random.PRNGKey(2)))
  out = stats.block_efficiency_stats(result)
  np.testing.assert_array_equal(result.rejections, 0)
  np.testing.assert_array_equal(result.output_rejections, 0)
  assert out["alpha_distillspec"] == 1.0
  assert out["draft_acceptance_rate"] == pytest.approx((4 + 4 + 2) / 12)
  assert out["mean_acceptance_length"] == pytest.approx(1 + (4 + 4 + 2) / 3)


@pytest.mark.slow
def test_distillspec_alpha_agrees_with_predicted_alpha_at_temperature_one():
  """Lossless sampling accepts a draft token with probability 1 - TVD(p, q) at its context,
  and the contexts it tests are target samples, so accepted / tests estimates the mean of
  1 - TVD along target samples: `predicted_alpha`. The draft acceptance rate (per proposed
  token) does not, and is far below it."""
  model, target, draft = _pair(noise=0.5)
  prompts = _prompts(256)
  sampling = SamplingConfig(1.0, eos_id=-1)
  samples = decode(model, target, prompt_tokens=jnp.asarray(prompts), max_new_tokens=16,
                   sampling=sampling, rng=jax.random.PRNGKey(2)).tokens
  predicted = predicted_alpha(model, target, model, draft, prompts, np.asarray(samples), 1.0)
  for gamma in (3, 5):
    result = speculative_decode(model, target, model, draft, prompt_tokens=jnp.asarray(prompts),
                                max_new_tokens=16, gamma=gamma, sampling=sampling,
                                rng=jax.random.PRNGKey(1))
    out = stats.block_efficiency_stats(jax.device_get(result))
    assert abs(out["alpha_distillspec"] - predicted) < 0.03, (gamma, out, predicted)
    assert out["draft_acceptance_rate"] < predicted - 0.15, (gamma, out, predicted)


@pytest.mark.slow
def test_an_identical_draft_reads_one_at_every_position_through_eos_and_length_cuts():
  """Draft == target at T = 0: every test accepts, so every per-position acceptance is 1.0,
  though an EOS (a token some row drafts early) and the length limit (12 tokens after the
  prefill's: two rounds of 5 and one cut to 2) end rounds inside their proposals."""
  model, target, _ = _pair(noise=0.0)
  gamma, new = 4, 13
  prompts = jnp.asarray(_prompts(8))
  run = lambda eos: jax.device_get(speculative_decode(
      model, target, model, target, prompt_tokens=prompts, max_new_tokens=new, gamma=gamma,
      sampling=SamplingConfig(0.0, eos_id=eos)))
  free = np.asarray(run(-1).tokens)
  eos = int(free[0, 2])  # row 0's second draft token of its first round
  result = run(eos)
  rounds, tested = np.asarray(result.accepted_per_round), np.asarray(result.tested_per_round)
  cut = (rounds >= 0) & (rounds < gamma)
  assert np.any(cut[result.lengths < new]) and np.any(cut[result.lengths == new])
  np.testing.assert_array_equal(tested, rounds)  # no test rejected
  assert stats.acceptance_by_position(rounds, gamma, tested_per_round=tested) == [1.0] * gamma
  assert stats.block_efficiency_stats(result)["alpha_distillspec"] == 1.0
  # Counting a cut round as a rejection after its last output token reads below 1.
  assert min(stats.acceptance_by_position(rounds, gamma)) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("rule", [
    DraftLength("confidence", 0.6), DraftLength("cumulative", 0.4),
    DraftLength("cost", costs=(1.0, 1.1, 1.25, 1.45, 1.7), draft_cost=0.05)])
def test_a_rows_draft_calls_are_its_own_alone_and_in_a_batch(rule):
  """Under an adaptive rule the batch's draft loop runs until its last row stops; a row
  counts only the calls it needed (its proposal + 1 where it stopped early, gamma where it
  proposed gamma), so alone it counts the same tokens, proposals and calls."""
  model, target, draft = _pair(noise=1.0)
  gamma, prompts = 4, _prompts(4)
  run = lambda rows: jax.device_get(speculative_decode(
      model, target, model, draft, prompt_tokens=jnp.asarray(rows), max_new_tokens=14,
      gamma=gamma, sampling=SamplingConfig(0.0, eos_id=-1), draft_length=rule))
  batch = run(prompts)
  proposed = np.asarray(batch.proposed_per_round)
  assert np.any((proposed > 0) & (proposed < gamma)), "the rule never stopped early"
  own = np.where(proposed > 0, np.minimum(proposed + 1, gamma), 0).sum(1)
  np.testing.assert_array_equal(batch.draft_calls, own)
  for row in range(len(prompts)):
    # Alone: a batch of copies of the row, which stop together (the batch's program again).
    alone = run(np.repeat(prompts[row:row + 1], len(prompts), axis=0))
    for field in ("tokens", "draft_calls", "drafted", "target_calls", "proposed_per_round",
                  "tested_per_round"):
      np.testing.assert_array_equal(getattr(alone, field), np.repeat(
          getattr(batch, field)[row:row + 1], len(prompts), axis=0), f"{field} of row {row}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_predicted_alpha_of_a_nan_target_is_nan(temperature):
  # Greedy, the per-token acceptance compared argmaxes, and argmax of a NaN row is an index:
  # a target with NaN logits read as a predicted alpha in [0, 1].
  model, target, draft = _pair(noise=0.5)
  kernel = target["decoder"]["logits_dense"]["kernel"]
  target["decoder"]["logits_dense"]["kernel"] = kernel.at[0, 3].set(jnp.nan)
  prompts = _prompts(4)
  samples = np.random.default_rng(1).integers(2, VOCAB, (4, 6)).astype(np.int32)
  assert np.isnan(predicted_alpha(model, target, model, draft, prompts, samples, temperature))


def test_statistics_of_no_round_or_no_draft_are_undefined_not_a_number():
  """Every row's first token EOS (no target call, nothing drafted): tau, the rates and the
  mean acceptance length are None; they were 0.0, 0.0 and 1.0 (clamped denominators)."""
  none = stats.block_statistics(produced=[0, 0], target_calls=[0, 0], accepted=[0, 0],
                                drafted=[0, 0], accepted_proposed=[0, 0],
                                output_rejections=[0, 0])
  for key in ("tau", "tau_stderr", "mean_acceptance_length", "draft_acceptance_rate", "alpha",
              "alpha_proposed", "alpha_distillspec"):
    assert none[key] is None, (key, none[key])
  # A round that proposed nothing (an adaptive rule): tau is defined, the rates are not.
  undrafted = stats.block_statistics([2], [1], [0], [0], accepted_proposed=[0])
  assert undrafted["tau"] == 2.0 and undrafted["mean_acceptance_length"] == 1.0
  assert undrafted["draft_acceptance_rate"] is None and undrafted["alpha_proposed"] is None


def test_a_result_with_no_round_has_nan_tau_and_rates_not_a_clamped_number():
  """SpeculativeResult.block_efficiency / acceptance_rate / proposed_acceptance_rate divided
  by max(count, 1): 0.0 where no target call ran and nothing was drafted. Undefined is NaN."""
  from distillspec_jax.decoding.speculative import SpeculativeResult
  zeros = jnp.zeros((2,), jnp.int32)
  none = -jnp.ones((2, 1), jnp.int32)
  result = SpeculativeResult(
      tokens=jnp.ones((2, 1), jnp.int32), lengths=jnp.ones((2,), jnp.int32),
      target_calls=zeros, draft_calls=zeros, drafted=zeros, accepted=zeros,
      accepted_proposed=zeros, produced=zeros, accepted_per_round=none, rejections=zeros,
      proposed_per_round=none, output_rejections=zeros, tested_per_round=none)
  for name in ("block_efficiency", "acceptance_rate", "proposed_acceptance_rate"):
    assert np.isnan(float(getattr(result, name))), name
