"""Distilling a draft head (distill/head_objectives.py): each divergence lowers the
training-time-test loss, AdaSPEC keeps the stated fraction per step, on-policy samples are the
head's own proposals, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distillspec_jax.distill import token_selection
from distillspec_jax.distill.head_objectives import (HeadDistillationObjective,
                                                     HeadTrainingConfig)
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.models.head import Head, HeadConfig
from test_heads import tiny_target


VOCAB = 31


def _setup(kind="decoder_only", draft_ids=None):
  target = tiny_target(kind, vocab=VOCAB)
  params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, mlp_dim=32, draft_ids=draft_ids))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 9), 2, VOCAB)
  batch = {"decoder_target_tokens": tokens[:, 1:], "decoder_input_tokens": tokens[:, :-1],
           "decoder_loss_weights": jnp.ones((4, 8)).at[1, 5:].set(0.0)}
  if kind == "encoder_decoder":
    batch["encoder_input_tokens"] = tokens[:, :5]
  return target, params, head, head.init(jax.random.PRNGKey(1), params), batch


def _train(objective, params, frozen, batch, steps=12):
  optimizer = optax.adam(3e-3)

  @jax.jit
  def step(params, state):
    (loss, _), grads = jax.value_and_grad(objective.loss, has_aux=True)(params, frozen, batch)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = optimizer.init(params), []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return losses


@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["fkl", "rkl", "jsd", "tvd"])
def test_each_divergence_lowers_the_head_loss(divergence):
  target, params, head, head_params, batch = _setup()
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=1.0, divergence=divergence, beta=0.3),
      HeadTrainingConfig(3))
  losses = _train(objective, head_params, {"target": params}, batch)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]


@pytest.mark.slow
def test_training_with_a_reduced_draft_vocabulary_on_an_encoder_decoder():
  ids = tuple(range(2, VOCAB, 2)) + (1, 0)
  target, params, head, head_params, batch = _setup("encoder_decoder", draft_ids=ids)
  objective = HeadDistillationObjective(target, head, DistillationConfig(lambda1=1.0),
                                        HeadTrainingConfig(2, step_weights=(1.0, 0.5)))
  losses = _train(objective, head_params, {"target": params}, batch, steps=8)
  assert losses[-1] < 0.8 * losses[0]


def test_adaspec_selection_with_a_head_keeps_the_stated_fraction_per_step():
  target, params, head, head_params, batch = _setup()
  reference_params = head.init(jax.random.PRNGKey(9), params)
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=1.0, top_k_fraction=0.4), HeadTrainingConfig(3),
      reference=head)
  # One compiled program (called eagerly, each operation compiles on its own).
  _, metrics = jax.jit(objective.loss)(head_params,
                                       {"target": params, "reference": reference_params}, batch)
  weights = np.asarray(batch["decoder_loss_weights"])
  for s in range(3):
    valid = int(np.sum(weights[:, s + 1:]))  # step s scores positions t + s + 1
    keep = int(token_selection.num_tokens_to_keep(jnp.asarray(valid), 0.4))
    np.testing.assert_allclose(float(metrics[f"kept_fraction_step{s + 1}"]), keep / valid,
                               rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
def test_on_policy_samples_are_the_heads_own_proposals(kind):
  """Greedy on-policy data: the first token is the target's, every later one the head's
  first-step argmax over the target's features of the sampled prefix."""
  target, params, head, head_params, batch = _setup(kind)
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=0.0, lambda2=1.0, sampling_temperature=0.0,
                                       max_new_tokens=6), HeadTrainingConfig(1))
  sampled, source = jax.jit(objective.make_batch)(head_params, {"target": params}, batch,
                                                  jax.random.PRNGKey(5))
  assert int(source) == 1
  teacher, head_logits, _ = jax.jit(objective.step_logits)(head_params, {"target": params},
                                                           sampled)
  tokens, weights = np.asarray(sampled["decoder_target_tokens"]), np.asarray(
      sampled["decoder_loss_weights"])
  proposals = np.asarray(jnp.argmax(head_logits[0], -1))
  first = np.argmax(weights > 0, axis=1)
  checked = 0
  for row in range(tokens.shape[0]):
    assert tokens[row, first[row]] == int(np.argmax(teacher[row, first[row]]))
    for t in range(first[row] + 1, tokens.shape[1]):
      if weights[row, t] > 0:
        assert tokens[row, t] == proposals[row, t - 1]
        checked += 1
  assert checked >= 8


def test_head_training_bad_input_names_the_value():
  with pytest.raises(ValueError, match="unroll steps=0 must be an integer >= 1"):
    HeadTrainingConfig(0)
  with pytest.raises(ValueError, match="one weight per step"):
    HeadTrainingConfig(2, step_weights=(1.0,))
  with pytest.raises(ValueError, match="are all 0"):
    HeadTrainingConfig(2, step_weights=(0.0, 0.0))
  target, _, head, _, _ = _setup()
  with pytest.raises(ValueError, match="reference head and top_k_fraction"):
    HeadDistillationObjective(target, head, DistillationConfig(top_k_fraction=0.5))
  wider = tiny_target("decoder_only", vocab=VOCAB).config.replace(emb_dim=48)
  from distillspec_jax.models.model import Model
  with pytest.raises(ValueError, match="width 32 does not match the target's emb_dim=48"):
    HeadDistillationObjective(Model(wider), head)


@pytest.mark.slow
def test_head_training_resumes_bit_identically(tmp_path):
  """The trainer runs a head objective like any other: 2k steps straight equal k steps, all
  state dropped, then a restart from MODEL_DIR up to 2k (what a kill -9 leaves), bitwise;
  every source (fixed, on-policy head samples, target samples) in play."""
  from distillspec_jax.models.model import Model
  from distillspec_jax.training import trainer as T
  target = Model.from_name("tiny_encoder_decoder", vocab_size=64)
  params = target.init(jax.random.PRNGKey(1))
  head = Head(HeadConfig(target.config, mlp_dim=32))
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=0.34, lambda2=0.5, max_new_tokens=6),
      HeadTrainingConfig(2))
  data = lambda: (T.SyntheticData(4, vocab_size=64).batch_at(s) for s in range(10**6))

  def run(folder, steps):
    config = T.TrainConfig(model_dir=str(tmp_path / folder), train_steps=steps, batch_size=4,
                           optimizer="adamw", learning_rate=1e-3, warmup_steps=0,
                           decay_steps=10, save_every=2, log_every=1, progress_bar=False)
    return T.train(config, objective, data, frozen_params={"target": params})

  straight = run("a", 4)
  run("b", 2)
  resumed = run("b", 4)
  assert int(resumed.state.step) == 4
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               straight.state.params, resumed.state.params)
  records = [r for r in straight.history if "loss" in r]
  assert all("predicted_acceptance" in r and "acceptance_step2" in r for r in records)


@pytest.mark.integration
def test_head_bench_smoke_runs_and_reports(tmp_path):
  """bench/head_draft.py --smoke: trains a head through the trainer, measures tau and costs."""
  import json
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "bench"))
  import head_draft  # noqa: E402
  out = tmp_path / "head.json"
  report = head_draft.main(["--smoke", "--out", str(out)])
  assert json.load(open(out))["rows"] == report["rows"]
  for row in report["rows"]:
    assert 1.0 <= row["tau"] <= row["gamma"] + 1
    assert len(row["acceptance_by_position"]) == row["gamma"]
    assert row["cost_model_speedup"] > 0 and row["projected_speedup_32_layers"] > 0
  assert report["per_call_s"]["head_1"]["median_s"] > 0


@pytest.mark.slow
def test_head_bench_projects_a_finished_reports_rows(tmp_path):
  """bench/head_draft.py --from_report: each draft row priced at its gamma is projected with
  the measured per-layer ratio (the target's calls scaled, the drafts' not); a draft the
  timing did not price is left out."""
  import json
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "bench"))
  import head_draft  # noqa: E402
  report = {"per_call_s": {"target_step": 1e-4, "verification_3": 2e-4},
            "drafts": {"a": {"first_call_s": {"3": 2e-5}, "step_s": 1e-5},
                       "b": {"first_call_s": {"5": 2e-5}, "step_s": 1e-5}},
            "draft_rows": [{"draft": "a", "gamma": 3, "temperature": 0.0, "tau": 3.0},
                           {"draft": "b", "gamma": 3, "temperature": 0.0, "tau": 3.5}]}
  path = tmp_path / "report.json"
  path.write_text(json.dumps(report))
  out = head_draft.main(["--out", str(tmp_path / "p.json"), "--from_report", str(path),
                         "--target_model", "tiny_encoder_decoder", "--calls", "2",
                         "--turns", "2"])
  (row,) = out["rows"]  # 'b' has no first call priced at gamma 3
  scale = out["step_scale_32_layers"]
  assert scale >= 1.0
  draft_cost = 2e-5 + 2 * 1e-5
  assert row["cost_model_speedup"] == pytest.approx(3.0 * 1e-4 / (2e-4 + draft_cost))
  assert row["projected_speedup_32_layers"] == pytest.approx(
      3.0 * 1e-4 * scale / (2e-4 * scale + draft_cost))


@pytest.mark.slow
def test_on_policy_head_samples_end_at_the_targets_stop_ids():
  """The head's on-policy samples end at the target's EOS or any of its stop ids
  (TokenIds.stop_ids), as the target's own samples (plain decoding) do: the samples with a
  stop id are the never-stopping samples cut after its first occurrence (before: at id 1
  alone, whatever the target's ids)."""
  from distillspec_jax.distill.head_objectives import sample_head_batch
  from distillspec_jax.distill.objectives import training_features
  from distillspec_jax.models.model import TokenIds
  target, params, head, head_params, batch = _setup()
  fixed = training_features(batch, target)
  sample = jax.jit(lambda model, eos_id: sample_head_batch(
      model, params, head, head_params, fixed, jax.random.PRNGKey(5), max_new_tokens=6,
      temperature=0.0, eos_id=eos_id), static_argnums=(0, 1))
  free = sample(target, -1)
  tokens, weights = (np.asarray(free[k]) for k in ("decoder_target_tokens",
                                                   "decoder_loss_weights"))
  samples = [tokens[r][weights[r] > 0] for r in range(len(tokens))]
  stop = next(int(t) for s in samples for i, t in enumerate(s[1:-1], 1)
              if t not in s[:i] and 1 not in s[:i + 1])
  stopped = sample(target.with_tokens(TokenIds(stop_ids=(stop,))), None)
  cut = 0
  for r, s in enumerate(samples):
    ends = np.flatnonzero(np.isin(s, [1, stop]))
    n = ends[0] + 1 if ends.size else len(s)
    cut += n < len(s)
    kept = np.asarray(stopped["decoder_target_tokens"])[r][
        np.asarray(stopped["decoder_loss_weights"])[r] > 0]
    np.testing.assert_array_equal(kept, s[:n], err_msg=f"row {r}")
  assert cut >= 1


def test_predicted_acceptance_of_a_reduced_vocabulary_head_is_its_real_acceptance():
  """The draft's expected acceptance is sum_v min(p(v), q(v)) over the target's whole
  vocabulary: the target's mass on ids outside the draft vocabulary can never be accepted.
  The loss compares distributions over the draft ids (the target's renormalised, as
  SpecForge), but predicted_acceptance and acceptance_step{s} must not."""
  ids = tuple(range(2, VOCAB, 3))
  target, params, head, head_params, batch = _setup(draft_ids=ids)
  objective = HeadDistillationObjective(target, head, DistillationConfig(lambda1=1.0),
                                        HeadTrainingConfig(2))
  _, metrics = jax.jit(objective.loss)(head_params, {"target": params}, batch)
  target_logits = target.logits(params, batch)
  layers = head.feature_layers
  _, features, _ = target.layer_features(params, batch, layers)
  unrolled = head.unroll(head_params, batch["decoder_target_tokens"], features, 2)
  weights = np.asarray(batch["decoder_loss_weights"])
  for s in range(2):
    p = np.asarray(jax.nn.softmax(target_logits[:, s + 1:]))
    q = np.asarray(jax.nn.softmax(head.to_target_logits(unrolled[s][:, :-(s + 1)])))
    w = weights[:, s + 1:]
    per_row = np.sum(np.minimum(p, q).sum(-1) * w, 1) / np.sum(w, 1)
    np.testing.assert_allclose(float(metrics[f"acceptance_step{s + 1}"]), per_row.mean(),
                               rtol=1e-5)
  np.testing.assert_allclose(float(metrics["predicted_acceptance"]),
                             float(metrics["acceptance_step1"]), rtol=1e-6)


def test_settings_a_head_does_not_train_with_are_refused():
  """A head's loss has no block-acceptance weighting and no acceptance head: such settings
  were ignored silently (a uniform loss, no acceptance term)."""
  target, _, head, _, _ = _setup()
  with pytest.raises(ValueError, match="position_weighting='block_acceptance'"):
    HeadDistillationObjective(target, head,
                              DistillationConfig(position_weighting="block_acceptance"))
  with pytest.raises(ValueError, match="acceptance_weight=0.5"):
    HeadDistillationObjective(target, head, DistillationConfig(acceptance_weight=0.5))


def test_deep_steps_report_the_acceptance_of_the_rows_they_score():
  """Step s scores positions t + s + 1 of each row: a short row (row 1 ends at position 5)
  has none at steps >= 5. Such a row counted as TVD 0 (acceptance 1) in acceptance_step{s},
  so deep steps read higher than any row they scored."""
  target, params, head, head_params, batch = _setup()
  k = 6
  objective = HeadDistillationObjective(target, head, DistillationConfig(lambda1=1.0),
                                        HeadTrainingConfig(k))
  _, metrics = jax.jit(objective.loss)(head_params, {"target": params}, batch)
  target_logits = target.logits(params, batch)
  _, features, _ = target.layer_features(params, batch, head.feature_layers)
  unrolled = head.unroll(head_params, batch["decoder_target_tokens"], features, k)
  weights = np.asarray(batch["decoder_loss_weights"])
  for s in range(k):
    p = np.asarray(jax.nn.softmax(target_logits[:, s + 1:]))
    q = np.asarray(jax.nn.softmax(unrolled[s][:, :-(s + 1)]))
    w = weights[:, s + 1:]
    scored = np.sum(w, 1) > 0
    per_row = np.sum(np.minimum(p, q).sum(-1) * w, 1) / np.maximum(np.sum(w, 1), 1)
    np.testing.assert_allclose(float(metrics[f"acceptance_step{s + 1}"]),
                               per_row[scored].mean(), rtol=1e-5)


def test_unrolling_as_deep_as_the_sequence_is_refused_naming_both():
  """Step s trains on positions t + s + 1 < T: k >= T leaves a step with nothing to learn,
  and k > T failed inside jnp.concatenate naming neither."""
  target, params, head, head_params, batch = _setup()
  for k in (8, 10):
    objective = HeadDistillationObjective(target, head, DistillationConfig(lambda1=1.0),
                                          HeadTrainingConfig(k))
    with pytest.raises(ValueError, match=rf"unroll steps={k} .* 8 positions"):
      objective.loss(head_params, {"target": params}, batch)


def test_an_adaspec_reference_head_of_another_shape_is_refused():
  """The reference head is unrolled on the head's features and compared over the head's draft
  ids: one reading other layers got the head's features silently (or failed inside its fc),
  one over other draft ids of the same count had its margin taken over mismatched tokens."""
  target, _, head, _, _ = _setup(draft_ids=tuple(range(0, 20)))
  config = DistillationConfig(lambda1=1.0, top_k_fraction=0.5)
  other_ids = Head(head.config.replace(draft_ids=tuple(range(11, 31))))
  with pytest.raises(ValueError, match="reference head's draft_ids"):
    HeadDistillationObjective(target, head, config, reference=other_ids)
  other_layers = Head(head.config.replace(feature_layers=(2, 1, 0)))
  with pytest.raises(ValueError, match=r"reference head's feature_layers=\(2, 1, 0\)"):
    HeadDistillationObjective(target, head, config, reference=other_layers)
  # Another MLP width is a reference of its own: allowed.
  HeadDistillationObjective(target, head, config, reference=Head(head.config.replace(mlp_dim=8)))
