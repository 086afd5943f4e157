"""The train binary starts from Hugging Face and T5X checkpoints (INITIAL/TARGET_CHECKPOINT_PATH)
and refuses a bad path before MODEL_DIR is touched (exit status 2, the macro named)."""

import os

import gin
import jax
import numpy as np
import pytest

from distillspec_jax import gin_utils
from distillspec_jax import train
from distillspec_jax.distill.objectives import FinetuneObjective
from distillspec_jax.interop import hf_t5
from distillspec_jax.interop import importer
from distillspec_jax.interop import t5x as t5x_lib
from distillspec_jax.models.model import Model
from distillspec_jax.training.trainer import SyntheticData


# gin/runs/finetune_tiny.gin trains this model: tiny_encoder_decoder with vocab_size 64.
MODEL = Model.from_name("tiny_encoder_decoder", vocab_size=64)
FINETUNE = ["--gin_file=gin/runs/finetune_tiny.gin", "--gin.TrainConfig.progress_bar=False",
            "--gin.LOG_EVERY=1"]


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random T5 1.1 of the gin model's shape, saved by transformers (safetensors)."""
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  transformers = pytest.importorskip("transformers",
                                     reason="transformers (extra 'reference') is not installed")
  c = MODEL.config
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(
      vocab_size=c.vocab_size, d_model=c.emb_dim, d_kv=c.head_dim, d_ff=c.mlp_dim,
      num_layers=c.num_encoder_layers, num_decoder_layers=c.num_decoder_layers,
      num_heads=c.num_heads, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
  # T5 1.1 has its own logits layer (transformers 5 ties it to `shared` regardless).
  model.lm_head.weight = torch.nn.Parameter(torch.randn(c.vocab_size, c.emb_dim) * 0.3)
  path = str(tmp_path_factory.mktemp("hf") / "t5")
  model.save_pretrained(path, safe_serialization=True)
  assert "lm_head.weight" in hf_t5.read_hf_shapes(path)  # the untied layer was written
  return path


@pytest.fixture(scope="module")
def t5x_dir(tmp_path_factory):
  """Parameters of the gin model in T5X's layout (a MODEL_DIR of checkpoint_<step>)."""
  path = str(tmp_path_factory.mktemp("t5x"))
  t5x_lib.save_t5x(MODEL.init(jax.random.PRNGKey(7)), path, step=5)
  return path


def _step_one_loss(params) -> float:
  """The loss the binary's first step sees: batch 0 of finetune_tiny.gin's synthetic data."""
  batch = SyntheticData(8, input_length=8, target_length=8, vocab_size=64, seed=0).batch_at(0)
  loss, _ = jax.jit(FinetuneObjective(MODEL).loss)(params, {}, batch)
  return float(loss)


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["hf", "t5x"])
def test_train_binary_finetunes_from_an_imported_checkpoint(fmt, tmp_path, request):
  path = request.getfixturevalue(f"{fmt}_dir")
  assert importer.detect_format(path) == fmt
  imported, _ = importer.load_checkpoint(path, MODEL.config)
  result = train.main(FINETUNE + [f"--gin.MODEL_DIR={tmp_path / 'run'}", "--gin.TRAIN_STEPS=2",
                                  f"--gin.INITIAL_CHECKPOINT_PATH={path}"])
  assert int(result.state.step) == 2
  first = result.history[0]
  assert first["step"] == 1
  # Step 1's loss is computed before its update: from the starting parameters.
  expected = _step_one_loss(imported)
  np.testing.assert_allclose(first["loss"], expected, rtol=1e-5)
  fresh = _step_one_loss(MODEL.init(jax.random.PRNGKey(0)))  # what a random start would give
  assert abs(fresh - expected) > 1e-3
  assert os.path.isdir(tmp_path / "run" / "2" / "params")  # trained on, saved in our format


@pytest.mark.integration
def test_train_binary_distills_towards_a_hugging_face_target(hf_dir, tmp_path, monkeypatch):
  """TARGET_CHECKPOINT_PATH in HF format: the trainer's frozen target is the imported model."""
  from distillspec_jax.training import trainer
  seen = {}
  original = trainer.distill

  def spy(config, target, target_params, *args, **kwargs):
    seen["target_params"] = jax.device_get(target_params)
    return original(config, target, target_params, *args, **kwargs)

  monkeypatch.setattr(trainer, "distill", spy)
  result = train.main(["--gin_file=gin/runs/distill_tiny.gin",
                       "--gin_file=gin/recipes/supervised_kd.gin",
                       "--gin.TrainConfig.progress_bar=False", "--gin.EVAL_EVERY=0",
                       f"--gin.MODEL_DIR={tmp_path / 'run'}", "--gin.TRAIN_STEPS=1",
                       f"--gin.TARGET_CHECKPOINT_PATH={hf_dir}"])
  assert int(result.state.step) == 1
  imported, _ = importer.load_checkpoint(hf_dir, MODEL.config)
  flat = jax.tree_util.tree_flatten_with_path(imported)[0]
  assert len(flat) == len(jax.tree.leaves(seen["target_params"]))
  for path, value in flat:
    got = seen["target_params"]
    for key in path:
      got = got[key.key]
    np.testing.assert_array_equal(got, value, err_msg=jax.tree_util.keystr(path))


def _bad_paths(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "weights.txt").write_text("not a checkpoint")
  other = str(tmp_path / "other_t5x")  # another model: mlp_dim 96 instead of 128
  other_model = Model.from_name("tiny_encoder_decoder", vocab_size=64, mlp_dim=96)
  t5x_lib.save_t5x(other_model.init(jax.random.PRNGKey(0)), other, step=1)
  return {"missing": (str(tmp_path / "nowhere"), "does not exist"),
          "unknown format": (str(empty), "Cannot tell the checkpoint format"),
          "other shapes": (other, "mlp/wi_0/kernel: checkpoint shape (64, 96) vs model shape "
                                  "(64, 128)")}


@pytest.mark.integration
@pytest.mark.parametrize("case", ["missing", "unknown format", "other shapes"])
@pytest.mark.parametrize("macro", ["INITIAL_CHECKPOINT_PATH", "TARGET_CHECKPOINT_PATH"])
def test_bad_checkpoint_path_fails_before_model_dir_is_written(case, macro, tmp_path):
  path, reason = _bad_paths(tmp_path)[case]
  model_dir = tmp_path / "run"
  argv = [f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=2", f"--gin.{macro}={path}"]
  if macro == "TARGET_CHECKPOINT_PATH":  # distil_tiny's target is the gin model above
    argv = ["--gin_file=gin/runs/distill_tiny.gin"] + argv
  else:
    argv = FINETUNE + argv
  with pytest.raises(gin_utils.GinConfigError) as error:
    train.main(argv)
  message = str(error.value)
  assert f"{macro}={path!r}" in message and reason in message
  assert "Fix: point --gin." + macro in message
  assert "\n" not in message  # one paragraph
  assert not os.path.exists(model_dir / "config.gin") and not os.path.exists(model_dir)


@pytest.mark.integration
def test_distillation_without_a_target_path_fails_before_model_dir_is_written(tmp_path):
  with pytest.raises(gin_utils.GinConfigError, match="TARGET_CHECKPOINT_PATH"):
    train.main(["--gin_file=gin/runs/distill_tiny.gin", f"--gin.MODEL_DIR={tmp_path / 'run'}",
                "--gin.TRAIN_STEPS=2"])
  assert not os.path.exists(tmp_path / "run")


def test_hf_config_that_changes_the_function_is_refused(hf_dir, tmp_path):
  """Same shapes, another relative-position range: loading would give other logits."""
  with pytest.raises(ValueError, match="relative_attention_max_distance=128, the model 64"):
    importer.check_checkpoint(hf_dir, MODEL.config.replace(relative_attention_max_distance=64))
  assert importer.check_checkpoint(hf_dir, MODEL.config) == "hf"


@pytest.mark.integration
def test_bad_path_exits_with_status_1_and_no_traceback(tmp_path, capsys):
  """Through the binary's command-line path (`cli`, as `python -m` runs it; the process itself
  is run by tests/test_bad_inputs.py)."""
  import testing
  model_dir = tmp_path / "run"
  testing.assert_refused_before_work(
      train.cli, ["--gin_file=gin/runs/finetune_tiny.gin", f"--gin.MODEL_DIR={model_dir}",
                  "--gin.TRAIN_STEPS=2", f"--gin.INITIAL_CHECKPOINT_PATH={tmp_path / 'nowhere'}"],
      f"INITIAL_CHECKPOINT_PATH='{tmp_path / 'nowhere'}' cannot start this run: "
      f"'{tmp_path / 'nowhere'}' does not exist", model_dir, capsys)
