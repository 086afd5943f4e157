"""`Model.score_block` + `write_block` (a block scored against a cache it only reads, then
written) give what `Model.extend` gives, for every family, and the adaptive verification built
on them compiles without copying the target's cache.

The comparisons run on rows at different positions (a per-row prefill), with a block wider
than Gemma 3's sliding window, so a wrong mask between the cache's slots and the block's keys,
a wrong relative position for the block, or a block written at the wrong slots fails by O(1).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.decoding import speculative
from distillspec_jax.models.model import Model

ATOL = RTOL = 1e-5
LENGTHS = np.array([1, 6, 10, 3], np.int32)  # gemma3's window is 4: rows past it and within
BLOCK = 5
MAX_LENGTH = 24
NAMES = ("tiny_encoder_decoder", "tiny_decoder_only", "tiny_llama", "tiny_qwen3", "tiny_gemma3")


@functools.lru_cache(maxsize=None)
def _model(name):
  model = Model.from_name(name)
  return model, jax.jit(model.init)(jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=None)
def _compiled(name):
  """(extend, score_block, write_block) of the model, each one compiled program per shape:
  called eagerly, each of their operations compiles on its own, for every family."""
  model, _ = _model(name)
  return (jax.jit(model.extend, static_argnums=3), jax.jit(model.score_block, static_argnums=3),
          jax.jit(model.write_block, static_argnums=2))


def _tokens(model, shape, seed):
  return np.random.default_rng(seed).integers(2, model.config.vocab_size, shape).astype(np.int32)


def _prefilled(model, params):
  """A cache holding rows of LENGTHS tokens (encoder inputs padded differently per row)."""
  encoder = None
  if model.is_encoder_decoder:
    encoder = _tokens(model, (len(LENGTHS), 6), seed=1)
    encoder[0, 2:] = 0
    encoder[2, 4:] = 0
  prompts = _tokens(model, (len(LENGTHS), int(LENGTHS.max())), seed=2)

  @jax.jit
  def prefilled(params, encoder, prompts, lengths):
    cache = model.init_cache(params, len(LENGTHS), MAX_LENGTH, encoder)
    return model.prefill(params, cache, prompts, lengths)[1]

  return prefilled(params, None if encoder is None else jnp.asarray(encoder),
                   jnp.asarray(prompts), jnp.asarray(LENGTHS))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_score_then_write_equals_extend(name):
  model, params = _model(name)
  extend, score_block, write_block = _compiled(name)
  cache = _prefilled(model, params)
  block = jnp.asarray(_tokens(model, (len(LENGTHS), BLOCK), seed=3))
  layers = (0, model.config.num_decoder_layers)
  written_logits, written, written_hidden = extend(params, cache, block, layers)
  logits, entries, hidden = score_block(params, cache, block, layers)
  np.testing.assert_allclose(logits, written_logits, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(hidden, written_hidden, atol=ATOL, rtol=RTOL)
  kv_heads = model.config.kv_heads
  assert [k.shape for k, _ in entries] == [
      (len(LENGTHS), BLOCK, kv_heads, model.config.head_dim)] * model.config.num_decoder_layers
  # Written, the entries are what extend writes at each row's slots, and the cache moves on.
  stored = write_block(cache, entries, BLOCK)
  np.testing.assert_array_equal(stored.positions, written.positions)
  for (keys, values), (ref_keys, ref_values) in zip(stored.self_attention,
                                                   written.self_attention):
    for b, start in enumerate(LENGTHS):
      rows = slice(b * kv_heads, (b + 1) * kv_heads)
      np.testing.assert_allclose(keys[rows, :, start:start + BLOCK],
                                 ref_keys[rows, :, start:start + BLOCK], atol=ATOL, rtol=RTOL)
      np.testing.assert_allclose(values[rows, start:start + BLOCK],
                                 ref_values[rows, start:start + BLOCK], atol=ATOL, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ("tiny_encoder_decoder", "tiny_gemma3"))
def test_a_partly_kept_block_reads_as_the_kept_tokens_alone(name):
  """write_block advancing by fewer than the block's width (the adaptive verification's padded
  block): the next call sees exactly the kept tokens, as after extending by those alone."""
  model, params = _model(name)
  extend, score_block, write_block = _compiled(name)
  cache = _prefilled(model, params)
  block = jnp.asarray(_tokens(model, (len(LENGTHS), BLOCK), seed=4))
  kept, following = 2, jnp.asarray(_tokens(model, (len(LENGTHS), 3), seed=5))
  _, entries = score_block(params, cache, block)
  padded = write_block(cache, entries, kept)
  _, reference = extend(params, cache, block[:, :kept])
  np.testing.assert_array_equal(padded.positions, LENGTHS + kept)
  np.testing.assert_allclose(extend(params, padded, following)[0],
                             extend(params, reference, following)[0], atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(score_block(params, padded, following)[0],
                             extend(params, reference, following)[0], atol=ATOL, rtol=RTOL)


def _cache_shaped_copies(draft_length):
  """The compiled speculative program's copies of arrays shaped like the target's cache
  keys or values ([batch * heads, head_dim, max_length] or its transpose)."""
  target, target_params = _model("tiny_decoder_only")
  draft, draft_params = _model("tiny_decoder_only")
  c = target.config
  shapes = {f"f32[{c.kv_heads},{c.head_dim},{MAX_LENGTH}]",
            f"f32[{c.kv_heads},{MAX_LENGTH},{c.head_dim}]"}
  prompts = jnp.asarray(_tokens(target, (1, 4), seed=6))

  def decode(target_params, draft_params):
    return speculative.speculative_decode(
        target, target_params, draft, draft_params, prompt_tokens=prompts, max_new_tokens=8,
        gamma=3, max_length=MAX_LENGTH, draft_length=draft_length).tokens

  text = jax.jit(decode).lower(target_params, draft_params).compile().as_text()
  return [line for line in text.splitlines()
          if re.search(r"= (\S+)\{[^}]*\} copy\(", line)
          and re.search(r"= (\S+)\{", line).group(1) in shapes]


@pytest.mark.slow
def test_the_adaptive_verification_does_not_copy_the_target_cache():
  """A branch by width that wrote the cache made XLA copy all of it every round (four copies
  per branch on the demo pair); the fixed rule's program is the bar."""
  assert _cache_shaped_copies(speculative.DraftLength()) == []
  assert _cache_shaped_copies(speculative.DraftLength("confidence", 0.5)) == []
