"""Block-acceptance weighting: each position's loss weighted by the chance of reaching it.

Speculative decoding scores a draft by the tokens a round accepts, tau - 1 = sum_i
prod_{j <= i} alpha_j over a block of gamma draft positions, not by the mean per-token
acceptance alpha_t. The block-acceptance objective (the D-PACE idea, arXiv 2605.18810,
applied to a separate draft) weights each position's per-token loss by the probability
that a round reaches it, under the current draft, with no gradient through the weight:

    w_t = stopgrad(prod_{s < t, s in t's block} alpha_s),   alpha_s = 1 - TVD(p_s, q_s).

A block is `block_size` consecutive loss positions (weight > 0), counted from each row's
first loss position; positions with weight 0 (prompt, padding) neither start nor break a
block. With the TVD as the per-token loss, sum_t w_t (1 - alpha_t) has the leading term of
-d E[accepted tokens per block] as its gradient; with any other divergence (or an LK loss)
it shifts the effort towards the positions a round reaches. AdaSPEC selection composes: it
picks tokens among the weighted per-token losses.

Blocked losses (positions processed in slices to bound memory): w needs the whole row's
alpha before any slice's loss. alpha is one scalar per position ([batch, length]), so it is
computed slice by slice first, then `reach_weights` scans it once, then each slice's loss
is multiplied by its slice of w.
"""

from __future__ import annotations

import typing
from typing import Literal

import jax
import jax.numpy as jnp

from distillspec_jax.core.validation import check_positive_int

Array = jax.Array

PositionWeighting = Literal["uniform", "block_acceptance"]
POSITION_WEIGHTINGS = typing.get_args(PositionWeighting)


def _segmented_product(left, right):
  """Combine of a product scan that restarts where `right` starts a segment."""
  left_value, left_start = left
  right_value, right_start = right
  return jnp.where(right_start, right_value, left_value * right_value), left_start | right_start


def reach_weights(alpha: Array, token_mask: Array, block_size: int) -> Array:
  """w_t = the product of alpha over the earlier loss positions of t's block, no gradient.

  Args:
    alpha: [batch, length] per-position acceptance in [0, 1] (e.g. 1 - TVD).
    token_mask: [batch, length] loss weights; positions > 0 are the loss positions.
    block_size: positions per block, an int >= 1 (gamma, the draft tokens of a round).

  Returns:
    [batch, length] weights in [0, 1]: 1 at each block's first position; at positions
    outside the mask, the product so far (they carry no loss). NaN in alpha propagates.
  """
  block_size = check_positive_int(block_size, "block_size")
  alpha = jax.lax.stop_gradient(jnp.asarray(alpha, jnp.float32))
  in_loss = jnp.asarray(token_mask) > 0
  index = jnp.cumsum(in_loss, axis=-1) - 1  # the loss position's rank in its row
  starts = in_loss & (index % block_size == 0)
  values = jnp.where(in_loss, alpha, 1.0)
  inclusive, _ = jax.lax.associative_scan(_segmented_product, (values, starts), axis=-1)
  # Exclusive product: the inclusive one of the previous position, 1 at a block start.
  before = jnp.pad(inclusive, ((0, 0), (1, 0)), constant_values=1.0)[:, :-1]
  return jnp.where(starts, 1.0, before)
