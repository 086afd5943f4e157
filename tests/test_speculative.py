"""Speculative decoding: exactness (greedy and sampled), statistics, lenience, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from distillspec_jax.decoding import speculative
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.distill.divergences import expected_acceptance
from distillspec_jax.models.model import EOS_ID, Model, TokenIds
from distillspec_jax.decoding.speculative import (DraftLength, Lenience, acceptance_probability,
                                                  speculative_decode)


def _pair(kind):
  common = dict(kind=kind, vocab_size=97, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                dropout_rate=0.0, max_decode_length=64)
  enc = 1 if kind == "encoder_decoder" else 0
  target = Model(TransformerConfig(num_encoder_layers=2 * enc, num_decoder_layers=2, **common))
  draft = Model(TransformerConfig(num_encoder_layers=enc, num_decoder_layers=1, **common))
  return target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1))


def _prompts(kind, batch=4):
  # Rows of different lengths (0 = padding).
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(7), (batch, 6), 2, 97))
  tokens[1, 3:] = 0
  tokens[2, 1:] = 0
  key = "encoder_input_tokens" if kind == "encoder_decoder" else "prompt_tokens"
  return {key: jnp.asarray(tokens)}


# The adaptive rule of the exactness tests: a threshold at which the tiny pairs' drafts stop
# some rounds early and not others.
ADAPTIVE = DraftLength("confidence", 0.05)
# The 'cost' rule: verifying up to 4 tokens free, a jump after (as a CPU's vector width makes
# one), so a tiny random draft proposes 3 tokens a round and a sure one more.
COSTS = DraftLength("cost", costs=(1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0))


# The fixed engine at the edge gammas 1 and 6 on both kinds (gamma 3, in between, is
# test_capacity_check_is_exact's, greedy and exact on both kinds); each adaptive rule at one
# gamma_max (its logic is the same for both kinds: the confidence rule runs on both). The
# decoder-only programs at max_new_tokens 20, gamma 1 and 6 also serve the argument and
# bad-input tests below (one compiled program per shape and setting).
@pytest.mark.slow
@pytest.mark.parametrize("kind, draft_length, gammas", [
    ("encoder_decoder", DraftLength(), (1, 6)), ("decoder_only", DraftLength(), (1, 6)),
    ("encoder_decoder", ADAPTIVE, (4,)), ("decoder_only", ADAPTIVE, (4,)),
    ("decoder_only", DraftLength("cumulative", 0.002), (4,)), ("decoder_only", COSTS, (6,))])
def test_greedy_speculative_equals_greedy_target(kind, draft_length, gammas):
  target, tp, draft, dp = _pair(kind)
  prompts = _prompts(kind)
  reference = decode(target, tp, max_new_tokens=20, **prompts)
  for gamma in gammas:
    result = speculative_decode(target, tp, draft, dp, max_new_tokens=20, gamma=gamma,
                                draft_length=draft_length, **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    np.testing.assert_array_equal(result.lengths, reference.lengths)
    proposed, most = int(np.sum(result.drafted)), gamma * int(np.sum(result.target_calls))
    if draft_length.adaptive and gamma > 1:  # the rule stopped some rounds, not all
      assert int(np.sum(result.target_calls)) < proposed < most
    else:
      assert proposed == most


def _recount_identical_draft(lengths, gamma):
  """Accepted draft tokens that reach the output, per row, when every draft token is accepted
  (draft == target): the output's tokens after the prefill's come in rounds of gamma draft
  tokens plus the target's bonus token; the last round keeps min(its tokens, gamma) drafts."""
  produced = np.asarray(lengths) - 1
  rounds = -(-produced // (gamma + 1))
  last = produced - (rounds - 1) * (gamma + 1)
  return (rounds - 1) * gamma + np.minimum(last, gamma), rounds, last


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_identical_draft_accepts_everything(temperature):
  """Draft == target accepts every draft token; the length limit (22 = 4 x 5 + 2 tokens after
  the prefill's) cuts the last round to 2 tokens, so 2 of its 4 accepted tokens reach the
  output and alpha = 18 / 20, not 1."""
  target, tp, _, _ = _pair("decoder_only")
  gamma, new = 4, 23
  result = speculative_decode(target, tp, target, tp, max_new_tokens=new, gamma=gamma,
                              sampling=SamplingConfig(temperature, eos_id=-1),
                              rng=jax.random.PRNGKey(3), **_prompts("decoder_only"))
  np.testing.assert_array_equal(result.accepted_proposed, result.drafted)
  # The first token comes from the prefill; every round then yields gamma + 1 tokens until the
  # length limit cuts the last one.
  np.testing.assert_array_equal(result.produced, new - 1)
  np.testing.assert_array_equal(result.target_calls, -(-(new - 1) // (gamma + 1)))
  expected, rounds, last = _recount_identical_draft(result.lengths, gamma)
  assert np.all(last < gamma)  # the cut this test is about
  np.testing.assert_array_equal(result.accepted, expected)
  np.testing.assert_allclose(float(result.acceptance_rate),
                             expected.sum() / (gamma * rounds.sum()), rtol=1e-6)
  np.testing.assert_allclose(float(result.proposed_acceptance_rate), 1.0)
  per_round = np.asarray(result.accepted_per_round)
  assert np.all(per_round[:, :rounds[0] - 1] == gamma)
  np.testing.assert_array_equal(per_round[:, rounds[0] - 1], last)
  np.testing.assert_array_equal(per_round[:, rounds[0]:], -1)
  np.testing.assert_array_equal(per_round.clip(0).sum(1), result.accepted)


@pytest.mark.slow
def test_alpha_counts_only_accepted_tokens_that_reach_the_output():
  """An accepted EOS inside a block ends the row: the accepted draft tokens after it are not
  output and must not count in alpha (draft == target, so every draft token is accepted).
  Sampled only: the temperature decides how many tokens a round accepts (greedy and sampled
  acceptance are test_identical_draft_accepts_everything's), and the cut at EOS and the counts
  after it read that number the same way at either temperature."""
  target, tp, _, _ = _pair("decoder_only")
  gamma, new, temperature = 4, 23, 1.0
  prompts = _prompts("decoder_only")
  run = lambda eos: speculative_decode(target, tp, target, tp, max_new_tokens=new, gamma=gamma,
                                       sampling=SamplingConfig(temperature, eos_id=eos),
                                       rng=jax.random.PRNGKey(4), **prompts)
  free = np.asarray(run(-1).tokens)
  # EOS := a token some row emits at a draft position (not a round's bonus token), early.
  draft_position = ((np.arange(new) - 1) % (gamma + 1) < gamma) & (np.arange(new) >= 1)
  candidates = [int(t) for t in free[:, 1:new - gamma].ravel()
                if draft_position[np.flatnonzero(np.any(free == t, axis=0))[0]]]
  assert candidates, "no token to relabel as EOS"
  eos = candidates[0]
  result = run(eos)
  lengths = np.asarray(result.lengths)
  for row in range(len(lengths)):  # the same draws: each row is the EOS-free row, cut
    hits = np.flatnonzero(free[row] == eos)
    assert lengths[row] == (hits[0] + 1 if hits.size else new)
  expected, rounds, last = _recount_identical_draft(lengths, gamma)
  assert np.any((lengths < new) & (last <= gamma))  # some row's last round was cut by EOS
  np.testing.assert_array_equal(result.target_calls, rounds)
  np.testing.assert_array_equal(result.accepted, expected)
  np.testing.assert_array_equal(result.accepted_proposed, gamma * rounds)
  np.testing.assert_allclose(float(result.acceptance_rate),
                             expected.sum() / (gamma * rounds.sum()), rtol=1e-6)
  assert float(result.acceptance_rate) < 1.0
  assert np.all(np.asarray(result.accepted) <= np.asarray(result.produced))



def _first_stop_candidate(free, ok):
  """A token that first appears in some row of `free` (outputs decoded with no stop) at a
  position i >= 1 with ok(i), before any EOS of that row: (token, row, i)."""
  for row, tokens in enumerate(np.asarray(free)):
    for i in range(1, len(tokens)):
      t = int(tokens[i])
      if EOS_ID in tokens[:i + 1]:
        break
      if t != 0 and t not in tokens[:i] and ok(i):
        return t, row, i
  raise AssertionError("no token to make a stop id")


_RESULT_FIELDS = ("tokens", "lengths", "target_calls", "draft_calls", "drafted", "accepted",
                  "accepted_proposed", "produced", "rejections", "output_rejections",
                  "accepted_per_round", "proposed_per_round", "tested_per_round")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
def test_greedy_speculative_with_stop_ids_equals_greedy_target(kind):
  """A model's further stop ids (TokenIds.stop_ids: an instruct model's turn end) end a row
  like its EOS in the rounds too: greedy speculative decoding with a stop id equals plain
  greedy decoding with it, with the tiny draft and with the target as its own draft, whose
  rounds accept every draft token, so the stop id is accepted mid-round and the accepted
  draft tokens after it are cut."""
  target, tp, draft, dp = _pair(kind)
  prompts = _prompts(kind)
  gamma, new = 3, 20
  free = decode(target, tp, max_new_tokens=new, sampling=SamplingConfig(eos_id=-1), **prompts)
  # First at a draft position of the identical draft's rounds (gamma + 1 tokens a round after
  # the prefill's) with another draft token after it in the round.
  stop, row, position = _first_stop_candidate(
      free.tokens, lambda i: (i - 1) % (gamma + 1) < gamma - 1 and i < new - gamma)
  tokens = TokenIds(stop_ids=(stop,))
  stopping = target.with_tokens(tokens)
  reference = decode(stopping, tp, max_new_tokens=new, **prompts)
  assert int(reference.lengths[row]) == position + 1
  assert int(reference.tokens[row, position]) == stop
  np.testing.assert_array_equal(np.asarray(reference.tokens)[row, position + 1:], 0)
  for name, d, p in (("tiny draft", draft.with_tokens(tokens), dp), ("identical", stopping, tp)):
    result = speculative_decode(stopping, tp, d, p, max_new_tokens=new, gamma=gamma, **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens, err_msg=name)
    np.testing.assert_array_equal(result.lengths, reference.lengths, err_msg=name)
  # The identical draft's last round of `row` accepted the stop id and tokens after it.
  assert int(result.accepted[row]) < int(result.accepted_proposed[row])
  assert int(result.produced[row]) == position


@pytest.mark.slow
def test_statistics_of_a_row_cut_by_a_stop_id_equal_those_of_the_row_cut_by_eos():
  """The rounds count a cut at a stop id as the cut at EOS: a model whose EOS is 1 and stop
  id s decodes (sampled, same key) exactly as the model whose EOS is s and stop id 1, every
  count and per-round statistic included (accepted and tested per round, tau)."""
  from distillspec_jax.decoding.stats import block_efficiency_stats
  target, tp, draft, dp = _pair("decoder_only")
  prompts, gamma, new = _prompts("decoder_only"), 4, 23
  sampling = SamplingConfig(1.0)
  run = lambda tokens, d, p: speculative_decode(
      target.with_tokens(tokens), tp, d.with_tokens(tokens), p, max_new_tokens=new,
      gamma=gamma, sampling=sampling, rng=jax.random.PRNGKey(4), **prompts)
  for d, p in ((draft, dp), (target, tp)):
    free = speculative_decode(target, tp, d, p, max_new_tokens=new, gamma=gamma,
                              sampling=SamplingConfig(1.0, eos_id=-1),
                              rng=jax.random.PRNGKey(4), **prompts)
    # For the identical draft (every round gamma + 1 tokens): inside a round, drafts after it.
    stop, row, position = _first_stop_candidate(
        free.tokens, lambda i: i < new - gamma and (d is draft or (i - 1) % (gamma + 1) < gamma - 1))
    by_stop = run(TokenIds(eos_id=EOS_ID, stop_ids=(stop,)), d, p)
    by_eos = run(TokenIds(eos_id=stop, stop_ids=(EOS_ID,)), d, p)
    assert int(by_stop.lengths[row]) == position + 1
    for name in _RESULT_FIELDS:
      np.testing.assert_array_equal(getattr(by_stop, name), getattr(by_eos, name), err_msg=name)
    assert block_efficiency_stats(by_stop) == block_efficiency_stats(by_eos)
  # The identical draft: the stop id's round was cut (accepted drafts after it not counted).
  assert int(by_stop.accepted[row]) < int(by_stop.accepted_proposed[row])

def _peaked_decoder_pair(vocab=5, seed_target=0, seed_draft=1):
  """Tiny decoder-only models whose next-token distributions are far from uniform and differ."""
  config = TransformerConfig(kind="decoder_only", vocab_size=vocab, emb_dim=16, num_heads=2,
                             num_encoder_layers=0, num_decoder_layers=1, head_dim=8, mlp_dim=32,
                             dropout_rate=0.0, max_decode_length=16)
  model = Model(config)

  def sharpen(params, scale):
    params = jax.tree.map(lambda x: x, params)
    params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * scale
    return params

  return (model, sharpen(model.init(jax.random.PRNGKey(seed_target)), 3.0),
          sharpen(model.init(jax.random.PRNGKey(seed_draft)), 3.0))


# Teacher-forced logits as one compiled program per model and shape (called eagerly, each
# operation compiles on its own).
_logits = jax.jit(lambda model, params, tokens: model.logits(
    params, {"decoder_input_tokens": tokens}), static_argnums=0)


def _exact_sequence_distribution(model, params, length, eos):
  """P(y) for every continuation of the empty prompt, enumerated with full forward passes:
  one batched pass per depth over every unfinished prefix of that depth (rows of one length,
  no padding, so each row's logits are its own sequence's). eos: the id, or the ids, that
  end a sequence."""
  vocab = model.config.vocab_size
  ends = {eos} if isinstance(eos, int) else set(eos)
  probs, live = {}, {(): 1.0}  # finished sequences; unfinished prefixes
  for depth in range(length):
    prefixes = list(live)
    logits = _logits(model, params, jnp.array([[0, *prefix] for prefix in prefixes]))
    p = np.asarray(jax.nn.softmax(logits[:, -1]), np.float64)
    grown = {}
    for row, prefix in enumerate(prefixes):
      for token in range(vocab):  # generated 0s are ordinary tokens; lengths delimit outputs
        ended = token in ends or depth == length - 1
        (probs if ended else grown)[prefix + (token,)] = live[prefix] * p[row, token]
    live = grown
  return probs


def _goodness_of_fit_pvalue(samples, expected):
  """Chi-square test of sampled sequences against exact probabilities (rare cells pooled)."""
  n = len(samples)
  counts = {}
  for s in samples:
    counts[s] = counts.get(s, 0) + 1
  observed_cells, expected_cells = [], []
  pooled_observed, pooled_expected = 0, 0.0
  for seq, prob in expected.items():
    if prob * n >= 5:
      observed_cells.append(counts.pop(seq, 0))
      expected_cells.append(prob * n)
    else:
      pooled_observed += counts.pop(seq, 0)
      pooled_expected += prob * n
  pooled_observed += sum(counts.values())  # sequences outside the support (must be ~none)
  observed_cells.append(pooled_observed)
  expected_cells.append(max(pooled_expected, 1e-9))
  return stats.chisquare(observed_cells, np.array(expected_cells) * n / sum(expected_cells)).pvalue


def _sample_speculative(model, tp, dp, lenience, num_samples, length, gamma=2, seed=11,
                        eos_id=1):
  result = speculative_decode(model, tp, model, dp, prompt_tokens=jnp.zeros((num_samples, 1), jnp.int32),
                              max_new_tokens=length, gamma=gamma,
                              sampling=SamplingConfig(1.0, eos_id=eos_id), lenience=lenience,
                              rng=jax.random.PRNGKey(seed))
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  return [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]


@pytest.mark.slow
def test_sampled_speculative_matches_target_distribution_and_broken_variants_fail(monkeypatch):
  model, tp, dp = _peaked_decoder_pair()
  length, num_samples = 3, 20000
  expected = _exact_sequence_distribution(model, tp, length, eos=1)
  np.testing.assert_allclose(sum(expected.values()), 1.0, atol=1e-4)
  draft_distribution = _exact_sequence_distribution(model, dp, length, eos=1)
  # The draft is far from the target, so a wrong acceptance rule has something to show.
  assert 0.5 * sum(abs(expected[k] - draft_distribution.get(k, 0.0)) for k in expected) > 0.1

  exact = _sample_speculative(model, tp, dp, Lenience("lin", 1.0), num_samples, length)
  assert _goodness_of_fit_pvalue(exact, expected) > 1e-3

  # Teeth 1: lossy acceptance (eps = 0.5) no longer samples the target's distribution.
  lossy = _sample_speculative(model, tp, dp, Lenience("lin", 0.5), num_samples, length)
  assert _goodness_of_fit_pvalue(lossy, expected) < 1e-6

  # Teeth 2: a broken engine that accepts every draft token.
  # Only the engine's program is traced anew and evicted after: clearing every cache
  # (jax.clear_caches) would make each later test of the process compile again.
  engine = speculative._speculative_jit  # pylint: disable=protected-access
  monkeypatch.setattr(speculative, "acceptance_probability",
                      lambda p, q, lenience=None: jnp.ones_like(p))
  engine.clear_cache()
  broken = _sample_speculative(model, tp, dp, Lenience("lin", 1.0), num_samples, length, seed=12)
  engine.clear_cache()
  assert _goodness_of_fit_pvalue(broken, expected) < 1e-6



@pytest.mark.slow
def test_sampled_speculative_with_a_stop_id_matches_target_distribution():
  """With a stop id (3) beside EOS (1), the sampled output distribution is the target's
  stopping at either; the same samples do not fit the distribution stopping at EOS alone."""
  model, tp, dp = _peaked_decoder_pair()
  stopping = model.with_tokens(TokenIds(stop_ids=(3,)))
  length, num_samples = 3, 20000
  expected = _exact_sequence_distribution(model, tp, length, eos=(1, 3))
  samples = _sample_speculative(stopping, tp, dp, Lenience(), num_samples, length,
                                eos_id=None)
  assert any(len(s) < length and s[-1] == 3 for s in samples)
  assert _goodness_of_fit_pvalue(samples, expected) > 1e-3
  assert _goodness_of_fit_pvalue(
      samples, _exact_sequence_distribution(model, tp, length, eos=1)) < 1e-6

@pytest.mark.slow
@pytest.mark.parametrize("rule", [DraftLength("confidence", 0.5),
                                  DraftLength("cumulative", 0.3),
                                  DraftLength("cost", costs=(1.0, 1.1, 1.2, 1.3),
                                              draft_cost=0.02)])
def test_sampled_speculative_with_adaptive_draft_length_matches_target_distribution(rule):
  """The exactness check with each adaptive rule on: proposals of 1-3 tokens, chosen from the
  draft's confidence (and the 'cost' rule's prices), leave the output distribution the
  target's."""
  model, tp, dp = _peaked_decoder_pair()
  length, num_samples = 4, 20000
  expected = _exact_sequence_distribution(model, tp, length, eos=1)
  result = speculative_decode(model, tp, model, dp,
                              prompt_tokens=jnp.zeros((num_samples, 1), jnp.int32),
                              max_new_tokens=length, gamma=3,
                              sampling=SamplingConfig(1.0, eos_id=1), draft_length=rule,
                              rng=jax.random.PRNGKey(13))
  proposed, rounds = int(np.sum(result.drafted)), int(np.sum(result.target_calls))
  assert 1.3 * rounds < proposed < 2.7 * rounds  # a mix of short and long proposals
  per_round = np.asarray(result.proposed_per_round)
  assert int(per_round.clip(0).sum()) == proposed and len(set(np.unique(per_round)) - {-1}) >= 2
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  samples = [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]
  assert _goodness_of_fit_pvalue(samples, expected) > 1e-3


@pytest.mark.slow
def test_adaptive_rule_at_threshold_zero_is_the_fixed_engine():
  """Threshold 0 proposes gamma_max every round: the same tokens and counts as fixed gamma."""
  target, tp, draft, dp = _pair("decoder_only")
  for temperature in (1.0,):  # sampled: the random draws must line up too
    run = lambda rule: speculative_decode(
        target, tp, draft, dp, max_new_tokens=16, gamma=3, draft_length=rule,
        sampling=SamplingConfig(temperature), rng=jax.random.PRNGKey(2),
        **_prompts("decoder_only"))
    fixed, adaptive = run(DraftLength()), run(DraftLength("confidence", 0.0))
    for field in ("tokens", "lengths", "target_calls", "draft_calls", "drafted", "accepted",
                  "rejections", "accepted_per_round"):
      np.testing.assert_array_equal(getattr(adaptive, field), getattr(fixed, field), field)


def test_adaptive_rule_bad_input_names_the_value():
  target, tp, draft, dp = _pair("decoder_only")
  prompts = _prompts("decoder_only")
  with pytest.raises(ValueError, match="gamma_max=0 must be an integer >= 1"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=0,
                       draft_length=ADAPTIVE, **prompts)
  for threshold in (-0.1, 1.5):
    with pytest.raises(ValueError, match=f"threshold={threshold}"):
      DraftLength("confidence", threshold)
  with pytest.raises(ValueError, match="threshold=0.5 with rule 'fixed'.*reads no threshold"):
    DraftLength("fixed", 0.5)  # silently ignored before
  with pytest.raises(ValueError, match="'entropy'.*'fixed', 'confidence'"):
    DraftLength("entropy", 0.5)
  # The cost rule: a price for every width, positive and finite; the other rules take none.
  with pytest.raises(ValueError, match="The 'cost' rule needs costs"):
    DraftLength("cost")
  with pytest.raises(ValueError, match="costs\\[1\\]=-1.0 must be > 0; it prices a 2-token verification"):
    DraftLength("cost", costs=(1.0, -1.0))
  with pytest.raises(ValueError, match="draft_cost=nan"):
    DraftLength("cost", costs=(1.0, 1.2), draft_cost=float("nan"))
  with pytest.raises(ValueError, match="rule 'confidence' takes a threshold only"):
    DraftLength("confidence", 0.5, costs=(1.0, 1.2))
  with pytest.raises(ValueError, match="costs has 3 entries but gamma_max=4 verifies up to 5"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=4,
                       draft_length=DraftLength("cost", costs=(1.0, 1.1, 1.2)), **prompts)
  with pytest.raises(TypeError, match="draft_length must be a DraftLength"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=2,
                       draft_length="confidence", **prompts)


@pytest.mark.slow
def test_empirical_acceptance_matches_one_minus_tvd():
  """gamma = 1: each round's acceptance probability is 1 - TVD(p, q) at that round's context."""
  model, tp, dp = _peaked_decoder_pair(vocab=7, seed_target=2, seed_draft=3)
  batch, new = 400, 8
  result = speculative_decode(model, tp, model, dp, prompt_tokens=jnp.zeros((batch, 1), jnp.int32),
                              max_new_tokens=new, gamma=1, sampling=SamplingConfig(1.0, eos_id=-1),
                              rng=jax.random.PRNGKey(5))
  tokens = np.asarray(result.tokens)
  rounds = np.asarray(result.accepted_per_round)
  contexts, accepted = [], []
  for row in range(batch):
    held = 1  # tokens committed before the round (the first comes from the prefill)
    for a in rounds[row]:
      if a < 0:
        break
      contexts.append(np.concatenate([[0], tokens[row, :held]]))
      accepted.append(a)
      held += a + 1
  contexts = np.stack([np.pad(c, (0, new + 1 - len(c))) for c in contexts])
  ends = np.array([np.count_nonzero(c[1:]) for c in contexts])  # index of the last real token
  t_logits = _logits(model, tp, jnp.asarray(contexts))
  d_logits = _logits(model, dp, jnp.asarray(contexts))
  rows = np.arange(len(contexts))
  beta = np.asarray(expected_acceptance(t_logits[rows, ends], d_logits[rows, ends]))
  accepted = np.array(accepted, np.float64)
  standard_error = np.sqrt(np.sum(beta * (1 - beta))) / len(beta)
  assert abs(accepted.mean() - beta.mean()) < 4 * standard_error
  np.testing.assert_allclose(float(result.acceptance_rate), accepted.mean(), rtol=1e-6)


@pytest.mark.parametrize("kind", speculative.LENIENCE_FUNCTIONS)
def test_acceptance_does_not_decrease_as_epsilon_decreases(kind):
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(11), size=200)
  q = rng.dirichlet(np.ones(11), size=200)
  previous = None
  for eps in (1.0, 0.8, 0.5, 0.3, 0.1):
    per_token = acceptance_probability(jnp.asarray(p), jnp.asarray(q), Lenience(kind, eps))
    expected = np.sum(q * np.asarray(per_token), axis=-1)  # E_{y~q}[min(1, f(p(y))/q(y))]
    if previous is not None:
      assert np.all(expected >= previous - 1e-7)
    previous = expected
  lossless = np.sum(q * np.asarray(acceptance_probability(jnp.asarray(p), jnp.asarray(q))), -1)
  np.testing.assert_allclose(lossless, 1 - 0.5 * np.abs(p - q).sum(-1), atol=1e-6)


def test_bad_input_is_rejected_with_a_clear_message():
  target, tp, draft, dp = _pair("decoder_only")
  prompts = _prompts("decoder_only")
  with pytest.raises(ValueError, match="gamma=0"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=0, **prompts)
  for eps in (0.0, 1.5):
    with pytest.raises(ValueError, match=f"epsilon={eps}"):
      Lenience("lin", eps)
  with pytest.raises(ValueError, match="'cubic'"):
    Lenience("cubic", 0.5)
  # Greedy verification accepts only the target's argmax: a lossy lenience would be silently
  # ignored, so it is refused; epsilon 1 (every kind lossless) is exact greedy decoding. The
  # greedy acceptance test reads no lenience, so the engine runs once (Lenience('lin', 1.0)
  # is the default's program) and each kind's epsilon 1 passes the same check before it.
  reference = decode(target, tp, max_new_tokens=20, **prompts)
  for kind in speculative.LENIENCE_FUNCTIONS:
    with pytest.raises(ValueError, match=rf"Lenience\('{kind}', epsilon=0.5\) at temperature 0"):
      speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=2,
                         lenience=Lenience(kind, 0.5), **prompts)
    Lenience(kind, 1.0).check_temperature(0.0)
  lossless = speculative_decode(target, tp, draft, dp, max_new_tokens=20, gamma=6,
                                lenience=Lenience("lin", 1.0), **prompts)
  np.testing.assert_array_equal(lossless.tokens, reference.tokens)
  other = Model(draft.config.replace(vocab_size=101))
  with pytest.raises(ValueError, match="vocab_size=101"):
    speculative_decode(target, tp, other, other.param_shapes(), max_new_tokens=5, gamma=2,
                       **prompts)
  with pytest.raises(ValueError, match="max_length=64"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=60, gamma=4, **prompts)


# --- cache capacity ----------------------------------------------------------------------------

_WRITE_ENDS = []  # (max over rows of position + k, max_length) of every extend call


@dataclasses.dataclass(frozen=True)
class _BoundsCheckedModel(Model):
  """A Model that records how far each cache write reaches (prefill included)."""

  def extend(self, params, cache, tokens):
    capacity = cache.max_length
    jax.debug.callback(lambda end: _WRITE_ENDS.append((int(np.max(end)), capacity)),
                       cache.positions + tokens.shape[1])
    return super().extend(params, cache, tokens)


def _write_ends(fn):
  _WRITE_ENDS.clear()
  out = fn()
  jax.block_until_ready(out)
  jax.effects_barrier()
  return out, [end for end, _ in _WRITE_ENDS]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
def test_capacity_check_is_exact(kind):
  """Exactly prompt width + max_new_tokens + gamma - 1 slots: enough (every write stays inside,
  the bound is reached, outputs unchanged) with rows finishing at different rounds and batch 10
  (the scatter write path); one slot fewer is refused."""
  target, tp, draft, dp = _pair(kind)
  checked_target, checked_draft = _BoundsCheckedModel(target.config), _BoundsCheckedModel(
      draft.config)
  prompts = _prompts(kind, batch=10)
  width = 1 if kind == "encoder_decoder" else 1 + 6
  gamma, new = 3, 12
  need = width + new + gamma - 1
  free = np.asarray(decode(target, tp, max_new_tokens=new, sampling=SamplingConfig(eos_id=-1),
                           **prompts).tokens)
  # EOS := a token some rows emit early and others never: rows finish in different rounds.
  counts = [(np.sum(np.any(free[:, :new // 2] == t, axis=1)), int(t)) for t in np.unique(free)]
  eos = max((c, t) for c, t in counts if c < len(free))[1]
  sampling = SamplingConfig(eos_id=eos)
  reference = decode(target, tp, max_new_tokens=new, sampling=sampling, **prompts)
  assert len(set(np.asarray(reference.lengths).tolist())) > 1 and reference.lengths.min() < new
  result, ends = _write_ends(lambda: speculative_decode(
      checked_target, tp, checked_draft, dp, max_new_tokens=new, gamma=gamma,
      sampling=sampling, max_length=need, **prompts))
  assert max(ends) <= need
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_array_equal(result.lengths, reference.lengths)
  # The bound is reached: draft == target accepts everything, so with new = 2 + 2 (gamma + 1)
  # the last round starts with new - 1 tokens generated.
  new = 2 + 2 * (gamma + 1)
  need = width + new + gamma - 1
  _, ends = _write_ends(lambda: speculative_decode(
      checked_target, tp, checked_target, tp, max_new_tokens=new, gamma=gamma,
      sampling=SamplingConfig(eos_id=-1), max_length=need, **prompts))
  assert max(ends) == need
  with pytest.raises(ValueError, match=f"needs {need} decoder positions.*max_length={need - 1}"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=new, gamma=gamma,
                       max_length=need - 1, **prompts)
  # max_new_tokens = 1 runs no round: the prompt alone fits.
  one = speculative_decode(target, tp, draft, dp, max_new_tokens=1, gamma=gamma,
                           max_length=width, **prompts)
  np.testing.assert_array_equal(one.tokens, reference.tokens[:, :1])
  with pytest.raises(ValueError, match=f"max_length={width - 1}"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=1, gamma=gamma,
                       max_length=width - 1, **prompts)


# --- argument checks ---------------------------------------------------------------------------


def test_decode_arguments_are_checked():
  target, tp, draft, dp = _pair("decoder_only")
  prompts = _prompts("decoder_only")
  run = lambda **kw: speculative_decode(target, tp, draft, dp, **{
      "max_new_tokens": 20, "gamma": 6, **prompts, **kw})
  for bad in (0, -1):
    with pytest.raises(ValueError, match=f"max_new_tokens={bad} must be an integer >= 1"):
      run(max_new_tokens=bad)
  with pytest.raises(ValueError, match="max_new_tokens=2.5"):
    run(max_new_tokens=2.5)
  with pytest.raises(ValueError, match="gamma=True is a bool"):
    run(gamma=True)
  with pytest.raises(ValueError, match="gamma=-2 must be an integer >= 1"):
    run(gamma=-2)
  with pytest.raises(ValueError, match="max_length=0 must be an integer >= 1"):
    run(max_length=0)
  # NumPy integers are integers.
  np_result = run(gamma=np.int64(6), max_new_tokens=np.int32(20), max_length=np.int64(64))
  np.testing.assert_array_equal(np_result.tokens, run().tokens)
  assert int(np_result.drafted[0]) % 6 == 0 and np_result.tokens.shape == (4, 20)


def test_sampling_needs_a_key_greedy_does_not():
  target, tp, draft, dp = _pair("decoder_only")
  prompts = _prompts("decoder_only")
  with pytest.raises(ValueError, match=r"temperature=1.0 needs a PRNG key: pass "
                                       r"rng=jax.random.PRNGKey\(seed\)"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=2,
                       sampling=SamplingConfig(1.0), **prompts)
  greedy = speculative_decode(target, tp, draft, dp, max_new_tokens=20, gamma=6, **prompts)
  assert greedy.tokens.shape == (4, 20)


def test_interior_prompt_padding_is_refused():
  target, tp, draft, dp = _pair("decoder_only")
  prompts = np.array([[5, 6, 7], [5, 0, 7], [9, 0, 0]], np.int32)
  for array in (prompts, jnp.asarray(prompts)):
    with pytest.raises(ValueError, match=r"prompt_tokens row 1 has padding \(id 0\) at "
                                         r"position 1 followed by a real id"):
      speculative_decode(target, tp, draft, dp, prompt_tokens=array, max_new_tokens=4, gamma=2)
  # Trailing padding is taken (rows 1 and 2 of _prompts), from NumPy as from JAX.
  trailing = _prompts("decoder_only")["prompt_tokens"]
  ok = speculative_decode(target, tp, draft, dp, prompt_tokens=np.asarray(trailing),
                          max_new_tokens=20, gamma=6)
  reference = decode(target, tp, prompt_tokens=trailing, max_new_tokens=20)
  np.testing.assert_array_equal(ok.tokens, reference.tokens)


# One program per kind and gamma, shared by the two tests below.
_start = jax.jit(speculative.speculative_start, static_argnums=(0, 2),
                 static_argnames=("max_new_tokens", "gamma", "sampling", "max_length"))


def _start_state(kind, gamma):
  target, tp, draft, dp = _pair(kind)
  prompts = _prompts(kind)
  return _start(target, tp, draft, dp, prompts.get("encoder_input_tokens"),
                prompts.get("prompt_tokens"), jax.random.PRNGKey(3), max_new_tokens=12,
                gamma=gamma, sampling=SamplingConfig(temperature=1.0), max_length=64)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
def test_start_state_for_gamma_equals_the_start_at_that_gamma(kind):
  """speed.py compiles one start per draft and resizes its state for every other gamma: the
  resized state equals the start at that gamma leaf by leaf in value, shape, dtype and weak
  type, so the rounds' program for that gamma reads it as it reads the start's (the same
  program, the same inputs)."""
  base = _start_state(kind, 3)
  for gamma in (1, 6):  # shrunk and grown (gamma 3 is the state itself)
    resized = speculative.start_state_for_gamma(base, gamma=gamma, max_new_tokens=12)
    expected = _start_state(kind, gamma)
    assert resized.out.shape == (4, 12 + gamma + 1)
    assert jax.tree.structure(resized) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, resized, expected)
    assert jax.tree.leaves(jax.tree.map(jax.typeof, resized)) == jax.tree.leaves(
        jax.tree.map(jax.typeof, expected))


@pytest.mark.slow
def test_start_state_for_gamma_refuses_a_state_past_its_start():
  state = _start_state("decoder_only", 3)
  with pytest.raises(ValueError, match="its round is 2"):
    speculative.start_state_for_gamma(state.replace(round=jnp.int32(2)), gamma=2,
                                      max_new_tokens=12)
  with pytest.raises(ValueError, match="gamma"):
    speculative.start_state_for_gamma(state, gamma=0, max_new_tokens=12)
