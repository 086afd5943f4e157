"""AdaSPEC selective distillation (Hu et al., 2025).

A reference model (a copy of the draft, first distilled from the target with
forward KL) estimates how learnable each token is.  Per token the margin

    dL_t = L_draft,t - L_ref,t,   L_m,t = KL(p_target,t || q_m,t)   (forward KL)

is large where the draft lags the reference, i.e. where the draft *can* still
improve.  Only the top-k fraction of the batch's valid tokens by margin
contribute to the draft's distillation loss (k = 0.4 by default); hard tokens,
which even the reference cannot fit, are filtered out.

Typical use inside a train step:

    margin = token_margin(target_logits, draft_logits, reference_logits)
    keep = select_tokens(margin, token_mask, top_k_fraction=0.4)
    losses = divergences.token_divergence("fkl", target_logits, draft_logits)
    loss = selective_loss(losses, keep, token_mask, normalization="sequence_mean")

Normalisations of the kept tokens' loss (``selective_loss``):

* "sequence_mean" (alias "all", the default of this framework): each row's
  kept-loss sum over that row's valid tokens, then the mean over rows.  With
  k = 1 it is exactly DistillSpec's sequence-level loss.
* "batch_valid_tokens": the kept-loss sum of the whole batch over the batch's
  count of valid tokens.  This is the rule of the public AdaSPEC code.
* "kept": the mean over the kept tokens of the whole batch.

"sequence_mean" and "batch_valid_tokens" agree when every row has the same
number of valid tokens.  When rows differ in length, "sequence_mean" gives
each kept token of a short row more weight than one of a long row.

The number of kept tokens is round(k * n) for n valid tokens.  The public code
keeps every token whose margin is >= the (1 - k) quantile of the valid margins
(linear interpolation).  Without ties that keeps floor(k * n + 1 - k) tokens,
so the two rules differ by one token in some batches: with k = 0.4, whenever
n = 6, 11, 16, ... (n = 6: we keep 2, the quantile rule keeps 3).
``quantile_keep_count`` gives the public count; the tests show both.
"""

from __future__ import annotations

import fractions
import math
import numbers
import typing
from typing import Dict, Literal, Optional

import jax
import jax.numpy as jnp

from distillspec_jax.distill import divergences

DEFAULT_TOP_K_FRACTION = 0.4
# "all" is the old name of "sequence_mean"; it stays so existing configs keep working.
Normalization = Literal["sequence_mean", "batch_valid_tokens", "kept", "all"]
NORMALIZATIONS = typing.get_args(Normalization)
_ALIASES = {"all": "sequence_mean"}


def _validate_top_k_fraction(top_k_fraction) -> None:
  # Traced values (k swept inside jit) cannot be checked eagerly.
  if isinstance(top_k_fraction, numbers.Real) and not 0.0 < float(top_k_fraction) <= 1.0:
    raise ValueError(
        f"top_k_fraction must lie in the half-open interval (0, 1]; got {top_k_fraction!r}."
    )


def token_margin(
    target_logits: jax.Array,
    draft_logits: jax.Array,
    reference_logits: jax.Array,
    *,
    temperature=None,
    target_temperature=1.0,
    draft_temperature=1.0,
    vocab_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """AdaSPEC margin dL = FKL(p || q_draft) - FKL(p || q_ref) per token.

  The forward KLs are the distillation loss's: the target at T_p, the draft and the
  reference (a copy of the draft) at T_q, so that the selection ranks tokens by the loss
  as trained.

  Args:
    target_logits, draft_logits, reference_logits: [batch, length, vocab].
    temperature: if given, one temperature (> 0) for all three models (overrides the two
      below).
    target_temperature: T_p (> 0) of the target.
    draft_temperature: T_q (> 0) of the draft and of the reference.
    vocab_mask: optional [vocab] bool, True = real vocabulary entry.

  Returns:
    [batch, length] margin, gradient-stopped (selection is not differentiated).
  """
  if temperature is not None:
    target_temperature = draft_temperature = temperature
  kwargs = dict(target_temperature=target_temperature, draft_temperature=draft_temperature,
                vocab_mask=vocab_mask)
  draft_loss = divergences.token_divergence("fkl", target_logits, draft_logits, **kwargs)
  reference_loss = divergences.token_divergence("fkl", target_logits, reference_logits, **kwargs)
  return jax.lax.stop_gradient(draft_loss - reference_loss)


def num_tokens_to_keep(num_valid: jax.Array, top_k_fraction) -> jax.Array:
  """round(k * n) clipped to [min(1, n), n], as int32.

  Nearest-integer rounding (rather than ceil) keeps float error in k * n from
  adding a token (e.g. 0.7 * 10 = 7.000000000000001 would ceil to 8); the
  lower clip keeps at least one token whenever the batch has any, and k = 1
  keeps exactly all n.

  This is not the count of the public AdaSPEC code, which can keep one token
  more or fewer (see ``quantile_keep_count`` and the module docstring).

  Args:
    num_valid: scalar number of valid tokens n.
    top_k_fraction: k in (0, 1], static or traced.

  Returns:
    int32 scalar.
  """
  num_valid = jnp.asarray(num_valid, jnp.int32)
  wanted = jnp.round(jnp.asarray(top_k_fraction, jnp.float32) * num_valid.astype(jnp.float32))
  return jnp.clip(wanted.astype(jnp.int32), jnp.minimum(1, num_valid), num_valid)


def quantile_keep_count(num_valid: int, top_k_fraction: float) -> int:
  """Tokens kept by the public AdaSPEC rule, for n distinct margins.

  That rule keeps the margins >= the (1 - k) quantile of the n valid margins,
  with linear interpolation between sorted values.  The quantile sits at
  sorted position (1 - k) * (n - 1) (0 = smallest), so ceil of that position
  tokens fall below it and the rest are kept.  Plain Python, for documentation
  and tests; the train step uses ``num_tokens_to_keep``.

  Args:
    num_valid: number of valid tokens n (>= 1).
    top_k_fraction: k in (0, 1].

  Returns:
    n - ceil((1 - k) * (n - 1)), in exact arithmetic.
  """
  _validate_top_k_fraction(top_k_fraction)
  if num_valid < 1:
    raise ValueError(f"num_valid must be >= 1; got {num_valid!r}.")
  # Exact rational arithmetic on k as written in decimal (0.4 is 2/5), so no float error
  # reaches the ceil.  Floating-point quantile code can be one token off where
  # (1 - k) * (n - 1) is a whole number: NumPy is for k = 0.7, n = 11.
  position = (1 - fractions.Fraction(repr(float(top_k_fraction)))) * (num_valid - 1)
  below = math.ceil(position)
  return int(num_valid - below)


def select_tokens(
    margin: jax.Array,
    token_mask: jax.Array,
    top_k_fraction=DEFAULT_TOP_K_FRACTION,
) -> jax.Array:
  """Keeps the valid tokens whose margin is in the batch's top-k fraction.

  Selection is over the flattened batch (as in the public AdaSPEC code), not
  per sequence.  n_keep = ``num_tokens_to_keep(n_valid, k)``; the threshold is
  the n_keep-th largest valid margin and every valid token with margin >=
  threshold is kept, so ties at the threshold may keep a few extra tokens.
  Padding (token_mask == 0) is never kept. A valid token whose margin is NaN (a NaN in its
  target, draft or reference logits) is always kept, so the NaN reaches the loss instead of
  being dropped as "not in the top k" and leaving a finite loss without it.  Works under jit with k static or
  traced (sort-based, no data-dependent shapes).

  Args:
    margin: [batch, length] per-token margin (gradient is stopped here).
    token_mask: [batch, length] loss weights; > 0 marks a valid token.
    top_k_fraction: k in (0, 1].

  Returns:
    [batch, length] float32 keep mask (1.0 = kept).
  """
  _validate_top_k_fraction(top_k_fraction)
  margin = jax.lax.stop_gradient(margin)
  valid = divergences.weighted_positions(token_mask)  # a NaN weight is valid: it propagates
  num_keep = num_tokens_to_keep(jnp.sum(valid), top_k_fraction)

  # Padding sorts last (as -inf) so the n_keep-th entry is always a valid margin.
  descending = -jnp.sort(-jnp.where(valid, margin, -jnp.inf).reshape(-1))
  threshold = descending[jnp.maximum(num_keep - 1, 0)]
  # NaN >= threshold is False: a NaN margin is kept explicitly so that it propagates.
  keep = valid & ((margin >= threshold) | jnp.isnan(margin)) & (num_keep > 0)
  return keep.astype(jnp.float32)


def selective_loss(
    token_losses: jax.Array,
    keep_mask: jax.Array,
    token_mask: jax.Array,
    normalization: str = "sequence_mean",
) -> jax.Array:
  """Distillation loss over the kept tokens only.

  Dropped tokens are replaced by exactly 0 with ``where`` so they receive
  exactly zero gradient.  With w = token_mask, s = keep_mask and L the token
  losses:

  * "sequence_mean" (alias "all"): per row sum_t s w L / sum_t w, then the
    mean over all batch rows (a row without valid tokens counts as 0).  This
    is DistillSpec's sequence-level loss (``divergences.sequence_divergence``)
    with dropped tokens zeroed; with k = 1 (s = 1 on valid tokens) it is
    numerically identical to it.  It is not the public AdaSPEC rule.
  * "batch_valid_tokens": sum_{b,t} s w L / sum_{b,t} w, the kept losses of
    the whole batch over the batch's count of valid tokens.  This is what the
    public AdaSPEC code computes (0/1 masks; there w is 0 or 1).  With k = 1
    it is the per-token mean over the batch.
  * "kept": sum_{b,t} s w L / sum_{b,t} s w, the mean over kept tokens of the
    whole batch.

  Each returns 0 (not NaN) when its denominator is 0, and NaN when a weight is NaN.  The first two agree
  when all rows have the same number of valid tokens.

  Args:
    token_losses: [batch, length] per-token divergence (any divergence).
    keep_mask: [batch, length] from ``select_tokens``.
    token_mask: [batch, length] loss weights, 0 for padding.
    normalization: one of ``NORMALIZATIONS``.

  Returns:
    scalar loss.
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(
        f"Unknown normalization {normalization!r}; valid values are "
        f"{', '.join(map(repr, NORMALIZATIONS))}."
    )
  normalization = _ALIASES.get(normalization, normalization)
  kept = jnp.asarray(keep_mask) > 0
  kept_losses = jnp.where(kept, token_losses, 0.0)
  if normalization == "sequence_mean":
    # Same reduction as divergences.sequence_divergence, so k = 1 matches exactly.
    return jnp.mean(divergences.masked_sequence_mean(kept_losses, token_mask))
  token_mask = jnp.asarray(token_mask, token_losses.dtype)
  kept_weights = jnp.where(kept, token_mask, 0.0)
  if normalization == "batch_valid_tokens":
    total_valid = jnp.sum(jnp.where(divergences.weighted_positions(token_mask), token_mask, 0.0))
    kept_sum = jnp.sum(jnp.where(divergences.weighted_positions(kept_weights),
                                 kept_losses * kept_weights, 0.0))
    has_valid = ~(total_valid <= 0)  # True for NaN: it propagates
    return jnp.where(has_valid, kept_sum / jnp.where(has_valid, total_valid, 1.0), 0.0)
  return _safe_mean(kept_losses, kept_weights)


def _safe_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
  """sum(w v) / sum(w) over all entries, 0 (not NaN) when sum(w) == 0."""
  total_weight = jnp.sum(weights)
  weighted = jnp.sum(jnp.where(divergences.weighted_positions(weights), values * weights, 0.0))
  has_weight = ~(total_weight <= 0)  # True for NaN: it propagates
  return jnp.where(has_weight, weighted / jnp.where(has_weight, total_weight, 1.0), 0.0)


def selection_stats(
    margin: jax.Array,
    keep_mask: jax.Array,
    token_mask: jax.Array,
) -> Dict[str, jax.Array]:
  """Logging summary of a selection.

  Args:
    margin: [batch, length] per-token margins.
    keep_mask: [batch, length] from ``select_tokens``.
    token_mask: [batch, length] loss weights, > 0 = valid token.

  Returns:
    dict of float scalars: kept_fraction (kept / valid tokens),
    mean_margin_kept and mean_margin_dropped (unweighted means over valid
    tokens; 0 when the set is empty).
  """
  margin = jax.lax.stop_gradient(jnp.asarray(margin, jnp.float32))
  valid = divergences.weighted_positions(token_mask)
  kept = valid & (jnp.asarray(keep_mask) > 0)
  dropped = valid & ~kept
  return {
      "kept_fraction": _safe_mean(kept.astype(jnp.float32), valid.astype(jnp.float32)),
      "mean_margin_kept": _safe_mean(margin, kept.astype(jnp.float32)),
      "mean_margin_dropped": _safe_mean(margin, dropped.astype(jnp.float32)),
  }
