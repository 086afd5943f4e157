"""T5 1.1 encoder-decoder and a decoder-only LM built from the same layers.

Module tree and parameter names mirror T5X's minimal T5 (`t5x/examples/t5/network.py`):
`token_embedder`, `encoder/{relpos_bias, layers_i/{pre_attention_layer_norm, attention,
pre_mlp_layer_norm, mlp}, encoder_norm}`, `decoder/{relpos_bias, layers_i/
{pre_self_attention_layer_norm, self_attention, pre_cross_attention_layer_norm,
encoder_decoder_attention, pre_mlp_layer_norm, mlp}, decoder_norm, logits_dense}`.
The decoder-only model has `token_embedder` and the same `decoder` without cross-attention.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from distillspec_jax.models import layers
from distillspec_jax.models.config import TransformerConfig

Array = jax.Array
KeyValue = tuple[Array, Array]


def _mask_to_bias(allowed: Array) -> Array:
  return jnp.where(allowed, 0.0, layers.NEG_INF).astype(jnp.float32)


# What each remat policy lets the forward pass keep for the backward pass (the policies are
# described in config.REMAT_POLICIES); None = nothing but the layer's inputs.
_SAVEABLE = {"minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
             "full": None}


def rematerialised(layer_class, policy: str, deterministic_argnum: int):
  """`layer_class`, or it wrapped in `nn.remat` with `policy` (config.REMAT_POLICIES).

  Parameter names and values are unchanged (remat changes what a backward pass keeps, not the
  function). `deterministic_argnum`: the position of `__call__`'s `deterministic` argument
  (self = 0), static because the layer branches on it in Python. Without differentiation
  (decoding) the wrapper adds nothing: jax inserts its barriers only into a backward pass.
  """
  if policy == "none":
    return layer_class
  return nn.remat(layer_class, policy=_SAVEABLE[policy], prevent_cse=True,
                  static_argnums=(deterministic_argnum,))


class EncoderLayer(nn.Module):
  config: TransformerConfig

  def setup(self):
    c, dtype = self.config, self.config.activation_dtype
    self.pre_attention_layer_norm = layers.RMSNorm(dtype=dtype)
    self.attention = layers.MultiHeadDotProductAttention(
        c.num_heads, c.head_dim, c.emb_dim, c.dropout_rate, dtype)
    self.pre_mlp_layer_norm = layers.RMSNorm(dtype=dtype)
    self.mlp = layers.MlpBlock(c.encoder_mlp_width, c.emb_dim, c.dropout_rate, dtype)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, x: Array, bias: Array, deterministic: bool) -> Array:
    """x: [batch, length, embed]; bias: [batch, heads, length, length]."""
    h = self.pre_attention_layer_norm(x)
    keys, values = self.attention.project_kv(h)
    x = x + self.dropout(self.attention(h, keys, values, bias, deterministic), deterministic)
    h = self.mlp(self.pre_mlp_layer_norm(x), deterministic)
    return x + self.dropout(h, deterministic)


class DecoderLayer(nn.Module):
  config: TransformerConfig
  has_cross_attention: bool = True

  def setup(self):
    c, dtype = self.config, self.config.activation_dtype
    self.pre_self_attention_layer_norm = layers.RMSNorm(dtype=dtype)
    self.self_attention = layers.MultiHeadDotProductAttention(
        c.num_heads, c.head_dim, c.emb_dim, c.dropout_rate, dtype)
    if self.has_cross_attention:
      self.pre_cross_attention_layer_norm = layers.RMSNorm(dtype=dtype)
      self.encoder_decoder_attention = layers.MultiHeadDotProductAttention(
          c.num_heads, c.head_dim, c.emb_dim, c.dropout_rate, dtype)
    self.pre_mlp_layer_norm = layers.RMSNorm(dtype=dtype)
    self.mlp = layers.MlpBlock(c.mlp_dim, c.emb_dim, c.dropout_rate, dtype)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))

  def cross_key_values(self, encoded: Array) -> KeyValue:
    """Cross-attention keys/values, computed once per prompt: 2 x [batch, input_len, heads, head_dim]."""
    return self.encoder_decoder_attention.project_kv(encoded)

  def __call__(self, x: Array, self_bias: Array, positions: Optional[Array],
               self_cache: Optional[KeyValue], cross: Optional[KeyValue],
               cross_bias: Optional[Array], deterministic: bool):
    """Positional arguments only (`nn.remat` traces keyword arguments; `deterministic`, the
    7th, is its static one). x: [batch, k, embed]. With `self_cache` (keys
    [batch * heads, head_dim, max_length], values
    [batch * heads, max_length, head_dim]) the new
    keys/values are written at per-row `positions: [batch]` and attention reads the cache;
    with a `layers.BlockBias` the cache is only read and the block's own (keys, values), each
    [batch, k, heads, head_dim], are returned in its place.
    Returns (x, updated self_cache, the block's keys/values, or None)."""
    h = self.pre_self_attention_layer_norm(x)
    keys, values = self.self_attention.project_kv(h)
    if self_cache is None:
      attended = self.self_attention(h, keys, values, self_bias, deterministic)
    elif isinstance(self_bias, layers.BlockBias):  # the cache is read, the block returned
      attended = self.self_attention.attend_cache_and_block(h, self_cache, keys, values,
                                                            self_bias)
      self_cache = (keys, values)
    else:
      self_cache = layers.write_key_values(self_cache, keys, values, positions)
      attended = self.self_attention.attend_cache(h, self_cache[0], self_cache[1], self_bias)
    x = x + self.dropout(attended, deterministic)
    if self.has_cross_attention:
      h = self.pre_cross_attention_layer_norm(x)
      if self_cache is None:
        h = self.encoder_decoder_attention(h, cross[0], cross[1], cross_bias, deterministic)
      else:  # decoding: the cache holds them in its layouts (`layers.to_cache_layout`)
        h = self.encoder_decoder_attention.attend_cache(h, cross[0], cross[1], cross_bias)
      x = x + self.dropout(h, deterministic)
    h = self.mlp(self.pre_mlp_layer_norm(x), deterministic)
    return x + self.dropout(h, deterministic), self_cache


class Encoder(nn.Module):
  config: TransformerConfig
  shared_embedding: nn.Module

  def setup(self):
    c = self.config
    self.relpos_bias = layers.RelativePositionBiases(
        c.relative_attention_num_buckets, c.relative_attention_max_distance, c.num_heads,
        bidirectional=True, dtype=c.activation_dtype)
    layer = rematerialised(EncoderLayer, c.remat_policy, deterministic_argnum=3)
    self.layers = [layer(c) for _ in range(c.num_encoder_layers)]
    self.encoder_norm = layers.RMSNorm(dtype=c.activation_dtype)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, tokens: Array, deterministic: bool) -> Array:
    """tokens: [batch, input_len] (0 = padding) -> encoded [batch, input_len, embed]."""
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    valid = tokens > 0
    bias = self.relpos_bias(positions, positions) + _mask_to_bias(
        valid[:, None, :, None] & valid[:, None, None, :])
    x = self.dropout(self.shared_embedding(tokens), deterministic)
    for layer in self.layers:
      x = layer(x, bias, deterministic)
    return self.dropout(self.encoder_norm(x), deterministic)


class Decoder(nn.Module):
  """Causal decoder; with a cache it scores k new tokens per row at per-row positions."""

  config: TransformerConfig
  shared_embedding: nn.Module
  has_cross_attention: bool = True

  def setup(self):
    c = self.config
    self.relpos_bias = layers.RelativePositionBiases(
        c.relative_attention_num_buckets, c.relative_attention_max_distance, c.num_heads,
        bidirectional=False, dtype=c.activation_dtype)
    layer = rematerialised(DecoderLayer, c.remat_policy, deterministic_argnum=7)
    self.layers = [layer(c, self.has_cross_attention) for _ in range(c.num_decoder_layers)]
    self.decoder_norm = layers.RMSNorm(dtype=c.activation_dtype)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))
    if not c.logits_via_embedding:
      self.logits_dense = layers.DenseGeneral(
          (c.vocab_size,), ("embed", "vocab"), dtype=c.activation_dtype)

  def cross_key_values(self, encoded: Array) -> tuple[KeyValue, ...]:
    return tuple(layer.cross_key_values(encoded) for layer in self.layers)

  def __call__(self, tokens: Array, *, positions: Optional[Array] = None,
               self_caches: Optional[tuple[KeyValue, ...]] = None,
               cross: Optional[tuple[KeyValue, ...]] = None,
               encoder_mask: Optional[Array] = None, deterministic: bool = True,
               hidden_layers: tuple[int, ...] = (), write: bool = True):
    """Scores `tokens: [batch, k]`.

    Without caches the tokens are a whole sequence starting at position 0 (training). With
    `self_caches` (one (keys, values) pair per layer) token j of row b sits at absolute position
    `positions[b] + j` and attends to cached keys at positions <= its own.
    Returns (logits [batch, k, vocab] fp32, updated self_caches or None), and with
    `hidden_layers` a third output: those hidden states (`collect_hidden`). With
    `write=False` the caches are only read and the second output is the block's own
    (keys, values) per layer instead (`Model.score_block`).
    """
    x, *rest = self.hidden_states(tokens, positions=positions, self_caches=self_caches,
                                  cross=cross, encoder_mask=encoder_mask,
                                  deterministic=deterministic, hidden_layers=hidden_layers,
                                  write=write)
    return (self.project(x, deterministic), *rest)

  def project(self, x: Array, deterministic: bool = True) -> Array:
    """The output projection: final norm, dropout and logits.

    x: [..., embed] last-layer hidden states -> logits [..., vocab] fp32. Position-wise, so
    the blocked loss (distill/blocked.py) applies it to a block of positions at a time.
    """
    x = self.dropout(self.decoder_norm(x), deterministic)
    if self.config.logits_via_embedding:
      logits = self.shared_embedding.attend(x) / jnp.sqrt(x.shape[-1]).astype(x.dtype)
    else:
      logits = self.logits_dense(x)
    return logits.astype(jnp.float32)

  def hidden_states(self, tokens: Array, *, positions: Optional[Array] = None,
                    self_caches: Optional[tuple[KeyValue, ...]] = None,
                    cross: Optional[tuple[KeyValue, ...]] = None,
                    encoder_mask: Optional[Array] = None, deterministic: bool = True,
                    hidden_layers: tuple[int, ...] = (), write: bool = True):
    """As `__call__`, but stops before `project`: (last-layer states [batch, k, embed],
    updated self_caches, the block's keys/values (`write=False`) or None[, the
    `hidden_layers` states])."""
    batch, k = tokens.shape
    offsets = jnp.arange(k)[None, :]
    if self_caches is None:
      query_positions = jnp.broadcast_to(offsets, (batch, k))
      key_positions = query_positions
    else:
      query_positions = positions[:, None] + offsets
      max_length = self_caches[0][0].shape[-1]
      key_positions = jnp.broadcast_to(jnp.arange(max_length)[None], (batch, max_length))
    causal = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
    self_bias = self.relpos_bias(query_positions, key_positions) + _mask_to_bias(causal)
    if self_caches is not None and not write:
      before = key_positions[:, None, None, :] < positions[:, None, None, None]
      within = offsets[:, None, None, :] <= offsets[:, None, :, None]
      self_bias = layers.BlockBias(
          cache=jnp.where(before, self_bias, layers.NEG_INF),
          block=self.relpos_bias(query_positions, query_positions) + _mask_to_bias(within))
    cross_bias = None
    if self.has_cross_attention:
      cross_bias = _mask_to_bias(encoder_mask[:, None, None, :])
    x = self.dropout(self.shared_embedding(tokens), deterministic)
    new_caches, hidden = [], [x]
    for i, layer in enumerate(self.layers):
      x, layer_cache = layer(
          x, self_bias, positions, None if self_caches is None else self_caches[i],
          None if cross is None else cross[i], cross_bias, deterministic)
      new_caches.append(layer_cache)
      hidden.append(x)
    out = x, (None if self_caches is None else tuple(new_caches))
    return out + (collect_hidden(hidden, hidden_layers),) if hidden_layers else out


def collect_hidden(hidden: list, hidden_layers: tuple[int, ...]) -> Array:
  """The chosen hidden states side by side: `hidden[i]` is the embedding output (i = 0) or
  decoder layer i's output, each [batch, k, embed]; returns [batch, k, len(hidden_layers) *
  embed] in `hidden_layers`' order (what a target-conditioned draft head reads)."""
  for index in hidden_layers:
    if not 0 <= index < len(hidden):
      raise ValueError(f"hidden layer index {index} is outside this decoder: it has "
                       f"{len(hidden) - 1} layers, so indices run 0 (embedding output) to "
                       f"{len(hidden) - 1}.")
  return jnp.concatenate([hidden[i] for i in hidden_layers], axis=-1)


class EncoderDecoder(nn.Module):
  """T5 1.1: shared token embedding, encoder, decoder with an untied logits layer."""

  config: TransformerConfig

  def setup(self):
    c = self.config
    self.token_embedder = layers.Embed(c.vocab_size, c.emb_dim, dtype=c.activation_dtype)
    self.encoder = Encoder(c, self.token_embedder)
    self.decoder = Decoder(c, self.token_embedder, has_cross_attention=True)

  def encode(self, encoder_input_tokens: Array, deterministic: bool = True) -> Array:
    return self.encoder(encoder_input_tokens, deterministic)

  def cross_key_values(self, encoded: Array):
    return self.decoder.cross_key_values(encoded)

  def decode(self, tokens: Array, **kwargs):
    return self.decoder(tokens, **kwargs)

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               deterministic: bool = True) -> Array:
    """Teacher forcing: [batch, input_len], [batch, target_len] -> logits [batch, target_len, vocab]."""
    encoded = self.encode(encoder_input_tokens, deterministic)
    logits, _ = self.decoder(decoder_input_tokens, cross=self.cross_key_values(encoded),
                             encoder_mask=encoder_input_tokens > 0, deterministic=deterministic)
    return logits

  def hidden_states(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
                    deterministic: bool = True) -> Array:
    """Teacher forcing up to the output projection: [batch, target_len, embed]."""
    encoded = self.encode(encoder_input_tokens, deterministic)
    x, _ = self.decoder.hidden_states(
        decoder_input_tokens, cross=self.cross_key_values(encoded),
        encoder_mask=encoder_input_tokens > 0, deterministic=deterministic)
    return x

  def project(self, x: Array, deterministic: bool = True) -> Array:
    """[..., embed] hidden states -> [..., vocab] fp32 logits (`Decoder.project`)."""
    return self.decoder.project(x, deterministic)


class DecoderOnly(nn.Module):
  """GPT-like causal LM from the T5 1.1 layers (relative position bias, gated GELU, RMSNorm)."""

  config: TransformerConfig

  def setup(self):
    c = self.config
    self.token_embedder = layers.Embed(c.vocab_size, c.emb_dim, dtype=c.activation_dtype)
    self.decoder = Decoder(c, self.token_embedder, has_cross_attention=False)

  def decode(self, tokens: Array, **kwargs):
    return self.decoder(tokens, **kwargs)

  def __call__(self, decoder_input_tokens: Array, deterministic: bool = True) -> Array:
    """Teacher forcing: [batch, length] -> logits [batch, length, vocab]."""
    logits, _ = self.decoder(decoder_input_tokens, deterministic=deterministic)
    return logits

  def hidden_states(self, decoder_input_tokens: Array, deterministic: bool = True) -> Array:
    """Teacher forcing up to the output projection: [batch, length, embed]."""
    x, _ = self.decoder.hidden_states(decoder_input_tokens, deterministic=deterministic)
    return x

  def project(self, x: Array, deterministic: bool = True) -> Array:
    """[..., embed] hidden states -> [..., vocab] fp32 logits (the decoder's `project`)."""
    return self.decoder.project(x, deterministic)
