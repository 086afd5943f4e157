"""The explicit decoding cache: per-layer keys/values and a real per-row position.

`positions[b]` is the number of decoder tokens row b holds, i.e. where its next token is
written. Rows move independently (speculative decoding accepts a different number of draft
tokens per row), and `rollback` moves rows back without copying: the stale entries past a row's
position are never attended to and are overwritten by the next write.

Bounds: the cache does not check or drop writes past its end. Writing k tokens at a row's
position p with p + k > max_length is wrong in both write paths of `layers.write_cache`: the
per-row dynamic-update-slice (batch <= 8) clamps the start to max_length - k, so the tokens
land on the row's last k valid slots (3 tokens written at slot 5 of 6 overwrite slots 3-5),
and the scatter (larger batches) is compiled with `mode="promise_in_bounds"`, for which
out-of-range indices are undefined. Callers check capacity before writing: `decoding.decode`
and `speculative.speculative_decode` refuse, up front, any request whose writes would not fit
(see `decoding.check_capacity`).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
KeyValue = tuple[Array, Array]


@flax.struct.dataclass
class DecodingCache:
  """Decoder state for incremental scoring.

  Attributes:
    positions: [batch] int32, tokens held per row.
    self_attention: one (keys, values) pair per decoder layer: keys
      [batch * heads, head_dim, max_length], values [batch * heads, max_length, head_dim] (row
      b's heads are rows b * heads .. b * heads + heads - 1; heads = the key/value heads,
      `config.kv_heads`: fewer than the query heads with grouped-query attention). These are
      the layouts attention's matmuls read, so a decoding step neither transposes nor copies
      the cache.
    cross_attention: encoder-decoder only: one (keys, values) pair per decoder layer, in the
      self-attention's layouts over the input: keys [batch * heads, head_dim, input_length],
      values [batch * heads, input_length, head_dim], computed once per prompt
      (`layers.to_cache_layout`), so a decoding step reads them without a transpose (one per
      layer and step would be 63% of the demo target's step at 2,048 input tokens).
    encoder_mask: encoder-decoder only: [batch, input_length] bool, True on real input tokens.
  """

  positions: Array
  self_attention: tuple[KeyValue, ...]
  cross_attention: Optional[tuple[KeyValue, ...]] = None
  encoder_mask: Optional[Array] = None

  @property
  def max_length(self) -> int:
    return self.self_attention[0][0].shape[-1]

  @property
  def batch_size(self) -> int:
    return self.positions.shape[0]

  def rollback(self, num_positions: Array) -> "DecodingCache":
    """Moves each row back by `num_positions: [batch]` (>= 0) tokens."""
    return self.replace(positions=self.positions - jnp.asarray(num_positions, jnp.int32))

  def advance(self, num_positions) -> "DecodingCache":
    return self.replace(positions=self.positions + jnp.asarray(num_positions, jnp.int32))


def empty_self_attention(num_layers: int, batch_size: int, max_length: int, num_heads: int,
                         head_dim: int, dtype) -> tuple[KeyValue, ...]:
  keys = (batch_size * num_heads, head_dim, max_length)
  values = (batch_size * num_heads, max_length, head_dim)
  return tuple((jnp.zeros(keys, dtype), jnp.zeros(values, dtype)) for _ in range(num_layers))
