"""Trainer: resume determinism, fine-tuning, distillation lowering TVD, metrics, errors."""

import json
import os

import jax
import numpy as np
import pytest

from distillspec_jax.distill import objectives
from distillspec_jax.training import trainer as trainer_lib
from distillspec_jax.models.model import Model


VOCAB = 64


def _pair():
  target = Model.from_name("tiny_encoder_decoder", vocab_size=VOCAB)
  draft = Model.from_name("demo_draft", vocab_size=VOCAB, dropout_rate=0.1)
  target_params = target.init(jax.random.PRNGKey(1))
  return target, target_params, draft


def _config(model_dir, steps, **kw):
  defaults = dict(batch_size=4, optimizer="adafactor", learning_rate=1e-2, warmup_steps=2,
                  decay_steps=20, save_every=3, keep_checkpoints=2, log_every=2,
                  progress_bar=False)
  defaults.update(kw)
  return trainer_lib.TrainConfig(model_dir=str(model_dir), train_steps=steps, **defaults)


@pytest.mark.slow
def test_resume_after_crash_matches_uninterrupted_run(tmp_path):
  """2k straight == k, drop everything, restart in the same MODEL_DIR up to 2k (bitwise)."""
  target, target_params, draft = _pair()
  # All three sources, dropout and an iterator-factory data source (skipped on resume).
  dc = objectives.DistillationConfig(lambda1=0.34, lambda2=0.5)
  data = lambda: (trainer_lib.SyntheticData(4, vocab_size=VOCAB).batch_at(s) for s in range(10**6))
  k = 3
  straight = trainer_lib.distill(_config(tmp_path / "a", 2 * k), target, target_params, draft, data, dc)
  first = trainer_lib.distill(_config(tmp_path / "b", k), target, target_params, draft, data, dc)
  del first  # "crash": nothing survives but MODEL_DIR
  resumed = trainer_lib.distill(_config(tmp_path / "b", 2 * k), target, target_params, draft, data, dc)
  assert int(resumed.state.step) == 2 * k
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               straight.state.params, resumed.state.params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               straight.state.opt_state, resumed.state.opt_state)
  # The resumed run replayed steps k..2k with the same sources.
  sources_a = [r["source_total/fixed"] for r in straight.history if "loss" in r]
  assert sources_a  # metrics were logged
  # The resumed run really resumed (it did not retrain from scratch).
  assert [r["step"] for r in resumed.history if "loss" in r] == [4, 6]


@pytest.mark.slow
def test_finetune_lowers_cross_entropy_and_writes_metrics(tmp_path):
  model = Model.from_name("demo_draft", vocab_size=VOCAB)
  config = _config(tmp_path, 60, batch_size=8, optimizer="adamw", learning_rate=3e-3,
                   warmup_steps=0, decay_steps=60, save_every=30, log_every=10)
  calls = []
  result = trainer_lib.finetune(config, model, trainer_lib.SyntheticData(8, vocab_size=VOCAB),
                      eval_fn=lambda p, s: calls.append(s) or {"x": 1.0})
  losses = [r["loss"] for r in result.history if "loss" in r]
  assert losses[-1] < losses[0] - 0.5
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  for key in ("loss", "tokens_per_s", "learning_rate", "source_count/fixed", "step"):
    assert key in records[0]
  assert os.listdir(tmp_path / "tensorboard")
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [30, 60]
  assert calls == []  # eval_every == 0: never called


@pytest.mark.slow
def test_on_policy_distillation_lowers_tvd_and_raises_tau(tmp_path):
  target = Model.from_name("tiny_encoder_decoder", vocab_size=VOCAB)
  draft = Model.from_name("demo_draft", vocab_size=VOCAB)
  target_params = target.init(jax.random.PRNGKey(1))
  # A peaked ("trained-ish") fixed target: random init gives near-uniform next tokens.
  logits = target_params["decoder"]["logits_dense"]
  logits["kernel"] = logits["kernel"] * 4.0
  held_out = trainer_lib.SyntheticData(16, input_length=6, target_length=8, vocab_size=VOCAB,
                             seed=99).batch_at(0)
  tvd_eval = objectives.make_tvd_eval_fn(target, target_params, draft, held_out, max_new_tokens=8)
  spec_eval = objectives.make_speculative_eval_fn(target, target_params, draft, held_out,
                                         max_new_tokens=8, gamma=3)
  # On host copies, the trainer's placed params and the fresh ones below share each
  # evaluation program (a committed array's sharding is part of jit's cache key).
  eval_fn = lambda p, s: {**tvd_eval(jax.device_get(p), s), **spec_eval(jax.device_get(p), s)}
  init_key, _ = jax.random.split(jax.random.PRNGKey(0))  # the trainer's init key for seed 0
  before = eval_fn(draft.init(init_key), 0)
  config = _config(tmp_path, 100, batch_size=8, optimizer="adamw", learning_rate=5e-3,
                   warmup_steps=0, decay_steps=100, save_every=1000, log_every=50,
                   eval_every=100)
  data = trainer_lib.SyntheticData(8, input_length=6, target_length=8, vocab_size=VOCAB)
  result = trainer_lib.distill(config, target, target_params, draft, data,
                     objectives.DistillationConfig.from_recipe("gkd"), eval_fn=eval_fn)
  after = [r for r in result.history if "eval/tau" in r][-1]
  assert all(r["source_total/draft"] == r["step"] for r in result.history if "loss" in r)
  assert after["eval/tvd_on_target_samples"] < before["tvd_on_target_samples"] - 0.1
  assert after["eval/tvd_on_draft_samples"] < before["tvd_on_draft_samples"] - 0.1
  assert after["eval/tau"] > before["tau"]


@pytest.mark.slow
def test_model_dir_with_another_models_checkpoint(tmp_path):
  small = Model.from_name("demo_draft", vocab_size=VOCAB)
  trainer_lib.finetune(_config(tmp_path, 3), small, trainer_lib.SyntheticData(4, vocab_size=VOCAB))
  other = Model.from_name("demo_draft", vocab_size=VOCAB, emb_dim=32)
  with pytest.raises(ValueError) as error:
    trainer_lib.finetune(_config(tmp_path, 6), other, trainer_lib.SyntheticData(4, vocab_size=VOCAB))
  message = str(error.value)
  assert "another model shape" in message and "(64," in message and "(32," in message
  assert "fresh MODEL_DIR" in message


def test_batch_size_mismatch_and_missing_target(tmp_path):
  model = Model.from_name("demo_draft", vocab_size=VOCAB)
  with pytest.raises(ValueError, match="batch_size=4"):
    trainer_lib.finetune(_config(tmp_path / "a", 2), model, trainer_lib.SyntheticData(2, vocab_size=VOCAB))
  target, _, draft = _pair()
  with pytest.raises(ValueError, match="frozen params"):
    trainer_lib.train(_config(tmp_path / "b", 2), objectives.DistillationObjective(target, draft),
            trainer_lib.SyntheticData(4, vocab_size=VOCAB))


def test_initial_checkpoint_path_and_restore_hook(tmp_path):
  model = Model.from_name("demo_draft", vocab_size=VOCAB)
  first = trainer_lib.finetune(_config(tmp_path / "a", 3), model, trainer_lib.SyntheticData(4, vocab_size=VOCAB))
  seen = []

  def restore_fn(path, abstract):
    seen.append(path)
    from distillspec_jax.training.checkpoints import restore_params
    return restore_params(path, abstract)

  config = _config(tmp_path / "b", 0, initial_checkpoint_path=str(tmp_path / "a"))
  second = trainer_lib.finetune(config, model, trainer_lib.SyntheticData(4, vocab_size=VOCAB),
                      restore_fn=restore_fn)
  assert seen == [str(tmp_path / "a")]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               first.state.params, second.state.params)


@pytest.mark.slow
def test_decoder_only_mixture_with_adaspec_hook(tmp_path):
  """Decoder-only pair (prompts from prefix-LM batches), all sources, AdaSPEC k = 0.5."""
  target = Model.from_name("tiny_decoder_only", vocab_size=VOCAB)
  draft = Model.from_name("tiny_decoder_only", vocab_size=VOCAB, num_decoder_layers=1)
  reference_params = draft.init(jax.random.PRNGKey(7))
  config = _config(tmp_path, 6, optimizer="adamw", learning_rate=3e-3, log_every=6)
  data = trainer_lib.SyntheticData(4, input_length=4, target_length=6, vocab_size=VOCAB,
                         decoder_only=True)
  result = trainer_lib.distill(config, target, target.init(jax.random.PRNGKey(1)), draft, data,
                     objectives.DistillationConfig(lambda1=0.34, lambda2=0.5, top_k_fraction=0.5),
                     reference=draft, reference_params=reference_params)
  record = result.history[-1]
  assert np.isfinite(record["loss"]) and record["loss"] <= record["divergence"]
  assert 0.3 < record["kept_fraction"] < 0.8
  assert sum(record[f"source_total/{s}"] for s in objectives.SOURCES) == 6


def test_model_dir_written_with_another_optimizer(tmp_path):
  # Written with the other tests' adafactor run (one compiled step for the module); the
  # adamw run is refused when it restores, before it compiles a step of its own.
  model = Model.from_name("demo_draft", vocab_size=VOCAB)
  trainer_lib.finetune(_config(tmp_path, 3), model, trainer_lib.SyntheticData(4, vocab_size=VOCAB))
  with pytest.raises(ValueError, match="optimizer state does not match"):
    trainer_lib.finetune(_config(tmp_path, 6, optimizer="adamw"), model,
               trainer_lib.SyntheticData(4, vocab_size=VOCAB))


@pytest.mark.integration  # a process of its own: torch may be loaded in this one already
def test_summary_writer_loads_without_torch_and_writes_readable_scalars(tmp_path):
  import importlib.util
  import subprocess
  import sys
  import tensorflow as tf
  if importlib.util.find_spec("torch") is None:  # found, not imported (seconds of CPU)
    pytest.skip("torch is not installed (the `reference` extra)")
  # Still importable afterwards: find_spec finds nothing while sys.modules blocks torch
  # (None); importing it would cost seconds of CPU and check no more.
  script = ("import sys, importlib.util; from distillspec_jax.training import metrics_log; "
            "w = metrics_log.summary_writer(sys.argv[1]); w.add_scalar('loss', 0.25, 3); "
            "w.close(); assert 'torch' not in sys.modules, 'torch was imported'; "
            "spec = importlib.util.find_spec('torch'); print('torch', spec.origin)")
  done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                        text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "torch " in done.stdout  # still importable afterwards
  (events,) = tmp_path.iterdir()
  scalars = [(e.step, v.tag, v.simple_value) for e in tf.compat.v1.train.summary_iterator(
      str(events)) for v in e.summary.value]
  assert scalars == [(3, "loss", 0.25)]
