"""Plain autoregressive decoding: the baseline speculative decoding is measured against.

One jitted `lax.while_loop` for both model kinds. The prompt is prefilled in a single call;
every loop step samples one token per row, and stops when every row has emitted EOS or the
token budget is spent.

Also the pieces speculative decoding shares: argument checks (`check_positive_int`,
`check_capacity`, `check_prompt_padding`, `check_rng`) and the sampler
(`sample_from_probabilities`, a two-level inverse CDF taking `UNIFORMS_PER_DRAW` uniforms).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.validation import check_field_types, check_positive_int, check_real
from distillspec_jax.models.config import check_token_ids
from distillspec_jax.models.model import PAD_ID, Model, decoder_prompt, ends_row

Array = jax.Array

# Independent uniforms one draw of `sample_from_probabilities` takes per row: one picks the
# block, one the token inside it.
UNIFORMS_PER_DRAW = 2
# Entries per block of the sampler's two-level inverse CDF (the vocabulary is padded to a
# multiple). 32,128 (T5) = 251 x 128.
SAMPLER_BLOCK = 128


@functools.cache
def default_rng() -> Array:
  """PRNGKey(0), made once: building a key costs ~0.2 ms of Python, as much as a few decoding
  steps of a small model. Only for greedy decoding, which draws nothing (see `check_rng`).
  Made concrete even when first asked for inside a trace (a caller's `jax.jit`): a cached
  tracer would leak into every later call."""
  with jax.ensure_compile_time_eval():
    return jax.random.PRNGKey(0)


def check_rng(rng: Optional[Array], sampling: "SamplingConfig") -> Array:
  """The key to decode with: `rng` itself, refused when missing at temperature > 0.

  Greedy decoding draws nothing, so it may omit the key (a fixed one is passed along)."""
  if rng is not None:
    return rng
  if sampling.greedy:
    return default_rng()
  raise ValueError(
      f"Sampling at temperature={sampling.temperature} needs a PRNG key: pass "
      "rng=jax.random.PRNGKey(seed) (a fixed default would give every call the same samples).")


def check_prompt_padding(prompt_tokens, name: str = "prompt_tokens", pad_id: int = PAD_ID,
                         need_tokens: bool = False) -> None:
  """Refuses interior padding in right-padded prompts `[batch, P]` (padding = `pad_id`).

  A row's length is its number of ids other than `pad_id`, so padding is trailing only: a pad
  followed by a real id in the same row is an error naming the row and the position; with
  `need_tokens` (no start id precedes the prompt) an empty row is refused too. Checked eagerly
  when the prompts are concrete (NumPy or JAX arrays outside jit); traced prompts are trusted.
  """
  if prompt_tokens is None or isinstance(prompt_tokens, jax.core.Tracer):
    return
  tokens = np.asarray(prompt_tokens)
  if tokens.ndim != 2:
    raise ValueError(f"{name} must be [batch, P]; got shape {tokens.shape}.")
  pad = tokens == pad_id
  # Padding followed by a real id anywhere in a row shows as a PAD right before a real id.
  interior = pad[:, :-1] & ~pad[:, 1:]
  if interior.any():
    row = int(np.argwhere(interior)[0, 0])
    column = int(np.argmax(pad[row]))  # the row's first padding position
    shown = str(tokens[row, :24].tolist())[:-1] + (", ...]" if tokens.shape[1] > 24 else "]")
    raise ValueError(
        f"{name} row {row} has padding (id {pad_id}) at position {column} followed by a "
        f"real id: {shown}. Prompts are right-padded: put every real token "
        "first and the padding after it.")
  if need_tokens and tokens.size and pad[:, 0].any():
    row = int(np.argmax(pad[:, 0]))
    raise ValueError(f"{name} row {row} is empty; this model's tokenizer has no start token, "
                     "so every prompt needs at least one token.")


def cache_capacity(model: Model, max_length) -> int:
  """The decoding cache's slots: `max_length`, or the model's max_decode_length when None."""
  if max_length is None:
    max_length = model.config.max_decode_length
  return check_positive_int(max_length, "max_length")


def local_rows(tokens):
  """What of `tokens` this process can read on the host: the array itself, or for a global
  array spanning processes the rows its devices hold ([rows, ...], in row order); the checks
  below then look at each process's own rows."""
  if (isinstance(tokens, jax.core.Tracer) or not isinstance(tokens, jax.Array)
      or tokens.is_fully_addressable):
    return tokens
  shards = {}
  for shard in tokens.addressable_shards:
    shards.setdefault(shard.index[0].start or 0, shard.data)
  return np.concatenate([np.asarray(shards[start]) for start in sorted(shards)])


def check_prompts(model: Model, encoder_input_tokens, prompt_tokens) -> None:
  """Refuses interior padding in decoder-only prompts and ids outside [0, vocab_size)
  (both checked when the prompts are concrete; a process checks its own rows of prompts
  spanning processes)."""
  encoder_input_tokens, prompt_tokens = map(local_rows, (encoder_input_tokens, prompt_tokens))
  if not model.is_encoder_decoder:
    pad_id = model.tokens.pad_id
    check_prompt_padding(prompt_tokens, pad_id=pad_id,
                         need_tokens=model.tokens.decoder_start_id is None)
    if prompt_tokens is not None and not isinstance(prompt_tokens, jax.core.Tracer):
      prompt_tokens = np.where(np.asarray(prompt_tokens) == pad_id, 0, prompt_tokens)
  for name, tokens in (("encoder_input_tokens", encoder_input_tokens),
                       ("prompt_tokens", prompt_tokens)):
    if tokens is not None:
      check_token_ids(tokens, model.config.vocab_size,
                      f"{name} of the prompts to decode (model vocab_size="
                      f"{model.config.vocab_size}; tokenize with the model's vocabulary)")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is chosen. temperature == 0 is greedy (argmax). eos_id: the id that
  ends a row; None: the model's own (`Model.tokens.eos_id` and its further stop ids,
  `TokenIds.stop_ids`); another id: that one alone; -1: none (fixed lengths)."""

  temperature: float = 0.0
  eos_id: Optional[int] = None

  def end_ids(self, model: Model) -> tuple:
    """The ids that end a row of `model` (static): `Model.ends_row`'s, or this eos_id."""
    if self.eos_id is None:
      return model.tokens.end_ids
    return () if self.eos_id == -1 else (self.eos_id,)

  def ends_row(self, model: Model, tokens):
    """Whether each of `tokens` ends a row of `model` under this sampling (`end_ids`)."""
    return ends_row(tokens, self.end_ids(model))

  def __post_init__(self):
    check_field_types(self)
    check_real(self.temperature, "temperature", minimum=0.0, fix="pass a temperature >= 0 "
               "(0 means greedy).")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probabilities(logits: Array, temperature: float) -> Array:
  """Next-token distribution [..., vocab] at `temperature` (one-hot argmax when 0)."""
  if temperature == 0.0:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def sample_from_probabilities(probs: Array, uniform: Array) -> Array:
  """Inverse-CDF sampling in two levels: probs [batch, vocab] (>= 0, need not sum to 1),
  uniform [batch, UNIFORMS_PER_DRAW] independent, in [0, 1) -> tokens [batch] int32.

  The vocabulary is cut into blocks of SAMPLER_BLOCK entries (zero-padded to a multiple):
  uniform[:, 0] picks a block by inverse CDF over the block totals, uniform[:, 1] a token by
  inverse CDF within that block. A single fp32 cumsum over 32,128 entries rounds every token's
  interval to the ulp of the running total (~6e-8 near 1: a TVD bias of ~2e-4, and tokens
  below ~6e-8 never drawn); here each level sums at most ~250 numbers, block boundaries are
  exact to fp32 rounding of the totals and tokens to fp32 rounding relative to their block, so
  a token of probability 1e-8 in a block of such tokens is drawn at its rate. What remains is
  the uniforms' resolution (fp32 uniforms carry 23 random bits): a block's probability is
  exact to within 2^-23 of the total, a token's within its block to 2^-23 of the block's
  mass; a token far below 2^-23 of its block's mass (next to a dominant token) is still
  quantised. Only the chosen block's cumsum is formed (one reduction over the vocabulary, no
  vocabulary-wide scan: 12-15x faster than the single cumsum at 32,128 on CPU, bench/sampler.py).
  Deterministic given `uniform`; two uniforms per row instead of one per vocabulary entry
  (what Gumbel sampling needs): on CPU the random bits, not the model, dominated a sampled
  step.
  Entries of zero probability are never chosen (when the row has any mass).
  """
  probs = probs.astype(jnp.float32)
  batch, vocab = probs.shape
  block = min(SAMPLER_BLOCK, vocab)
  num_blocks = -(-vocab // block)
  if num_blocks * block != vocab:
    probs = jnp.pad(probs, ((0, 0), (0, num_blocks * block - vocab)))
  blocks = probs.reshape(batch, num_blocks, block)

  def inverse_cdf(weights, u):
    """First index whose cumulative weight reaches (1 - u) x total, in (0, total]."""
    cdf = jnp.cumsum(weights, axis=-1)
    threshold = (1.0 - u)[:, None] * cdf[:, -1:]
    return jnp.minimum(jnp.sum(cdf < threshold, axis=-1), weights.shape[-1] - 1)

  chosen = inverse_cdf(jnp.sum(blocks, axis=-1), uniform[:, 0])              # [batch]
  in_block = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]  # [batch, block]
  token = chosen * block + inverse_cdf(in_block, uniform[:, 1])
  return token.astype(jnp.int32)


def sample_tokens(logits: Array, rng: Array, temperature: float,
                  uniform: Optional[Array] = None) -> Array:
  """logits: [batch, vocab] -> tokens [batch] int32 (argmax when temperature == 0).

  `uniform: [batch, UNIFORMS_PER_DRAW]` may be given instead of drawing it from `rng`."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if uniform is None:
    uniform = jax.random.uniform(rng, (logits.shape[0], UNIFORMS_PER_DRAW))
  return sample_from_probabilities(probabilities(logits, temperature), uniform)


@flax.struct.dataclass
class DecodeResult:
  """tokens: [batch, max_new_tokens], EOS (or the stop id that ended the row) included, the
  model's pad id (T5: 0) after it; lengths: [batch]."""

  tokens: Array
  lengths: Array


def prompt_inputs(model: Model, prompts) -> dict:
  """Decoding keyword arguments for `prompts: [N, P]`: encoder inputs of an encoder-decoder,
  decoder prompts of a decoder-only model."""
  key = "encoder_input_tokens" if model.is_encoder_decoder else "prompt_tokens"
  return {key: jnp.asarray(prompts, jnp.int32)}


def check_capacity(prompt_length: int, new_tokens: int, max_length: int, what: str) -> None:
  """Refuses a request whose cache writes (`prompt_length + new_tokens` slots, the most the
  caller's engine writes for one row) do not fit `max_length`. The cache does not drop
  writes past its end (see `DecodingCache`), so this check is what keeps them in bounds."""
  if prompt_length + new_tokens > max_length:
    raise ValueError(
        f"The request needs {prompt_length + new_tokens} decoder positions ({what}) but the cache "
        f"holds max_length={max_length}; raise max_length (TransformerConfig.max_decode_length "
        "or the max_length argument) or lower max_new_tokens / the prompt length.")


def _start(model: Model, params, encoder_input_tokens, prompt_tokens, batch_size: int,
           max_length: int):
  tokens, lengths = decoder_prompt(model, prompt_tokens, batch_size)
  cache = model.init_cache(params, batch_size, max_length, encoder_input_tokens)
  logits, cache = model.prefill(params, cache, tokens, lengths)
  return logits, cache


def _batch_size(encoder_input_tokens, prompt_tokens) -> int:
  source = encoder_input_tokens if encoder_input_tokens is not None else prompt_tokens
  if source is None:
    raise ValueError("Pass encoder_input_tokens (encoder-decoder) or prompt_tokens "
                     "(decoder-only) to decode.")
  return source.shape[0]


def decode(model: Model, params, *, encoder_input_tokens: Optional[Array] = None,
           prompt_tokens: Optional[Array] = None, max_new_tokens: int,
           sampling: SamplingConfig = SamplingConfig(), rng: Optional[Array] = None,
           max_length: Optional[int] = None) -> DecodeResult:
  """Generates up to `max_new_tokens` (int >= 1) tokens per row.

  Args:
    encoder_input_tokens: [batch, input_len] for encoder-decoder models (0 = padding).
    prompt_tokens: [batch, P] right-padded prompts for decoder-only models (may be None);
      padding is trailing only (interior padding is refused).
    sampling: greedy when temperature == 0.
    rng: PRNG key, required when temperature > 0; the same key gives the same samples.
    max_length: cache capacity (>= 1 + P + max_new_tokens); defaults to
      `config.max_decode_length`.
  Returns:
    DecodeResult with tokens [batch, max_new_tokens] and lengths [batch].
  """
  if model.is_encoder_decoder and encoder_input_tokens is None:
    raise ValueError("This model is an encoder-decoder: pass encoder_input_tokens.")
  _batch_size(encoder_input_tokens, prompt_tokens)  # fails early, naming what is missing
  max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
  max_length = cache_capacity(model, max_length)
  check_prompts(model, encoder_input_tokens, prompt_tokens)
  prompt_width = 1 + (0 if model.is_encoder_decoder or prompt_tokens is None
                      else prompt_tokens.shape[1])
  # The prefill writes prompt_width slots and the steps at most max_new_tokens - 1 more; the
  # check keeps the bound this function documents (prompt + max_new_tokens): one spare slot.
  check_capacity(prompt_width, max_new_tokens, max_length, "prompt + max_new_tokens")
  rng = check_rng(rng, sampling)
  return _decode_jit(model, params, encoder_input_tokens, prompt_tokens, rng,
                     max_new_tokens=max_new_tokens, sampling=sampling, max_length=max_length)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "max_length"))
def _decode_jit(model, params, encoder_input_tokens, prompt_tokens, rng, *, max_new_tokens,
                sampling, max_length):
  batch_size = _batch_size(encoder_input_tokens, prompt_tokens)
  logits, cache = _start(model, params, encoder_input_tokens, prompt_tokens, batch_size,
                         max_length)
  return decode_steps(model, params, logits, cache, rng, max_new_tokens=max_new_tokens,
                      sampling=sampling)


def decode_start(model: Model, params, encoder_input_tokens=None, prompt_tokens=None, *,
                 max_length: int):
  """(logits [batch, vocab] of the first new token, cache after the prefill); traceable,
  unchecked (`decode` checks). `decode_steps(..., *decode_start(...), ...)` is `decode`; the
  split lets speed.py time the decoding steps apart from the encoder and the prefill."""
  batch_size = _batch_size(encoder_input_tokens, prompt_tokens)
  return _start(model, params, encoder_input_tokens, prompt_tokens, batch_size, max_length)


def decode_steps(model: Model, params, logits, cache, rng, *, max_new_tokens: int,
                 sampling: SamplingConfig) -> DecodeResult:
  """Samples from `logits: [batch, vocab]` and extends `cache` until every row has its EOS (or
  a stop id: `SamplingConfig.end_ids`) or `max_new_tokens` tokens.

  L new tokens take L - 1 target calls after the setup: the first token comes from the
  prefill's logits, and a token is fed to the model only when another one will be sampled
  after it (the last token's logits would never be used). The speculative engine makes no
  such call either, so the two decoders' target calls compare directly.
  """
  batch_size = logits.shape[0]

  def emit(step, logits, out, done, lengths):
    """Samples token `step` of every row; finished rows get PAD."""
    token = sample_tokens(logits, jax.random.fold_in(rng, step), sampling.temperature)
    token = jnp.where(done, model.tokens.pad_id, token)
    out = out.at[:, step].set(token)
    lengths = lengths + (~done).astype(jnp.int32)
    return token, out, done | sampling.ends_row(model, token), lengths

  out = jnp.full((batch_size, max_new_tokens), model.tokens.pad_id, jnp.int32)
  token, out, done, lengths = emit(0, logits, out, jnp.zeros((batch_size,), bool),
                                   jnp.zeros((batch_size,), jnp.int32))

  def cond(state):
    step, _, _, _, done, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    step, token, cache, out, done, lengths = state
    next_logits, cache = model.extend(params, cache, token[:, None])
    token, out, done, lengths = emit(step, next_logits[:, 0], out, done, lengths)
    return step + 1, token, cache, out, done, lengths

  state = (jnp.int32(1), token, cache, out, done, lengths)
  _, _, _, out, _, lengths = jax.lax.while_loop(cond, body, state)
  return DecodeResult(tokens=out, lengths=lengths)
