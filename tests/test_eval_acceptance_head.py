"""The eval binary's side of the calibrated stop signal: a checkpoint of ours holding a draft
and its acceptance head loads as a Model with that head (its width from the stored shapes),
the loaded draft drives the head rule exactly as before saving, and DRAFT_LENGTH_SIGNAL
(DraftLength.signal) is checked with the other draft-length settings."""

import jax
import numpy as np
import pytest

from distillspec_jax import eval as eval_bin
from distillspec_jax.decoding.speculative import DraftLength, speculative_decode
from distillspec_jax.models.config_json import config_to_json
from distillspec_jax.training import checkpoints
from test_acceptance_signal import HEAD, _with_head
import test_eval
from test_speculative import _pair, _prompts

setup = test_eval.setup  # tiny checkpoints and the embedded vocabulary (a module fixture)
_config = test_eval._config


@pytest.mark.slow
def test_a_draft_with_its_head_round_trips_through_the_eval_loader(tmp_path):
  target, tp, draft, dp = _pair("encoder_decoder")
  model, params = _with_head(draft, dp)
  path = str(tmp_path / "head_draft")
  checkpoints.save_params(path, params, meta={"model_config": config_to_json(model.config)})
  loaded, loaded_params = eval_bin.load_model(path, "DRAFT_CHECKPOINT_PATH", None, None)
  assert loaded.acceptance_head == HEAD
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded_params)):
    np.testing.assert_array_equal(np.asarray(a), b)
  rule = DraftLength("confidence", 0.5, signal="acceptance_head")
  run = lambda m, p: speculative_decode(target, tp, m, p, max_new_tokens=8, gamma=4,
                                        draft_length=rule, **_prompts("encoder_decoder"))
  before, after = run(model, params), run(loaded, loaded_params)
  np.testing.assert_array_equal(before.tokens, after.tokens)
  np.testing.assert_array_equal(before.drafted, after.drafted)
  # A draft saved without a head still loads as one without.
  plain_path = str(tmp_path / "plain_draft")
  checkpoints.save_params(plain_path, dp, meta={"model_config": config_to_json(draft.config)})
  assert eval_bin.load_model(plain_path, "DRAFT_CHECKPOINT_PATH", None, None)[0].acceptance_head \
      is None


def test_the_signal_is_checked_with_the_rule():
  DraftLength("confidence", 0.5, signal="acceptance_head")
  with pytest.raises(ValueError, match="signal='acceptance_head' with rule 'fixed'"):
    DraftLength("fixed", 0.0, signal="acceptance_head")
  with pytest.raises((TypeError, ValueError), match="'entropy'"):
    DraftLength("confidence", 0.5, signal="entropy")


def test_the_run_file_reads_the_head_and_refuses_it_with_the_fixed_rule():
  from distillspec_jax import gin_utils
  gin_utils.clear()
  config = eval_bin.load_config(["--gin_file=gin/runs/eval_calibrated_demo.gin"])
  rule = config.grid.draft_length
  assert (rule.rule, rule.signal, rule.threshold) == ("confidence", "acceptance_head", 0.5)
  assert config.grid.gammas == (9,) and config.grid.temperatures == (0.0,)
  gin_utils.clear()
  with pytest.raises(gin_utils.GinConfigError, match="signal='acceptance_head' with rule 'fixed'"):
    eval_bin.load_config(["--gin_file=gin/runs/eval_calibrated_demo.gin",
                          "--gin.DRAFT_LENGTH_RULE='fixed'"])
  gin_utils.clear()


@pytest.mark.integration  # the binary's whole evaluation, timing included
def test_the_binary_drives_the_rule_with_the_loaded_head(setup, tmp_path):
  """A draft saved with its head (no stored config: inferred from the shapes) runs the head
  rule through the binary, rebuilt at the decode capacity with the head; at T = 0 its
  outputs are the target's."""
  import json
  from distillspec_jax.models.acceptance_head import AcceptanceHeadConfig
  from distillspec_jax.models.config import model_config
  from distillspec_jax.models.model import Model
  draft = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=256,
                             max_decode_length=32))
  model, params = draft.with_acceptance_head(draft.init(jax.random.PRNGKey(1)),
                                             AcceptanceHeadConfig(8), jax.random.PRNGKey(3))
  path = str(tmp_path / "head_draft")
  checkpoints.save_params(path, params)
  rule = DraftLength("confidence", 0.5, signal="acceptance_head")
  config = _config(setup, tmp_path / "run",
                   grid=dict(gammas=(3,), temperatures=(0.0,), draft_length=rule),
                   draft_checkpoint_path=path)
  (row,) = eval_bin.evaluate(config)["rows"]
  assert row["signal"] == "acceptance_head" and row["end_to_end_speedup"] is not None
  lines = [json.loads(line) for line in
           open(tmp_path / "run" / "inferences" / "embedded_arithmetic.jsonl")]
  by_decoder = {d: [x["prediction"] for x in lines if x["decoder"] == d]
                for d in ("target", "speculative")}
  assert by_decoder["target"] and by_decoder["target"] == by_decoder["speculative"]
