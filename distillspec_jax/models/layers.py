"""T5 1.1 building blocks in flax.linen, with T5X parameter names and logical axes.

Parameter layout follows T5X's minimal T5 (`t5x/examples/t5/layers.py`) so that T5X T5 1.1
checkpoints map one to one: projection kernels are stored 2-D (`[embed, heads * head_dim]`,
logical axes `('embed', 'joined_kv')`), the relative position bias is
`rel_embedding: [heads, buckets]`, RMS norms hold only `scale`.

Self-attention can write into an explicit decoding cache. Its keys are stored as
`[batch * heads, head_dim, max_length]` and its values as `[batch * heads, max_length,
head_dim]`, the layouts attention's two matmuls read: with
`[batch, length, heads, head_dim]` XLA transposed the whole cache on every decoding step, and a
cache write that XLA cannot do in place copies it (on CPU this was a third of a small model's
decoding step). Each batch row has its own
position, k new tokens are written at `positions[b] .. positions[b] + k - 1`, and attention
only sees keys at or before each query's absolute position. Entries past a row's position are
never read, so moving a row back (rejected draft tokens) is just lowering its position.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import flax.struct
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
    kernel = jnp.asarray(kernel, self.dtype)
    batch_dims = x.shape[:-self.num_input_axes]
    # One 2-D matmul [rows, in] x [in, out]: XLA:CPU runs the backward pass's weight gradient
    # of a dot that contracts several batch axes (batch, length) about 2x slower than the same
    # product of flattened operands (bench/train_step.py).
    rows = jnp.asarray(x, self.dtype).reshape((-1, kernel.shape[0]))
    return (rows @ kernel).reshape(tuple(batch_dims) + tuple(self.features))


class RMSNorm(nn.Module):
  """T5's layer norm: scale only, no bias, no mean subtraction; statistics in fp32.

  `plus_one`: the normalised x is multiplied by (1 + scale), scale initialised to 0 (Gemma's
  norms: weight decay then pulls towards the identity). `axis`: the logical name of the
  normalised (last) dimension.
  """

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  plus_one: bool = False
  axis: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: [..., features] -> [..., features]."""
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param("scale", _logical(init, (self.axis,)), (x.shape[-1],), jnp.float32)
    # fp32 even when the parameters were cast to bf16: 1 + scale rounded to bf16 would lose
    # most of a small scale.
    scale = jnp.asarray(scale, jnp.float32)
    x32 = jnp.asarray(x, jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return jnp.asarray(x32 * (1.0 + scale if self.plus_one else scale), self.dtype)


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


@functools.lru_cache(maxsize=None)
def relative_position_bucket_table(bidirectional: bool, num_buckets: int,
                                   max_distance: int) -> np.ndarray:
  """Bucket of each relative position in [-max_distance, max_distance]: [2 * max_distance + 1].

  Entry i is the bucket of `key_position - query_position = i - max_distance`. Every relative
  position at or beyond +-max_distance falls in the same bucket as +-max_distance, so clipping
  to this range is exact. Computed once, eagerly (a constant of the compiled programs).
  """
  with jax.ensure_compile_time_eval():
    relative = jnp.arange(-max_distance, max_distance + 1, dtype=jnp.int32)
    return np.asarray(relative_position_bucket(relative, bidirectional, num_buckets,
                                               max_distance))


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
    # A lookup in a per-relative-position bias row instead of T5's bucket formula per
    # (query, key) pair: decoding steps see new positions every call, and the formula took a
    # log for every cache slot on every call.
    buckets = relative_position_bucket_table(self.bidirectional, self.num_buckets,
                                             self.max_distance)
    bias_by_relative = jnp.take(table, jnp.asarray(buckets), axis=1)  # [heads, 2 * max_dist + 1]
    relative = key_positions[:, None, :] - query_positions[:, :, None]
    index = jnp.clip(relative, -self.max_distance, self.max_distance) + self.max_distance
    bias = jnp.take(bias_by_relative, index, axis=1)  # [heads, batch, q, k]
    return jnp.asarray(jnp.transpose(bias, (1, 0, 2, 3)), self.dtype)


@flax.struct.dataclass
class BlockBias:
  """Attention biases of a block of k tokens scored against a decoding cache that it is not
  written into (`Model.score_block`): `cache` over the cache's slots, NEG_INF at and past
  each row's position (those slots are stale), and `block` over the block's own keys
  (causal). Shapes are the family's bias layout with max_length and k as the key axis: T5
  [batch, heads, k, max_length] and [batch, heads, k, k], the RoPE kinds [batch, 1, 1, k,
  max_length] and [batch, 1, 1, k, k]."""

  cache: Array
  block: Array


def softmax_over_cache_and_block(cache_logits: Array, block_logits: Array):
  """One softmax over a cache's keys and a block's keys together (the last axis of each):
  (cache weights, block weights), the shapes of the inputs."""
  weights = jax.nn.softmax(jnp.concatenate([cache_logits, block_logits], axis=-1), axis=-1)
  return weights[..., :cache_logits.shape[-1]], weights[..., cache_logits.shape[-1]:]


def to_cache_layout(keys: Array, values: Array) -> tuple[Array, Array]:
  """`keys, values: [batch, length, heads, head_dim]` in a decoding cache's layouts: keys
  [batch * heads, head_dim, length], values [batch * heads, length, head_dim] (what
  `attend_cache` reads without transposing)."""
  batch, length, heads, head_dim = keys.shape
  return (jnp.transpose(keys, (0, 2, 3, 1)).reshape(batch * heads, head_dim, length),
          jnp.transpose(values, (0, 2, 1, 3)).reshape(batch * heads, length, head_dim))


# Up to this batch size a cache write is one dynamic-update-slice per batch row, which XLA does
# in place; larger batches use one scatter (an unrolled loop that long would bloat the program).
MAX_BATCH_FOR_ROW_WRITES = 8


def write_cache(cache: Array, new: Array, positions: Array, *, length_last: bool) -> Array:
  """Writes `new: [batch, k, heads, head_dim]` into a decoding cache at per-row
  `positions: [batch]`: keys `[batch * heads, head_dim, max_length]` (`length_last`) or values
  `[batch * heads, max_length, head_dim]`.

  Callers guarantee `positions + k <= max_length` (they check capacity up front). Past the
  end nothing is dropped: the per-row path clamps the start to `max_length - k` (overwriting
  valid slots) and the scatter path's indices are promised in bounds (undefined otherwise).
  """
  if new.shape[0] <= MAX_BATCH_FOR_ROW_WRITES:
    return write_cache_by_rows(cache, new, positions, length_last=length_last)
  return write_cache_by_scatter(cache, new, positions, length_last=length_last)


def write_key_values(cache: tuple[Array, Array], keys: Array, values: Array,
                     positions: Array) -> tuple[Array, Array]:
  """One layer's `write_cache` of `keys, values: [batch, k, heads, head_dim]` into its
  (keys, values) cache pair at per-row `positions: [batch]`."""
  return (write_cache(cache[0], keys, positions, length_last=True),
          write_cache(cache[1], values, positions, length_last=False))


def write_cache_by_rows(cache: Array, new: Array, positions: Array, *,
                        length_last: bool) -> Array:
  """`write_cache` as one dynamic-update-slice per batch row (in place, no layout change)."""
  batch, k, heads, head_dim = new.shape
  if length_last:
    new = jnp.transpose(new, (0, 2, 3, 1)).reshape(batch * heads, head_dim, k)
  else:
    new = jnp.transpose(new, (0, 2, 1, 3)).reshape(batch * heads, k, head_dim)
  new = new.astype(cache.dtype)
  for row in range(batch):
    start = (row * heads, 0, positions[row]) if length_last else (row * heads, positions[row], 0)
    cache = jax.lax.dynamic_update_slice(cache, new[row * heads:(row + 1) * heads], start)
  return cache


def write_cache_by_scatter(cache: Array, new: Array, positions: Array, *,
                           length_last: bool) -> Array:
  """`write_cache` as one scatter over all rows (any batch size)."""
  batch, k, heads, _ = new.shape
  cache_rows = jnp.arange(batch)[:, None] * heads + jnp.arange(heads)[None, :]  # [batch, heads]
  slots = positions[:, None] + jnp.arange(k)[None, :]                           # [batch, k]
  # The advanced indices broadcast to [batch, heads, k] and come first; head_dim follows.
  update = jnp.transpose(new.astype(cache.dtype), (0, 2, 1, 3))  # [batch, heads, k, head_dim]
  if length_last:
    indexed = cache.at[cache_rows[:, :, None], :, slots[:, None, :]]
  else:
    indexed = cache.at[cache_rows[:, :, None], slots[:, None, :], :]
  return indexed.set(update, mode="promise_in_bounds")


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

  def attend_cache(self, inputs_q: Array, keys: Array, values: Array, bias: Array) -> Array:
    """Attends `inputs_q: [batch, q, embed]` to a decoding cache's `keys: [batch * heads,
    head_dim, max_length]` and `values: [batch * heads, max_length, head_dim]`;
    bias: [batch, heads or 1, q, max_length].
    Returns [batch, q, embed] (inference only: no dropout)."""
    batch, q = inputs_q.shape[:2]
    query = jnp.transpose(self.query(inputs_q), (0, 2, 1, 3))  # [batch, heads, q, head_dim]
    query = query.reshape(batch * self.num_heads, q, self.head_dim)
    logits = jnp.einsum("nqd,ndk->nqk", query, keys, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, self.num_heads, q, -1) + bias.astype(jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
    weights = weights.reshape(batch * self.num_heads, q, -1)
    mixed = jnp.einsum("nqk,nkd->nqd", weights, values.astype(self.dtype))
    mixed = jnp.transpose(mixed.reshape(batch, self.num_heads, q, self.head_dim), (0, 2, 1, 3))
    return self.out(mixed)

  def attend_cache_and_block(self, inputs_q: Array, cache: tuple[Array, Array], keys: Array,
                             values: Array, bias: BlockBias) -> Array:
    """`attend_cache` for a block that is not written into the cache: `inputs_q: [batch, k,
    embed]` attends to the cache's slots before each row's position (`cache`: keys
    [batch * heads, head_dim, max_length], values [batch * heads, max_length, head_dim], read
    only) and to the block's own `keys, values: [batch, k, heads, head_dim]`. Returns [batch,
    k, embed], what `attend_cache` gives once the block is written."""
    batch, q = inputs_q.shape[:2]
    query = self.query(inputs_q)  # [batch, q, heads, head_dim]
    flat = jnp.transpose(query, (0, 2, 1, 3)).reshape(batch * self.num_heads, q, self.head_dim)
    cache_logits = jnp.einsum("nqd,ndk->nqk", flat, cache[0], preferred_element_type=jnp.float32)
    cache_logits = cache_logits.reshape(batch, self.num_heads, q, -1) + bias.cache
    block_logits = jnp.einsum("bqhd,bkhd->bhqk", query, keys, preferred_element_type=jnp.float32)
    on_cache, on_block = softmax_over_cache_and_block(cache_logits, block_logits + bias.block)
    on_cache = on_cache.astype(self.dtype).reshape(batch * self.num_heads, q, -1)
    mixed = jnp.einsum("nqk,nkd->nqd", on_cache, cache[1].astype(self.dtype))
    mixed = mixed.reshape(batch, self.num_heads, q, self.head_dim) + jnp.einsum(
        "bhqk,bkhd->bhqd", on_block.astype(self.dtype), values.astype(self.dtype))
    return self.out(jnp.transpose(mixed, (0, 2, 1, 3)))


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
