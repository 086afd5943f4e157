"""Cached (incremental) decoding reproduces the full teacher-forced forward pass.

Every test compares `Model.extend` / `Model.prefill` against `Model.logits` on the sequence
the cache should hold, in fp32 at a tight tolerance, for both model kinds, with padded
encoder inputs. A wrong mask, a wrong relative position, a stale cache entry read after a
rollback or a row reading another row's position makes the comparison fail by O(1).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.models.model import DECODER_START_ID, Model


ATOL = RTOL = 1e-5
BATCH = 4
MAX_LENGTH = 32  # one cache shape and one reference width: few compilations
MODEL_NAMES = ("tiny_encoder_decoder", "tiny_decoder_only")


@functools.lru_cache(maxsize=None)
def model_and_params(name):
  model = Model.from_name(name)
  return model, jax.jit(model.init)(jax.random.PRNGKey(0))


@pytest.fixture(scope="module", params=MODEL_NAMES)
def setup(request):
  """(model, params, jitted functions, encoder inputs with per-row padding or None)."""
  model, params = model_and_params(request.param)
  fns = Jitted(model)
  encoder_input_tokens = None
  if model.is_encoder_decoder:
    rng = np.random.default_rng(1)
    lengths = [7, 3, 5, 1]  # every row padded differently (0 = padding)
    enc = np.zeros((BATCH, 8), np.int32)
    for b, n in enumerate(lengths):
      enc[b, :n] = rng.integers(2, model.config.vocab_size, n)
    encoder_input_tokens = jnp.asarray(enc)
  return model, params, fns, encoder_input_tokens


class Jitted:
  """The model's functions, jitted once per model and shared by the tests of this module."""

  def __init__(self, model):
    self.model = model
    self.extend = jax.jit(model.extend)
    self.prefill = jax.jit(model.prefill)
    self.logits = jax.jit(model.logits)
    self._init_cache = jax.jit(model.init_cache, static_argnums=(1, 2))

  def new_cache(self, params, encoder_input_tokens):
    return self._init_cache(params, BATCH, MAX_LENGTH, encoder_input_tokens)

  def full_logits(self, params, encoder_input_tokens, rows):
    """Teacher-forced logits of each row's own sequence (rows may differ in length).

    Rows are right-padded with 0 to MAX_LENGTH; the decoder is causal, so the logits at a
    row's real positions do not depend on the padding. Returns a list of [len(row), vocab].
    """
    tokens = np.zeros((len(rows), MAX_LENGTH), np.int32)
    for b, r in enumerate(rows):
      tokens[b, :len(r)] = r
    batch = {"decoder_input_tokens": jnp.asarray(tokens)}
    if self.model.is_encoder_decoder:
      batch["encoder_input_tokens"] = encoder_input_tokens
    logits = np.asarray(self.logits(params, batch))
    return [logits[b, :len(r)] for b, r in enumerate(rows)]


def random_tokens(model, shape, seed):
  """Tokens in [2, vocab): never PAD (0) or EOS (1)."""
  return np.random.default_rng(seed).integers(2, model.config.vocab_size, shape).astype(np.int32)


def decoder_sequences(model, batch, length, seed):
  """Decoder inputs as `decode` builds them: the start token, then arbitrary tokens."""
  tokens = random_tokens(model, (batch, length), seed)
  tokens[:, 0] = DECODER_START_ID
  return tokens


@pytest.mark.slow
def test_one_token_at_a_time(setup):
  model, params, fns, enc = setup
  length = 20
  seqs = decoder_sequences(model, BATCH, length, seed=2)
  cache = fns.new_cache(params, enc)
  steps = []
  for t in range(length):
    logits, cache = fns.extend(params, cache, jnp.asarray(seqs[:, t:t + 1]))
    steps.append(np.asarray(logits[:, 0]))
  np.testing.assert_array_equal(cache.positions, [length] * BATCH)
  expected = np.stack(fns.full_logits(params, enc, list(seqs)))
  np.testing.assert_allclose(np.stack(steps, axis=1), expected, atol=ATOL, rtol=RTOL)


def test_k_tokens_at_a_time(setup):
  model, params, fns, enc = setup
  chunks = (3, 1, 4, 4, 1, 3, 4)  # uneven, so chunk boundaries fall everywhere
  length = sum(chunks)
  seqs = decoder_sequences(model, BATCH, length, seed=3)
  cache = fns.new_cache(params, enc)
  outs, start = [], 0
  for k in chunks:
    logits, cache = fns.extend(params, cache, jnp.asarray(seqs[:, start:start + k]))
    assert logits.shape == (BATCH, k, model.config.vocab_size)
    outs.append(np.asarray(logits))
    start += k
  np.testing.assert_array_equal(cache.positions, [length] * BATCH)
  expected = np.stack(fns.full_logits(params, enc, list(seqs)))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, atol=ATOL, rtol=RTOL)


def test_rollback_per_row_then_other_tokens(setup):
  """Speculative decoding's pattern: score k drafts, keep a different prefix per row."""
  model, params, fns, enc = setup
  length, k = 12, 4  # k = 4 and 12 reuse compilations of other tests
  seqs = decoder_sequences(model, BATCH, length, seed=4)
  cache = fns.new_cache(params, enc)
  for start in range(0, length, k):
    _, cache = fns.extend(params, cache, jnp.asarray(seqs[:, start:start + k]))
  rows = [list(s) for s in seqs]
  # Two rounds of (rollback a different amount per row, then feed k fresh tokens).
  for round_, rollback in enumerate(([0, 3, 7, 11], [4, 0, 2, 1])):
    cache = cache.rollback(jnp.asarray(rollback))
    rows = [r[:len(r) - n] for r, n in zip(rows, rollback)]
    np.testing.assert_array_equal(cache.positions, [len(r) for r in rows])
    new = random_tokens(model, (BATCH, k), seed=10 + round_)
    logits, cache = fns.extend(params, cache, jnp.asarray(new))
    starts = [len(r) for r in rows]
    rows = [r + list(n) for r, n in zip(rows, new)]
    expected = fns.full_logits(params, enc, rows)
    for b in range(BATCH):
      np.testing.assert_allclose(np.asarray(logits[b]), expected[b][starts[b]:starts[b] + k],
                                 atol=ATOL, rtol=RTOL, err_msg=f"round {round_}, row {b}")
  # And single-token steps afterwards still see exactly the kept history.
  token = random_tokens(model, (BATCH, 1), seed=20)
  logits, cache = fns.extend(params, cache, jnp.asarray(token))
  rows = [r + [t] for r, t in zip(rows, token[:, 0])]
  expected = fns.full_logits(params, enc, rows)
  np.testing.assert_allclose(np.asarray(logits[:, 0]), np.stack([e[-1] for e in expected]),
                             atol=ATOL, rtol=RTOL)


def test_prefill_rows_at_different_positions(setup):
  model, params, fns, enc = setup
  lengths = np.array([1, 6, 10, 3], np.int32)
  width = int(lengths.max())
  # The padded tail holds arbitrary tokens (not 0): it is written to the cache but must never
  # be attended to, so its content cannot matter.
  prompts = decoder_sequences(model, BATCH, width, seed=5)
  rows = [list(p[:n]) for p, n in zip(prompts, lengths)]
  cache = fns.new_cache(params, enc)
  last, cache = fns.prefill(params, cache, jnp.asarray(prompts), jnp.asarray(lengths))
  np.testing.assert_array_equal(cache.positions, lengths)
  expected = fns.full_logits(params, enc, rows)
  np.testing.assert_allclose(np.asarray(last), np.stack([e[-1] for e in expected]),
                             atol=ATOL, rtol=RTOL)
  # Rows now sit at different positions in one batch: step them together.
  for step, k in enumerate((3, 1)):
    new = random_tokens(model, (BATCH, k), seed=30 + step)
    starts = [len(r) for r in rows]
    logits, cache = fns.extend(params, cache, jnp.asarray(new))
    rows = [r + list(n) for r, n in zip(rows, new)]
    expected = fns.full_logits(params, enc, rows)
    for b in range(BATCH):
      np.testing.assert_allclose(np.asarray(logits[b]), expected[b][starts[b]:starts[b] + k],
                                 atol=ATOL, rtol=RTOL, err_msg=f"step {step}, row {b}")
  np.testing.assert_array_equal(cache.positions, lengths + 4)


@pytest.mark.slow
def test_encoder_padding_is_invisible():
  """Logits do not change when the encoder input gets extra padding columns."""
  model, params = model_and_params("tiny_encoder_decoder")
  logits_fn = jax.jit(model.logits)
  source = random_tokens(model, (2, 5), seed=6)
  padded = np.concatenate([source, np.zeros((2, 6), np.int32)], axis=1)
  dec = decoder_sequences(model, 2, 7, seed=7)
  a = logits_fn(params, {"encoder_input_tokens": source, "decoder_input_tokens": dec})
  b = logits_fn(params, {"encoder_input_tokens": padded, "decoder_input_tokens": dec})
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=RTOL)
  # The padding mask is also what the cache stores for cross-attention.
  cache = jax.jit(model.init_cache, static_argnums=(1, 2))(params, 2, 8, jnp.asarray(padded))
  np.testing.assert_array_equal(cache.encoder_mask, padded > 0)
  logits, _ = jax.jit(model.extend)(params, cache, jnp.asarray(dec))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(a), atol=ATOL, rtol=RTOL)


def test_cache_layout_and_rollback_arithmetic():
  model, params = model_and_params("tiny_decoder_only")
  cache = model.init_cache(params, 3, 16)
  c = model.config
  assert cache.max_length == 16 and cache.batch_size == 3
  assert len(cache.self_attention) == c.num_decoder_layers
  for keys, values in cache.self_attention:
    assert keys.shape == (3 * c.num_heads, c.head_dim, 16)
    assert values.shape == (3 * c.num_heads, 16, c.head_dim)
  assert cache.cross_attention is None and cache.encoder_mask is None
  cache = cache.advance(5).rollback(jnp.array([0, 2, 5]))
  np.testing.assert_array_equal(cache.positions, [5, 3, 0])


def test_encoder_decoder_cache_needs_encoder_inputs():
  model, params = model_and_params("tiny_encoder_decoder")
  with pytest.raises(ValueError, match="encoder_input_tokens"):
    model.init_cache(params, 2, 8)


def test_cross_attention_is_cached_in_the_layouts_attention_reads():
  """Keys [batch * heads, head_dim, input_len], values [batch * heads, input_len, head_dim]:
  row b's heads are rows b * heads ..., as for self-attention, so no step transposes them."""
  model, params = model_and_params("tiny_encoder_decoder")
  c = model.config
  inputs = jnp.asarray(random_tokens(model, (3, 7), seed=8))
  cache = model.init_cache(params, 3, 16, inputs)
  module, variables = model.module, {"params": params}
  raw = module.apply(variables, module.apply(variables, inputs, method=module.encode),
                     method=module.cross_key_values)
  assert len(cache.cross_attention) == c.num_decoder_layers
  for (keys, values), (raw_keys, raw_values) in zip(cache.cross_attention, raw):
    assert keys.shape == (3 * c.num_heads, c.head_dim, 7)
    assert values.shape == (3 * c.num_heads, 7, c.head_dim)
    np.testing.assert_array_equal(keys[c.num_heads + 2], np.asarray(raw_keys)[1, :, 2].T)
    np.testing.assert_array_equal(values[c.num_heads + 2], np.asarray(raw_values)[1, :, 2])


@pytest.mark.parametrize("length_last", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_cache_write_paths_agree(k, length_last):
  """The per-row in-place write (small batches) and the scatter (large ones) store the same."""
  from distillspec_jax.models import layers
  batch, heads, head_dim, max_length = 3, 2, 4, 10
  rng = np.random.default_rng(0)
  shape = (batch * heads,) + ((head_dim, max_length) if length_last else (max_length, head_dim))
  cache = jnp.asarray(rng.normal(size=shape), jnp.float32)
  new = jnp.asarray(rng.normal(size=(batch, k, heads, head_dim)), jnp.float32)
  positions = jnp.array([0, 4, max_length - k], jnp.int32)
  by_rows = layers.write_cache_by_rows(cache, new, positions, length_last=length_last)
  by_scatter = layers.write_cache_by_scatter(cache, new, positions, length_last=length_last)
  np.testing.assert_array_equal(by_rows, by_scatter)
  expected = np.array(cache)
  for b in range(batch):
    for j in range(k):
      for h in range(heads):
        slot = int(positions[b]) + j
        if length_last:
          expected[b * heads + h, :, slot] = np.asarray(new[b, j, h])
        else:
          expected[b * heads + h, slot, :] = np.asarray(new[b, j, h])
  np.testing.assert_array_equal(by_rows, expected)


def test_writes_past_the_end_are_clamped_not_dropped():
  """What `DecodingCache` documents: the per-row write path clamps a write that does not fit
  onto the row's last valid slots (3 tokens at slot 5 of 6 land on slots 3-5), so capacity is
  checked before decoding, never left to the cache."""
  from distillspec_jax.models import layers
  heads, head_dim, max_length, k = 1, 2, 6, 3
  cache = jnp.zeros((heads, max_length, head_dim), jnp.float32)
  new = jnp.arange(1, 1 + k * head_dim, dtype=jnp.float32).reshape(1, k, heads, head_dim)
  out = np.asarray(layers.write_cache_by_rows(cache, new, jnp.array([5]), length_last=False))
  np.testing.assert_array_equal(out[0, :3], 0.0)
  np.testing.assert_array_equal(out[0, 3:], np.asarray(new[0, :, 0]))
