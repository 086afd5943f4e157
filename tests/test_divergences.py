"""Tests for distillspec_jax.distill.divergences against float64 NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.distill import divergences


NAMES = divergences.DIVERGENCES


# ---------------------------------------------------------------------------
# Independent float64 NumPy references, written straight from Knowl 6.
# ---------------------------------------------------------------------------


def np_softmax(logits, temperature=1.0):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def np_kl(a, b):
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.sum(np.where(a > 0, a * (np.log(a) - np.log(b)), 0.0), axis=-1)


def np_divergence(name, p, q, beta=0.5, s=1.0, eta=3.0):
  alpha = np.sum(np.minimum(p, q), axis=-1)
  if name == "lk_alpha":
    return -np.log(alpha)
  if name == "lk_lambda":
    lam = s * np.exp(-eta * alpha)
    return lam * np_kl(p, q) + (1 - lam) * (1 - alpha)
  if name == "fkl":
    return np_kl(p, q)
  if name == "rkl":
    return np_kl(q, p)
  if name == "jsd":
    m = beta * p + (1 - beta) * q
    return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)
  return 0.5 * np.sum(np.abs(p - q), axis=-1)


def random_logits(seed, shape=(3, 5, 11), scale=2.0):
  rng = np.random.default_rng(seed)
  return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---------------------------------------------------------------------------
# Values.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("beta", [0.5, 0.2])
def test_matches_numpy_formula(name, beta):
  t, d = random_logits(0), random_logits(1)
  got = divergences.token_divergence(name, t, d, beta=beta)
  want = np_divergence(name, np_softmax(t), np_softmax(d), beta)
  assert got.shape == (3, 5)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("name", NAMES)
def test_temperatures_match_numpy(name):
  t, d = random_logits(2), random_logits(3)
  got = divergences.token_divergence(name, t, d, target_temperature=0.7, draft_temperature=1.9)
  want = np_divergence(name, np_softmax(t, 0.7), np_softmax(d, 1.9))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("name", NAMES)
def test_nonnegative_and_zero_iff_equal(name):
  t, d = random_logits(4), random_logits(5)
  different = np.asarray(divergences.token_divergence(name, t, d))
  assert np.all(different > 1e-4)
  # A constant shift of the logits leaves the distribution unchanged.
  same = np.asarray(divergences.token_divergence(name, t, t + 3.0))
  np.testing.assert_allclose(same, 0.0, atol=1e-5)
  assert np.all(same >= -1e-6)


def test_jsd_half_is_symmetric_and_general_beta_is_not():
  t, d = random_logits(6), random_logits(7)
  np.testing.assert_allclose(
      divergences.token_divergence("jsd", t, d, beta=0.5), divergences.token_divergence("jsd", d, t, beta=0.5),
      rtol=1e-5, atol=1e-7)
  # JSD[beta](p||q) == JSD[1-beta](q||p), and differs from JSD[beta](q||p).
  np.testing.assert_allclose(
      divergences.token_divergence("jsd", t, d, beta=0.2), divergences.token_divergence("jsd", d, t, beta=0.8),
      rtol=1e-5, atol=1e-7)
  assert not np.allclose(
      divergences.token_divergence("jsd", t, d, beta=0.2), divergences.token_divergence("jsd", d, t, beta=0.2))


# ---------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_draft_gradient_matches_central_finite_differences(name):
  rng = np.random.default_rng(8)
  with jax.enable_x64(True):
    t = jnp.asarray(rng.standard_normal((2, 3, 7)) * 2.0)
    d = jnp.asarray(rng.standard_normal((2, 3, 7)) * 2.0)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (2, 3)))

    def f(draft):
      return jnp.sum(w * divergences.token_divergence(name, t, draft, beta=0.3))

    grad = np.asarray(jax.grad(f)(d))
    if name == "lk_lambda":  # lambda carries no gradient: differentiate at lambda fixed
      lam = jnp.exp(-3.0 * (1.0 - divergences.token_divergence("tvd", t, d)))
      f = lambda draft: jnp.sum(w * (lam * divergences.token_divergence("fkl", t, draft) + (
          1.0 - lam) * divergences.token_divergence("tvd", t, draft)))
    assert grad.dtype == np.float64
    eps = 1e-6
    d_np = np.asarray(d)
    numeric = np.zeros_like(d_np)
    for idx in np.ndindex(d_np.shape):
      plus, minus = d_np.copy(), d_np.copy()
      plus[idx] += eps
      minus[idx] -= eps
      numeric[idx] = (float(f(jnp.asarray(plus))) - float(f(jnp.asarray(minus)))) / (2 * eps)
  np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
def test_no_gradient_to_target(name):
  t, d = random_logits(9), random_logits(10)
  grad_t = jax.grad(lambda x: jnp.sum(divergences.token_divergence(name, x, d)))(t)
  assert np.all(np.asarray(grad_t) == 0.0)
  grad_d = jax.grad(lambda x: jnp.sum(divergences.token_divergence(name, t, x)))(d)
  assert np.any(np.asarray(grad_d) != 0.0)


# ---------------------------------------------------------------------------
# Numerical stability.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_extreme_logits_are_finite(name):
  rng = np.random.default_rng(11)
  t = (1e4 * rng.choice([-1.0, 1.0], (2, 4, 9))).astype(np.float32)
  d = (1e4 * rng.choice([-1.0, 1.0], (2, 4, 9))).astype(np.float32)
  value, grad = jax.value_and_grad(lambda x: jnp.sum(divergences.token_divergence(name, t, x)))(d)
  assert np.isfinite(float(value))
  assert np.all(np.isfinite(np.asarray(grad)))


def test_extreme_logits_values():
  # p = one-hot(0), q = one-hot(1), up to exp(-2e4) = 0 in fp32.
  t = np.array([[[1e4, -1e4, 0.0]]], np.float32)
  d = np.array([[[-1e4, 1e4, 0.0]]], np.float32)
  # KL(p||q) = log p_0 - log q_0 = 0 - (-2e4); symmetric for RKL.
  np.testing.assert_allclose(divergences.token_divergence("fkl", t, d), [[2e4]], rtol=1e-6)
  np.testing.assert_allclose(divergences.token_divergence("rkl", t, d), [[2e4]], rtol=1e-6)
  # Disjoint supports: JSD(0.5) = log 2, TVD = 1.
  np.testing.assert_allclose(divergences.token_divergence("jsd", t, d), [[np.log(2.0)]], rtol=1e-6)
  np.testing.assert_allclose(divergences.token_divergence("tvd", t, d), [[1.0]], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("how", ["vocab_mask", "neg_inf_logits"])
def test_masked_vocabulary(name, how):
  t, d = random_logits(12, (2, 3, 10)), random_logits(13, (2, 3, 10))
  real = np.array([True] * 7 + [False] * 3)
  if how == "vocab_mask":
    kwargs = dict(vocab_mask=real)
    # Garbage in the padded entries must be ignored.
    t[..., ~real], d[..., ~real] = 50.0, -50.0
  else:
    kwargs = {}
    t[..., ~real], d[..., ~real] = -np.inf, -np.inf

  value, grad = jax.value_and_grad(
      lambda x: jnp.sum(divergences.token_divergence(name, t, x, beta=0.4, **kwargs)))(d)
  grad = np.asarray(grad)
  assert np.all(np.isfinite(grad))
  assert np.all(grad[..., ~real] == 0.0)
  # Equals the divergence over the real sub-vocabulary only.
  want = np_divergence(name, np_softmax(t[..., real]), np_softmax(d[..., real]), 0.4)
  np.testing.assert_allclose(
      np.asarray(divergences.token_divergence(name, t, d, beta=0.4, **kwargs)), want, rtol=2e-4, atol=2e-6)
  assert np.isfinite(float(value))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_partial_support_zero_probabilities(name):
  # p has zero mass on entries where q does not (and vice versa for some names
  # this would be infinite, so only zero out the target where the draft is > 0).
  t, d = random_logits(14, (1, 2, 6)), random_logits(15, (1, 2, 6))
  t[..., :2] = -np.inf
  if name == "rkl":  # KL(q||p) is +inf when p = 0 < q; use a shared zero instead.
    d[..., :2] = -np.inf
  value, grad = jax.value_and_grad(lambda x: jnp.sum(divergences.token_divergence(name, t, x)))(d)
  assert np.isfinite(float(value))
  assert np.all(np.isfinite(np.asarray(grad)))
  p, q = np_softmax(t), np_softmax(d)
  with np.errstate(divide="ignore", invalid="ignore"):
    if name.startswith("lk_"):
      want = np_divergence(name, p, q)
    elif name == "fkl":
      want = np.sum(np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0), -1)
    elif name == "rkl":
      want = np.sum(np.where(q > 0, q * (np.log(q) - np.log(p)), 0.0), -1)
    elif name == "jsd":
      m = 0.5 * (p + q)
      want = 0.5 * np.sum(np.where(p > 0, p * np.log(p / m), 0.0), -1) + 0.5 * np.sum(
          np.where(q > 0, q * np.log(q / m), 0.0), -1)
    else:
      want = 0.5 * np.sum(np.abs(p - q), -1)
  np.testing.assert_allclose(np.asarray(divergences.token_divergence(name, t, d)), want, rtol=2e-4,
                             atol=2e-6)


# ---------------------------------------------------------------------------
# Sequence level.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_sequence_averaging(name):
  t, d = random_logits(16, (4, 6, 8)), random_logits(17, (4, 6, 8))
  mask = np.array([
      [1, 1, 1, 1, 1, 1],
      [1, 1, 1, 0, 0, 0],
      [0, 0, 0, 0, 0, 0],  # empty row: contributes 0 to the batch mean
      [0.5, 2.0, 1, 1, 0, 0],  # general loss weights
  ], np.float32)
  per_token = np_divergence(name, np_softmax(t), np_softmax(d))
  want_rows = []
  for b in range(4):
    total = mask[b].sum()
    want_rows.append(0.0 if total == 0 else float((per_token[b] * mask[b]).sum() / total))
  got_rows = divergences.per_sequence_divergence(name, t, d, mask)
  np.testing.assert_allclose(np.asarray(got_rows), want_rows, rtol=2e-4, atol=2e-6)
  got = divergences.sequence_divergence(name, t, d, mask)
  assert got.shape == ()
  np.testing.assert_allclose(float(got), np.mean(want_rows), rtol=2e-4, atol=2e-6)

  grad = jax.grad(lambda x: divergences.sequence_divergence(name, t, x, mask))(d)
  grad = np.asarray(grad)
  assert np.all(np.isfinite(grad))
  assert np.all(grad[2] == 0.0)  # empty row
  assert np.all(grad[1, 3:] == 0.0)  # padding


def test_sequence_all_padding_is_zero_not_nan():
  t, d = random_logits(18, (2, 3, 5)), random_logits(19, (2, 3, 5))
  mask = np.zeros((2, 3), np.float32)
  value, grad = jax.value_and_grad(lambda x: divergences.sequence_divergence("fkl", t, x, mask))(d)
  assert float(value) == 0.0
  assert np.all(np.asarray(grad) == 0.0)


def test_jit_compatible():
  t, d = random_logits(20), random_logits(21)
  mask = np.ones((3, 5), np.float32)
  f = jax.jit(lambda a, b, m: divergences.sequence_divergence("jsd", a, b, m, beta=0.3))
  np.testing.assert_allclose(float(f(t, d, mask)), float(divergences.sequence_divergence(
      "jsd", t, d, mask, beta=0.3)), rtol=1e-6)


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def test_expected_acceptance_equals_speculative_sampling_expectation():
  t, d = random_logits(22), random_logits(23)
  p, q = np_softmax(t), np_softmax(d)
  # E_{y ~ q}[min(1, p(y) / q(y))], evaluated directly.
  want = np.sum(q * np.minimum(1.0, p / q), axis=-1)
  np.testing.assert_allclose(np.asarray(divergences.expected_acceptance(t, d)), want, rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(divergences.expected_acceptance(p, q, from_logits=False)), want, rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(divergences.expected_acceptance(t, d)), 1.0 - np.asarray(divergences.token_divergence("tvd", t, d)),
      rtol=1e-6, atol=1e-7)


def test_cross_entropy():
  logits = random_logits(24)
  rng = np.random.default_rng(25)
  targets = rng.integers(0, 11, (3, 5))
  mask = (rng.uniform(size=(3, 5)) > 0.3).astype(np.float32)
  log_q = np.log(np_softmax(logits))
  want = -np.take_along_axis(log_q, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(divergences.cross_entropy(logits, targets)), want, rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(divergences.cross_entropy(logits, targets, mask)), want * mask, rtol=1e-5)


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def test_unknown_name_raises_and_lists_valid_names():
  t = random_logits(26)
  with pytest.raises(ValueError, match="'kl'") as info:
    divergences.token_divergence("kl", t, t)
  for name in NAMES:
    assert repr(name) in str(info.value)
  with pytest.raises(ValueError, match="'js'"):
    divergences.sequence_divergence("js", t, t, np.ones((3, 5)))


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, 1.5])
def test_bad_beta_raises(beta):
  t = random_logits(27)
  with pytest.raises(ValueError, match=repr(beta).replace(".", r"\.")):
    divergences.token_divergence("jsd", t, t, beta=beta)


@pytest.mark.parametrize("kw", ["target_temperature", "draft_temperature"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_bad_temperature_raises(kw, value):
  t = random_logits(28)
  with pytest.raises(ValueError, match=kw):
    divergences.token_divergence("fkl", t, t, **{kw: value})


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("which", ["target", "draft"])
def test_nan_logits_propagate_not_read_as_zero_probability(name, which):
  """A NaN row is not a zero-probability row: value and draft gradient must be NaN."""
  rng = np.random.default_rng(0)
  target = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  draft = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  if which == "target":
    target = target.at[0, 1].set(jnp.nan)
  else:
    draft = draft.at[0, 1].set(jnp.nan)
  per_token = divergences.token_divergence(name, target, draft)
  assert np.isnan(float(per_token[0, 1]))
  assert np.all(np.isfinite(np.delete(np.asarray(per_token).reshape(-1), 1)))
  mask = jnp.ones((2, 3))
  loss = divergences.sequence_divergence(name, target, draft, mask)
  assert np.isnan(float(loss))
  grad = jax.grad(lambda d: divergences.sequence_divergence(name, target, d, mask))(draft)
  if not (name == "tvd" and which == "target"):  # d|q - NaN|/dq = sign(NaN) is 0 in XLA;
    assert np.isnan(np.asarray(grad)).any()      # the NaN loss still stops the trainer


@pytest.mark.parametrize("name", NAMES)
def test_nan_in_one_logit_of_a_row_propagates(name):
  target = jnp.zeros((1, 1, 5)).at[0, 0, 2].set(jnp.nan)
  draft = jnp.zeros((1, 1, 5))
  assert np.isnan(float(divergences.token_divergence(name, target, draft)[0, 0]))
  assert np.isnan(float(divergences.token_divergence(name, draft, target)[0, 0]))


# ---------------------------------------------------------------------------
# The LK losses.
# ---------------------------------------------------------------------------


def _logits_of(probabilities):
  with np.errstate(divide="ignore"):
    return jnp.asarray(np.log(np.asarray(probabilities, np.float64)), jnp.float32)[None, None]


def test_lk_losses_on_hand_computed_distributions():
  p = [0.5, 0.3, 0.2, 0.0]
  q = [0.2, 0.2, 0.1, 0.5]
  # alpha = 0.2 + 0.2 + 0.1 + 0 = 0.5; TVD = (0.3 + 0.1 + 0.1 + 0.5) / 2 = 0.5 = 1 - alpha.
  t, d = _logits_of(p), _logits_of(q)
  tvd = float(divergences.token_divergence("tvd", t, d)[0, 0])
  assert tvd == pytest.approx(0.5, abs=1e-6)
  lk_alpha = float(divergences.token_divergence("lk_alpha", t, d)[0, 0])
  assert lk_alpha == pytest.approx(np.log(2.0), rel=1e-6) == pytest.approx(-np.log(1 - tvd))
  kl = 0.5 * np.log(0.5 / 0.2) + 0.3 * np.log(0.3 / 0.2) + 0.2 * np.log(0.2 / 0.1)
  for s, eta in ((1.0, 3.0), (0.8, 2.0), (0.5, 0.0)):
    lam = s * np.exp(-eta * 0.5)
    got = float(divergences.token_divergence("lk_lambda", t, d, lk_s=s, lk_eta=eta)[0, 0])
    assert got == pytest.approx(lam * kl + (1 - lam) * 0.5, rel=1e-5), (s, eta)
  # Random distributions: LK-alpha = -log(1 - TVD) everywhere.
  t, d = random_logits(20), random_logits(21)
  np.testing.assert_allclose(divergences.token_divergence("lk_alpha", t, d),
                             -np.log1p(-np.asarray(divergences.token_divergence("tvd", t, d))),
                             rtol=1e-5)


@pytest.mark.parametrize("name", ["lk_alpha", "lk_lambda"])
def test_lk_gradients_are_finite_where_p_or_q_has_zeros(name):
  t, d = random_logits(22, (1, 3, 6)), random_logits(23, (1, 3, 6))
  t[..., 0] = -np.inf          # p = 0 < q
  t[..., 1] = d[..., 1] = -np.inf  # both zero
  if name == "lk_alpha":
    d[..., 2] = -np.inf        # q = 0 < p: alpha stays > 0 (KL would be infinite)
  value, grad = jax.value_and_grad(lambda x: jnp.sum(divergences.token_divergence(name, t, x)))(d)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
  assert np.any(np.asarray(grad) != 0.0)
  assert np.all(np.asarray(grad)[..., 1] == 0.0)


def test_lk_alpha_of_disjoint_supports_is_infinite_without_nan_gradient():
  t, d = _logits_of([1.0, 0.0, 0.0]), _logits_of([0.0, 0.5, 0.5])
  value, grad = jax.value_and_grad(lambda x: jnp.sum(divergences.token_divergence("lk_alpha", t, x)))(d)
  assert float(value) == np.inf and not np.any(np.isnan(np.asarray(grad)))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lk_s=0.0), "s=0.0 must lie in (0, 1]"),
    (dict(lk_s=-1.0), "s=-1.0 must lie in (0, 1]"),
    (dict(lk_s=1.5), "s=1.5 must lie in (0, 1]"),
    (dict(lk_eta=-0.5), "eta=-0.5 must be finite and >= 0"),
    (dict(lk_eta=float("inf")), "eta=inf must be finite and >= 0"),
])
def test_bad_lk_schedule_names_the_value(kwargs, needle):
  t = random_logits(24)
  for call in (lambda: divergences.token_divergence("lk_lambda", t, t, **kwargs),
               lambda: divergences.binned_token_divergence("lk_lambda", t[..., :2], jnp.zeros(
                   t.shape[:-1] + (2,), jnp.int32), t[..., 0], t, **kwargs)):
    with pytest.raises(ValueError) as error:
      call()
    assert needle in str(error.value)


def test_a_nan_loss_weight_propagates_not_read_as_padding():
  # A NaN weight is neither padding (0) nor a weight: `w > 0` and `sum(w) > 0` are False for
  # NaN, which turned the row's mean into a finite number over its other tokens, or into 0.
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  weights = jnp.array([[1.0, jnp.nan, 1.0], [1.0, 1.0, 0.0]])
  per_row = np.asarray(divergences.masked_sequence_mean(values, weights))
  assert np.isnan(per_row[0]) and per_row[1] == 4.5
  only_nan = np.asarray(divergences.masked_sequence_mean(values[:1], jnp.array([[0.0, jnp.nan, 0.0]])))
  assert np.isnan(only_nan).all()
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5))
  assert np.isnan(float(divergences.sequence_divergence("fkl", logits, logits[::-1], weights)))


@pytest.mark.parametrize("target_vocab", [1, 5])
def test_logits_of_different_vocabulary_sizes_are_refused(target_vocab):
  # A target with one vocabulary entry broadcast against the draft's six: every divergence
  # came out a number (expected_acceptance -1.5, outside [0, 1]); 5 against 6 failed inside
  # jnp with a broadcasting message that names neither model.
  draft = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 6))
  target = jnp.zeros((2, 3, target_vocab))
  for name in divergences.DIVERGENCES:
    with pytest.raises(ValueError, match=f"vocabulary of {target_vocab} .* draft's 6"):
      divergences.token_divergence(name, target, draft)
  with pytest.raises(ValueError, match=f"vocabulary of {target_vocab} .* draft's 6"):
    divergences.expected_acceptance(target, draft)
  with pytest.raises(ValueError, match=f"vocabulary of {target_vocab} .* draft's 6"):
    divergences.expected_acceptance(jax.nn.softmax(target), jax.nn.softmax(draft),
                                    from_logits=False)
