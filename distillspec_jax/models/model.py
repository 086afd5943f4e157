"""`Model`: the functional face of a network, the one object the rest of the framework uses.

It wraps a `TransformerConfig` and exposes pure functions of explicit parameters:
teacher-forced logits for training, and incremental scoring against an explicit
`DecodingCache` for decoding and speculative decoding. Encoder-decoder and decoder-only
models present the same decoding interface: the *decoder prompt* is `[0]` (T5's start token)
for an encoder-decoder, and `[0] + prompt` for a decoder-only model.
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
from distillspec_jax.models.config import TransformerConfig, model_config

Array = jax.Array
Params = Any

# T5 vocabulary conventions.
PAD_ID = 0
EOS_ID = 1
DECODER_START_ID = 0


@dataclasses.dataclass(frozen=True)
class Model:
  """A network plus its config; hashable, so it can be a static argument of `jax.jit`."""

  config: TransformerConfig

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
    if self.config.is_rope_decoder:
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
      return self.module.apply(variables, batch["encoder_input_tokens"],
                               batch["decoder_input_tokens"], deterministic, rngs=rngs)
    return self.module.apply(variables, batch["decoder_input_tokens"], deterministic, rngs=rngs)

  def hidden_states(self, params: Params, batch: dict, *,
                    dropout_rng: Optional[Array] = None) -> Array:
    """Teacher-forced last-layer states [batch, target_len, embed], before the output
    projection: `project(params, hidden_states(params, batch))` equals `logits(params, batch)`
    (without dropout). The blocked loss projects them a block of positions at a time."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    module = self.module
    tokens = ((batch["encoder_input_tokens"], batch["decoder_input_tokens"])
              if self.is_encoder_decoder else (batch["decoder_input_tokens"],))
    return module.apply({"params": params}, *tokens, deterministic, rngs=rngs,
                        method=module.hidden_states)

  def project(self, params: Params, hidden: Array, *,
              dropout_rng: Optional[Array] = None) -> Array:
    """The output projection (final norm, dropout, logits): [..., embed] -> [..., vocab] fp32.

    Position-wise: any block of positions of `hidden_states` projects on its own."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    module = self.module
    return module.apply({"params": params}, hidden, deterministic, rngs=rngs,
                        method=module.project)

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

  def extend(self, params: Params, cache: DecodingCache, tokens: Array,
             hidden_layers: tuple[int, ...] = ()):
    """Scores `tokens: [batch, k]` placed at each row's cache position and stores them.

    Returns (logits [batch, k, vocab] fp32, cache with positions advanced by k), and with
    `hidden_layers` (indices: 0 the embedding output, i decoder layer i's output) a third
    output, those hidden states side by side: [batch, k, len(hidden_layers) * emb_dim]. The
    caller guarantees `positions + k <= max_length`: writes past the end are not dropped but
    clamped onto the row's last valid slots or undefined (see `DecodingCache`).
    """
    module = self.module
    outputs = module.apply(
        {"params": params}, tokens, positions=cache.positions, self_caches=cache.self_attention,
        cross=cache.cross_attention, encoder_mask=cache.encoder_mask,
        hidden_layers=tuple(hidden_layers), method=module.decode)
    cache = cache.replace(self_attention=outputs[1]).advance(tokens.shape[1])
    return (outputs[0], cache) + tuple(outputs[2:])

  def encode(self, params: Params, encoder_input_tokens: Array) -> Array:
    """An encoder-decoder's encoder output [batch, input_len, emb_dim] (no dropout)."""
    module = self.module
    return module.apply({"params": params}, encoder_input_tokens, method=module.encode)

  def layer_features(self, params: Params, batch: dict, hidden_layers: tuple[int, ...]):
    """Teacher-forced (logits [batch, len, vocab] fp32, hidden [batch, len, len(hidden_layers)
    * emb_dim], encoded [batch, input_len, emb_dim] or None), no dropout; `batch` as for
    `logits`. What a draft head is trained on."""
    module, variables = self.module, {"params": params}
    tokens = batch["decoder_input_tokens"]
    if not self.is_encoder_decoder:
      logits, _, hidden = module.apply(variables, tokens, hidden_layers=tuple(hidden_layers),
                                       method=module.decode)
      return logits, hidden, None
    inputs = batch["encoder_input_tokens"]
    encoded = self.encode(params, inputs)
    cross = module.apply(variables, encoded, method=module.cross_key_values)
    logits, _, hidden = module.apply(variables, tokens, cross=cross, encoder_mask=inputs > 0,
                                     hidden_layers=tuple(hidden_layers), method=module.decode)
    return logits, hidden, encoded

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

  Encoder-decoder: `[0]` for every row (the prompt goes to the encoder). Decoder-only:
  `[0] + prompt` where `prompt_tokens: [batch, P]` is right-padded with 0.
  Returns (tokens [batch, 1 + P], lengths [batch] int32).
  """
  start = jnp.full((batch_size, 1), DECODER_START_ID, jnp.int32)
  if model.is_encoder_decoder or prompt_tokens is None:
    return start, jnp.ones((batch_size,), jnp.int32)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  lengths = 1 + jnp.sum(prompt_tokens != PAD_ID, axis=1).astype(jnp.int32)
  return jnp.concatenate([start, prompt_tokens], axis=1), lengths
