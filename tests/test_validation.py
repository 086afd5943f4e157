"""core/validation.py, the one validation module, and the configs and binaries that use it:
every refusal names the field or macro and the fix, before work starts; nothing coerces."""

import math
import os

import gin
import numpy as np
import pytest

from distillspec_jax import eval as eval_lib
from distillspec_jax import gin_utils
from distillspec_jax import main as main_lib
from distillspec_jax.core import validation
from distillspec_jax.decoding.plain import SamplingConfig
from distillspec_jax.decoding.speculative import DraftLength, Lenience
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig
from distillspec_jax.studies.garden import GardenConfig
from distillspec_jax.studies.pipeline import PipelineConfig
from distillspec_jax.studies.recipe_grid import RecipeGridConfig
from distillspec_jax.training.partitioning import MeshConfig


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


# --- the checks themselves ---------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("3", r"n='3' must be an integer >= 0 \(got str\)"), (True, "n=True is a bool"),
    (2.0, r"n=2.0 must be an integer >= 0 \(got float\)"), (-1, "n=-1 must be an integer >= 0")])
def test_check_int_refuses_what_is_not_a_count(value, message):
  with pytest.raises(ValueError, match=message):
    validation.check_int(value, "n", 0)


def test_check_int_takes_numpy_integers():
  assert validation.check_int(np.int64(3), "n", 1) == 3 and validation.check_positive_int(1, "n")


@pytest.mark.parametrize("value, kwargs, message", [
    (1.5, {}, r"p=1.5 must lie in \[0, 1\]"), (0.0, dict(zero=False), r"must lie in \(0, 1\]"),
    (1.0, dict(one=False), r"must lie in \[0, 1\)"), (True, {}, "p=True is not a number"),
    ("0.5", {}, "p='0.5' is not a number"), (math.nan, {}, "p=nan is not finite")])
def test_check_probability(value, kwargs, message):
  with pytest.raises(ValueError, match=message):
    validation.check_probability(value, "p", **kwargs)
  assert validation.check_probability(1, "p") == 1.0


def test_check_grid_and_budget():
  with pytest.raises(ValueError, match=r"gammas=\(\) is empty"):
    validation.check_grid((), (0.0,))
  with pytest.raises(ValueError, match="gamma=True is a bool"):
    validation.check_grid((True,), (0.0,))
  with pytest.raises(ValueError, match=r"temperatures=\(\) is empty"):
    validation.check_grid((3,), ())
  for bad in (-1, True, "5", math.inf):
    with pytest.raises(ValueError, match="budget_s=.*: pass the seconds"):
      validation.check_budget(bad)
  assert validation.check_budget(np.float32(2)) == 2.0


def test_check_path(tmp_path):
  with pytest.raises(ValueError, match=r"VOCABULARY='.*nope.model' does not exist; pass it"):
    validation.check_path(str(tmp_path / "nope.model"), "VOCABULARY", kind="file", fix="pass it")
  with pytest.raises(ValueError, match="DATA_DIR=.* is not a directory"):
    (tmp_path / "a_file").write_text("x")
    validation.check_path(str(tmp_path / "a_file"), "DATA_DIR", kind="dir")
  assert validation.check_path("gs://bucket/model", "X", kind="file") == "gs://bucket/model"


def test_check_finite_names_the_row_and_key():
  validation.check_finite([{"tau": 2.0, "range": [1.0, 3.0]}], "report")
  with pytest.raises(ValueError, match="report: the row .* has a non-finite range"):
    validation.check_finite([{"tau": 2.0, "range": [1.0, math.inf]}], "report")


# --- every config dataclass --------------------------------------------------------------------


@pytest.mark.parametrize("value, fix", [
    ("3", r"Write the number without quotes"), (True, "A bool is not taken as a number")])
def test_pipeline_config_refuses_a_quoted_or_bool_count(tmp_path, value, fix):
  for field in ("target_steps", "eval_examples"):
    with pytest.raises(TypeError, match=rf"PipelineConfig.{field}={value!r} .*{fix}.* "
                                        rf"Set PipelineConfig.{field}"):
      PipelineConfig(run_dir=str(tmp_path), **{field: value})
  with pytest.raises(TypeError, match=rf"SpeedConfig.calls={value!r} .*{fix}.* "
                                      r"Set SpeedConfig.calls"):
    SpeedConfig(calls=value)


@pytest.mark.parametrize("make, field", [
    (lambda d: GardenConfig(run_dir=d, middle_steps="2"), "GardenConfig.middle_steps='2'"),
    (lambda d: RecipeGridConfig(run_dir=d, distill_steps=True),
     "RecipeGridConfig.distill_steps=True"),
    (lambda d: eval_lib.EvalConfig(model_dir=d, mixture_or_task_name="t",
                                   target_checkpoint_path="a", draft_checkpoint_path="b",
                                   task_feature_lengths={"targets": 4}, max_new_tokens="4"),
     "EvalConfig.max_new_tokens='4'"),
    (lambda d: SpeedConfig(cpus=True), "SpeedConfig.cpus=True"),
    (lambda d: MeshConfig(model_parallel=2.0), "MeshConfig.model_parallel=2.0"),
    (lambda d: DecodingGrid(draft_length=DraftLength(threshold="0.5")),
     "DraftLength.threshold='0.5'"),
    (lambda d: PipelineConfig(run_dir=d, speed=(3, 2)), "PipelineConfig.speed=\\(3, 2\\) must "
     "be a SpeedConfig"),
    (lambda d: Lenience("lin", True), "Lenience.epsilon=True"),
    (lambda d: SamplingConfig("1.0"), "SamplingConfig.temperature='1.0'"),
    (lambda d: SpeedConfig(repeats="7"), "SpeedConfig.repeats='7'")])
def test_every_config_dataclass_checks_its_field_types(tmp_path, make, field):
  with pytest.raises(TypeError, match=field):
    make(str(tmp_path))


def test_one_speed_config_for_the_main_job_and_the_eval_binary(tmp_path):
  speed = SpeedConfig(examples=3, repeats=2, calls=4, budget_s=1.5, cpus=0)
  assert PipelineConfig(run_dir=str(tmp_path), speed=speed).speed is speed
  assert speed.measure_kwargs() == dict(repeats=2, timed_per_turn=4, budget_s=1.5)
  assert eval_lib.EvalConfig(
      model_dir="m", mixture_or_task_name="t", target_checkpoint_path="a",
      draft_checkpoint_path="b", task_feature_lengths={"targets": 4},
      speed=SpeedConfig(examples=0)).speed.examples == 0  # 0: the eval binary does not time
  for changes, message in ((dict(calls=0), "SpeedConfig.calls=0 must be an integer >= 1"),
                           (dict(cpus=-1), "SpeedConfig.cpus=-1 must be an integer >= 0"),
                           (dict(budget_s=math.inf), "SpeedConfig.budget_s=inf: pass the "
                                                     "seconds")):
    with pytest.raises(ValueError, match=message):
      SpeedConfig(**changes)
  with pytest.raises(ValueError, match="SpeedConfig.examples.*=0 must be an integer >= 1"):
    PipelineConfig(run_dir=str(tmp_path), speed=SpeedConfig(examples=0))  # the main job times


def test_one_mesh_config_for_the_three_binaries():
  assert MeshConfig(4, 2) == MeshConfig(data_parallel=4, model_parallel=2)
  for changes, message in ((dict(data_parallel=0), "MeshConfig.data_parallel=0 must be"),
                           (dict(model_parallel=0), "MeshConfig.model_parallel=0 must be")):
    with pytest.raises(ValueError, match=message):
      MeshConfig(**changes)
  with pytest.raises(ValueError, match=r"MeshConfig.data_parallel=3 \(DATA_PARALLEL\), "
                                       r"MeshConfig.model_parallel=1 \(MODEL_PARALLEL\): "):
    MeshConfig(3, 1).make(devices=[object()] * 2)


def test_lenience_is_checked_by_the_engine_when_the_eval_config_is_made():
  with pytest.raises(ValueError, match="DecodingGrid.epsilons has 0: lenience epsilon=0 must "
                                       "lie in"):
    DecodingGrid(epsilons=(1.0, 0))
  with pytest.raises(ValueError, match=r"TASK_FEATURE_LENGTHS\['targets'\].*='44' must be"):
    eval_lib.EvalConfig(model_dir="m", mixture_or_task_name="t", target_checkpoint_path="a",
                        draft_checkpoint_path="b", task_feature_lengths={"targets": "44"})


# --- paths, before work starts -----------------------------------------------------------------


def test_pipeline_paths_are_checked(tmp_path):
  with pytest.raises(ValueError, match=r"DATA_DIR \(PipelineConfig.data_dir\)=.*nowhere' does "
                                       "not exist; pass the folder"):
    PipelineConfig(run_dir=str(tmp_path), data_dir=str(tmp_path / "nowhere")).check_inputs()
  with pytest.raises(ValueError, match=r"TARGET_CHECKPOINT_PATH .*=.*missing' does not exist; "
                                       "pass an existing checkpoint"):
    PipelineConfig(run_dir=str(tmp_path),
                   target_checkpoint_path=str(tmp_path / "missing")).check_inputs()
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match="DRAFT_CHECKPOINT_PATH .*Cannot tell the checkpoint "
                                       "format"):
    PipelineConfig(run_dir=str(tmp_path),
                   draft_checkpoint_path=str(tmp_path / "empty")).check_inputs()
  with pytest.raises(ValueError, match="reuse_run_dir=.* has no finished stage 'vocab'"):
    RecipeGridConfig(run_dir=str(tmp_path), reuse_run_dir=str(tmp_path)).check_inputs()


def _user_error(fn, argv, capsys) -> str:
  """stderr of `fn(argv)` run as the binaries run it, which must exit with status 1."""
  assert gin_utils.run_binary(fn, argv) == 1
  err = capsys.readouterr().err
  assert err.startswith("Error: ") and "Traceback" not in err
  return err


def test_the_binaries_exit_1_with_the_message(tmp_path, capsys):
  err = _user_error(eval_lib.main, ["--gin_file=gin/runs/eval_demo.gin",
                                    f"--gin.MODEL_DIR={tmp_path}/eval",
                                    f"--gin.VOCABULARY={tmp_path}/missing.model"], capsys)
  assert f"VOCABULARY='{tmp_path}/missing.model' does not exist" in err
  assert not os.path.exists(tmp_path / "eval")  # nothing was made
  demo = ["--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={tmp_path}/main"]
  err = _user_error(main_lib.prepare, demo + ["--gin.SpeedConfig.calls='3'"], capsys)
  assert "SpeedConfig.calls='3' is of type str" in err
  err = _user_error(main_lib.prepare, demo + ["--gin.SPEED_CALLS=True"], capsys)
  assert "SpeedConfig.calls=True is of type bool" in err
  err = _user_error(main_lib.prepare, demo + [f"--gin.DRAFT_CHECKPOINT_PATH={tmp_path}/no"],
                    capsys)
  assert f"DRAFT_CHECKPOINT_PATH (PipelineConfig.draft_checkpoint_path)='{tmp_path}/no' " \
         "does not exist" in err
  assert not os.path.exists(tmp_path / "main")


@pytest.mark.integration
def test_the_main_binary_exits_1_without_a_traceback(tmp_path, capsys):
  """Through the binary's command-line path (`cli`, as `python -m` runs it; the process itself
  is run by tests/test_bad_inputs.py and tests/test_help.py)."""
  import testing
  testing.assert_refused_before_work(
      main_lib.cli, ["--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={tmp_path}/run",
                     f"--gin.PipelineConfig.data_dir={tmp_path}/no_data"],
      f"DATA_DIR (PipelineConfig.data_dir)='{tmp_path}/no_data' does not exist",
      tmp_path / "run", capsys)
