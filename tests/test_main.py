"""The main binary rejects bad run files, bindings and MODEL_DIRs before any training."""

import gin
import pytest

from distillspec_jax import gin_utils, main


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_unknown_run_file_is_named():
  with pytest.raises(gin_utils.GinConfigError, match="gin/runs/dmeo.gin"):
    main.main(["--gin_file=gin/runs/dmeo.gin"])


def test_binding_to_a_name_that_does_not_exist():
  with pytest.raises(gin_utils.GinConfigError, match="bogus_field"):
    main.main(["--gin_file=gin/runs/demo.gin", "--gin.PipelineConfig.bogus_field=3"])


def test_unwritable_model_dir(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match="MODEL_DIR="):
    main.main(["--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={blocker}/run"])
