"""T5 1.1 building blocks in flax.linen, with T5X parameter names and logical axes.

Parameter layout follows T5X's minimal T5 (`t5x/examples/t5/layers.py`) so that T5X T5 1.1
checkpoints map one to one: projection kernels are stored 2-D (`[embed, heads * head_dim]`,
logical axes `('embed', 'joined_kv')`), the relative position bias is
`rel_embedding: [heads, buckets]`, RMS norms hold only `scale`.

Self-attention can write into an explicit decoding cache: each batch row has its own
position, k new tokens are written at `positions[b] .. positions[b] + k - 1`, and attention
only sees keys at or before each query's absolute position. Entries past a row's position are
never read, so moving a row back (rejected draft tokens) is just lowering its position.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Initializer = Callable[..., Array]

# Added to attention logits where attention is not allowed (fp32 logits; as in T5X).
NEG_INF = -1e10


def _logical(init: Initializer, axes: Sequence[str]) -> Initializer:
  return nn.with_logical_partitioning(init, tuple(axes))


class DenseGeneral(nn.Module):
  """A linear map whose kernel is stored 2-D, T5X style.

  Contracts the last `num_input_axes` axes of `x` with a kernel of stored shape
  `[prod(input dims), prod(features)]` and returns `x.shape[:-num_input_axes] + features`.
  """

  features: tuple[int, ...]
  kernel_axes: tuple[str, str]
  num_input_axes: int = 1
  dtype: jnp.dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")

  @nn.compact
  def __call__(self, x: Array) -> Array:
    input_dims = x.shape[-self.num_input_axes:]
    kernel = self.param("kernel", _logical(self.kernel_init, self.kernel_axes),
                        (int(np.prod(input_dims)), int(np.prod(self.features))), jnp.float32)
    kernel = jnp.asarray(kernel, self.dtype).reshape(tuple(input_dims) + tuple(self.features))
    x = jnp.asarray(x, self.dtype)
    contracting = tuple(range(x.ndim - self.num_input_axes, x.ndim))
    return jax.lax.dot_general(x, kernel, ((contracting, tuple(range(self.num_input_axes))), ((), ())))


class RMSNorm(nn.Module):
  """T5's layer norm: scale only, no bias, no mean subtraction; statistics in fp32."""

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", _logical(nn.initializers.ones, ("embed",)), (x.shape[-1],),
                       jnp.float32)
    x32 = jnp.asarray(x, jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return jnp.asarray(x32 * scale, self.dtype)


class Embed(nn.Module):
  """Token embedding `embedding: [vocab, embed]`; `attend` gives tied logits."""

  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        "embedding", _logical(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    """tokens: [batch, length] int -> [batch, length, embed]."""
    return jnp.take(jnp.asarray(self.embedding, self.dtype), tokens, axis=0)

  def attend(self, x: Array) -> Array:
    """x: [..., embed] -> logits [..., vocab]."""
    return jnp.dot(jnp.asarray(x, self.dtype), jnp.asarray(self.embedding, self.dtype).T)


def relative_position_bucket(relative_position: Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Array:
  """T5's bucketing of `key_position - query_position` (exact near, log-spaced far)."""
  distance = -relative_position
  bucket = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (distance < 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(distance)
  else:
    distance = jnp.maximum(distance, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # log(distance / max_exact) is only used where distance >= max_exact, so it is finite.
  safe = jnp.maximum(distance, max_exact).astype(jnp.float32)
  large = max_exact + (jnp.log(safe / max_exact) / math.log(max_distance / max_exact) *
                       (num_buckets - max_exact)).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, distance, large)


class RelativePositionBiases(nn.Module):
  """Per-head scalar bias from the bucketed relative position: `rel_embedding: [heads, buckets]`."""

  num_buckets: int
  max_distance: int
  num_heads: int
  bidirectional: bool
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, query_positions: Array, key_positions: Array) -> Array:
    """query_positions: [batch, q], key_positions: [batch, k] -> bias [batch, heads, q, k]."""
    table = self.param(
        "rel_embedding",
        _logical(nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                 ("heads", "relpos_buckets")),
        (self.num_heads, self.num_buckets), jnp.float32)
    relative = key_positions[:, None, :] - query_positions[:, :, None]
    buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets,
                                       self.max_distance)
    bias = jnp.take(table, buckets, axis=1)  # [heads, batch, q, k]
    return jnp.asarray(jnp.transpose(bias, (1, 0, 2, 3)), self.dtype)


def write_cache(cache: Array, new: Array, positions: Array) -> Array:
  """Writes `new: [batch, k, ...]` into `cache: [batch, max_length, ...]` at per-row `positions`.

  Out-of-range writes are dropped, never clamped onto valid entries (callers check capacity).
  """
  batch, k = new.shape[:2]
  rows = jnp.arange(batch)[:, None]
  cols = positions[:, None] + jnp.arange(k)[None, :]
  return cache.at[rows, cols].set(new.astype(cache.dtype), mode="drop")


class MultiHeadDotProductAttention(nn.Module):
  """T5 attention (no 1/sqrt(d) logit scaling: T5 folds it into the query initialisation)."""

  num_heads: int
  head_dim: int
  embed_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    base = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    depth_scaling = math.sqrt(self.head_dim)

    def query_init(*args):
      return base(*args) / depth_scaling

    heads = (self.num_heads, self.head_dim)
    self.query = DenseGeneral(heads, ("embed", "joined_kv"), dtype=self.dtype,
                              kernel_init=query_init)
    self.key = DenseGeneral(heads, ("embed", "joined_kv"), dtype=self.dtype, kernel_init=base)
    self.value = DenseGeneral(heads, ("embed", "joined_kv"), dtype=self.dtype, kernel_init=base)
    self.out = DenseGeneral((self.embed_dim,), ("joined_kv", "embed"), num_input_axes=2,
                            dtype=self.dtype, kernel_init=base)

  def project_kv(self, inputs_kv: Array) -> tuple[Array, Array]:
    """inputs_kv: [batch, length, embed] -> keys, values: [batch, length, heads, head_dim]."""
    return self.key(inputs_kv), self.value(inputs_kv)

  def __call__(self, inputs_q: Array, keys: Array, values: Array, bias: Array,
               deterministic: bool = True) -> Array:
    """Attends `inputs_q: [batch, q, embed]` to `keys, values: [batch, k, heads, head_dim]`.

    bias: [batch or 1, heads or 1, q, k], the relative position bias plus the mask (NEG_INF
    where attention is not allowed). Returns [batch, q, embed].
    """
    query = self.query(inputs_q)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, keys, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits + bias.astype(jnp.float32), axis=-1)
    if not deterministic and self.dropout_rate > 0.0:
      keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.dropout_rate,
                                  weights.shape)
      weights = jnp.where(keep, weights / (1.0 - self.dropout_rate), 0.0)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.dtype), values.astype(self.dtype))
    return self.out(mixed)


class MlpBlock(nn.Module):
  """T5 1.1 gated-GELU MLP: wo(gelu(wi_0 x) * wi_1 x)."""

  mlp_dim: int
  embed_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x: [batch, length, embed] -> [batch, length, embed]."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    gate = DenseGeneral((self.mlp_dim,), ("embed", "mlp"), dtype=self.dtype, kernel_init=init,
                        name="wi_0")(x)
    linear = DenseGeneral((self.mlp_dim,), ("embed", "mlp"), dtype=self.dtype, kernel_init=init,
                          name="wi_1")(x)
    hidden = jax.nn.gelu(gate, approximate=True) * linear
    # Same dropout mask along the length axis, as in T5X.
    hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(hidden, deterministic)
    return DenseGeneral((self.embed_dim,), ("mlp", "embed"), dtype=self.dtype, kernel_init=init,
                        name="wo")(hidden)
