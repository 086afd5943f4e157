"""Gin files and the binary: model files equal the presets, recipes, errors, end to end."""

import glob
import json
import os

import gin
import pytest

from distillspec_jax import gin_utils
from distillspec_jax import train
from distillspec_jax.models.config import MODEL_CONFIGS
from distillspec_jax.models.model import Model


ROOT = gin_utils.REPO_ROOT


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _resolve(files, bindings=()):
  train.register_configurables()
  gin_utils.parse_gin(files, list(bindings))
  return train.resolve()


BASE = ["MODEL_DIR = '/tmp/unused'", "TRAIN_STEPS = 1"]


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_each_gin_model_file_equals_the_preset(name):
  path = os.path.join(ROOT, "gin", "models", f"{name}.gin")
  gin_utils.parse_gin([path], [])
  with gin.config_scope(name):
    built = gin.get_configurable("model_by_name")()
  assert built.config == MODEL_CONFIGS[name], (
      f"{path} differs from config.MODEL_CONFIGS[{name!r}]; if the preset changed on purpose, "
      "regenerate with `python -m distillspec_jax.gin_utils --write_model_gin`.")
  # Every field is spelled out in the file (not inherited silently from the preset).
  text = open(path).read()
  for field in ("vocab_size", "emb_dim", "num_heads", "num_decoder_layers", "head_dim",
                "mlp_dim"):
    assert f"{name}/model_by_name.{field} =" in text


def test_published_t5_shapes():
  small, xxl = MODEL_CONFIGS["t5_1_1_small"], MODEL_CONFIGS["t5_1_1_xxl"]
  assert (small.emb_dim, small.num_heads, small.num_decoder_layers, small.mlp_dim) == (
      512, 6, 8, 1024)
  assert (xxl.emb_dim, xxl.num_heads, xxl.num_decoder_layers, xxl.mlp_dim) == (
      4096, 64, 24, 10240)


@pytest.mark.parametrize("recipe,lambda1,lambda2,divergence", [
    ("supervised_kd", 1.0, 0.0, "fkl"), ("seqkd", 0.0, 0.0, "fkl"),
    ("imitkd", 0.5, 1.0, "fkl"), ("fdistill", 0.0, 0.5, "tvd"), ("gkd", 0.0, 1.0, "fkl")])
def test_recipes(recipe, lambda1, lambda2, divergence):
  spec = _resolve(["gin/runs/distill_tiny.gin", f"gin/recipes/{recipe}.gin"], BASE)
  c = spec.distillation_config
  assert (c.lambda1, c.lambda2, c.divergence) == (lambda1, lambda2, divergence)
  assert (c.target_temperature, c.draft_temperature, c.sampling_temperature) == (1.0, 1.0, 1.0)
  gin.clear_config()
  spec = _resolve(["gin/runs/distill_tiny.gin", f"gin/recipes/{recipe}.gin"],
                  BASE + ["DIVERGENCE = 'rkl'"])
  assert spec.distillation_config.divergence == "rkl"


def test_paper_optimizer_defaults_and_demo_overrides():
  files, bindings, _, _ = gin_utils.parse_flags(
      ["--gin_file=gin/recipes/train_base.gin", "--gin.MODEL_DIR=/tmp/x",
       "--gin.TRAIN_STEPS=10", "--gin.MIXTURE_OR_TASK_NAME=synthetic_reverse",
       "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 8}",
       "--gin.run.mode='finetune'", "--gin.run.model=@tiny_encoder_decoder/model_by_name()",
       "--gin_file=gin/models/tiny_encoder_decoder.gin"])
  assert "MODEL_DIR = '/tmp/x'" in bindings  # bare words become strings
  spec = _resolve(files, bindings)
  t = spec.train_config
  assert (t.optimizer, t.learning_rate, t.warmup_steps, t.decay_steps, t.final_fraction,
          t.batch_size) == ("adafactor", 3e-4, 5000, 300000, 0.1, 32)
  gin.clear_config()
  demo = _resolve(["gin/runs/distill_demo.gin"], BASE).train_config
  assert (demo.optimizer, demo.batch_size) == ("adamw", 16)


@pytest.mark.parametrize("path", sorted(
    glob.glob(os.path.join(ROOT, "gin", "runs", "finetune_*.gin")) +
    glob.glob(os.path.join(ROOT, "gin", "runs", "distill_*.gin"))))
def test_every_trainer_run_file_resolves(path):
  if os.path.basename(path) == "distill_own_pair.gin":
    # Its models come from the checkpoints it is given (a tiny run: tests/test_own_pair.py).
    with pytest.raises(Exception, match=r"model_from_checkpoint.path=None is not a checkpoint"):
      _resolve([path], BASE)
    return
  spec = _resolve([path], BASE)
  assert spec.train_config.model_dir == "/tmp/unused"


@pytest.mark.parametrize("argv,needle", [
    (["--gin_file=gin/runs/distill_tny.gin"], "distill_tiny.gin"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.DistillationConfig.lambda3=2"],
     "lambda3"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x"], "TRAIN_STEPS"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.TRAIN_STEPS=3"], "MODEL_DIR"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.demo_draft/model_by_name.name=t5_small"], "t5_1_1_small"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.LAMBDA1=1.5"], "lambda1=1.5"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.demo_draft/model_by_name.vocab_size=128"], "vocab_size=128"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.DIVERGENCE=kl"], "'kl'"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.BETA=1.0"], "beta=1.0"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.LK_S=0.0"], "s=0.0 must lie in (0, 1]"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.LK_ETA=-1.0"], "eta=-1.0 must be finite and >= 0"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--gin.MODEL_DIR=/tmp/x", "--gin.TRAIN_STEPS=3",
      "--gin.POSITION_WEIGHTING='reach'"], "'reach'"),
    (["--gin_file=gin/runs/distill_tiny.gin", "--bogus"], "--bogus"),
])
@pytest.mark.integration
def test_bad_configuration_fails_before_training(argv, needle):
  with pytest.raises(gin_utils.GinConfigError) as error:
    train.main(argv)
  assert needle in str(error.value)


def test_library_modules_do_not_import_gin():
  for path in glob.glob(os.path.join(ROOT, "distillspec_jax", "*.py")):
    if os.path.basename(path) in ("gin_utils.py", "train.py", "main.py", "eval.py"):  # binaries
      continue
    text = open(path).read()
    assert "import gin" not in text, path


@pytest.mark.integration
def test_binary_finetune_then_distill_then_resume(tmp_path):
  # A few steps each: compiling the steps is the cost, and every check needs only a
  # checkpoint, an evaluation and a logged step on each side of the restart.
  target_dir, draft_dir = str(tmp_path / "target"), str(tmp_path / "draft")
  train.main(["--gin_file=gin/runs/finetune_tiny.gin", f"--gin.MODEL_DIR={target_dir}",
              "--gin.TRAIN_STEPS=4", "--gin.TrainConfig.progress_bar=False"])
  assert os.path.isdir(os.path.join(target_dir, "4", "params"))
  gin.clear_config()
  argv = ["--gin_file=gin/runs/distill_tiny.gin", f"--gin.MODEL_DIR={draft_dir}",
          f"--gin.TARGET_CHECKPOINT_PATH={target_dir}", "--gin.EVAL_EVERY=2",
          "--gin.TrainConfig.progress_bar=False", "--gin.SAVE_EVERY=2", "--gin.LOG_EVERY=2"]
  train.main(argv + ["--gin.TRAIN_STEPS=2"])
  gin.clear_config()
  result = train.main(argv + ["--gin.TRAIN_STEPS=4"])  # resumes at 2
  assert int(result.state.step) == 4
  records = [json.loads(l) for l in open(os.path.join(draft_dir, "metrics.jsonl"))]
  assert any("eval/tau" in r for r in records)
  train_records = [r for r in records if "loss" in r]
  assert [r["step"] for r in train_records] == [2, 4]  # one record each side of the restart
  assert train_records[-1]["source_total/draft"] == 2  # counted since the restart
  assert os.path.isfile(os.path.join(draft_dir, "config.gin"))


PRECISION = ["REMAT_POLICY = 'full'", "ACTIVATION_DTYPE = 'bfloat16'",
             "TARGET_PARAM_DTYPE = 'bfloat16'", "PrecisionConfig.target_remat_policy = 'minimal'"]


def test_precision_macros_reach_the_train_binarys_models():
  """ACTIVATION_DTYPE, REMAT_POLICY, TARGET_PARAM_DTYPE bind run.precision (PrecisionConfig),
  which sets both models' TransformerConfig; the defaults leave them float32, no remat."""
  spec = _resolve(["gin/runs/distill_tiny.gin"], BASE)
  for model in (spec.model, spec.target):
    assert (model.config.dtype, model.config.remat_policy) == ("float32", "none")
  assert spec.precision.target_param_dtype is None
  gin.clear_config()
  spec = _resolve(["gin/runs/distill_tiny.gin"], BASE + PRECISION)
  assert (spec.model.config.dtype, spec.model.config.remat_policy) == ("bfloat16", "full")
  assert (spec.target.config.dtype, spec.target.config.remat_policy) == ("bfloat16", "minimal")
  assert spec.precision.target_param_dtype == "bfloat16"
  # A fine-tuning run has one model and no frozen target: a pair's setting is refused.
  gin.clear_config()
  with pytest.raises(gin_utils.GinConfigError, match="PrecisionConfig.target_param_dtype="
                     "'bfloat16': a fine-tuning run trains one model"):
    _resolve(["gin/runs/finetune_tiny.gin"], BASE + ["TARGET_PARAM_DTYPE = 'bfloat16'"])


def test_precision_macros_reach_the_main_jobs_and_the_eval_binarys_models():
  from distillspec_jax import eval as eval_lib
  from distillspec_jax import main as main_lib
  from distillspec_jax.studies import pipeline
  demo = main_lib.load_pipeline(["--gin_file=gin/runs/demo.gin", "--gin.MODEL_DIR=/tmp/unused"])
  assert [(m.config.dtype, m.config.remat_policy) for m in pipeline.models(demo, 256)] == [
      ("float32", "none")] * 2
  assert demo.precision.target_param_dtype is None
  gin.clear_config()
  flags = [f"--gin_bindings={binding}" for binding in PRECISION]
  config = main_lib.load_pipeline(["--gin_file=gin/runs/demo.gin",
                                   "--gin.MODEL_DIR=/tmp/unused"] + flags)
  target, draft = pipeline.models(config, 256)
  assert (target.config.dtype, target.config.remat_policy) == ("bfloat16", "minimal")
  assert (draft.config.dtype, draft.config.remat_policy) == ("bfloat16", "full")
  assert config.precision.target_param_dtype == "bfloat16"
  gin.clear_config()  # the paper runs' shared settings (paper_base.gin)
  paper = main_lib.load_pipeline(["--gin_file=gin/runs/paper_gsm8k.gin",
                                  "--gin.MODEL_DIR=/tmp/unused"]).precision
  assert (paper.activation_dtype, paper.remat_policy, paper.target_param_dtype) == (
      "float32", "minimal", "bfloat16")
  gin.clear_config()
  assert eval_lib.load_config(["--gin_file=gin/runs/eval_demo.gin"]).precision == (
      eval_lib.PrecisionConfig())  # the models as their checkpoints have them
  gin.clear_config()
  config = eval_lib.load_config(["--gin_file=gin/runs/eval_demo.gin",
                                 "--gin.TARGET_PARAM_DTYPE=bfloat16",
                                 "--gin.PrecisionConfig.activation_dtype=bfloat16"])
  target = config.precision.apply(Model.from_name("demo_target"), "target")
  assert (target.config.dtype, config.precision.target_param_dtype) == ("bfloat16", "bfloat16")
