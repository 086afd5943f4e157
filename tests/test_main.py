"""The main binary rejects bad run files, bindings and MODEL_DIRs before any training."""

import gin
import pytest

from distillspec_jax import gin_utils
from distillspec_jax import main


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.integration
def test_unknown_run_file_is_named():
  with pytest.raises(gin_utils.GinConfigError, match="gin/runs/dmeo.gin"):
    main.main(["--gin_file=gin/runs/dmeo.gin"])


@pytest.mark.integration
def test_binding_to_a_name_that_does_not_exist():
  with pytest.raises(gin_utils.GinConfigError, match="bogus_field"):
    main.main(["--gin_file=gin/runs/demo.gin", "--gin.PipelineConfig.bogus_field=3"])


@pytest.mark.integration
def test_unwritable_model_dir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match="MODEL_DIR="):
    main.main(["--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={blocker}/run"])


MAIN_RUN_FILES = ["gin/runs/demo.gin", "gin/runs/adaspec_compare.gin", "gin/runs/paper_xsum.gin",
                  "gin/runs/paper_cnn_dailymail.gin", "gin/runs/paper_gsm8k.gin",
                  "gin/runs/paper_wmt_en_de.gin", "gin/runs/paper_bbh.gin",
                  "gin/runs/paper_lm1b.gin", "gin/runs/adaspec_gsm8k.gin"]


@pytest.mark.parametrize("run_file", MAIN_RUN_FILES)
def test_every_main_run_file_builds_its_pipeline(run_file):
  config = main.load_pipeline([f"--gin_file={run_file}", "--gin.MODEL_DIR=/tmp/unused"])
  assert config.run_dir == "/tmp/unused" and config.recipes
  if "paper" in run_file:
    assert (config.optimizer, config.learning_rate, config.warmup_steps, config.decay_steps,
            config.batch_size) == ("adafactor", 3e-4, 5000, 300000, 32)
  if run_file.endswith("lm1b.gin"):
    assert config.feature_converter == "decoder"


def test_paper_run_file_needs_a_model_dir():
  with pytest.raises(gin_utils.GinConfigError, match="MODEL_DIR is not set"):
    main.load_pipeline(["--gin_file=gin/runs/paper_xsum.gin"])


def test_own_pair_run_file_takes_the_pair_from_the_checkpoints():
  flags = ["--gin_file=gin/runs/own_pair_gsm8k.gin", "--gin.MODEL_DIR=/tmp/unused"]
  with pytest.raises(gin_utils.GinConfigError, match="TARGET_MODEL=None needs "
                                                     "TARGET_CHECKPOINT_PATH"):
    main.load_pipeline(flags)
  config = main.load_pipeline(flags + ["--gin.TARGET_CHECKPOINT_PATH='t'",
                                       "--gin.DRAFT_CHECKPOINT_PATH='d'",
                                       "--gin.VOCABULARY='t'"])
  assert (config.target_model, config.draft_model, config.pair.vocabulary) == (None, None, "t")
  assert not config.pair.finetune_target and config.teacher_cache_k is None


def test_own_pair_chat_run_file_renders_conversations_with_the_vocabulary():
  flags = ["--gin_file=gin/runs/own_pair_chat.gin", "--gin.MODEL_DIR=/tmp/unused",
           "--gin.TARGET_CHECKPOINT_PATH='t'", "--gin.DRAFT_CHECKPOINT_PATH='d'"]
  with pytest.raises(gin_utils.GinConfigError, match=r"CHAT_TEMPLATE=True .* set VOCABULARY"):
    main.load_pipeline(flags)
  config = main.load_pipeline(flags + ["--gin.VOCABULARY='t'"])
  assert (config.task, config.pair.chat_template, config.pair.vocabulary) == (
      "chat_files", True, "t")
