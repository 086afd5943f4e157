"""The main job's teacher_cache stage: wiring, the gin switch, bad settings, a killed stage."""

import os

import numpy as np
import pytest

from distillspec_jax import main as main_lib
from distillspec_jax.studies import pipeline
from distillspec_jax.distill import teacher_cache
from distillspec_jax.studies.pipeline import PipelineConfig


def _config(run_dir, **changes):
  fields = dict(run_dir=str(run_dir), recipes=("gkd", "supervised_kd"), teacher_cache_k=4)
  fields.update(changes)
  return PipelineConfig(**fields)


def test_stages_and_dependencies_with_the_cache(tmp_path):
  config = _config(tmp_path)
  assert config.stages == ("vocab", "target", "draft_raw", "teacher_cache", "distill_gkd",
                           "distill_supervised_kd", "evaluate", "report")
  assert config.dependencies("teacher_cache") == ("vocab", "target")
  assert "teacher_cache" in config.dependencies("distill_supervised_kd")
  assert "teacher_cache" not in config.dependencies("distill_gkd")  # runs the live target
  assert "teacher_cache" not in _config(tmp_path, teacher_cache_k=None).stages


def test_gin_switch_turns_it_on():
  argv = ["--gin_file=gin/runs/demo.gin", "--gin_file=gin/recipes/teacher_cache.gin",
          "--gin.TEACHER_CACHE_K=8"]
  config = main_lib.load_pipeline(argv)
  assert (config.teacher_cache_k, config.cached_recipes) == (8, ("supervised_kd",))


@pytest.mark.parametrize("changes,match", [
    (dict(teacher_cache_recipes=("gkd",)), "recipe 'gkd'.*samples from the draft"),
    (dict(teacher_cache_recipes=("seqkd",), recipes=("seqkd",)),
     "recipe 'seqkd'.*samples from the target"),
    (dict(teacher_cache_recipes=("imitkd",)), "'imitkd', which is not in recipes"),
    (dict(teacher_cache_k=0), "teacher_cache_k=0 must be an integer >= 1"),
])
def test_bad_cache_settings_are_refused(tmp_path, changes, match):
  with pytest.raises(ValueError, match=match):
    _config(tmp_path, **changes)


@pytest.mark.integration
def test_killed_stage_is_finished_by_the_rerun(tmp_path, monkeypatch):
  """A kill inside write_cache (here: an exception after shard 0) leaves no marker and no
  manifest; the rerun of the job reuses shard 0 and completes the cache."""
  config = _config(tmp_path, recipes=("supervised_kd",))
  target = pipeline.Model.from_name("demo_target", vocab_size=16, emb_dim=8, num_heads=1,
                                    head_dim=8, mlp_dim=8, num_encoder_layers=1,
                                    num_decoder_layers=1)
  params = teacher_cache.jax.tree.map(lambda s: np.ones(s.shape, s.dtype) * 0.01,
                                      target.param_shapes())
  rng = np.random.default_rng(0)
  arrays = {"encoder_input_tokens": rng.integers(2, 16, (10, 5)).astype(np.int32),
            "decoder_input_tokens": rng.integers(0, 16, (10, 4)).astype(np.int32),
            "decoder_target_tokens": rng.integers(1, 16, (10, 4)).astype(np.int32),
            "decoder_loss_weights": np.ones((10, 4), np.int32)}
  monkeypatch.setattr(pipeline, "models", lambda c: (target, None))
  monkeypatch.setattr(pipeline, "load_params", lambda c, stage, m, *mesh_and_dtype: params)
  monkeypatch.setattr(pipeline, "_train_arrays", lambda c: arrays)
  real_write = teacher_cache.write_cache

  def killed_after_first_shard(*args, **kwargs):
    def die(index):
      raise KeyboardInterrupt("killed")
    return real_write(*args, **dict(kwargs, shard_examples=4, on_shard=die))

  stages = {"teacher_cache": pipeline.stage_teacher_cache}
  for name in ("vocab", "target"):  # their markers, as after a finished run
    os.makedirs(config.stage_dir(name))
    pipeline.write_json_atomic(os.path.join(config.stage_dir(name), pipeline.DONE), {})
  monkeypatch.setattr(pipeline, "write_cache", killed_after_first_shard)
  with pytest.raises(KeyboardInterrupt):
    pipeline.run_pipeline(config, stage_fns=stages, stages=("teacher_cache",))
  assert pipeline.stage_status(config, "teacher_cache") == "todo"
  with pytest.raises(ValueError, match="no complete teacher cache"):
    pipeline.open_teacher_cache(config, target, params,
                                 pipeline.distillation_config(config, "supervised_kd"))
  monkeypatch.setattr(pipeline, "write_cache",
                      lambda *a, **k: real_write(*a, **dict(k, shard_examples=4)))
  assert pipeline.run_pipeline(config, stage_fns=stages, stages=("teacher_cache",)) == {
      "vocab": "skipped", "target": "skipped", "teacher_cache": "ran"}
  marker = pipeline.read_json(os.path.join(config.stage_dir("teacher_cache"), pipeline.DONE))
  assert marker["reused_shards"] == 1 and marker["k"] == 4
  cache = pipeline.open_teacher_cache(config, target, params,
                                       pipeline.distillation_config(config, "supervised_kd"))
  assert cache.arrays["teacher_top_ids"][np.arange(10)].shape == (10, 4, 4)
