"""Trainer hardening (issue 14): non-finite steps, token ids, donation, config checks, resume
logs. Tiny models, a few steps each."""

import json
import os

import jax
import numpy as np
import pytest

from distillspec_jax.distill import objectives
from distillspec_jax.training import metrics_log
from distillspec_jax.training import trainer
from distillspec_jax.models.model import Model


VOCAB = 64


def _config(model_dir, steps, **kw):
  defaults = dict(batch_size=4, optimizer="adafactor", learning_rate=1e-2, warmup_steps=0,
                  decay_steps=20, save_every=2, keep_checkpoints=None, log_every=1,
                  progress_bar=False)
  defaults.update(kw)
  return trainer.TrainConfig(model_dir=str(model_dir), train_steps=steps, **defaults)


def _draft():
  return Model.from_name("demo_draft", vocab_size=VOCAB)


def _steps_on_disk(model_dir):
  return sorted(int(d) for d in os.listdir(model_dir) if d.isdigit())


def _records(model_dir):
  return [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]


# --- item 2: a non-finite loss or gradient stops training --------------------------------------


@pytest.mark.slow
def test_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
  """Step 6's batch has an infinite loss weight: the run stops there, names the step, the
  source and what to check; checkpoint 4 stays and step 6 is never saved."""
  clean = trainer.SyntheticData(4, vocab_size=VOCAB)

  def batch_at(step):
    batch = clean.batch_at(step)
    if step == 5:  # the batch of step 6 (steps are counted from 1 in logs and checkpoints)
      batch["decoder_loss_weights"] = batch["decoder_loss_weights"].copy()
      batch["decoder_loss_weights"][0, 0] = np.inf
    return batch

  model = _draft()
  with pytest.raises(trainer.NonFiniteError) as error:
    trainer.finetune(_config(tmp_path, 10, log_every=4), model, trainer.BatchAt(batch_at),
               data_name="the inf-weight source")
  message = str(error.value)
  for needle in ("Step 6 of 10", "fixed data", "learning rate", "input ids",
                 "the inf-weight source", "checkpoint, step 4, stays", str(tmp_path)):
    assert needle in message, (needle, message)
  assert _steps_on_disk(tmp_path) == [1, 2, 4]  # orbax also saves a run's first step
  assert [r["step"] for r in _records(tmp_path)] == [4]
  # The kept checkpoint is the good state: it restores finite and resumes cleanly.
  resumed = trainer.finetune(_config(tmp_path, 5, log_every=4), model, clean)
  assert int(resumed.state.step) == 5
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(resumed.state.params))


@pytest.mark.slow
def test_nan_target_stops_distillation_naming_the_target_checkpoint(tmp_path):
  """A NaN target gave FKL 0.0 (read as zero probability) and trained on silently."""
  target = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32)
  target_params = jax.tree.map(lambda x: x * np.nan, target.init(jax.random.PRNGKey(1)))
  with pytest.raises(trainer.NonFiniteError) as error:
    trainer.distill(_config(tmp_path, 3, log_every=3, save_every=10), target, target_params,
              _draft(), trainer.SyntheticData(4, vocab_size=VOCAB),
              objectives.DistillationConfig.from_recipe("gkd"))
  message = str(error.value)
  for needle in ("Step 1 of 3", "loss=nan", "draft samples", "TARGET_CHECKPOINT_PATH",
                 "no checkpoint had been written"):
    assert needle in message, (needle, message)
  assert _steps_on_disk(tmp_path) == []


def test_train_step_leaves_the_state_unchanged_on_a_non_finite_update():
  model = _draft()
  config = _config("/tmp/unused", 1)
  mesh = trainer.partitioning.make_mesh()
  objective = objectives.FinetuneObjective(model)
  step_fn, shardings, _ = trainer.make_train_step(objective, config.optimizer_spec, mesh)
  params = model.init(jax.random.PRNGKey(0))
  opt_state = config.optimizer_spec.make().init(params)
  before = jax.tree.map(np.asarray, (params, opt_state))
  state = jax.device_put(trainer.TrainState(step=np.int32(0), params=params, opt_state=opt_state),
                         shardings)
  batch = trainer.SyntheticData(4, vocab_size=VOCAB).batch_at(0)
  batch["decoder_loss_weights"] = batch["decoder_loss_weights"] * np.float32(np.nan)
  state, metrics = step_fn(state, trainer.partitioning.shard_batch(batch, mesh),
                           jax.random.PRNGKey(0), {})
  assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
  assert int(state.step) == 1
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, (state.params, state.opt_state)))


# --- item 3: token ids outside the vocabulary ---------------------------------------------------


def test_token_ids_past_the_vocabulary_are_refused_in_distillation(tmp_path):
  """Data of vocabulary 200 on a vocabulary-64 pair logged loss 0.0."""
  target = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32)
  with pytest.raises(ValueError) as error:
    trainer.distill(_config(tmp_path, 2), target, target.init(jax.random.PRNGKey(1)), _draft(),
              trainer.SyntheticData(4, vocab_size=200), objectives.DistillationConfig.from_recipe("gkd"),
              data_name="task 'wide_vocab'")
  message = str(error.value)
  for needle in ("encoder_input_tokens", "vocab_size=64", "step 1", "task 'wide_vocab'",
                 str(tmp_path)):
    assert needle in message, (needle, message)
  bad_id = int(message.split("token id ")[1].split()[0])
  assert bad_id >= VOCAB
  assert _steps_on_disk(tmp_path) == []


def test_negative_token_ids_are_refused_in_finetuning(tmp_path):
  clean = trainer.SyntheticData(4, vocab_size=VOCAB)

  def batch_at(step):
    batch = clean.batch_at(step)
    if step == 1:
      batch["decoder_target_tokens"] = batch["decoder_target_tokens"].copy()
      batch["decoder_target_tokens"][2, 0] = -3
    return batch

  with pytest.raises(ValueError) as error:
    trainer.finetune(_config(tmp_path, 4), _draft(), trainer.BatchAt(batch_at))
  message = str(error.value)
  for needle in ("decoder_target_tokens", "token id -3", "[2, 0]", "negative", "step 2",
                 "BatchAt"):
    assert needle in message, (needle, message)


# --- item 8: the caller's init_params are not donated ------------------------------------------


def test_init_params_stay_usable_after_training(tmp_path):
  model = _draft()
  params = model.init(jax.random.PRNGKey(3))
  copy = jax.tree.map(np.array, params)
  result = trainer.finetune(_config(tmp_path, 2), model, trainer.SyntheticData(4, vocab_size=VOCAB),
                      init_params=params)
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))
  jax.tree.map(np.testing.assert_array_equal, copy, jax.tree.map(np.asarray, params))
  # ... and training did start from them (the trained params differ from the caller's).
  assert any(not np.array_equal(a, np.asarray(b)) for a, b in
             zip(jax.tree.leaves(copy), jax.tree.leaves(result.state.params)))


# --- item 9: warm-up longer than the decay -------------------------------------------------------


def test_warmup_longer_than_decay_is_refused_not_clamped(tmp_path):
  with pytest.raises(ValueError) as error:
    trainer.TrainConfig(model_dir=str(tmp_path), train_steps=10, warmup_steps=5000, decay_steps=1000)
  message = str(error.value)
  assert "warmup_steps=5000" in message and "decay_steps=1000" in message
  assert "must not exceed" in message  # the schedule's own rule
  trainer.TrainConfig(model_dir=str(tmp_path), train_steps=10, warmup_steps=1000, decay_steps=1000)


# --- item 12: clear config errors ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs,needle", [
    (dict(learning_rate="1e-3"), "learning_rate='1e-3'"),
    (dict(train_steps=10.0), "train_steps=10.0"),
    (dict(batch_size=True), "batch_size=True"),
    (dict(keep_checkpoints="3"), "keep_checkpoints='3'"),
    (dict(progress_bar=1), "progress_bar=1"),
    (dict(optimizer=None), "optimizer=None"),
])
def test_train_config_values_are_type_checked(tmp_path, kwargs, needle):
  args = dict(model_dir=str(tmp_path), train_steps=10)
  args.update(kwargs)
  with pytest.raises(TypeError) as error:
    trainer.TrainConfig(**args)
  assert needle in str(error.value) and "TrainConfig." in str(error.value)


def test_train_config_takes_numpy_numbers(tmp_path):
  config = trainer.TrainConfig(model_dir=str(tmp_path), train_steps=np.int64(10),
                         learning_rate=np.float32(1e-3), warmup_steps=0, decay_steps=10,
                         keep_checkpoints=None)
  assert config.train_steps == 10


def test_reference_params_of_another_shape_name_the_parameters(tmp_path):
  """AdaSPEC with a reference checkpoint of the wrong shape failed inside device_put."""
  target = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32)
  draft = _draft()
  wrong = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32).init(jax.random.PRNGKey(2))
  with pytest.raises(ValueError) as error:
    trainer.distill(_config(tmp_path, 2), target, target.init(jax.random.PRNGKey(1)), draft,
              trainer.SyntheticData(4, vocab_size=VOCAB),
              objectives.DistillationConfig(top_k_fraction=0.5), reference=draft, reference_params=wrong)
  message = str(error.value)
  assert "frozen reference params" in message and "first mismatching parameters" in message
  assert "(64," in message and "(32," in message and "/" in message  # a parameter path
  assert "tree prefix" not in message


def test_target_params_of_another_shape_name_the_parameters(tmp_path):
  target = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32)
  with pytest.raises(ValueError, match="frozen target params"):
    trainer.distill(_config(tmp_path, 2), target, _draft().init(jax.random.PRNGKey(1)), _draft(),
              trainer.SyntheticData(4, vocab_size=VOCAB))


# --- item 10: logs after a resume ----------------------------------------------------------------


class _Crash(Exception):
  pass


@pytest.mark.slow
def test_resume_logs_each_step_once_and_keeps_the_earlier_eval_curve(tmp_path):
  """Run 8 steps straight; separately run, "crash" at step 7 (checkpoint 4, steps 5-6 and the
  step-6 evaluation logged after it), resume to 8: the log and the eval curve must equal the
  straight run's, each step once."""
  model = _draft()
  clean = trainer.SyntheticData(4, vocab_size=VOCAB)
  eval_fn = lambda params, step: {"tau": float(step) / 10}  # depends only on the step
  config = lambda d: _config(d, 8, save_every=4, eval_every=2)

  trainer.finetune(config(tmp_path / "a"), model, clean, eval_fn=eval_fn)  # the straight run

  def crashing(step):
    if step == 6:  # fetching step 7's batch: the process dies
      raise _Crash()
    return clean.batch_at(step)

  with pytest.raises(_Crash):
    trainer.finetune(config(tmp_path / "b"), model, trainer.BatchAt(crashing), eval_fn=eval_fn)
  assert _steps_on_disk(tmp_path / "b") == [1, 4]  # orbax also saves a run's first step
  assert [r["step"] for r in _records(tmp_path / "b") if "loss" in r] == [1, 2, 3, 4, 5, 6]

  resumed = trainer.finetune(config(tmp_path / "b"), model, clean, eval_fn=eval_fn)
  logged = _records(tmp_path / "b")
  assert [r["step"] for r in logged if "loss" in r] == list(range(1, 9))
  assert [r["step"] for r in logged if "eval/tau" in r] == [2, 4, 6, 8]
  # The earlier process's points come back in the result (pipeline's tau curve uses it).
  assert [r["step"] for r in resumed.resumed_history if "eval/tau" in r] == [2, 4]
  assert [r["step"] for r in resumed.full_history if "eval/tau" in r] == [2, 4, 6, 8]
  # Same records as the uninterrupted run, timings aside (source totals count per process).
  strip = lambda r: {k: v for k, v in r.items()
                     if not k.endswith("_per_s") and not k.startswith("source_total/")}
  assert [strip(r) for r in logged] == [strip(r) for r in _records(tmp_path / "a")]


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
  kept = metrics_log.truncate_metrics(str(path), 2)
  assert [r["step"] for r in kept] == [1, 2]
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]
  assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left
