"""Plain autoregressive decoding: the baseline speculative decoding is measured against.

One jitted `lax.while_loop` for both model kinds. The prompt is prefilled in a single call;
every loop step samples one token per row, and stops when every row has emitted EOS or the
token budget is spent.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from distillspec_jax.models import EOS_ID, PAD_ID, Model, decoder_prompt

Array = jax.Array


@functools.cache
def default_rng() -> Array:
  """PRNGKey(0), made once: building a key costs ~0.2 ms of Python, as much as a few decoding
  steps of a small model."""
  return jax.random.PRNGKey(0)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is chosen. temperature == 0 is greedy (argmax)."""

  temperature: float = 0.0
  eos_id: int = EOS_ID

  def __post_init__(self):
    if not self.temperature >= 0.0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy).")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probabilities(logits: Array, temperature: float) -> Array:
  """Next-token distribution [..., vocab] at `temperature` (one-hot argmax when 0)."""
  if temperature == 0.0:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def sample_from_probabilities(probs: Array, uniform: Array) -> Array:
  """Inverse-CDF sampling: probs [batch, vocab] (need not sum to 1), uniform [batch] in [0, 1).

  One uniform number per row instead of one per vocabulary entry (what Gumbel sampling
  needs): on CPU the random bits, not the model, dominated the cost of a sampled step.
  Entries of zero probability are never chosen.
  """
  cdf = jnp.cumsum(probs.astype(jnp.float32), axis=-1)
  threshold = (1.0 - uniform)[:, None] * cdf[:, -1:]  # in (0, total]
  token = jnp.sum(cdf < threshold, axis=-1)
  return jnp.minimum(token, probs.shape[-1] - 1).astype(jnp.int32)


def sample_tokens(logits: Array, rng: Array, temperature: float,
                  uniform: Optional[Array] = None) -> Array:
  """logits: [batch, vocab] -> tokens [batch] int32 (argmax when temperature == 0).

  `uniform: [batch]` may be given instead of drawing it from `rng`."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if uniform is None:
    uniform = jax.random.uniform(rng, logits.shape[:1])
  return sample_from_probabilities(probabilities(logits, temperature), uniform)


@flax.struct.dataclass
class DecodeResult:
  """tokens: [batch, max_new_tokens], EOS included, PAD (0) after it; lengths: [batch]."""

  tokens: Array
  lengths: Array


def prompt_inputs(model: Model, prompts) -> dict:
  """Decoding keyword arguments for `prompts: [N, P]`: encoder inputs of an encoder-decoder,
  decoder prompts of a decoder-only model."""
  key = "encoder_input_tokens" if model.is_encoder_decoder else "prompt_tokens"
  return {key: jnp.asarray(prompts, jnp.int32)}


def check_capacity(prompt_length: int, new_tokens: int, max_length: int, what: str) -> None:
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
  """Generates up to `max_new_tokens` tokens per row.

  Args:
    encoder_input_tokens: [batch, input_len] for encoder-decoder models (0 = padding).
    prompt_tokens: [batch, P] right-padded prompts for decoder-only models (may be None).
    sampling: greedy when temperature == 0.
    rng: PRNG key; the same key gives the same samples.
    max_length: cache capacity; defaults to `config.max_decode_length`.
  """
  if model.is_encoder_decoder and encoder_input_tokens is None:
    raise ValueError("This model is an encoder-decoder: pass encoder_input_tokens.")
  _batch_size(encoder_input_tokens, prompt_tokens)  # fails early, naming what is missing
  max_length = max_length or model.config.max_decode_length
  prompt_width = 1 + (0 if model.is_encoder_decoder or prompt_tokens is None
                      else prompt_tokens.shape[1])
  check_capacity(prompt_width, max_new_tokens, max_length, "prompt + max_new_tokens")
  if rng is None:
    rng = default_rng()
  return _decode_jit(model, params, encoder_input_tokens, prompt_tokens, rng,
                     max_new_tokens=max_new_tokens, sampling=sampling, max_length=max_length)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "max_length"))
def _decode_jit(model, params, encoder_input_tokens, prompt_tokens, rng, *, max_new_tokens,
                sampling, max_length):
  batch_size = _batch_size(encoder_input_tokens, prompt_tokens)
  logits, cache = _start(model, params, encoder_input_tokens, prompt_tokens, batch_size,
                         max_length)
  out = jnp.full((batch_size, max_new_tokens), PAD_ID, jnp.int32)
  done = jnp.zeros((batch_size,), bool)
  lengths = jnp.zeros((batch_size,), jnp.int32)

  def cond(state):
    step, _, _, _, done, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    step, logits, cache, out, done, lengths = state
    token = sample_tokens(logits, jax.random.fold_in(rng, step), sampling.temperature)
    token = jnp.where(done, PAD_ID, token)
    out = out.at[:, step].set(token)
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | (token == sampling.eos_id)
    next_logits, cache = model.extend(params, cache, token[:, None])
    return step + 1, next_logits[:, 0], cache, out, done, lengths

  state = (jnp.int32(0), logits, cache, out, done, lengths)
  _, _, _, out, _, lengths = jax.lax.while_loop(cond, body, state)
  return DecodeResult(tokens=out, lengths=lengths)
