"""The RoPE decoders: Llama 2/3, Qwen2, Qwen3 and Gemma 3 (text).

RoPE, grouped-query attention, a gated MLP and RMSNorm; the network of the kinds
`config.ROPE_KINDS`. Kind "llama" computes what Hugging Face's `LlamaForCausalLM` /
`Qwen2ForCausalLM` compute, "qwen3" `Qwen3ForCausalLM` (an RMSNorm over head_dim on every query
and key head before RoPE), "gemma3" `Gemma3ForCausalLM` (those norms too; every norm
multiplies by (1 + scale); norms after attention and after the MLP as well as before; a GELU
(tanh) gated MLP; the embedding scaled by sqrt(emb_dim); attention logits scaled by
query_pre_attn_scalar**-0.5; local layers that attend within a sliding window with their own
RoPE base; optionally soft-capped output logits). `interop/hf_llama.py` maps the weights. The
network presents the decoding interface of the T5 decoder (`network.Decoder`): teacher
forcing from position 0, or k new tokens per row at per-row cache positions. Attention is
strictly causal.

Parameters (stored shape, logical axes):

  token_embedder/embedding                      [vocab, embed]            (vocab, embed)
  decoder/layers_i/pre_self_attention_layer_norm/scale   [embed]          (embed,)
  decoder/layers_i/self_attention/query/kernel  [embed, heads, head_dim]  (embed, heads, kv)
  decoder/layers_i/self_attention/key/kernel    [embed, kv_heads, head_dim]
                                                          (embed, kv_heads, kv); value alike
  decoder/layers_i/self_attention/{query,key,value}/bias  [(kv_)heads, head_dim]  (use_qkv_bias)
  decoder/layers_i/self_attention/out/kernel    [heads, head_dim, embed]  (heads, kv, embed)
  decoder/layers_i/self_attention/{query,key}_norm/scale  [head_dim]  (kv,)  (qwen3, gemma3)
  decoder/layers_i/post_self_attention_layer_norm/scale  [embed]          (gemma3)
  decoder/layers_i/pre_mlp_layer_norm/scale     [embed]
  decoder/layers_i/post_mlp_layer_norm/scale    [embed]                   (gemma3)
  decoder/layers_i/mlp/{wi_0 (gate), wi_1 (up)}/kernel [embed, mlp], wo/kernel [mlp, embed]
  decoder/decoder_norm/scale                    [embed]
  decoder/logits_dense/kernel                   [embed, vocab]  (absent when tied)

Heads are a dimension of their own so that the key/value heads can be sharded apart from the
query heads: partitioning splits `kv_heads` over the model axis only when it divides them
(Llama-3.2-1B has 8 key/value heads; a model axis of 16 replicates them).

The decoding cache holds `kv_heads` heads per row (`[batch * kv_heads, head_dim, max_length]`
keys, `[batch * kv_heads, max_length, head_dim]` values, as `layers.write_cache` writes them).
Keys are stored already rotated: slot s of a row holds the key of that row's position s, so
RoPE needs no position other than the slot, and rolling a row back (lowering its position)
stays exact. A local (sliding-window) layer keeps every slot too and masks the keys more than
`sliding_window - 1` positions behind the query, so its logits past the window are exact and a
rollback needs nothing else. Each query group of `heads / kv_heads` heads reads its key/value
head in one batched matmul (query head h uses key/value head h // (heads / kv_heads), as in
transformers).
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.models import layers
from distillspec_jax.models import network
from distillspec_jax.models.config import TransformerConfig

Array = jax.Array
KeyValue = tuple[Array, Array]


# --- rotary position embedding -----------------------------------------------------------------


def rope_inverse_frequencies(config: TransformerConfig, local: bool = False) -> np.ndarray:
  """The rotation speed of each feature pair, scaled as `config.rope_scaling` says:
  [head_dim // 2] float32 (radians per position). `local`: a Gemma 3 local layer's plain RoPE
  of base `rope_local_theta` (the scaling is the global layers')."""
  dim = config.head_dim
  theta = float(config.rope_local_theta if local else config.rope_theta)
  inverse = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  if local:
    return inverse.astype(np.float32)
  factor = float(config.rope_scaling_factor)
  if config.rope_scaling == "linear":
    inverse = inverse / factor
  elif config.rope_scaling == "llama3":
    # Llama 3.1+: wavelengths longer than original / low_freq_factor are stretched by the
    # factor, those shorter than original / high_freq_factor are kept, and the band between
    # interpolates linearly in original / wavelength.
    original = float(config.rope_original_max_length)
    low, high = float(config.rope_low_freq_factor), float(config.rope_high_freq_factor)
    wavelength = 2 * math.pi / inverse
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    inverse = (1 - smooth) * inverse / factor + smooth * inverse
  return inverse.astype(np.float32)


def apply_rope(x: Array, positions: Array, inverse_frequencies: np.ndarray) -> Array:
  """Rotates `x: [batch, length, heads, head_dim]` by `positions: [batch, length]`.

  Feature i pairs with feature i + head_dim / 2 (transformers' `rotate_half` layout, the one
  Hugging Face Llama weights are stored for). Angles and products in fp32.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies)
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def soft_cap(x: Array, cap: Optional[float]) -> Array:
  """cap * tanh(x / cap) (Gemma's logit soft-capping), or x when `cap` is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def attention_bias(query_positions: Array, key_positions: Array,
                   window: Optional[int] = None) -> Array:
  """0 where a query may attend, NEG_INF elsewhere: causal, and with `window` only the
  `window` latest positions (the query's own included). query_positions: [batch, q],
  key_positions: [batch, keys] -> [batch, 1, 1, q, keys] fp32."""
  allowed = key_positions[:, None, :] <= query_positions[:, :, None]
  if window is not None:
    allowed &= key_positions[:, None, :] > query_positions[:, :, None] - window
  return jnp.where(allowed, 0.0, layers.NEG_INF).astype(jnp.float32)[:, None, None]


def _norm(config: TransformerConfig, axis: str = "embed") -> layers.RMSNorm:
  return layers.RMSNorm(config.norm_epsilon, config.activation_dtype,
                        plus_one=config.kind == "gemma3", axis=axis)


# --- layers -------------------------------------------------------------------------------------


def _flat_fan_in(base, num_input_axes: int):
  """`base` initialiser applied to the kernel flattened to [prod(inputs), prod(outputs)], so
  fan-in is the input width whatever the stored rank."""
  def init(key, shape, dtype=jnp.float32):
    rows = int(np.prod(shape[:num_input_axes]))
    return base(key, (rows, int(np.prod(shape[num_input_axes:]))), dtype).reshape(shape)
  return init


class Projection(nn.Module):
  """A linear map with an N-D kernel `[*input dims, *features]` and an optional bias
  `[*features]`; the product runs as one 2-D matmul of the flattened operands (faster weight
  gradients on XLA:CPU, as in `layers.DenseGeneral`)."""

  features: tuple[int, ...]
  kernel_axes: tuple[str, ...]
  num_input_axes: int = 1
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: [..., *input dims] -> [..., *features]."""
    input_dims = x.shape[x.ndim - self.num_input_axes:]
    init = _flat_fan_in(nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                        self.num_input_axes)
    kernel = self.param("kernel", nn.with_logical_partitioning(init, self.kernel_axes),
                        tuple(input_dims) + tuple(self.features), jnp.float32)
    rows = int(np.prod(input_dims))
    kernel = jnp.asarray(kernel, self.dtype).reshape(rows, -1)
    batch_dims = x.shape[:x.ndim - self.num_input_axes]
    y = (jnp.asarray(x, self.dtype).reshape(-1, rows) @ kernel).reshape(
        tuple(batch_dims) + tuple(self.features))
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(
          nn.initializers.zeros, self.kernel_axes[self.num_input_axes:]),
                        tuple(self.features), jnp.float32)
      y = y + jnp.asarray(bias, self.dtype)
    return y


class Embed(nn.Module):
  """Token embedding `embedding: [vocab, embed]`; `attend` gives tied logits (no rescale).

  Initialised N(0, 1) untied and N(0, 1/embed) tied, so that the tied logits of unit-RMS
  hidden states start at unit scale too.
  """

  num_embeddings: int
  features: int
  tied: bool = False
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    stddev = self.features ** -0.5 if self.tied else 1.0
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(nn.initializers.normal(stddev),
                                                  ("vocab", "embed")),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    """tokens: [batch, length] int -> [batch, length, embed]."""
    return jnp.take(jnp.asarray(self.embedding, self.dtype), tokens, axis=0)

  def attend(self, x: Array) -> Array:
    """x: [..., embed] -> logits [..., vocab]."""
    return jnp.dot(jnp.asarray(x, self.dtype), jnp.asarray(self.embedding, self.dtype).T)


class GroupedQueryAttention(nn.Module):
  """Causal self-attention with RoPE and `kv_heads` key/value heads shared by groups of
  query heads; logits scaled by `config.attention_scale` and taken in fp32. `local`: a
  sliding-window layer (its RoPE base; the window is in the bias the caller passes)."""

  config: TransformerConfig
  local: bool = False

  def setup(self):
    c, dtype = self.config, self.config.activation_dtype
    bias = c.use_qkv_bias
    self.query = Projection((c.num_heads, c.head_dim), ("embed", "heads", "kv"),
                            use_bias=bias, dtype=dtype)
    self.key = Projection((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"),
                          use_bias=bias, dtype=dtype)
    self.value = Projection((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"),
                            use_bias=bias, dtype=dtype)
    self.out = Projection((c.emb_dim,), ("heads", "kv", "embed"), num_input_axes=2,
                          dtype=dtype)
    if c.has_qk_norm:
      self.query_norm = _norm(c, axis="kv")
      self.key_norm = _norm(c, axis="kv")

  def project(self, x: Array, rope_positions: Array) -> tuple[Array, Array, Array]:
    """x: [batch, k, embed], rope_positions: [batch, k] -> rotated queries
    [batch, k, heads, head_dim], rotated keys and values [batch, k, kv_heads, head_dim]."""
    query, key = self.query(x), self.key(x)
    if self.config.has_qk_norm:  # per head, before RoPE
      query, key = self.query_norm(query), self.key_norm(key)
    frequencies = rope_inverse_frequencies(self.config, self.local)
    query = apply_rope(query, rope_positions, frequencies)
    key = apply_rope(key, rope_positions, frequencies)
    return query, key, self.value(x)

  def _grouped_softmax(self, logits: Array, bias: Array, deterministic: bool) -> Array:
    """logits: [batch, kv_heads, group, q, k] fp32; bias: [batch, 1, 1, q, k]."""
    logits = logits * self.config.attention_scale + bias
    weights = jax.nn.softmax(logits, axis=-1)
    rate = self.config.dropout_rate
    if not deterministic and rate > 0.0:
      keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - rate, weights.shape)
      weights = jnp.where(keep, weights / (1.0 - rate), 0.0)
    return weights.astype(self.config.activation_dtype)

  def __call__(self, query: Array, keys: Array, values: Array, bias: Array,
               deterministic: bool = True) -> Array:
    """Attends `query: [batch, q, heads, head_dim]` to `keys, values: [batch, k, kv_heads,
    head_dim]`; bias: [batch, 1, 1, q, k] (0 or NEG_INF). Returns [batch, q, embed]."""
    c = self.config
    batch, q = query.shape[:2]
    group = c.num_heads // c.kv_heads
    grouped = query.reshape(batch, q, c.kv_heads, group, c.head_dim)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", grouped, keys,
                        preferred_element_type=jnp.float32)
    weights = self._grouped_softmax(logits, bias, deterministic)
    mixed = jnp.einsum("bkgqs,bskd->bqkgd", weights, values.astype(weights.dtype))
    return self.out(mixed.reshape(batch, q, c.num_heads, c.head_dim))

  def attend_cache(self, query: Array, keys: Array, values: Array, bias: Array) -> Array:
    """Attends `query: [batch, q, heads, head_dim]` to a decoding cache's `keys:
    [batch * kv_heads, head_dim, max_length]` and `values: [batch * kv_heads, max_length,
    head_dim]`; bias: [batch, 1, 1, q, max_length]. Returns [batch, q, embed] (no dropout)."""
    c = self.config
    batch, q = query.shape[:2]
    group = c.num_heads // c.kv_heads
    # [batch * kv_heads, group * q, head_dim]: each key/value head's queries in one matmul.
    grouped = jnp.transpose(query.reshape(batch, q, c.kv_heads, group, c.head_dim),
                            (0, 2, 3, 1, 4)).reshape(batch * c.kv_heads, group * q, c.head_dim)
    logits = jnp.einsum("nqd,ndm->nqm", grouped, keys, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, c.kv_heads, group, q, -1)
    weights = self._grouped_softmax(logits, bias, True)
    weights = weights.reshape(batch * c.kv_heads, group * q, -1)
    mixed = jnp.einsum("nqm,nmd->nqd", weights, values.astype(weights.dtype))
    mixed = jnp.transpose(mixed.reshape(batch, c.kv_heads, group, q, c.head_dim),
                          (0, 3, 1, 2, 4))
    return self.out(mixed.reshape(batch, q, c.num_heads, c.head_dim))

  def attend_cache_and_block(self, query: Array, cache: tuple[Array, Array], keys: Array,
                             values: Array, bias: layers.BlockBias) -> Array:
    """`attend_cache` for a block that is not written into the cache: `query: [batch, k,
    heads, head_dim]` attends to the cache's slots before each row's position (`cache` as
    `attend_cache` reads it, read only) and to the block's own rotated `keys, values: [batch,
    k, kv_heads, head_dim]`. Returns [batch, k, embed], what `attend_cache` gives once the
    block is written."""
    c = self.config
    batch, q = query.shape[:2]
    group = c.num_heads // c.kv_heads
    grouped = query.reshape(batch, q, c.kv_heads, group, c.head_dim)
    flat = jnp.transpose(grouped, (0, 2, 3, 1, 4)).reshape(batch * c.kv_heads, group * q,
                                                           c.head_dim)
    cache_logits = jnp.einsum("nqd,ndm->nqm", flat, cache[0], preferred_element_type=jnp.float32)
    cache_logits = cache_logits.reshape(batch, c.kv_heads, group, q, -1)
    block_logits = jnp.einsum("bqkgd,bskd->bkgqs", grouped, keys,
                              preferred_element_type=jnp.float32)
    scale = c.attention_scale
    on_cache, on_block = layers.softmax_over_cache_and_block(
        cache_logits * scale + bias.cache, block_logits * scale + bias.block)
    dtype = c.activation_dtype
    on_cache = on_cache.astype(dtype).reshape(batch * c.kv_heads, group * q, -1)
    mixed = jnp.einsum("nqm,nmd->nqd", on_cache, cache[1].astype(dtype))
    mixed = mixed.reshape(batch, c.kv_heads, group, q, c.head_dim) + jnp.einsum(
        "bkgqs,bskd->bkgqd", on_block.astype(dtype), values.astype(dtype))
    mixed = jnp.transpose(mixed, (0, 3, 1, 2, 4))
    return self.out(mixed.reshape(batch, q, c.num_heads, c.head_dim))


class GatedMlp(nn.Module):
  """wo(act(wi_0 x) * wi_1 x): gate_proj, up_proj, down_proj; act is SiLU (SwiGLU: Llama,
  Qwen) or, for Gemma 3, GELU's tanh approximation (GeGLU)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x: [batch, length, embed] -> [batch, length, embed]."""
    c, dtype = self.config, self.config.activation_dtype
    gate = Projection((c.mlp_dim,), ("embed", "mlp"), dtype=dtype, name="wi_0")(x)
    up = Projection((c.mlp_dim,), ("embed", "mlp"), dtype=dtype, name="wi_1")(x)
    act = (jax.nn.gelu(gate, approximate=True) if c.kind == "gemma3" else jax.nn.silu(gate))
    hidden = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))(act * up, deterministic)
    return Projection((c.emb_dim,), ("mlp", "embed"), dtype=dtype, name="wo")(hidden)


class LlamaLayer(nn.Module):
  """Pre-norm block: x + attention(norm(x)), then + mlp(norm(x)); Gemma 3 also normalises
  each branch's output before the residual sum (x + norm(attention(norm(x)))). `local`: a
  sliding-window layer."""

  config: TransformerConfig
  local: bool = False

  def setup(self):
    c = self.config
    self.pre_self_attention_layer_norm = _norm(c)
    self.self_attention = GroupedQueryAttention(c, self.local)
    self.pre_mlp_layer_norm = _norm(c)
    self.mlp = GatedMlp(c)
    if c.kind == "gemma3":
      self.post_self_attention_layer_norm = _norm(c)
      self.post_mlp_layer_norm = _norm(c)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))

  def __call__(self, x: Array, rope_positions: Array, bias: Array,
               cache: Optional[KeyValue], cache_positions: Optional[Array],
               deterministic: bool):
    """Positional arguments only (`nn.remat`; `deterministic`, the 6th, is its static one).

    x: [batch, k, embed]; rope_positions: [batch, k]; bias: [batch, 1, 1, k, keys] (this
    layer's: sliding-window for a local layer). With
    `cache` (keys [batch * kv_heads, head_dim, max_length], values [batch * kv_heads,
    max_length, head_dim]) the new keys/values are written at `cache_positions: [batch]`
    and attention reads the cache; with a `layers.BlockBias` the cache is only read and the
    block's rotated (keys, values), each [batch, k, kv_heads, head_dim], are returned in its
    place. Returns (x, updated cache, the block's keys/values, or None).
    """
    h = self.pre_self_attention_layer_norm(x)
    query, keys, values = self.self_attention.project(h, rope_positions)
    if cache is None:
      attended = self.self_attention(query, keys, values, bias, deterministic)
    elif isinstance(bias, layers.BlockBias):  # the cache is read, the block returned
      attended = self.self_attention.attend_cache_and_block(query, cache, keys, values, bias)
      cache = (keys, values)
    else:
      cache = layers.write_key_values(cache, keys, values, cache_positions)
      attended = self.self_attention.attend_cache(query, cache[0], cache[1], bias)
    gemma = self.config.kind == "gemma3"
    if gemma:
      attended = self.post_self_attention_layer_norm(attended)
    x = x + self.dropout(attended, deterministic)
    h = self.mlp(self.pre_mlp_layer_norm(x), deterministic)
    if gemma:
      h = self.post_mlp_layer_norm(h)
    return x + self.dropout(h, deterministic), cache


class LlamaDecoder(nn.Module):
  """The layer stack, final norm and logits; `shared_embedding` is the token embedder."""

  config: TransformerConfig
  shared_embedding: nn.Module

  def setup(self):
    c = self.config
    layer = network.rematerialised(LlamaLayer, c.remat_policy,
                                    deterministic_argnum=6)
    self.layers = [layer(c, c.is_local_layer(i)) for i in range(c.num_decoder_layers)]
    self.decoder_norm = _norm(c)
    self.dropout = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))
    if not c.logits_via_embedding:
      self.logits_dense = Projection((c.vocab_size,), ("embed", "vocab"),
                                     dtype=c.activation_dtype)

  def __call__(self, tokens: Array, *, positions: Optional[Array] = None,
               self_caches: Optional[tuple[KeyValue, ...]] = None, cross=None,
               encoder_mask=None, deterministic: bool = True,
               hidden_layers: tuple[int, ...] = (), write: bool = True):
    """Scores `tokens: [batch, k]` (the interface of `network.Decoder`, `hidden_layers` and
    `write` included; `cross` and `encoder_mask` exist for it and must be None).

    Without caches the tokens are a whole sequence from position 0 (training). With
    `self_caches` token j of row b sits at position `positions[b] + j` and attends to the
    cached keys at positions <= its own.
    Returns (logits [batch, k, vocab] fp32, updated self_caches or None[, the
    `hidden_layers` states]).
    """
    x, *rest = self.hidden_states(tokens, positions=positions, self_caches=self_caches,
                                  cross=cross, encoder_mask=encoder_mask,
                                  deterministic=deterministic, hidden_layers=hidden_layers,
                                  write=write)
    return (self.project(x, deterministic), *rest)

  def project(self, x: Array, deterministic: bool = True) -> Array:
    """The output projection: final norm, dropout and logits, position-wise.

    x: [..., embed] last-layer hidden states -> logits [..., vocab] fp32.
    """
    x = self.dropout(self.decoder_norm(x), deterministic)
    if self.config.logits_via_embedding:
      logits = self.shared_embedding.attend(x)
    else:
      logits = self.logits_dense(x)
    return soft_cap(logits.astype(jnp.float32), self.config.final_logit_softcapping)

  def hidden_states(self, tokens: Array, *, positions: Optional[Array] = None,
                    self_caches: Optional[tuple[KeyValue, ...]] = None, cross=None,
                    encoder_mask=None, deterministic: bool = True,
                    hidden_layers: tuple[int, ...] = (), write: bool = True):
    """As `__call__`, but stops before `project`: (last-layer states [batch, k, embed],
    updated self_caches, the block's keys/values (`write=False`) or None[, the
    `hidden_layers` states])."""
    if cross is not None or encoder_mask is not None:
      raise ValueError("A llama-kind model has no encoder: cross / encoder_mask must be None.")
    batch, k = tokens.shape
    offsets = jnp.arange(k, dtype=jnp.int32)[None, :]
    if self_caches is None:
      query_positions = jnp.broadcast_to(offsets, (batch, k))
      key_positions = query_positions
    else:
      query_positions = positions[:, None].astype(jnp.int32) + offsets
      max_length = self_caches[0][0].shape[-1]
      key_positions = jnp.broadcast_to(jnp.arange(max_length)[None], (batch, max_length))
    c = self.config
    bias = attention_bias(query_positions, key_positions)
    if c.sliding_window is not None:
      local_bias = attention_bias(query_positions, key_positions, c.sliding_window)
    if self_caches is not None and not write:
      before = (key_positions < positions[:, None])[:, None, None, None, :]
      split = lambda full, window: layers.BlockBias(
          cache=jnp.where(before, full, layers.NEG_INF),
          block=attention_bias(query_positions, query_positions, window))
      bias = split(bias, None)
      if c.sliding_window is not None:
        local_bias = split(local_bias, c.sliding_window)
    x = self.shared_embedding(tokens)
    if c.kind == "gemma3":  # sqrt(emb_dim) in the activation dtype, as Gemma rounds it
      x = x * jnp.asarray(c.emb_dim ** 0.5, x.dtype)
    x = self.dropout(x, deterministic)
    new_caches, hidden = [], [x]
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, query_positions, local_bias if c.is_local_layer(i) else bias,
                       None if self_caches is None else self_caches[i], positions,
                       deterministic)
      new_caches.append(cache)
      hidden.append(x)
    out = x, (None if self_caches is None else tuple(new_caches))
    return out + (network.collect_hidden(hidden, hidden_layers),) if hidden_layers else out


class LlamaDecoderOnly(nn.Module):
  """The causal LM: token embedder and decoder (the module of `Model` for the RoPE kinds)."""

  config: TransformerConfig

  def setup(self):
    c = self.config
    self.token_embedder = Embed(c.vocab_size, c.emb_dim, tied=c.logits_via_embedding,
                                dtype=c.activation_dtype)
    self.decoder = LlamaDecoder(c, self.token_embedder)

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
    """[..., embed] hidden states -> [..., vocab] fp32 logits (`LlamaDecoder.project`)."""
    return self.decoder.project(x, deterministic)
