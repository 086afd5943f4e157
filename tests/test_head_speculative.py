"""Speculative decoding with a draft head as the draft (decoding/head_draft.py): lossless
(greedy identical to the target's, sampled distribution the target's), and the head's cache
rolled back per row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.decoding import head_draft
from distillspec_jax.decoding import speculative
from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.decoding.speculative import DraftLength, Lenience, speculative_decode
from distillspec_jax.models.head import Head, HeadConfig
from test_heads import tiny_target
from test_speculative import (_exact_sequence_distribution, _goodness_of_fit_pvalue,
                              _peaked_decoder_pair)



def _pair(kind, vocab=97, seed=1):
  target = tiny_target(kind, vocab=vocab)
  params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, mlp_dim=48))
  return target, params, head, head.init(jax.random.PRNGKey(seed), params)


def _prompts(kind, vocab=97):
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(7), (4, 6), 2, vocab))
  tokens[1, 3:] = 0  # rows of different lengths
  tokens[2, 1:] = 0
  key = "encoder_input_tokens" if kind == "encoder_decoder" else "prompt_tokens"
  return {key: jnp.asarray(tokens)}


@pytest.mark.slow
@pytest.mark.parametrize("kind, draft_length, gammas", [
    ("encoder_decoder", DraftLength(), (1, 4)), ("decoder_only", DraftLength(), (3,)),
    ("llama", DraftLength(), (1, 4)), ("encoder_decoder", DraftLength("confidence", 0.05), (4,)),
    ("llama", DraftLength("confidence", 0.05), (4,))])
def test_greedy_with_a_head_equals_greedy_target(kind, draft_length, gammas):
  target, params, head, head_params = _pair(kind)
  prompts = _prompts(kind)
  reference = decode(target, params, max_new_tokens=16, **prompts)
  for gamma in gammas:
    result = speculative_decode(target, params, head, head_params, max_new_tokens=16,
                                gamma=gamma, draft_length=draft_length, **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    np.testing.assert_array_equal(result.lengths, reference.lengths)
    if draft_length.adaptive:
      assert int(np.sum(result.target_calls)) < int(np.sum(result.drafted))


def _peaked_head(model, params, scale=3.0, seed=3):
  head = Head(HeadConfig(model.config))
  head_params = head.init(jax.random.PRNGKey(seed), params)
  head_params["lm_head"]["kernel"] = head_params["lm_head"]["kernel"] * scale
  return head, head_params


@pytest.mark.slow
@pytest.mark.parametrize("draft_length", [DraftLength(), DraftLength("confidence", 0.5)])
def test_sampled_with_a_head_matches_target_distribution(draft_length):
  model, params, _ = _peaked_decoder_pair()
  head, head_params = _peaked_head(model, params)
  length, num_samples = 3, 20000
  expected = _exact_sequence_distribution(model, params, length, eos=1)

  def sample(lenience, seed):
    result = speculative_decode(model, params, head, head_params,
                                prompt_tokens=jnp.zeros((num_samples, 1), jnp.int32),
                                max_new_tokens=length, gamma=2, draft_length=draft_length,
                                sampling=SamplingConfig(1.0, eos_id=1), lenience=lenience,
                                rng=jax.random.PRNGKey(seed))
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    assert 0 < int(np.sum(result.accepted)) < int(np.sum(result.drafted))
    return [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]

  assert _goodness_of_fit_pvalue(sample(Lenience(), 11), expected) > 1e-3
  if not draft_length.adaptive:
    # Teeth: lossy acceptance with this head no longer samples the target's distribution.
    assert _goodness_of_fit_pvalue(sample(Lenience("lin", 0.3), 12), expected) < 1e-6


# The reference's sequences padded to one width: one compiled program for every row.
_WIDTH = 32


@functools.partial(jax.jit, static_argnums=(0, 2))
def _reference_first_logits(target, params, head, head_params, sequence, length,
                            encoder_inputs):
  """The head's first draft step after the committed decoder `sequence` ([_WIDTH], its first
  `length` tokens real, padding after them), computed from scratch: the target's features
  over it, then the head over every position. Attention is causal, so the padding after
  position length - 1 changes nothing before it."""
  batch = {"decoder_input_tokens": sequence[None, :-1]}
  if encoder_inputs is not None:
    batch["encoder_input_tokens"] = encoder_inputs[None]
  _, features, encoded = target.layer_features(params, batch, head.feature_layers)
  mask = None if encoded is None else batch["encoder_input_tokens"] > 0
  cache = head.init_cache(head_params, 1, 64, encoded, mask)
  logits, _, _ = head.extend(head_params, cache, sequence[None, 1:], features,
                             from_target=True)
  return logits[0, length - 2]


_STATIC = ("max_new_tokens", "gamma", "sampling", "lenience", "draft_length", "max_length")


def _first_step_mismatch(kind, commit=None, rounds=3) -> float:
  """After some rounds at T = 1 (rows accept different numbers of tokens), each row's first
  draft step from the engine's head state against the same step computed from scratch over
  the row's committed sequence. `commit` replaces `head_draft.commit` (a broken variant)."""
  target, params, head, head_params = _pair(kind, vocab=11, seed=5)
  tokens = next(iter(_prompts(kind, vocab=11).values()))
  encoder = tokens if kind == "encoder_decoder" else None
  options = dict(max_new_tokens=40, gamma=3, sampling=SamplingConfig(1.0, eos_id=-1))
  # New wrappers for each call: a patched `commit` is traced anew, not read from jit's cache.
  start = jax.jit(lambda *a, **k: speculative.speculative_start(*a, **k),
                  static_argnums=(0, 2), static_argnames=_STATIC)
  step = jax.jit(lambda *a, **k: speculative._round(*a, **k),  # pylint: disable=protected-access
                 static_argnums=(0, 2), static_argnames=_STATIC)
  state = start(target, params, head, head_params, encoder,
                None if encoder is not None else tokens, jax.random.PRNGKey(4), max_length=64,
                **options)
  original = head_draft.commit
  head_draft.commit = commit or original
  try:
    for _ in range(rounds):
      state = step(target, params, head, head_params, state, lenience=Lenience(),
                   draft_length=DraftLength(), **options)
  finally:
    head_draft.commit = original
  accepted = np.asarray(state.accepted_per_round)[:, :rounds]
  assert len(set(map(tuple, accepted))) > 1  # rows accepted differently
  logits, _ = head_draft.HeadDrafter(head).extend(head_params, state.draft_cache,
                                                  jnp.zeros((4, 2), jnp.int32))
  worst = 0.0
  for row in range(4):
    prompt = [0] if encoder is not None else [0] + [int(t) for t in tokens[row] if t]
    generated = np.asarray(state.out)[row, :int(state.generated[row])]
    sequence = prompt + [int(t) for t in generated]
    assert len(sequence) <= _WIDTH
    padded = jnp.asarray(sequence + [0] * (_WIDTH - len(sequence)), jnp.int32)
    reference = _reference_first_logits(target, params, head, head_params, padded,
                                        len(sequence),
                                        None if encoder is None else encoder[row])
    worst = max(worst, float(jnp.max(jnp.abs(logits[row, 1] - reference))))
  return worst


@pytest.mark.slow
def test_head_cache_is_rolled_back_per_row():
  """The head state after rounds of different acceptance per row drafts exactly as a head that
  read the committed sequence's target features from scratch; rolling every row back by the
  batch's least acceptance (not per row) breaks that."""
  assert _first_step_mismatch("encoder_decoder") < 1e-4
  original = head_draft.commit

  def batch_rollback(state, block, num_accepted, next_token, going_on):
    least = jnp.min(num_accepted) * jnp.ones_like(num_accepted)
    return original(state, block, least, next_token, going_on)

  assert _first_step_mismatch("encoder_decoder", batch_rollback) > 1e-2


def test_head_pair_refusals_name_the_value():
  target, params, head, head_params = _pair("llama")
  wider = tiny_target("llama").config.replace(emb_dim=48)
  from distillspec_jax.models.model import Model
  with pytest.raises(ValueError, match="head's width 32 does not match the target's emb_dim=48"):
    speculative.check_pair(Model(wider), head)
  other = tiny_target("decoder_only")
  with pytest.raises(ValueError, match="built for a llama target"):
    speculative.check_pair(other, head)


@pytest.mark.slow
def test_greedy_with_a_head_and_a_stop_id_equals_greedy_target():
  """The target's further stop id (TokenIds.stop_ids) ends a row of the head's rounds as in
  plain decoding: a stop id the target emits is kept, the row padded after it."""
  from distillspec_jax.models.model import TokenIds
  from test_speculative import _first_stop_candidate
  target, params, head, head_params = _pair("decoder_only")
  prompts = _prompts("decoder_only")
  free = decode(target, params, max_new_tokens=16, sampling=SamplingConfig(eos_id=-1), **prompts)
  stop, row, position = _first_stop_candidate(free.tokens, lambda i: i < 12)
  stopping = target.with_tokens(TokenIds(stop_ids=(stop,)))
  reference = decode(stopping, params, max_new_tokens=16, **prompts)
  assert int(reference.lengths[row]) == position + 1
  result = speculative_decode(stopping, params, head, head_params, max_new_tokens=16, gamma=3,
                              **prompts)
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_array_equal(result.lengths, reference.lengths)
