"""The acceptance head: parameters, labels and loss, its calibration, the engine driven by it
(exactness, greedy and sampled), and bad input."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.decoding.speculative import DraftLength, speculative_decode
from distillspec_jax.distill import acceptance_signal
from distillspec_jax.distill.objectives import DistillationConfig, DistillationObjective
from distillspec_jax.evaluation import calibration
from distillspec_jax.models.acceptance_head import AcceptanceHeadConfig
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model
from test_speculative import (_exact_sequence_distribution, _goodness_of_fit_pvalue,
                              _pair, _peaked_decoder_pair, _prompts)


HEAD = AcceptanceHeadConfig(width=16)


def _with_head(draft, draft_params, spread=20.0, seed=5):
  """The draft with a random head whose output logits are scaled by `spread`, so its
  probabilities range over (0, 1) and a 0.5 threshold stops some rounds and not others."""
  model, params = draft.with_acceptance_head(draft_params, HEAD, jax.random.PRNGKey(seed))
  params["acceptance_head"]["output"]["kernel"] = (
      params["acceptance_head"]["output"]["kernel"] * spread)
  return model, params


@pytest.mark.slow
def test_head_parameters_have_logical_axes_and_leave_the_network_alone():
  target, tp, draft, dp = _pair("decoder_only")
  model, params = _with_head(draft, dp)
  axes = model.logical_axes()["acceptance_head"]
  assert axes["hidden"]["kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
  assert axes["output"]["kernel"] == jax.sharding.PartitionSpec("mlp", "acceptance")
  shapes = jax.tree.map(lambda x: x.shape, model.param_shapes())
  assert jax.tree.map(lambda x: x.shape, params) == shapes
  batch = {"decoder_input_tokens": _prompts("decoder_only")["prompt_tokens"]}
  # Each call one compiled program (called eagerly, each of their operations compiles alone).
  logits, head = jax.jit(model.logits_with_acceptance)(params, batch)
  np.testing.assert_array_equal(logits, jax.jit(draft.logits)(dp, batch))
  assert head.shape == batch["decoder_input_tokens"].shape
  # The incremental call gives the same head output as the teacher-forced one.
  step_logits, acceptance, _ = jax.jit(lambda p, t: model.extend_with_acceptance(
      p, model.init_cache(p, 4, 16), t))(params, batch["decoder_input_tokens"])
  np.testing.assert_allclose(acceptance, jax.nn.sigmoid(head), atol=1e-5)
  np.testing.assert_allclose(step_logits, logits, atol=1e-4)
  assert 0.05 < float(jnp.std(acceptance))  # the spread the engine tests rely on


def test_labels_and_cross_entropy_on_a_hand_computed_case():
  target = jnp.log(jnp.array([[[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]]))
  draft = jnp.log(jnp.array([[[0.5, 0.1, 0.4], [0.7, 0.2, 0.1]]]))
  np.testing.assert_array_equal(acceptance_signal.acceptance_labels(target, draft, 0.0),
                                [[1.0, 0.0]])
  # sum_v min(p_v, q_v): 0.5 + 0.1 + 0.1 and 0.2 + 0.2 + 0.1.
  np.testing.assert_allclose(acceptance_signal.acceptance_labels(target, draft, 1.0),
                             [[0.7, 0.5]], rtol=1e-5)
  logits, labels = jnp.array([2.0, -1.0]), jnp.array([0.7, 0.0])
  s = 1.0 / (1.0 + np.exp(-np.array([2.0, -1.0])))
  expected = -(np.array([0.7, 0.0]) * np.log(s) + np.array([0.3, 1.0]) * np.log(1 - s))
  np.testing.assert_allclose(acceptance_signal.binary_cross_entropy(logits, labels), expected,
                             rtol=1e-5)
  loss, _ = acceptance_signal.acceptance_loss(logits[None], labels[None], jnp.array([[1.0, 0]]))
  np.testing.assert_allclose(loss, expected[0], rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_logit_makes_its_label_and_the_ece_nan(temperature):
  # The greedy label compared argmaxes, and argmax of a row holding NaN is an index: the NaN
  # became a 0/1 outcome, and the head's loss and the calibration's ECE numbers.
  target = jnp.log(jnp.array([[[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]]]))
  draft = jnp.log(jnp.array([[[0.5, 0.1, 0.4], [0.7, 0.2, 0.1], [0.3, 0.3, 0.4]]]))
  target = target.at[0, 0, 1].set(jnp.nan)
  draft = draft.at[0, 1, 2].set(jnp.nan)
  labels = np.asarray(acceptance_signal.acceptance_labels(target, draft, temperature))
  assert np.isnan(labels[0, :2]).all() and np.isfinite(labels[0, 2])
  loss, _ = acceptance_signal.acceptance_loss(jnp.zeros((1, 3)), labels, jnp.ones((1, 3)))
  assert np.isnan(float(loss))
  table = calibration.reliability(np.full((1, 3), 0.5), labels)
  assert np.isnan(table.ece)


def test_reliability_on_a_hand_computed_case():
  signal = [0.05, 0.15, 0.12, 0.95, 0.5]
  outcome = [0.0, 1.0, 0.0, 1.0, 1.0]
  table = calibration.reliability(signal, outcome, weights=[1, 1, 1, 1, 0], bins=10)
  # Bins 0, 1, 9: |0 - 0.05| * 1, |0.5 - 0.135| * 2, |1 - 0.95| * 1, over 4 positions.
  np.testing.assert_allclose(table.ece, (0.05 + 2 * 0.365 + 0.05) / 4)
  assert table.count[:2] == (1, 2) and table.count[9] == 1 and table.positions == 4
  with pytest.raises(ValueError, match="outside \\[0, 1\\].*1.5"):
    calibration.reliability([1.5], [1.0])


def _train_jointly(temperature, steps=150):
  """A tiny decoder-only pair: the draft and its head trained together by the library's
  objective on fixed random sequences; returns the models, parameters and a held-out batch."""
  common = dict(kind="decoder_only", vocab_size=24, emb_dim=32, num_heads=2, head_dim=16,
                mlp_dim=64, dropout_rate=0.0, max_decode_length=32, num_encoder_layers=0)
  target = Model(TransformerConfig(num_decoder_layers=2, **common))
  draft = Model(TransformerConfig(num_decoder_layers=1, **common), acceptance_head=HEAD)
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  objective = DistillationObjective(target, draft, DistillationConfig(
      lambda1=1.0, lambda2=0.0, acceptance_weight=1.0, acceptance_temperature=temperature))

  def batch(seed, rows=16):
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (rows, 12), 2, 24)
    return {"decoder_input_tokens": jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1],
            "decoder_target_tokens": tokens, "decoder_loss_weights": jnp.ones((rows, 12))}

  optimizer = optax.adam(3e-3)

  @jax.jit
  def step(params, state, features):
    grads = jax.grad(lambda p: objective.loss(p, {"target": tp}, features)[0])(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = optimizer.init(dp)
  for i in range(steps):
    dp, state = step(dp, state, batch(100 + i % 8))
  return target, tp, draft, dp, batch(7, rows=64)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trained_head_is_better_calibrated_than_the_top_probability(temperature):
  target, tp, draft, dp, held_out = _train_jointly(temperature)
  tables = calibration.signal_calibration(target, tp, draft, dp, held_out,
                                          temperature=temperature)
  head, top = tables["acceptance_head"], tables["top_probability"]
  assert head.positions == top.positions == 64 * 12
  # Held-out positions; a head that learned nothing (or the top probability's miscalibration)
  # fails by a wide margin.
  assert head.ece < 0.5 * top.ece, (head.ece, top.ece)
  assert head.ece < 0.12


# Each rule on the head's signal; the confidence rule on both model kinds.
@pytest.mark.slow
@pytest.mark.parametrize("kind, rules", [
    ("encoder_decoder", (DraftLength("confidence", 0.5, signal="acceptance_head"),)),
    ("decoder_only", (DraftLength("confidence", 0.5, signal="acceptance_head"),
                      DraftLength("cumulative", 0.2, signal="acceptance_head"),
                      DraftLength("cost", costs=(1.0, 1.0, 1.0, 1.0, 3.0), draft_cost=0.05,
                                  signal="acceptance_head")))])
def test_greedy_speculative_with_the_head_signal_equals_greedy_target(kind, rules):
  target, tp, draft, dp = _pair(kind)
  draft, dp = _with_head(draft, dp)
  prompts = _prompts(kind)
  reference = decode(target, tp, max_new_tokens=20, **prompts)
  for rule in rules:
    result = speculative_decode(target, tp, draft, dp, max_new_tokens=20, gamma=4,
                                draft_length=rule, **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    np.testing.assert_array_equal(result.lengths, reference.lengths)
    proposed, rounds = int(np.sum(result.drafted)), int(np.sum(result.target_calls))
    assert rounds < proposed < 4 * rounds, (kind, rule.rule)  # the head stopped some rounds


@pytest.mark.slow
def test_head_signal_drives_the_rule_not_the_top_probability():
  """The same pair and threshold give other proposals with the head's signal than with the
  top probability (the signal reaches the rule)."""
  target, tp, draft, dp = _pair("decoder_only")
  headed, hp = _with_head(draft, dp)
  prompts = _prompts("decoder_only")
  run = lambda model, params, signal: speculative_decode(
      target, tp, model, params, max_new_tokens=20, gamma=4,
      draft_length=DraftLength("confidence", 0.5, signal=signal), **prompts)
  top, head = run(draft, dp, "top_probability"), run(headed, hp, "acceptance_head")
  assert not np.array_equal(top.proposed_per_round, head.proposed_per_round)


@pytest.mark.slow
def test_sampled_speculative_with_the_head_signal_matches_target_distribution():
  model, tp, dp = _peaked_decoder_pair()
  draft, hp = _with_head(model, dp)
  length, num_samples = 4, 20000
  expected = _exact_sequence_distribution(model, tp, length, eos=1)
  result = speculative_decode(model, tp, draft, hp,
                              prompt_tokens=jnp.zeros((num_samples, 1), jnp.int32),
                              max_new_tokens=length, gamma=3,
                              sampling=SamplingConfig(1.0, eos_id=1),
                              draft_length=DraftLength("confidence", 0.5,
                                                       signal="acceptance_head"),
                              rng=jax.random.PRNGKey(13))
  proposed, rounds = int(np.sum(result.drafted)), int(np.sum(result.target_calls))
  assert 1.2 * rounds < proposed < 2.8 * rounds  # a mix of short and long proposals
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  samples = [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]
  assert _goodness_of_fit_pvalue(samples, expected) > 1e-3


def test_bad_input_is_refused_before_work():
  target, tp, draft, dp = _pair("decoder_only")
  with pytest.raises(ValueError, match="needs a draft with an acceptance head"):
    speculative_decode(target, tp, draft, dp, max_new_tokens=5, gamma=3,
                       draft_length=DraftLength("confidence", 0.5, signal="acceptance_head"),
                       **_prompts("decoder_only"))
  with pytest.raises(ValueError, match="signal='entropy' is not one of"):
    DraftLength("confidence", 0.5, signal="entropy")
  with pytest.raises(ValueError, match="the fixed rule reads no confidence"):
    DraftLength(signal="acceptance_head")
  for weight in (-0.5, float("nan")):
    with pytest.raises(ValueError, match=f"acceptance_weight={weight}"):
      DistillationConfig(acceptance_weight=weight)
  with pytest.raises(TypeError, match="acceptance_weight"):
    DistillationConfig(acceptance_weight="1.0")
  with pytest.raises(ValueError, match="acceptance_temperature=-1.0"):
    DistillationConfig(acceptance_temperature=-1.0)
  with pytest.raises(ValueError, match="acceptance_weight=1.0 needs a draft with an acceptance"):
    DistillationObjective(target, draft, DistillationConfig(acceptance_weight=1.0))
  with pytest.raises(ValueError, match="acceptance_weight=0.0 would leave it untrained"):
    DistillationObjective(target, Model(draft.config, acceptance_head=HEAD), DistillationConfig())
  with pytest.raises(ValueError, match="width=0"):
    AcceptanceHeadConfig(width=0)
  from distillspec_jax.distill.teacher_cache import CachedTeacherObjective
  with pytest.raises(ValueError, match="teacher cache does not train an acceptance head"):
    CachedTeacherObjective(Model(draft.config, acceptance_head=HEAD), DistillationConfig(
        lambda1=1.0, lambda2=0.0, acceptance_weight=1.0))
  with pytest.raises(ValueError, match="already has an acceptance head"):
    Model(draft.config, acceptance_head=HEAD).with_acceptance_head(dp, HEAD, jax.random.PRNGKey(0))


@pytest.mark.integration  # trains a target and a draft (bench/acceptance_calibration.py)
def test_calibration_bench_smoke(tmp_path):
  import json
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import acceptance_calibration
  out = tmp_path / "calibration.json"
  # The script's whole --smoke run, as a user runs it (so test_bench_smoke.py does not again).
  acceptance_calibration.main(["--smoke", "--out", str(out)])
  report = json.loads(out.read_text())
  entry = report["temperatures"]["1"]
  assert set(entry["calibration"]) == {"top_probability", "acceptance_head"}
  for table in entry["calibration"].values():
    assert 0.0 <= table["ece"] <= 1.0 and table["positions"] > 0
  assert (tmp_path / entry["diagram"]).stat().st_size > 0
  assert {row["signal"] for row in entry["rules"]} == {"top_probability", "acceptance_head"}
  with pytest.raises(ValueError, match="--head_width=0"):
    acceptance_calibration.parse(["--out", str(out), "--head_width", "0"])
  with pytest.raises(ValueError, match="acceptance_weight=-1.0"):
    acceptance_calibration.parse(["--out", str(out), "--acceptance_weight", "-1"])


@pytest.mark.slow
def test_the_trainer_trains_and_checkpoints_the_head_with_the_draft(tmp_path):
  """The project's trainer: the head's loss is logged, its parameters are saved and restored
  (resume) with the draft's and the next step updates them."""
  from distillspec_jax.training import trainer
  target, tp, draft, _ = _pair("encoder_decoder")
  draft = Model(draft.config, acceptance_head=HEAD)
  data = trainer.SyntheticData(8, vocab_size=97)
  objective = DistillationObjective(target, draft, DistillationConfig(
      lambda1=1.0, lambda2=0.0, acceptance_weight=1.0))
  config = lambda steps: trainer.TrainConfig(
      model_dir=str(tmp_path / "draft"), train_steps=steps, batch_size=8, optimizer="adamw",
      learning_rate=1e-2, warmup_steps=0, decay_steps=100, save_every=12, log_every=1,
      progress_bar=False)
  first = trainer.train(config(12), objective, data, frozen_params={"target": tp})
  losses = [r["acceptance_bce"] for r in first.history if "acceptance_bce" in r]
  assert len(losses) == 12 and np.all(np.isfinite(losses))
  resumed = trainer.train(config(13), objective, data, frozen_params={"target": tp})
  assert resumed.resumed_history and int(resumed.state.step) == 13
  before = first.state.params["acceptance_head"]["output"]["kernel"]
  after = resumed.state.params["acceptance_head"]["output"]["kernel"]
  assert not np.allclose(before, after)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma3"])
def test_head_reads_the_last_hidden_state_of_the_rope_families(name):
  """The head finds each family's final norm: its incremental output equals its
  teacher-forced one, and the logits are the network's."""
  plain = Model.from_name(name, max_decode_length=32)
  model = Model(plain.config, acceptance_head=HEAD)
  # Each call one compiled program (called eagerly, each of their operations compiles alone).
  params = jax.jit(model.init)(jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 2, plain.config.vocab_size)
  logits, head = jax.jit(model.logits_with_acceptance)(params, {"decoder_input_tokens": tokens})
  np.testing.assert_array_equal(
      logits, jax.jit(plain.logits)({k: v for k, v in params.items() if k != "acceptance_head"},
                                    {"decoder_input_tokens": tokens}))
  _, acceptance, _ = jax.jit(lambda p, t: model.extend_with_acceptance(
      p, model.init_cache(p, 2, 16), t))(params, tokens)
  np.testing.assert_allclose(acceptance, jax.nn.sigmoid(head), atol=1e-5)
