"""Divergences between target (p) and draft (q) next-token distributions.

DistillSpec (Zhou et al., ICLR 2024, Knowl 6) trains the draft q by minimising a
divergence D(p || q) averaged over the tokens of each sequence:

    D(M_p || M_q)(y | x) = (1 / |y|) * sum_t D(p(. | x, y_<t) || q(. | x, y_<t)).

Supported token-level divergences (names are the strings used in configs):

* ``"fkl"``: forward KL,  KL(p || q) = sum_c p log(p / q)   (mean-seeking).
* ``"rkl"``: reverse KL,  KL(q || p) = sum_c q log(q / p)   (mode-seeking).
* ``"jsd"``: generalised JSD[beta] = beta KL(p || m) + (1 - beta) KL(q || m),
  m = beta p + (1 - beta) q.
* ``"tvd"``: total variation, 0.5 * sum_c |p - q|.  1 - TVD is the expected
  speculative-sampling acceptance probability (Knowl 2).

Acceptance-targeted losses (the LK losses, arXiv 2602.23881), with the per-token acceptance
alpha = sum_c min(p, q) = 1 - TVD:

* ``"lk_alpha"``: -log alpha. Its gradient is TVD's divided by alpha, so it pushes hardest
  where the draft is rarely accepted; 0 iff p = q.
* ``"lk_lambda"``: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = s exp(-eta
  stopgrad(alpha)) per token: mostly KL where acceptance is low (KL's gradient does not
  vanish on disjoint supports), mostly 1 - alpha once it is high. s = 1, eta = 3 is vLLM
  speculators' exp(-3 alpha); SpecForge sets both. s in (0, 1] keeps lambda a mixing weight.

Everything is computed from logits in log space.  Entries with probability zero
(``-inf`` logits, e.g. a padded vocabulary) are handled with the "double where"
pattern so that neither values nor gradients become NaN (0 * log 0 = 0).  A NaN
logit is not a zero probability: it propagates, so every divergence of a NaN
target or draft is NaN (the trainer then stops with an error).

Gradients flow to the draft only: target logits pass through
``jax.lax.stop_gradient``.
"""

from __future__ import annotations

import numbers
import typing
from typing import Literal, Optional

import jax
import jax.numpy as jnp

Divergence = Literal["fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda"]
DIVERGENCES = typing.get_args(Divergence)
# lk_lambda's schedule when none is given: speculators' lambda = exp(-3 alpha).
LK_S, LK_ETA = 1.0, 3.0


# --------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------


def _is_static_number(x) -> bool:
  """True for Python/NumPy scalars; traced values cannot be validated eagerly."""
  return isinstance(x, numbers.Real)


def validate_divergence_name(name: str) -> None:
  """Raises ValueError unless ``name`` is one of ``DIVERGENCES``."""
  if name not in DIVERGENCES:
    raise ValueError(
        f"Unknown divergence {name!r}; valid names are {', '.join(map(repr, DIVERGENCES))}."
    )


def _validate_beta(beta) -> None:
  if _is_static_number(beta) and not 0.0 < float(beta) < 1.0:
    raise ValueError(f"JSD beta must lie in the open interval (0, 1); got {beta!r}.")


def validate_lk_schedule(s, eta) -> None:
  """Raises ValueError unless 0 < s <= 1 and eta >= 0 (finite), naming the bad value."""
  if _is_static_number(s) and not 0.0 < float(s) <= 1.0:
    raise ValueError(f"lk_lambda's s={s!r} must lie in (0, 1]: lambda = s exp(-eta alpha) "
                     "weighs KL against 1 - alpha (1.0 with eta 3 is speculators' schedule).")
  if _is_static_number(eta) and not 0.0 <= float(eta) < float("inf"):
    raise ValueError(f"lk_lambda's eta={eta!r} must be finite and >= 0: lambda = s exp(-eta "
                     "alpha) falls as acceptance rises (0 keeps lambda = s).")


def _check_same_vocabulary(target, draft) -> None:
  """Refuses target and draft distributions over vocabularies of different sizes (the last
  axis): broadcasting one of size 1 against the other would give a number, not a divergence."""
  target_vocab, draft_vocab = jnp.shape(target)[-1], jnp.shape(draft)[-1]
  if target_vocab != draft_vocab:
    raise ValueError(f"The target's logits have a vocabulary of {target_vocab} entries but the "
                     f"draft's {draft_vocab}: a divergence compares distributions over one "
                     "vocabulary; pair models with the same vocabulary size.")


def _validate_temperature(temperature, which: str) -> None:
  if _is_static_number(temperature) and not float(temperature) > 0.0:
    raise ValueError(f"{which} must be > 0; got {temperature!r}.")


# --------------------------------------------------------------------------
# Log-space building blocks.
# --------------------------------------------------------------------------


def log_probs(
    logits: jax.Array,
    *,
    temperature=1.0,
    vocab_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """Temperature-scaled log-softmax with optional vocabulary masking.

  Args:
    logits: [..., vocab] unnormalised logits (may contain -inf).
    temperature: scalar > 0; logits are divided by it.
    vocab_mask: optional [vocab] bool, True = real entry.  Masked entries get
      -inf logits, i.e. probability exactly 0.

  Returns:
    [..., vocab] log-probabilities; -inf where the probability is zero.
  """
  logits = logits / temperature
  if vocab_mask is not None:
    logits = jnp.where(jnp.asarray(vocab_mask, bool), logits, -jnp.inf)
  return jax.nn.log_softmax(logits, axis=-1)


def _kl_from_log_probs(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
  """KL(a || b) = sum_c a (log a - log b) over the last axis.

  Terms with a == 0 (log_a == -inf) are exactly 0; NaN entries are not "zero
  probability" (the support test is ``!= -inf``, True for NaN) and make the result NaN.
  The operands of the
  arithmetic are replaced by 0 there *before* use (the double-where trick),
  because the backward pass of ``where`` multiplies the unused branch's local
  derivative by 0 and 0 * inf = NaN would otherwise leak into the gradient.

  Args:
    log_a, log_b: [..., vocab] log-probabilities.

  Returns:
    [...] KL divergence.  +inf only if a > 0 where b == 0 (true infinity).
  """
  support = log_a != -jnp.inf  # True for NaN: NaN must propagate, not read as p = 0
  safe_log_a = jnp.where(support, log_a, 0.0)
  safe_log_b = jnp.where(support, log_b, 0.0)
  terms = jnp.exp(safe_log_a) * (safe_log_a - safe_log_b)
  return jnp.sum(jnp.where(support, terms, 0.0), axis=-1)


def _jsd_from_log_probs(log_p: jax.Array, log_q: jax.Array, beta) -> jax.Array:
  """beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q.

  log m is formed with ``logaddexp`` so that tiny probabilities (logits of
  +-1e4) are not rounded to zero before the log.  Where both p and q are zero
  the inputs to ``logaddexp`` are swapped for finite dummies: its derivative at
  (-inf, -inf) is NaN, and those entries contribute 0 anyway.

  Args:
    log_p, log_q: [..., vocab] log-probabilities.
    beta: scalar in (0, 1).

  Returns:
    [...] generalised Jensen-Shannon divergence.
  """
  either = (log_p != -jnp.inf) | (log_q != -jnp.inf)  # NaN counts as support (propagates)
  safe_log_p = jnp.where(either, log_p, 0.0)
  safe_log_q = jnp.where(either, log_q, 0.0)
  log_m = jnp.logaddexp(jnp.log(beta) + safe_log_p, jnp.log1p(-beta) + safe_log_q)
  return beta * _kl_from_log_probs(log_p, log_m) + (1.0 - beta) * _kl_from_log_probs(
      log_q, log_m
  )


def _tvd_from_log_probs(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """0.5 * sum_c |p - q| over the last axis; exp(-inf) = 0 is safe here."""
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(log_p) - jnp.exp(log_q)), axis=-1)


def log_acceptance(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """log alpha, alpha = sum_c min(p, q) = 1 - TVD(p, q), over the last axis.

  Summed in log space (logsumexp of the elementwise minimum), so a tiny alpha keeps its log.
  Entries where p or q is zero add exp(-inf) = 0 with a zero gradient. Disjoint supports
  (alpha = 0) give -inf with a zero, not NaN, gradient (double where); NaN propagates.

  Args:
    log_p, log_q: [..., vocab] log-probabilities.

  Returns:
    [...] log alpha <= 0.
  """
  smaller = jnp.minimum(log_p, log_q)
  overlap = jnp.any(smaller != -jnp.inf, axis=-1)  # True for NaN: it must propagate
  safe = jnp.where(overlap[..., None], smaller, 0.0)
  return jnp.where(overlap, jax.nn.logsumexp(safe, axis=-1), -jnp.inf)


def _lk_lambda_from_log_probs(log_p: jax.Array, log_q: jax.Array, s, eta) -> jax.Array:
  """lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = s exp(-eta stopgrad(alpha))."""
  log_alpha = log_acceptance(log_p, log_q)
  weight = s * jnp.exp(-eta * jax.lax.stop_gradient(jnp.exp(log_alpha)))
  return weight * _kl_from_log_probs(log_p, log_q) - (1.0 - weight) * jnp.expm1(log_alpha)


# --------------------------------------------------------------------------
# Token- and sequence-level divergences.
# --------------------------------------------------------------------------


def token_divergence(
    name: str,
    target_logits: jax.Array,
    draft_logits: jax.Array,
    *,
    target_temperature=1.0,
    draft_temperature=1.0,
    beta=0.5,
    lk_s=LK_S,
    lk_eta=LK_ETA,
    vocab_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """Per-token divergence D(p_t || q_t) between target p and draft q.

  Args:
    name: one of DIVERGENCES ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda").
    target_logits: [batch, length, vocab] target logits (no gradient flows).
    draft_logits: [batch, length, vocab] draft logits.
    target_temperature: T_p > 0 applied to the target logits.
    draft_temperature: T_q > 0 applied to the draft logits.
    beta: JSD mixing weight in (0, 1) (validated for every name so a bad config
      fails loudly even if the divergence is switched later).
    lk_s, lk_eta: lk_lambda's schedule lambda = s exp(-eta alpha), 0 < s <= 1, eta >= 0
      (validated for every name, as beta).
    vocab_mask: optional [vocab] bool, True = real vocabulary entry.

  Returns:
    [batch, length] divergence per token.
  """
  validate_divergence_name(name)
  _validate_beta(beta)
  validate_lk_schedule(lk_s, lk_eta)
  _validate_temperature(target_temperature, "target_temperature")
  _validate_temperature(draft_temperature, "draft_temperature")
  _check_same_vocabulary(target_logits, draft_logits)

  # The target is a fixed teacher: distillation must never update it.
  target_logits = jax.lax.stop_gradient(target_logits)
  log_p = log_probs(target_logits, temperature=target_temperature, vocab_mask=vocab_mask)
  log_q = log_probs(draft_logits, temperature=draft_temperature, vocab_mask=vocab_mask)

  return divergence_from_log_probs(name, log_p, log_q, beta, lk_s, lk_eta)


def divergence_from_log_probs(name: str, log_p: jax.Array, log_q: jax.Array,
                              beta=0.5, lk_s=LK_S, lk_eta=LK_ETA) -> jax.Array:
  """D(p || q) of a checked divergence name over the last axis (dense or binned): the
  per-position function every loss applies, from log-probabilities [..., vocab] to [...]."""
  if name == "lk_alpha":
    return -log_acceptance(log_p, log_q)
  if name == "lk_lambda":
    return _lk_lambda_from_log_probs(log_p, log_q, lk_s, lk_eta)
  if name == "fkl":
    return _kl_from_log_probs(log_p, log_q)
  if name == "rkl":
    return _kl_from_log_probs(log_q, log_p)
  if name == "jsd":
    return _jsd_from_log_probs(log_p, log_q, beta)
  return _tvd_from_log_probs(log_p, log_q)


def weighted_positions(token_mask: jax.Array) -> jax.Array:
  """Where a loss weight counts: > 0, or NaN (a NaN weight is not padding; it must reach the
  loss as NaN, where `w > 0` alone would read it as 0)."""
  token_mask = jnp.asarray(token_mask)
  return (token_mask > 0) | jnp.isnan(token_mask)


def masked_sequence_mean(token_values: jax.Array, token_mask: jax.Array) -> jax.Array:
  """Weighted mean over the length axis: sum_t w_t v_t / sum_t w_t.

  Rows whose weights sum to 0 give exactly 0 (not NaN), with zero gradient.
  Values at zero-weight positions are ignored even if they are inf/NaN. A NaN weight makes
  its row NaN (it is no padding).

  Args:
    token_values: [batch, length] per-token values.
    token_mask: [batch, length] non-negative loss weights (0 = padding).

  Returns:
    [batch] per-sequence mean.
  """
  token_mask = jnp.asarray(token_mask, token_values.dtype)
  weighted = jnp.where(weighted_positions(token_mask), token_values * token_mask, 0.0)
  numerator = jnp.sum(weighted, axis=-1)
  denominator = jnp.sum(token_mask, axis=-1)
  has_tokens = ~(denominator <= 0)  # True for NaN: it propagates
  safe_denominator = jnp.where(has_tokens, denominator, 1.0)
  return jnp.where(has_tokens, numerator / safe_denominator, 0.0)


def per_sequence_divergence(
    name: str,
    target_logits: jax.Array,
    draft_logits: jax.Array,
    token_mask: jax.Array,
    **kwargs,
) -> jax.Array:
  """Sequence-level D(M_p || M_q)(y | x) = (1/|y|) sum_t D(p_t || q_t).

  Args:
    name, target_logits [batch, length, vocab], draft_logits
      [batch, length, vocab], **kwargs: as in ``token_divergence``.
    token_mask: [batch, length] loss weights, 0 for padding; |y| = sum_t w_t.

  Returns:
    [batch] per-sequence divergence (0 for rows without tokens).
  """
  per_token = token_divergence(name, target_logits, draft_logits, **kwargs)
  return masked_sequence_mean(per_token, token_mask)


def sequence_divergence(
    name: str,
    target_logits: jax.Array,
    draft_logits: jax.Array,
    token_mask: jax.Array,
    **kwargs,
) -> jax.Array:
  """DistillSpec loss: per-sequence divergence averaged over the batch.

  Every row counts in the batch mean (rows without tokens contribute 0), so
  the normaliser is the static batch size and the loss never becomes NaN.

  Args: as in ``per_sequence_divergence``.

  Returns:
    scalar loss.
  """
  return jnp.mean(per_sequence_divergence(name, target_logits, draft_logits, token_mask, **kwargs))


# --------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------


def expected_acceptance(
    target: jax.Array,
    draft: jax.Array,
    *,
    from_logits: bool = True,
    target_temperature=1.0,
    draft_temperature=1.0,
    vocab_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """Expected speculative-sampling acceptance per token, 1 - TVD(p, q).

  E_{y ~ q}[min(1, p(y)/q(y))] = sum_y min(p(y), q(y)) = 1 - TVD(p, q)
  (DistillSpec Knowl 2).

  Args:
    target: [..., vocab] target logits, or probabilities if from_logits=False.
    draft: [..., vocab] draft logits, or probabilities if from_logits=False.
    from_logits: whether inputs are logits (temperatures/vocab_mask apply) or
      already-normalised probabilities.
    target_temperature, draft_temperature, vocab_mask: see ``token_divergence``.

  Returns:
    [...] acceptance probability in [0, 1].
  """
  _check_same_vocabulary(target, draft)
  if from_logits:
    _validate_temperature(target_temperature, "target_temperature")
    _validate_temperature(draft_temperature, "draft_temperature")
    p = jnp.exp(log_probs(target, temperature=target_temperature, vocab_mask=vocab_mask))
    q = jnp.exp(log_probs(draft, temperature=draft_temperature, vocab_mask=vocab_mask))
  else:
    p, q = jnp.asarray(target), jnp.asarray(draft)
  return 1.0 - 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    token_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """Per-token negative log-likelihood, for supervised fine-tuning.

  Args:
    logits: [batch, length, vocab].
    targets: [batch, length] int token ids.
    token_mask: optional [batch, length] weights; masked positions give 0.

  Returns:
    [batch, length] loss -log softmax(logits)[target] * weight.
  """
  log_q = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_q, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if token_mask is None:
    return nll
  token_mask = jnp.asarray(token_mask, nll.dtype)
  return jnp.where(token_mask > 0, nll * token_mask, 0.0)


# --------------------------------------------------------------------------
# Binned divergences over the target's top-k ids plus one tail bin.
# --------------------------------------------------------------------------
#
# A teacher cache (teacher_cache.py) keeps, per token, the target's k most probable ids, their
# log-probabilities and the log of the remaining mass. Both distributions are then coarsened
# to k + 1 bins: bin i < k is the target's i-th id, bin k everything else. The coarsening is
# one deterministic map applied to p and q, so by the data-processing inequality every
# f-divergence (FKL, RKL, JSD, TVD) of the binned pair is <= the full one, with equality at
# k = vocabulary size (the tail bin is then empty for both). The binned alpha = 1 - binned TVD
# is >= the full alpha, so binned LK-alpha is a lower bound too; binned LK-lambda is not a
# bound (its lambda reads the binned alpha, and KL and 1 - alpha need not be ordered).


def tail_log_mass(log_probs_full: jax.Array, top_ids: jax.Array) -> jax.Array:
  """log sum_{c not in top_ids} exp(log_probs_full[c]), per token.

  Summed over the complement directly (not as log(1 - sum of the top-k)), so a tail of mass
  1e-30 is still accurate. An empty complement (k = vocabulary size) gives exactly -inf with
  a zero, not NaN, gradient: the logsumexp then runs on dummy zeros and is discarded.

  Args:
    log_probs_full: [..., vocab] log-probabilities.
    top_ids: [..., k] int ids (distinct per token).

  Returns:
    [...] log tail mass (-inf when the complement is empty or has zero probability).
  """
  vocab = log_probs_full.shape[-1]
  # Membership mask by one scatter over the flattened tokens ([tokens, vocab], like the logits;
  # a one-hot of the ids would be k times larger).
  flat_ids = top_ids.reshape(-1, top_ids.shape[-1]).astype(jnp.int32)
  rows = jnp.arange(flat_ids.shape[0])[:, None]
  in_top = jnp.zeros((flat_ids.shape[0], vocab), bool).at[rows, flat_ids].set(True)
  in_top = in_top.reshape(log_probs_full.shape)
  has_tail = ~jnp.all(in_top, axis=-1)
  masked = jnp.where(in_top, -jnp.inf, log_probs_full)
  safe = jnp.where(has_tail[..., None], masked, 0.0)  # double where: no NaN gradient
  return jnp.where(has_tail, jax.nn.logsumexp(safe, axis=-1), -jnp.inf)


def top_k_bins(log_probs_full: jax.Array, k: int) -> tuple:
  """The target side of the binned distribution.

  Args:
    log_probs_full: [..., vocab] log-probabilities.
    k: number of kept ids, 1 <= k <= vocab (checked by the caller: teacher_cache.check_k).

  Returns:
    (top_log_probs [..., k] in descending order, top_ids [..., k] int32, tail [...]).
  """
  top_log_probs, top_ids = jax.lax.top_k(log_probs_full, k)
  top_ids = top_ids.astype(jnp.int32)
  return top_log_probs, top_ids, tail_log_mass(log_probs_full, top_ids)


def binned_token_divergence(
    name: str,
    target_top_log_probs: jax.Array,
    target_top_ids: jax.Array,
    target_tail_log_prob: jax.Array,
    draft_logits: jax.Array,
    *,
    draft_temperature=1.0,
    beta=0.5,
    lk_s=LK_S,
    lk_eta=LK_ETA,
) -> jax.Array:
  """Per-token D(p_bins || q_bins) over the (k + 1)-bin distributions.

  The target's bins come from a cache (already at the target temperature it was written
  with); the draft's bins are its log-probabilities at the target's top-k ids and its mass
  outside them. A lower bound of `token_divergence` (data processing), equal to it at
  k = vocabulary size (for the f-divergences and lk_alpha; lk_lambda is no bound).

  Args:
    name: one of DIVERGENCES.
    target_top_log_probs: [batch, length, k] target log-probabilities (no gradient).
    target_top_ids: [batch, length, k] int ids of those entries.
    target_tail_log_prob: [batch, length] log of the target's remaining mass.
    draft_logits: [batch, length, vocab] draft logits.
    draft_temperature: T_q > 0.
    beta: JSD mixing weight in (0, 1).
    lk_s, lk_eta: lk_lambda's schedule (as `token_divergence`'s).

  Returns:
    [batch, length] divergence per token.
  """
  validate_divergence_name(name)
  _validate_beta(beta)
  validate_lk_schedule(lk_s, lk_eta)
  _validate_temperature(draft_temperature, "draft_temperature")
  log_p = jax.lax.stop_gradient(jnp.concatenate(
      [target_top_log_probs, target_tail_log_prob[..., None]], axis=-1).astype(jnp.float32))
  log_q_full = log_probs(draft_logits, temperature=draft_temperature)
  ids = target_top_ids.astype(jnp.int32)
  log_q = jnp.concatenate([jnp.take_along_axis(log_q_full, ids, axis=-1),
                           tail_log_mass(log_q_full, ids)[..., None]], axis=-1)
  return divergence_from_log_probs(name, log_p, log_q, beta, lk_s, lk_eta)
