"""The main job's starting checkpoints: PipelineConfig.target_checkpoint_path (any format,
read by interop.importer.restore_any) is where the target's fine-tuning starts when the job
asks for it (PairSource.finetune_target)."""

import jax
import numpy as np
import pytest

from distillspec_jax.interop import importer
from distillspec_jax.models.config import model_config
from distillspec_jax.models.model import Model
from distillspec_jax.studies import pipeline
from distillspec_jax.studies.pair_source import PairSource
from distillspec_jax.studies.pipeline import PipelineConfig
from distillspec_jax.training.trainer import SyntheticData

pytestmark = pytest.mark.integration

VOCAB = 64


def test_the_target_stage_starts_from_a_hugging_face_checkpoint(tmp_path, monkeypatch):
  model = Model(model_config("tiny_encoder_decoder", vocab_size=VOCAB))
  start = jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(5)))
  importer.save_checkpoint(start, model.config, str(tmp_path / "hf"), "hf")
  config = PipelineConfig(run_dir=str(tmp_path / "run"), target_model="tiny_encoder_decoder",
                          target_steps=1, batch_size=2, warmup_steps=1, learning_rate=1e-9,
                          target_checkpoint_path=str(tmp_path / "hf"), progress_bar=False,
                          pair=PairSource(finetune_target=True))
  config.check_inputs()  # the path is a checkpoint the importer reads
  # The vocab stage's outputs, stood in for: the vocabulary's size and a tiny data source.
  monkeypatch.setattr(pipeline, "vocab_size", lambda config: VOCAB)
  monkeypatch.setattr(pipeline, "train_data", lambda config: SyntheticData(
      2, input_length=6, target_length=6, vocab_size=VOCAB))
  pipeline.stage_finetune(config, "target")
  trained = pipeline.load_params(config, "target", model)
  # One step at a negligible rate: the stage's weights are the checkpoint's, not a fresh init.
  for saved, after in zip(jax.tree.leaves(start), jax.tree.leaves(trained)):
    np.testing.assert_allclose(np.asarray(after), saved, atol=1e-5)
  fresh = jax.tree.leaves(model.init(jax.random.PRNGKey(config.seed)))
  assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(fresh, jax.tree.leaves(start)))
