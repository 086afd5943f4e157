"""Worker of tests/test_head_resume.py: trains a draft head on a tiny encoder-decoder pair
through the trainer (all three data sources: fixed, the head's own proposals, target samples)
into MODEL_DIR, resuming from its latest checkpoint as any restarted job does.

  python tests/head_resume_worker.py MODEL_DIR STEPS [--slow]

--slow waits SLOW_S before each batch after the first, so that a test has time to kill the
process between two checkpoints (it changes when steps run, never what they compute).
Prints `LOGGED <json list of the steps this process logged>` at the end.
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from distillspec_jax.distill.head_objectives import (HeadDistillationObjective,  # noqa: E402
                                                     HeadTrainingConfig)
from distillspec_jax.distill.objectives import DistillationConfig  # noqa: E402
from distillspec_jax.models.config import TransformerConfig  # noqa: E402
from distillspec_jax.models.head import Head, HeadConfig  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training import trainer as T  # noqa: E402
from collector import freeze_long_lived  # noqa: E402

VOCAB = 48
SAVE_EVERY = 2
SLOW_S = 0.4


class SlowData:
  """`SyntheticData` whose batches after the first arrive SLOW_S late."""

  def __init__(self, slow: bool):
    self.data, self.slow = T.SyntheticData(4, vocab_size=VOCAB), slow

  def batch_at(self, step: int):
    if self.slow and step > 0:
      time.sleep(SLOW_S)
    return self.data.batch_at(step)


def pair():
  """(target, its params, head, objective) of the tiny pair."""
  target = Model(TransformerConfig(
      kind="encoder_decoder", vocab_size=VOCAB, emb_dim=32, num_heads=2, head_dim=16,
      mlp_dim=64, dropout_rate=0.0, max_decode_length=32, num_encoder_layers=1,
      num_decoder_layers=2))
  target_params = target.init(jax.random.PRNGKey(1))
  head = Head(HeadConfig(target.config, mlp_dim=32))
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=0.34, lambda2=0.5, max_new_tokens=6),
      HeadTrainingConfig(3))
  return target, target_params, head, objective


def main(model_dir: str, steps: int, slow: bool) -> None:
  target, target_params, head, objective = pair()
  config = T.TrainConfig(model_dir=model_dir, train_steps=steps, batch_size=4,
                         optimizer="adamw", learning_rate=1e-3, warmup_steps=0,
                         decay_steps=steps, save_every=SAVE_EVERY, keep_checkpoints=2,
                         log_every=1, progress_bar=False)
  result = T.train(config, objective, SlowData(slow), frozen_params={"target": target_params},
                   init_params=head.init(jax.random.PRNGKey(2), target_params))
  print("LOGGED", json.dumps([r["step"] for r in result.history if "loss" in r]), flush=True)


if __name__ == "__main__":
  freeze_long_lived()  # the imports are done (collector.py)
  main(sys.argv[1], int(sys.argv[2]), "--slow" in sys.argv[3:])
