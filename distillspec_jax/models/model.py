"""`Model`: the functional face of a network, the one object the rest of the framework uses.

It wraps a `TransformerConfig` and exposes pure functions of explicit parameters:
teacher-forced logits for training, and incremental scoring against an explicit
`DecodingCache` for decoding and speculative decoding. Encoder-decoder and decoder-only
models present the same decoding interface: the *decoder prompt* is `[start]` for an
encoder-decoder and `[start] + prompt` for a decoder-only model, where `start` is T5's start
token 0; a model whose `TokenIds` come from a Hugging Face tokenizer has no start token and
takes its prompt exactly as the tokenizer encoded it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.models import llama
from distillspec_jax.models import network
from distillspec_jax.models.cache import DecodingCache, empty_self_attention
from distillspec_jax.models.config import TransformerConfig, check_same_vocabulary, model_config

Array = jax.Array
Params = Any

# T5 vocabulary conventions.
PAD_ID = 0
EOS_ID = 1
DECODER_START_ID = 0
# Padding of token rows when 0 is a real token: no token has a negative id.
NO_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """The ids decoding relies on, from the model's vocabulary (the defaults are T5's).

  eos_id: ends a row's output.
  decoder_start_id: put before every decoder prompt; None (a Hugging Face tokenizer): the
    prompt is used as the tokenizer encoded it (its own BOS, if any).
  pad_id: the value right-padding token rows (prompts `[batch, P]`, decoded outputs); 0 for
    T5 (its real pad), NO_TOKEN where 0 is a real token, so that no id is read as padding.
  num_tokens: the tokenizer's size when the embedding has more rows (rows past it are never
    sampled: logits are cut to `num_tokens`); None: every row is a token.
  """

  eos_id: int = EOS_ID
  decoder_start_id: Optional[int] = DECODER_START_ID
  pad_id: int = PAD_ID
  num_tokens: Optional[int] = None

  def __post_init__(self):
    for name in ("eos_id", "decoder_start_id", "pad_id", "num_tokens"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"TokenIds.{name}={value!r} must be an int.")
    if self.num_tokens is not None and self.num_tokens <= self.eos_id:
      raise ValueError(f"TokenIds.num_tokens={self.num_tokens} must exceed eos_id="
                       f"{self.eos_id}.")


@dataclasses.dataclass(frozen=True)
class Model:
  """A network plus its config; hashable, so it can be a static argument of `jax.jit`.

  `tokens` gives the special ids decoding uses (T5's unless a vocabulary says otherwise;
  `with_tokens`)."""

  config: TransformerConfig
  tokens: TokenIds = TokenIds()

  def __post_init__(self):
    t = self.tokens
    if self.config.kind == "encoder_decoder" and t.decoder_start_id is None:
      raise ValueError("An encoder-decoder model needs a decoder start id; its TokenIds "
                       "have decoder_start_id=None.")
    if t.num_tokens is not None and t.num_tokens > self.config.vocab_size:
      raise ValueError(
          f"The vocabulary has {t.num_tokens} tokens but the model only {self.config.vocab_size} "
          "embedding rows; use a model with vocab_size >= the tokenizer's size.")

  def with_tokens(self, tokens: TokenIds) -> "Model":
    return dataclasses.replace(self, tokens=tokens)

  @property
  def output_size(self) -> int:
    """Width of the logits: the tokenizer's size when it is smaller than the embedding."""
    return self.tokens.num_tokens or self.config.vocab_size

  def _cut(self, logits: Array) -> Array:
    n = self.tokens.num_tokens
    return logits if n is None or n == logits.shape[-1] else logits[..., :n]

  @classmethod
  def from_name(cls, name: str, **overrides) -> "Model":
    return cls(model_config(name, **overrides))

  @property
  def is_encoder_decoder(self) -> bool:
    return self.config.kind == "encoder_decoder"

  @property
  def module(self) -> nn.Module:
    if self.is_encoder_decoder:
      return network.EncoderDecoder(self.config)
    if self.config.kind == "llama":
      return llama.LlamaDecoderOnly(self.config)
    return network.DecoderOnly(self.config)

  # --- parameters -------------------------------------------------------------------------

  def _init_boxed(self, rng: Array):
    tokens = jnp.ones((1, 4), jnp.int32)
    if self.is_encoder_decoder:
      return self.module.init(rng, tokens, tokens)["params"]
    return self.module.init(rng, tokens)["params"]

  def init(self, rng: Array) -> Params:
    """Random parameters (fp32), as a plain nested dict of arrays."""
    return nn.unbox(self._init_boxed(rng))

  def param_shapes(self) -> Params:
    """Parameter ShapeDtypeStructs via `jax.eval_shape`: nothing is allocated."""
    return nn.unbox(_abstract_init(self))  # fresh containers around the shared leaves

  def logical_axes(self) -> Params:
    """The logical axis names of every parameter (a tree of `jax.sharding.PartitionSpec`)."""
    return nn.get_partition_spec(_abstract_init(self))

  def num_params(self) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.param_shapes())))

  # --- training -----------------------------------------------------------------------------

  def logits(self, params: Params, batch: dict, *, dropout_rng: Optional[Array] = None) -> Array:
    """Teacher-forced logits [batch, target_len, vocab] (fp32) from T5X feature names.

    batch: `decoder_input_tokens: [batch, target_len]` and, for encoder-decoders,
    `encoder_input_tokens: [batch, input_len]`. Dropout is on iff `dropout_rng` is given.
    """
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    variables = {"params": params}
    if self.is_encoder_decoder:
      return self._cut(self.module.apply(variables, batch["encoder_input_tokens"],
                                         batch["decoder_input_tokens"], deterministic, rngs=rngs))
    return self._cut(self.module.apply(variables, batch["decoder_input_tokens"], deterministic,
                                       rngs=rngs))

  # --- incremental decoding -----------------------------------------------------------------

  def init_cache(self, params: Params, batch_size: int, max_length: int,
                 encoder_input_tokens: Optional[Array] = None) -> DecodingCache:
    """An empty cache of capacity `max_length` decoder tokens per row, positions at 0.

    For an encoder-decoder the prompt `encoder_input_tokens: [batch, input_len]` is encoded
    here, once, and each layer's cross-attention keys/values are stored in the cache.
    """
    c = self.config
    self_attention = empty_self_attention(c.num_decoder_layers, batch_size, max_length,
                                          c.kv_heads, c.head_dim, c.activation_dtype)
    positions = jnp.zeros((batch_size,), jnp.int32)
    if not self.is_encoder_decoder:
      return DecodingCache(positions=positions, self_attention=self_attention)
    if encoder_input_tokens is None:
      raise ValueError("An encoder-decoder model needs encoder_input_tokens to start decoding.")
    module, variables = self.module, {"params": params}
    encoded = module.apply(variables, encoder_input_tokens, method=module.encode)
    cross = module.apply(variables, encoded, method=module.cross_key_values)
    return DecodingCache(positions=positions, self_attention=self_attention,
                         cross_attention=cross, encoder_mask=encoder_input_tokens > 0)

  def extend(self, params: Params, cache: DecodingCache, tokens: Array):
    """Scores `tokens: [batch, k]` placed at each row's cache position and stores them.

    Returns (logits [batch, k, vocab] fp32, cache with positions advanced by k). The caller
    guarantees `positions + k <= max_length`: writes past the end are not dropped but clamped
    onto the row's last valid slots or undefined (see `DecodingCache`).
    """
    module = self.module
    logits, self_attention = module.apply(
        {"params": params}, tokens, positions=cache.positions, self_caches=cache.self_attention,
        cross=cache.cross_attention, encoder_mask=cache.encoder_mask, method=module.decode)
    cache = cache.replace(self_attention=self_attention).advance(tokens.shape[1])
    return self._cut(logits), cache

  def prefill(self, params: Params, cache: DecodingCache, tokens: Array, lengths: Array):
    """Stores right-padded `tokens: [batch, P]` of per-row `lengths: [batch]` (>= 1).

    Returns (logits [batch, vocab] at each row's last real token, cache advanced by `lengths`).
    The padded tail is written but lies past the new positions, so it is never attended to.
    """
    logits, cache = self.extend(params, cache, tokens)
    cache = cache.rollback(tokens.shape[1] - lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


@functools.lru_cache(maxsize=64)
def _abstract_init(model: Model):
  """The boxed (logically partitioned) abstract parameters of `model`, traced once per config:
  `param_shapes` and `logical_axes` are called for every sharding, step and checkpoint, and
  each trace of the init costs about as much as tracing the model (0.5 s for a tiny one on
  CPU). The leaves are immutable; callers get new containers (`nn.unbox`,
  `nn.get_partition_spec`)."""
  return jax.eval_shape(model._init_boxed, jax.random.PRNGKey(0))


def decoder_prompt(model: Model, prompt_tokens: Optional[Array], batch_size: int):
  """The decoder's prompt and per-row lengths.

  Encoder-decoder: `[start]` for every row (the prompt goes to the encoder). Decoder-only:
  `[start] + prompt`, or the prompt alone when the model has no start id, where
  `prompt_tokens: [batch, P]` is right-padded with `model.tokens.pad_id` (the padding
  is read as a mask; the padded slots are given id 0, which is never attended to).
  Returns (tokens [batch, P (+ 1 with a start id)], lengths [batch] int32).
  """
  start_id = model.tokens.decoder_start_id
  if model.is_encoder_decoder or prompt_tokens is None:
    if start_id is None:
      raise ValueError("Decoding without a prompt needs a decoder start id; this model's "
                       "tokenizer has none, so pass prompt_tokens.")
    return jnp.full((batch_size, 1), start_id, jnp.int32), jnp.ones((batch_size,), jnp.int32)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  real = prompt_tokens != model.tokens.pad_id
  lengths = jnp.sum(real, axis=1).astype(jnp.int32)
  prompt_tokens = jnp.where(real, prompt_tokens, 0)
  if start_id is None:
    return prompt_tokens, lengths
  start = jnp.full((batch_size, 1), start_id, jnp.int32)
  return jnp.concatenate([start, prompt_tokens], axis=1), lengths + 1


def check_same_tokens(target: Model, draft: Model,
                      roles: tuple[str, str] = ("target", "draft")) -> None:
  """Refuses a pair whose distributions cannot be compared token by token.

  With a tokenizer's TokenIds on both (`num_tokens` set) the two must agree on them; their
  embeddings may have different row counts (the rows past `num_tokens` are never output).
  Otherwise (T5's conventions) the vocab sizes must be equal. That the two tokenizers are
  the same is checked where the vocabulary is read (`data.vocabularies`)."""
  first, second = roles
  if target.tokens.num_tokens is None and draft.tokens.num_tokens is None:
    check_same_vocabulary(target.config, draft.config, roles)
    return
  if target.tokens != draft.tokens:
    raise ValueError(
        f"The {second}'s token ids {draft.tokens} differ from the {first}'s {target.tokens}; "
        f"give both models the one tokenizer they share (Model.with_tokens).")
