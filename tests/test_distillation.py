"""DistillSpec objective: source mixture, sampled batches, validation, AdaSPEC hook."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import testing

from distillspec_jax.distill import objectives
from distillspec_jax.distill import divergences
from distillspec_jax.distill import token_selection
from distillspec_jax.models.model import Model
from distillspec_jax.training.trainer import SyntheticData


VOCAB = 64


def _models():
  return testing.tiny_pair(vocab_size=VOCAB)


@pytest.mark.parametrize("lambda1,lambda2", [(1.0, 0.0), (0.0, 0.0), (0.5, 1.0), (0.0, 0.5),
                                             (0.0, 1.0), (0.3, 0.7)])
def test_source_selection_follows_lambdas(lambda1, lambda2):
  n = 20000
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  sources = np.asarray(jax.vmap(lambda k: objectives.select_source(k, lambda1, lambda2))(keys))
  counts = np.bincount(sources, minlength=3) / n
  expected = np.array([lambda1, (1 - lambda1) * lambda2, (1 - lambda1) * (1 - lambda2)])
  # 5 binomial standard errors (exact 0 / 1 probabilities must give exact 0 / 1 counts).
  tolerance = 5 * np.sqrt(expected * (1 - expected) / n)
  np.testing.assert_array_less(np.abs(counts - expected), tolerance + 1e-12)


def test_source_selection_is_a_function_of_the_key():
  key = jax.random.PRNGKey(3)
  assert int(objectives.select_source(key, 0.4, 0.5)) == int(objectives.select_source(key, 0.4, 0.5))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(lambda1=1.5), "lambda1=1.5"),
    (dict(lambda1=-0.1), "lambda1=-0.1"),
    (dict(lambda2=2.0), "lambda2=2.0"),
    (dict(beta=0.0), "beta=0.0"),
    (dict(beta=1.0), "beta=1.0"),
    (dict(divergence="kl"), "'kl'"),
    (dict(top_k_fraction=0.0), "top_k_fraction=0.0"),
])
def test_bad_config_names_value_and_fix(kwargs, needle):
  with pytest.raises((TypeError, ValueError)) as error:  # TypeError: not one of the choices
    objectives.DistillationConfig(**kwargs)
  message = str(error.value)
  assert needle in message
  assert "[0, 1]" in message or "(0, 1)" in message or "one of" in message or "(0, 1]" in message


def test_different_vocabularies_rejected():
  target = Model.from_name("tiny_encoder_decoder", vocab_size=64)
  draft = Model.from_name("demo_draft", vocab_size=128)
  with pytest.raises(ValueError, match="vocab_size=128.*vocab_size=64"):
    objectives.DistillationObjective(target, draft)


def test_reference_with_another_vocabulary_is_reported_as_the_reference():
  target, draft = _models()
  reference = Model.from_name("demo_draft", vocab_size=128)
  with pytest.raises(ValueError) as error:
    objectives.DistillationObjective(target, draft, objectives.DistillationConfig(top_k_fraction=0.5), reference)
  message = str(error.value)
  assert "The reference's vocab_size=128 differs from the target's vocab_size=64" in message
  assert "draft" not in message


def test_adaspec_needs_reference_and_fraction():
  target, draft = _models()
  with pytest.raises(ValueError, match="reference"):
    objectives.DistillationObjective(target, draft, objectives.DistillationConfig(top_k_fraction=0.5))


def test_samples_to_batch_encoder_decoder():
  target, _ = _models()
  batch = SyntheticData(2, vocab_size=VOCAB).batch_at(0)
  tokens = jnp.array([[5, 6, 1, 0], [7, 1, 0, 0]], jnp.int32)
  out = objectives.samples_to_batch(tokens, jnp.array([3, 2]), batch, target)
  width = batch["decoder_target_tokens"].shape[1]
  assert out["decoder_target_tokens"].shape == (2, width)
  np.testing.assert_array_equal(out["decoder_target_tokens"][:, :4], tokens)
  np.testing.assert_array_equal(out["decoder_input_tokens"][:, :5],
                                [[0, 5, 6, 1, 0], [0, 7, 1, 0, 0]])
  np.testing.assert_array_equal(out["decoder_loss_weights"][:, :5],
                                [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])


def test_samples_to_batch_decoder_only_places_sample_after_prompt():
  model = Model.from_name("tiny_decoder_only", vocab_size=VOCAB)
  batch = SyntheticData(2, input_length=3, target_length=4, vocab_size=VOCAB,
                        decoder_only=True).batch_at(0)
  prompts = objectives.prompt_tokens_from_batch(batch)
  n = np.asarray(jnp.sum(prompts > 0, axis=1))
  tokens = jnp.array([[9, 1, 0], [8, 8, 1]], jnp.int32)
  out = objectives.samples_to_batch(tokens, jnp.array([2, 3]), batch, model, prompts)
  for row in range(2):
    targets = np.asarray(out["decoder_target_tokens"][row])
    weights = np.asarray(out["decoder_loss_weights"][row])
    np.testing.assert_array_equal(targets[:n[row]], np.asarray(prompts[row, :n[row]]))
    length = [2, 3][row]
    np.testing.assert_array_equal(targets[n[row]:n[row] + length], tokens[row, :length])
    assert weights.sum() == length and weights[:n[row]].sum() == 0


@pytest.mark.slow
def test_on_policy_batch_is_drawn_from_the_draft():
  target, draft = _models()
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  batch = SyntheticData(4, vocab_size=VOCAB).batch_at(0)
  objective = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(lambda1=0.0,
                                                                          lambda2=1.0))
  out, source = jax.jit(objective.make_batch)(dp, {"target": tp}, batch, jax.random.PRNGKey(5))
  assert int(source) == objectives.DRAFT
  _, sample_rng = jax.random.split(jax.random.PRNGKey(5))
  expected = objectives.sample_batch(draft, dp, batch, sample_rng, max_new_tokens=8, temperature=1.0)
  for k in expected:
    np.testing.assert_array_equal(out[k], expected[k])
  # Weights are 1 up to and including EOS, 0 after.
  t, w = np.asarray(out["decoder_target_tokens"]), np.asarray(out["decoder_loss_weights"])
  for row in range(4):
    eos = np.flatnonzero(t[row] == 1)
    end = eos[0] + 1 if len(eos) else t.shape[1]
    assert w[row, :end].all() and not w[row, end:].any()


def test_fixed_source_returns_the_fixed_batch():
  target, draft = _models()
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  batch = SyntheticData(4, vocab_size=VOCAB).batch_at(0)
  objective = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(lambda1=1.0))
  out, source = objective.make_batch(dp, {"target": tp}, batch, jax.random.PRNGKey(0))
  assert int(source) == objectives.FIXED
  np.testing.assert_array_equal(out["decoder_target_tokens"], batch["decoder_target_tokens"])


@pytest.mark.slow
def test_loss_is_sequence_divergence_and_grads_only_reach_the_draft():
  target, draft = _models()
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  batch = objectives.training_features(SyntheticData(4, vocab_size=VOCAB).batch_at(0), draft)
  objective = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(divergence="rkl"))
  loss, metrics = objective.loss(dp, {"target": tp}, batch)
  expected = divergences.sequence_divergence("rkl", target.logits(tp, batch),
                                             draft.logits(dp, batch),
                                             batch["decoder_loss_weights"])
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["predicted_acceptance"], 1 - metrics["tvd"], rtol=1e-6)
  target_grads = jax.grad(lambda t: objective.loss(dp, {"target": t}, batch)[0])(tp)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(target_grads))


@pytest.mark.slow
def test_adaspec_k1_equals_plain_distillation():
  target, draft = _models()
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  rp = draft.init(jax.random.PRNGKey(2))
  batch = objectives.training_features(SyntheticData(4, vocab_size=VOCAB).batch_at(0), draft)
  plain = objectives.DistillationObjective(target, draft, objectives.DistillationConfig())
  ada = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(top_k_fraction=1.0),
                                reference=draft)
  frozen = {"target": tp, "reference": rp}
  grad_plain = jax.grad(lambda p: plain.loss(p, frozen, batch)[0])(dp)
  grad_ada = jax.grad(lambda p: ada.loss(p, frozen, batch)[0])(dp)
  np.testing.assert_allclose(plain.loss(dp, frozen, batch)[0], ada.loss(dp, frozen, batch)[0],
                             rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
               grad_plain, grad_ada)
  # k < 1 drops tokens: a different (smaller-or-equal) loss.
  half = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(top_k_fraction=0.5),
                                 reference=draft)
  loss_half, metrics = half.loss(dp, frozen, batch)
  assert float(loss_half) < float(plain.loss(dp, frozen, batch)[0])
  assert 0.4 < float(metrics["kept_fraction"]) < 0.7


def test_recipes_table():
  assert objectives.DistillationConfig.from_recipe("gkd").lambda2 == 1.0
  assert objectives.DistillationConfig.from_recipe("fdistill").divergence == "tvd"
  with pytest.raises(ValueError, match="Unknown recipe"):
    objectives.DistillationConfig.from_recipe("nope")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(lambda1="0.5"), "lambda1='0.5'"),
    (dict(lambda2=True), "lambda2=True"),
    (dict(beta="0.5"), "beta='0.5'"),
    (dict(max_new_tokens=4.0), "max_new_tokens=4.0"),
    (dict(top_k_fraction="0.4"), "top_k_fraction='0.4'"),
    (dict(divergence=1), "divergence=1"),
])
def test_config_values_are_type_checked(kwargs, needle):
  """A quoted number was coerced by float(...) and a bool taken as 1; both are refused."""
  with pytest.raises(TypeError) as error:
    objectives.DistillationConfig(**kwargs)
  message = str(error.value)
  assert needle in message and "DistillationConfig." in message
  if isinstance(next(iter(kwargs.values())), str):
    assert "without quotes" in message


def test_config_takes_ints_and_numpy_numbers_as_real_numbers():
  config = objectives.DistillationConfig(lambda1=1, lambda2=np.float32(0.5), max_new_tokens=np.int64(4),
                                top_k_fraction=None)
  assert config.lambda1 == 1 and config.max_new_tokens == 4


# --- the acceptance-targeted objectives --------------------------------------------------------

NEW_OBJECTIVES = [
    dict(divergence="lk_alpha"),
    dict(divergence="lk_lambda"),                       # speculators' lambda = exp(-3 alpha)
    dict(divergence="lk_lambda", lk_s=0.5, lk_eta=1.0),  # a SpecForge-style schedule
    dict(divergence="tvd", position_weighting="block_acceptance", block_size=3),
    dict(divergence="lk_lambda", position_weighting="block_acceptance", block_size=2),
]


def _tiny_setup():
  target, draft = _models()
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  batch = objectives.training_features(SyntheticData(4, vocab_size=VOCAB).batch_at(0), draft)
  return target, draft, tp, dp, batch


@pytest.mark.slow
@pytest.mark.parametrize("changes", NEW_OBJECTIVES)
def test_each_new_objective_lowers_its_loss_on_a_tiny_pair(changes):
  target, draft, tp, dp, batch = _tiny_setup()
  objective = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(**changes))
  loss = jax.jit(lambda p: objective.loss(p, {"target": tp}, batch)[0])
  grad = jax.jit(jax.grad(lambda p: objective.loss(p, {"target": tp}, batch)[0]))
  params, first = dp, float(loss(dp))
  for _ in range(8):
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grad(params))
  assert np.isfinite(first) and float(loss(params)) < 0.95 * first, (first, loss(params))


@pytest.mark.slow
def test_block_acceptance_is_the_divergence_weighted_by_detached_reach_weights():
  from distillspec_jax.distill import block_acceptance
  target, draft, tp, dp, batch = _tiny_setup()
  config = objectives.DistillationConfig(divergence="fkl", position_weighting="block_acceptance",
                                block_size=3)
  objective = objectives.DistillationObjective(target, draft, config)
  weights = batch["decoder_loss_weights"]
  target_logits = target.logits(tp, batch)
  alpha = divergences.expected_acceptance(target_logits, draft.logits(dp, batch))
  reach = block_acceptance.reach_weights(alpha, weights, 3)  # a constant below
  manual = lambda p: jnp.mean(divergences.masked_sequence_mean(
      reach * divergences.token_divergence("fkl", target_logits, draft.logits(p, batch)),
      weights))
  loss, metrics = objective.loss(dp, {"target": tp}, batch)
  np.testing.assert_allclose(loss, manual(dp), rtol=1e-5)
  assert float(loss) < float(metrics["divergence"])  # some weights < 1
  assert 0.0 < float(metrics["mean_reach_weight"]) < 1.0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               jax.grad(lambda p: objective.loss(p, {"target": tp}, batch)[0])(dp),
               jax.grad(manual)(dp))


@pytest.mark.slow
@pytest.mark.parametrize("changes", NEW_OBJECTIVES)
def test_adaspec_selection_composes_with_each_new_objective(changes):
  target, draft, tp, dp, batch = _tiny_setup()
  frozen = {"target": tp, "reference": draft.init(jax.random.PRNGKey(2))}
  plain = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(**changes))
  every = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(
      top_k_fraction=1.0, **changes), reference=draft)
  half = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(
      top_k_fraction=0.5, **changes), reference=draft)
  np.testing.assert_allclose(every.loss(dp, frozen, batch)[0], plain.loss(dp, frozen, batch)[0],
                             rtol=1e-6)
  assert float(half.loss(dp, frozen, batch)[0]) < float(plain.loss(dp, frozen, batch)[0])


@pytest.mark.slow
def test_the_cached_teacher_at_full_vocabulary_gives_the_live_new_objectives():
  from distillspec_jax.distill import teacher_cache
  target, draft, tp, dp, batch = _tiny_setup()
  top, ids, tail = divergences.top_k_bins(divergences.log_probs(target.logits(tp, batch)),
                                          VOCAB)
  cached_batch = {**batch, "teacher_top_log_probs": top, "teacher_top_ids": ids,
                  "teacher_tail_log_prob": tail}
  for changes in NEW_OBJECTIVES:
    config = objectives.DistillationConfig(lambda1=1.0, lambda2=0.0, **changes)
    live = objectives.DistillationObjective(target, draft, config).loss(dp, {"target": tp}, batch)
    cached = teacher_cache.CachedTeacherObjective(draft, config).loss(dp, {}, cached_batch)
    np.testing.assert_allclose(cached[0], live[0], rtol=1e-5, err_msg=str(changes))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(divergence="lk"), "divergence='lk' is not one of"),
    (dict(divergence="lk_lambda", lk_s=0.0), "s=0.0 must lie in (0, 1]"),
    (dict(lk_s=-2.0), "s=-2.0 must lie in (0, 1]"),
    (dict(lk_eta=-1.0), "eta=-1.0 must be finite and >= 0"),
    (dict(position_weighting="reach"), "position_weighting='reach' is not one of"),
    (dict(position_weighting="block_acceptance", block_size=0), "block_size=0"),
])
def test_bad_new_objective_settings_name_the_value(kwargs, needle):
  with pytest.raises(ValueError) as error:
    objectives.DistillationConfig(**kwargs)
  assert needle in str(error.value)


def test_adaspec_margin_reads_the_configured_temperatures():
  # The margin ranks tokens by how far the draft's loss is above the reference's: the loss as
  # trained, at the config's T_p and T_q, not at temperature 1.
  target, draft, tp, dp, batch = _tiny_setup()
  rp = draft.init(jax.random.PRNGKey(2))
  temperatures = dict(target_temperature=2.0, draft_temperature=0.5)
  objective = objectives.DistillationObjective(target, draft, objectives.DistillationConfig(
      top_k_fraction=0.5, **temperatures), reference=draft)
  _, metrics = objective.loss(dp, {"target": tp, "reference": rp}, batch)
  target_logits = target.logits(tp, batch)
  margin = (divergences.token_divergence("fkl", target_logits, draft.logits(dp, batch),
                                         **temperatures)
            - divergences.token_divergence("fkl", target_logits, draft.logits(rp, batch),
                                           **temperatures))
  weights = batch["decoder_loss_weights"]
  keep = token_selection.select_tokens(margin, weights, 0.5)
  expected = token_selection.selection_stats(margin, keep, weights)
  for name in ("mean_margin_kept", "mean_margin_dropped"):
    np.testing.assert_allclose(metrics[name], expected[name], rtol=1e-4, atol=1e-6)
