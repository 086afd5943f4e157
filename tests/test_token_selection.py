"""Tests for distillspec_jax.distill.token_selection (AdaSPEC)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.distill import divergences
from distillspec_jax.distill import token_selection


def random_mask(rng, batch, length, min_len=1):
  lengths = rng.integers(min_len, length + 1, batch)
  return (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)


@pytest.mark.parametrize("k", [0.1, 0.25, 0.4, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_fraction_equals_k(k, seed):
  rng = np.random.default_rng(seed)
  margin = rng.standard_normal((6, 17)).astype(np.float32)
  mask = random_mask(rng, 6, 17)
  n_valid = int(mask.sum())
  keep = np.asarray(token_selection.select_tokens(margin, mask, k))
  n_kept = int(keep.sum())
  # Continuous margins have no ties: exactly the nearest integer to k * n.
  assert abs(n_kept - k * n_valid) <= 0.5 + 1e-9
  assert set(np.unique(keep)) <= {0.0, 1.0}
  # The kept tokens are exactly the largest valid margins.
  valid_margins = margin[mask > 0]
  assert np.min(margin[keep > 0]) >= np.max(
      margin[(mask > 0) & (keep == 0)], initial=-np.inf)
  np.testing.assert_allclose(
      np.sort(margin[keep > 0]), np.sort(valid_margins)[n_valid - n_kept:])
  stats = token_selection.selection_stats(margin, keep, mask)
  np.testing.assert_allclose(float(stats["kept_fraction"]), n_kept / n_valid, rtol=1e-6)


def test_padding_never_kept_even_with_huge_margins():
  rng = np.random.default_rng(3)
  margin = rng.standard_normal((4, 10)).astype(np.float32)
  mask = random_mask(rng, 4, 10)
  margin[mask == 0] = 1e9  # padding looks like the "best" tokens
  for k in [0.1, 0.5, 1.0]:
    keep = np.asarray(token_selection.select_tokens(margin, mask, k))
    assert np.all(keep[mask == 0] == 0.0)
  keep_all = np.asarray(token_selection.select_tokens(margin, mask, 1.0))
  np.testing.assert_array_equal(keep_all, mask)


def test_ties_at_threshold_are_kept():
  margin = np.array([[3.0, 1.0, 1.0, 1.0, 0.0]], np.float32)
  mask = np.ones_like(margin)
  # round(0.4 * 5) = 2 -> threshold is the 2nd largest (1.0); all ties kept.
  keep = np.asarray(token_selection.select_tokens(margin, mask, 0.4))
  np.testing.assert_array_equal(keep, [[1, 1, 1, 1, 0]])


def test_at_least_one_token_and_empty_batch():
  margin = np.array([[0.3, -0.2, 0.1]], np.float32)
  keep = np.asarray(token_selection.select_tokens(margin, np.ones_like(margin), 0.01))
  np.testing.assert_array_equal(keep, [[1, 0, 0]])
  empty = np.asarray(token_selection.select_tokens(margin, np.zeros_like(margin), 0.5))
  assert np.all(empty == 0.0)


def test_select_tokens_jit_with_traced_k():
  rng = np.random.default_rng(4)
  margin = rng.standard_normal((3, 8)).astype(np.float32)
  mask = random_mask(rng, 3, 8)
  jitted = jax.jit(token_selection.select_tokens)
  for k in [0.2, 0.6]:
    np.testing.assert_array_equal(
        np.asarray(jitted(margin, mask, jnp.float32(k))), np.asarray(token_selection.select_tokens(margin, mask, k)))


def test_selection_has_no_gradient():
  rng = np.random.default_rng(5)
  margin = jnp.asarray(rng.standard_normal((2, 5)), jnp.float32)
  grad = jax.grad(lambda m: jnp.sum(token_selection.select_tokens(m, jnp.ones((2, 5)), 0.4) * m))(margin)
  # Only the explicit "* m" factor differentiates; the mask itself is constant.
  np.testing.assert_array_equal(
      np.asarray(grad), np.asarray(token_selection.select_tokens(margin, jnp.ones((2, 5)), 0.4)))


def _logits(seed, shape):
  return jnp.asarray(2.0 * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("normalization", token_selection.NORMALIZATIONS)
@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_dropped_tokens_get_exactly_zero_gradient(name, normalization):
  batch, length, vocab = 3, 7, 9
  target, draft, reference = (_logits(s, (batch, length, vocab)) for s in (10, 11, 12))
  mask = jnp.asarray(random_mask(np.random.default_rng(13), batch, length, min_len=3))
  margin = token_selection.token_margin(target, draft, reference)
  keep = token_selection.select_tokens(margin, mask, 0.4)

  def loss_fn(d):
    losses = divergences.token_divergence(name, target, d)
    return token_selection.selective_loss(losses, keep, mask, normalization)

  grad = np.asarray(jax.grad(loss_fn)(draft))
  keep, mask = np.asarray(keep), np.asarray(mask)
  dropped = keep == 0
  assert dropped.any() and (keep > 0).any()
  assert np.all(grad[dropped] == 0.0)  # exactly zero, including padding
  per_token_grad_norm = np.abs(grad).sum(-1)
  assert np.all(per_token_grad_norm[keep > 0] > 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_k_one_equals_distillspec_loss(name):
  batch, length, vocab = 4, 6, 8
  target, draft, reference = (_logits(s, (batch, length, vocab)) for s in (20, 21, 22))
  mask = np.asarray(random_mask(np.random.default_rng(23), batch, length))
  mask[2] = 0.0  # an empty row still contributes 0 to the batch mean in both
  keep = token_selection.select_tokens(token_selection.token_margin(target, draft, reference), mask, 1.0)
  np.testing.assert_array_equal(np.asarray(keep), mask)

  losses = divergences.token_divergence(name, target, draft)
  got = token_selection.selective_loss(losses, keep, mask, "sequence_mean")
  want = divergences.sequence_divergence(name, target, draft, mask)
  assert float(got) == float(want)
  # Gradients agree as well.
  g_sel = jax.grad(lambda d: token_selection.selective_loss(divergences.token_divergence(name, target, d), keep, mask))(draft)
  g_ref = jax.grad(lambda d: divergences.sequence_divergence(name, target, d, mask))(draft)
  np.testing.assert_allclose(np.asarray(g_sel), np.asarray(g_ref), rtol=1e-6, atol=1e-9)


def test_normalizations_match_numpy():
  rng = np.random.default_rng(30)
  losses = rng.uniform(0, 2, (3, 5)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  keep = np.array([[1, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  # "sequence_mean": per sequence, kept losses over its valid tokens; then batch mean.
  want_seq = np.mean([(losses[0, 0] + losses[0, 2]) / 5, losses[1, 1] / 2, 0.0])
  # "batch_valid_tokens": kept losses of the batch over the batch's 7 valid tokens.
  want_batch = (losses[0, 0] + losses[0, 2] + losses[1, 1]) / 7
  # "kept": mean over kept tokens of the whole batch.
  want_kept = (losses[0, 0] + losses[0, 2] + losses[1, 1]) / 3
  for name, want in [("sequence_mean", want_seq), ("all", want_seq),
                     ("batch_valid_tokens", want_batch), ("kept", want_kept)]:
    np.testing.assert_allclose(float(token_selection.selective_loss(losses, keep, mask, name)), want, rtol=1e-6)
  nothing = np.zeros_like(keep)
  for name in token_selection.NORMALIZATIONS:
    assert float(token_selection.selective_loss(losses, nothing, mask, name)) == 0.0
    assert float(token_selection.selective_loss(losses, keep, np.zeros_like(mask), name)) == 0.0


def test_batch_valid_tokens_is_the_public_adaspec_rule():
  # Rows of 4, 2 and 1 valid tokens; 3 of the 7 valid tokens are kept.
  losses = np.array([[1.0, 2.0, 3.0, 4.0],
                     [5.0, 6.0, 0.0, 0.0],
                     [7.0, 0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  keep = np.array([[0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  # Public rule: sum of kept losses / count of valid tokens = (4 + 6 + 7) / 7.
  got = float(token_selection.selective_loss(losses, keep, mask, "batch_valid_tokens"))
  assert got == pytest.approx(17.0 / 7.0, rel=1e-6)
  # Ours: (4/4 + 6/2 + 7/1) / 3 = 11/3, not the same number.
  ours = float(token_selection.selective_loss(losses, keep, mask, "sequence_mean"))
  assert ours == pytest.approx(11.0 / 3.0, rel=1e-6)
  assert abs(ours - got) > 1.0
  # "all" is only another name for "sequence_mean".
  assert float(token_selection.selective_loss(losses, keep, mask, "all")) == ours


def test_batch_valid_tokens_weighs_every_kept_token_alike():
  # One kept token of loss 1 in a row of length 1 or in a row of length 4.
  mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
  short = np.array([[0, 0, 0, 0], [1, 0, 0, 0]], np.float32)
  long = np.array([[1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
  losses = np.ones((2, 4), np.float32)
  batch = [float(token_selection.selective_loss(losses, k, mask, "batch_valid_tokens")) for k in (short, long)]
  seq = [float(token_selection.selective_loss(losses, k, mask, "sequence_mean")) for k in (short, long)]
  assert batch[0] == batch[1] == pytest.approx(1.0 / 5.0)
  assert seq[0] == pytest.approx(1.0 / 2.0) and seq[1] == pytest.approx(1.0 / 8.0)


def test_normalizations_agree_when_rows_have_equal_length():
  rng = np.random.default_rng(31)
  losses = rng.uniform(0, 2, (4, 6)).astype(np.float32)
  mask = np.ones((4, 6), np.float32)
  mask[:, 4:] = 0.0
  keep = token_selection.select_tokens(rng.standard_normal((4, 6)).astype(np.float32), mask, 0.4)
  np.testing.assert_allclose(float(token_selection.selective_loss(losses, keep, mask, "batch_valid_tokens")),
                             float(token_selection.selective_loss(losses, keep, mask, "sequence_mean")),
                             rtol=1e-6)


@pytest.mark.parametrize("name", ["fkl", "tvd"])
def test_batch_valid_tokens_with_k_one_is_the_token_mean(name):
  target, draft = _logits(50, (3, 5, 7)), _logits(51, (3, 5, 7))
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], np.float32)
  losses = divergences.token_divergence(name, target, draft)
  keep = token_selection.select_tokens(np.zeros((3, 5), np.float32), mask, 1.0)
  want = float(np.sum(np.asarray(losses) * mask) / mask.sum())
  got = float(token_selection.selective_loss(losses, keep, mask, "batch_valid_tokens"))
  assert got == pytest.approx(want, rel=1e-6)


def _quantile_rule_count(margins, k):
  """Tokens kept by the public rule: margin >= the (1 - k) quantile (linear)."""
  return int(np.sum(margins >= np.quantile(margins, 1.0 - k)))


def test_kept_count_differs_from_quantile_rule_by_one_in_some_batches():
  # Worked example, k = 0.4.  Six valid tokens: round(0.4 * 6) = round(2.4) = 2.
  # The 0.6 quantile of six sorted margins sits at position 0.6 * 5 = 3, the
  # 4th smallest (0.4), and the margins >= 0.4 are three: 0.4, 0.5 and 0.6.
  margin = np.array([[0.6, 0.1, 0.5, 0.3, 0.2, 0.4, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.float32)
  ours = np.asarray(token_selection.select_tokens(margin, mask, 0.4))
  np.testing.assert_array_equal(ours, [[1, 0, 1, 0, 0, 0, 0, 0]])
  assert _quantile_rule_count(margin[mask > 0], 0.4) == 3
  assert token_selection.quantile_keep_count(6, 0.4) == 3
  # Five valid tokens: both rules keep 2.
  assert int(token_selection.num_tokens_to_keep(5, 0.4)) == 2 == token_selection.quantile_keep_count(5, 0.4)
  # With k = 0.4 they differ exactly when n = 6, 11, 16, ... (not n = 1).
  differ = [n for n in range(1, 40)
            if int(token_selection.num_tokens_to_keep(n, 0.4)) != token_selection.quantile_keep_count(n, 0.4)]
  assert differ == [6, 11, 16, 21, 26, 31, 36]


@pytest.mark.parametrize("k", [0.1, 0.25, 0.4, 0.5, 0.7, 1.0])
def test_kept_count_is_within_one_of_quantile_rule(k):
  rng = np.random.default_rng(60)
  for n in range(1, 80):
    margins = rng.standard_normal(n)
    public = _quantile_rule_count(margins, k)
    assert abs(int(token_selection.num_tokens_to_keep(n, k)) - public) <= 1
    if k != 0.7:  # NumPy's float position is exact for these k (not for 0.7, n = 11)
      assert token_selection.quantile_keep_count(n, k) == public


def test_token_margin_is_fkl_difference_without_gradient():
  target, draft, reference = (_logits(s, (2, 3, 6)) for s in (40, 41, 42))
  margin = token_selection.token_margin(target, draft, reference)
  want = divergences.token_divergence("fkl", target, draft) - divergences.token_divergence("fkl", target, reference)
  np.testing.assert_allclose(np.asarray(margin), np.asarray(want), rtol=1e-6, atol=1e-7)
  grad = jax.grad(lambda d: jnp.sum(token_selection.token_margin(target, d, reference)))(draft)
  assert np.all(np.asarray(grad) == 0.0)


def test_selection_stats_values():
  margin = np.array([[4.0, 3.0, 2.0, 1.0], [9.0, 0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [0, 1, 1, 0]], np.float32)
  keep = np.asarray(token_selection.select_tokens(margin, mask, 0.5))  # round(0.5*6) = 3 -> 4, 3, 2
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [0, 0, 0, 0]])
  stats = {k: float(v) for k, v in token_selection.selection_stats(margin, keep, mask).items()}
  assert stats["kept_fraction"] == pytest.approx(0.5)
  assert stats["mean_margin_kept"] == pytest.approx(3.0)
  assert stats["mean_margin_dropped"] == pytest.approx(1.0 / 3.0)


def test_num_tokens_to_keep_rounding():
  assert int(token_selection.num_tokens_to_keep(10, 0.7)) == 7  # 0.7 * 10 = 7.000000000000001
  assert int(token_selection.num_tokens_to_keep(10, 1.0)) == 10
  assert int(token_selection.num_tokens_to_keep(3, 0.01)) == 1
  assert int(token_selection.num_tokens_to_keep(0, 0.4)) == 0
  assert int(token_selection.num_tokens_to_keep(1000, 0.4)) == math.floor(0.4 * 1000 + 0.5)


@pytest.mark.parametrize("k", [0.0, -0.2, 1.01, 2.0])
def test_bad_k_raises(k):
  with pytest.raises(ValueError, match=r"\(0, 1\]") as info:
    token_selection.select_tokens(np.zeros((1, 3)), np.ones((1, 3)), k)
  assert repr(k) in str(info.value)


def test_bad_normalization_raises():
  with pytest.raises(ValueError, match="'mean'.*'sequence_mean'.*'batch_valid_tokens'.*'kept'.*'all'"):
    token_selection.selective_loss(np.zeros((1, 3)), np.ones((1, 3)), np.ones((1, 3)), "mean")


@pytest.mark.parametrize("normalization", ["sequence_mean", "batch_valid_tokens", "kept"])
def test_nan_target_logit_makes_the_selective_loss_nan(normalization):
  # A NaN in one position's target logits makes that position's margin NaN. Selection must
  # not drop it as "not in the top k" (NaN >= threshold is False), which would hand the
  # trainer a finite loss with the bad position silently left out.
  key = jax.random.split(jax.random.PRNGKey(0), 3)
  target, draft, reference = (jax.random.normal(k, (1, 5, 7)) for k in key)
  target = target.at[0, 2, 3].set(jnp.nan)
  mask = np.ones((1, 5), np.float32)
  margin = token_selection.token_margin(target, draft, reference)
  assert np.isnan(margin[0, 2]) and np.isfinite(np.delete(np.asarray(margin[0]), 2)).all()
  keep = token_selection.select_tokens(margin, mask, 0.4)
  assert float(keep[0, 2]) == 1.0
  losses = divergences.token_divergence("fkl", target, draft)
  assert np.isnan(float(token_selection.selective_loss(losses, keep, mask, normalization)))
  # Padding stays out even where its margin is NaN.
  padded = np.array([[1, 1, 0, 1, 1]], np.float32)
  assert float(token_selection.select_tokens(margin, padded, 0.4)[0, 2]) == 0.0


@pytest.mark.parametrize("normalization", ["sequence_mean", "batch_valid_tokens", "kept"])
def test_a_nan_loss_weight_makes_the_selective_loss_nan(normalization):
  losses = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  weights = jnp.array([[1.0, jnp.nan, 1.0, 1.0]])
  keep = token_selection.select_tokens(jnp.array([[0.1, 0.9, 0.2, 0.3]]), weights, 1.0)
  assert float(keep[0, 1]) == 1.0
  assert np.isnan(float(token_selection.selective_loss(losses, keep, weights, normalization)))
