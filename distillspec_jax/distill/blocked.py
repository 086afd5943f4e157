"""Per-position losses over blocks of positions, so no [batch, length, vocab] tensor is whole.

A distillation step needs, per position, a few scalars (a divergence, the TVD, AdaSPEC's
margin, a cross-entropy), each a function of that position's logits only. The logits are the
output projection (final norm, logits layer) of the last-layer hidden states, so the step
keeps the hidden states [batch, length, embed] whole and produces logits a block of positions
at a time:

    values = map_position_blocks(per_position, {"draft": h_q, "target": h_p, ...}, block)

`per_position(index, block)` projects the block's hidden states to logits (`Model.project`),
computes its per-position values and returns them ([batch, block] leaves). The blocks run in
a `lax.scan` whose body is `jax.checkpoint`ed: the forward pass keeps only the block inputs
(slices of the hidden states) and the [batch, block] outputs; the backward pass recomputes
each block's logits. The largest live logits tensor is [batch, block, vocab] per model.

Exact: the values are the same functions of the same per-position logits as unblocked, so
only float summation order (the logits layer's gradient, summed over blocks) differs.

Block sizes (`resolve_block_size`): an int b in [1, length] (a length that b does not divide
is padded with positions whose outputs are dropped, so they get no gradient); "auto" (the
default of every objective): blocks of at most `AUTO_MAX_BLOCK` positions, as equal as the
length allows, and no blocking for a sequence that short; None: no blocking (one call on the
whole sequence, the original computation).

A new per-position divergence joins by being a function of (draft logits, target logits,
weights) of one block -> [batch, block], called inside `per_position`
(`blocked_token_divergence` shows the pattern); a loss that couples positions (a product of
acceptances along the sequence) computes its per-position factors in the block and combines
the [batch, length] outputs outside.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp

from distillspec_jax.core import validation

Array = jax.Array
BlockSize = Union[int, str, None]

AUTO = "auto"
# Blocks of 256 positions: at batch 8 and a 262,144-row vocabulary one fp32 block of logits is
# 2 GiB per model (the whole 2,048-token sequence would be 16 GiB).
AUTO_MAX_BLOCK = 256


def check_block_size_setting(block_size: BlockSize, name: str = "loss_block_size") -> None:
  """Refuses a setting other than "auto", None or an int >= 1 (the length is checked later)."""
  if block_size is None or (isinstance(block_size, str) and block_size == AUTO):
    return
  if isinstance(block_size, str):
    raise ValueError(f"{name}={block_size!r}; pass an int >= 1, {AUTO!r} or None.")
  validation.check_block_size(block_size, name)


def resolve_block_size(block_size: BlockSize, length: int,
                       name: str = "loss_block_size") -> Optional[int]:
  """The positions per block for a sequence of `length`, or None (no blocking).

  "auto": None when length <= AUTO_MAX_BLOCK, else ceil(length / n) for the fewest blocks n of
  at most AUTO_MAX_BLOCK positions. An int must lie in [1, length] (`validation.
  check_block_size`): a block longer than the sequence is a configuration error.
  """
  check_block_size_setting(block_size, name)
  if block_size is None:
    return None
  if isinstance(block_size, str):
    if length <= AUTO_MAX_BLOCK:
      return None
    return -(-length // math.ceil(length / AUTO_MAX_BLOCK))
  return validation.check_block_size(block_size, name, length)


def _to_blocks(x: Array, block_size: int, num_blocks: int) -> Array:
  """[batch, length, ...] -> [num_blocks, batch, block_size, ...], zero-padded at the end."""
  pad = num_blocks * block_size - x.shape[1]
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape((x.shape[0], num_blocks, block_size) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _from_blocks(y: Array, length: int) -> Array:
  """[num_blocks, batch, block_size, ...] -> [batch, length, ...] (padding dropped)."""
  y = jnp.moveaxis(y, 0, 1)
  y = y.reshape((y.shape[0], y.shape[1] * y.shape[2]) + y.shape[3:])
  return y[:, :length]


def map_position_blocks(per_position: Callable[[Array, Any], Any], inputs: Any,
                        block_size: Optional[int]) -> Any:
  """`per_position` over blocks of positions, rematerialised on the backward pass.

  Args:
    per_position: (block index: int32 scalar, block of `inputs`: the same tree with
      [batch, block, ...] leaves) -> a tree of [batch, block, ...] per-position values. It
      must treat positions independently (a position's outputs depend on its inputs only).
    inputs: a tree of [batch, length, ...] arrays (hidden states, targets, weights).
    block_size: positions per block (from `resolve_block_size`), or None: one call on the
      whole sequence with index 0.

  Returns:
    per_position's tree with [batch, length, ...] leaves.
  """
  leaves = jax.tree.leaves(inputs)
  length = leaves[0].shape[1]
  if block_size is None:
    return per_position(jnp.int32(0), inputs)
  num_blocks = -(-length // block_size)
  blocks = jax.tree.map(lambda x: _to_blocks(x, block_size, num_blocks), inputs)
  body = jax.checkpoint(per_position)

  def step(carry, indexed):
    index, block = indexed
    return carry, body(index, block)

  _, outputs = jax.lax.scan(step, None, (jnp.arange(num_blocks, dtype=jnp.int32), blocks))
  return jax.tree.map(lambda y: _from_blocks(y, length), outputs)


def blocked_token_divergence(divergence: Callable[[Array, Array, Array], Array],
                             draft_project: Callable[[Array], Array], draft_hidden: Array,
                             target_project: Callable[[Array], Array], target_hidden: Array,
                             weights: Array, block_size: Optional[int]) -> Array:
  """A per-position divergence of two models' logits, computed a block at a time.

  Args:
    divergence: (draft logits [batch, block, vocab], target logits [batch, block, vocab],
      weights [batch, block]) -> [batch, block]; e.g.
      `lambda q, p, w: divergences.token_divergence("fkl", p, q)`.
    draft_project / target_project: hidden [..., embed] -> logits [..., vocab] (a model's
      `project` with its params bound). The target's logits get no gradient.
    draft_hidden / target_hidden: [batch, length, embed] last-layer states of each model.
    weights: [batch, length] loss weights.
    block_size: as in `map_position_blocks`.

  Returns:
    [batch, length] per-position divergence.
  """
  def per_position(index, block):
    del index
    target_logits = jax.lax.stop_gradient(target_project(block["target"]))
    return divergence(draft_project(block["draft"]), target_logits, block["weights"])

  inputs = {"draft": draft_hidden, "target": target_hidden, "weights": weights}
  return map_position_blocks(per_position, inputs, block_size)
