"""Checkpoints: round trip, keep-last-N, atomic saves, clear errors for another model."""

import os

import jax
import numpy as np
import optax
import pytest

from distillspec_jax.training import checkpoints
from distillspec_jax.models.model import Model


def _state(emb_dim=64):
  model = Model.from_name("demo_draft", vocab_size=64, emb_dim=emb_dim)
  params = model.init(jax.random.PRNGKey(0))
  opt_state = optax.adafactor(1e-3).init(params)
  return model, params, opt_state


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.slow
def test_round_trip_and_keep_last_n(tmp_path):
  _, params, opt_state = _state()
  ck = checkpoints.Checkpointer(str(tmp_path), save_every=2, keep=2)
  saved = [ck.save(step, params, opt_state, {"note": "x"}) for step in range(7)]
  assert saved == [True, False, True, False, True, False, True]
  ck.wait()
  assert ck.all_steps() == [4, 6]
  restored, restored_opt, meta = checkpoints.Checkpointer(str(tmp_path)).restore(
      6, checkpoints.abstract_like(params), checkpoints.abstract_like(opt_state))
  _equal(params, restored)
  _equal(jax.tree.leaves(opt_state), jax.tree.leaves(restored_opt))
  assert meta == {"note": "x", "step": 6}
  assert not [d for d in os.listdir(tmp_path) if "tmp" in d]  # nothing half-written left


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_meta_that_is_not_json_is_refused_before_the_save_starts(tmp_path):
  """The bad value is named, no step 2 appears (not even a temporary one), the previous step
  restores, and nothing is left running (no unraisable exception at exit)."""
  _, params, opt_state = _state()
  ck = checkpoints.Checkpointer(str(tmp_path), save_every=1)
  ck.save(1, params, opt_state)
  ck.wait()
  with pytest.raises(TypeError, match="'bad': <object object"):
    ck.save(2, params, opt_state, {"bad": object()})
  with pytest.raises(TypeError, match="'loss': nan"):
    ck.save(2, params, opt_state, {"loss": float("nan")})
  ck.close()
  assert sorted(os.listdir(tmp_path)) == ["1"]
  fresh = checkpoints.Checkpointer(str(tmp_path))
  assert fresh.latest_step() == 1
  restored, _, _ = fresh.restore(1, checkpoints.abstract_like(params), checkpoints.abstract_like(opt_state))
  _equal(params, restored)
  fresh.close()


def test_leftover_temporary_directory_is_ignored(tmp_path):
  """A process killed mid-save leaves `<step>.orbax-checkpoint-tmp-*`: never restored."""
  _, params, opt_state = _state()
  ck = checkpoints.Checkpointer(str(tmp_path), save_every=1)
  ck.save(3, params, opt_state)
  ck.close()
  partial = tmp_path / "5.orbax-checkpoint-tmp-1234567" / "params"
  partial.mkdir(parents=True)
  (partial / "garbage").write_bytes(b"\0" * 10)
  fresh = checkpoints.Checkpointer(str(tmp_path))
  assert fresh.latest_step() == 3
  restored = checkpoints.restore_params(str(tmp_path), checkpoints.abstract_like(params))
  _equal(params, restored)


def test_leftover_temporary_directories_are_removed_when_a_checkpointer_opens(tmp_path):
  """Both orbax spellings of an unfinished save are deleted; finalized steps are kept."""
  _, params, opt_state = _state()
  ck = checkpoints.Checkpointer(str(tmp_path), save_every=1)
  ck.save(3, params, opt_state)
  ck.close()
  leftovers = ["5.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1234567"]
  for name in leftovers:
    (tmp_path / name / "params").mkdir(parents=True)
    (tmp_path / name / "params" / "garbage").write_bytes(b"\0" * 10)
  fresh = checkpoints.Checkpointer(str(tmp_path), save_every=1)
  assert sorted(os.listdir(tmp_path)) == ["3"]
  assert fresh.removed_temporary == leftovers
  assert fresh.latest_step() == 3
  restored, _, _ = fresh.restore(3, checkpoints.abstract_like(params), checkpoints.abstract_like(opt_state))
  _equal(params, restored)
  fresh.save(4, params, opt_state)  # the manager still writes new steps there
  fresh.close()
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]


def test_restore_params_from_model_dir_or_step_dir(tmp_path):
  _, params, opt_state = _state()
  ck = checkpoints.Checkpointer(str(tmp_path / "run"), save_every=1)
  ck.save(7, params, opt_state)
  ck.close()
  _equal(params, checkpoints.restore_params(str(tmp_path / "run"), checkpoints.abstract_like(params)))
  _equal(params, checkpoints.restore_params(str(tmp_path / "run" / "7"), checkpoints.abstract_like(params)))
  checkpoints.save_params(str(tmp_path / "exported"), params)
  _equal(params, checkpoints.restore_params(str(tmp_path / "exported"), checkpoints.abstract_like(params)))
  with pytest.raises(FileNotFoundError, match="restore_fn"):
    checkpoints.restore_params(str(tmp_path / "nothing"), checkpoints.abstract_like(params))


def test_restore_without_shardings_gives_host_arrays_whatever_the_saved_devices(tmp_path):
  """Saved from the last device, restored without shardings: numpy arrays, not arrays on the
  saving device (which another process of a multi-process run would not hold)."""
  _, params, _ = _state()
  on_last = jax.device_put(params, jax.devices()[-1])
  checkpoints.save_params(str(tmp_path / "exported"), on_last)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  restored = checkpoints.restore_params(str(tmp_path / "exported"), abstract)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(restored))
  _equal(params, restored)


@pytest.mark.slow
def test_other_model_shape_is_a_clear_error(tmp_path):
  _, params, opt_state = _state(emb_dim=64)
  other_model, other_params, _ = _state(emb_dim=32)
  ck = checkpoints.Checkpointer(str(tmp_path), save_every=1)
  ck.save(1, params, opt_state)
  ck.close()
  with pytest.raises(ValueError) as error:
    checkpoints.Checkpointer(str(tmp_path)).check_compatible(1, other_model.param_shapes())
  message = str(error.value)
  assert "checkpoint shape (64" in message and "model shape (32" in message
  assert message.count("\n  ") <= 5  # only the first few mismatches
  with pytest.raises(ValueError, match="another model shape"):
    checkpoints.restore_params(str(tmp_path), checkpoints.abstract_like(other_params))


@pytest.mark.slow
def test_token_ids_with_stop_ids_round_trip_through_the_meta(tmp_path):
  """The trainer stores the model's TokenIds in the meta (dataclasses.asdict): the stop ids
  come back (as a JSON list; TokenIds.from_json makes the tuple), and meta written before
  the field existed reads as no stop ids (convert.py's check: T5's ids, not a tokenizer's)."""
  import dataclasses
  from distillspec_jax.models.model import NO_TOKEN, TokenIds
  _, params, opt_state = _state()
  tokens = TokenIds(eos_id=7, decoder_start_id=None, pad_id=NO_TOKEN, num_tokens=60,
                    stop_ids=(9, 11))
  older = {k: v for k, v in dataclasses.asdict(TokenIds()).items() if k != "stop_ids"}
  ck = checkpoints.Checkpointer(str(tmp_path / "new"))
  ck.save(1, params, opt_state, {"token_ids": dataclasses.asdict(tokens)}, force=True)
  ck.wait()
  assert TokenIds.from_json(checkpoints.read_meta(str(tmp_path / "new"))["token_ids"]) == tokens
  ck = checkpoints.Checkpointer(str(tmp_path / "old"))
  ck.save(1, params, opt_state, {"token_ids": older}, force=True)
  ck.wait()
  assert TokenIds.from_json(checkpoints.read_meta(str(tmp_path / "old"))["token_ids"]) == TokenIds()
