"""evaluation/evaluate.py, the one evaluation path of the main job, the garden, the recipe
grid and the eval binary: its rows on tiny random models, and that every caller uses it."""

import ast
import math
import pathlib

import jax
import numpy as np
import pytest

from distillspec_jax.data import batches
from distillspec_jax.decoding.speculative import Lenience
from distillspec_jax.evaluation import evaluate as evaluate_lib
from distillspec_jax.models.config import model_config
from distillspec_jax.models.model import Model


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distillspec_jax"


class _Scorer:
  """A TaskScorer's interface without a seqio task: text is the ids, the metric counts."""

  def detokenize(self, ids):
    return " ".join(str(int(i)) for i in ids)

  def metrics(self, references, predictions):
    return {"nonempty": 100.0 * np.mean([bool(p) for p in predictions]),
            "count": float(len(predictions))}


@pytest.fixture(scope="module")
def pair():
  # One architecture for both (different weights): every pair shares its compiled programs.
  target = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=64,
                              max_decode_length=32))
  draft = target
  prompts = np.random.default_rng(0).integers(2, 64, (5, 6)).astype(np.int32)
  targets = np.random.default_rng(1).integers(2, 64, (5, 4)).astype(np.int32)
  examples = batches.Examples(prompts, (prompts > 0).sum(1), targets, (targets > 0).sum(1),
                              ["p"] * 5, ["x"] * 5)
  return (target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1)),
          examples)


@pytest.mark.slow
def test_speculative_grid_rows(pair):
  target, target_params, draft, draft_params, examples = pair
  rows = [row.to_json() for row in evaluate_lib.speculative_grid(
      target, target_params, {"raw": (draft, draft_params), "self": (target, target_params)},
      examples, _Scorer(), gammas=(2, 3), temperatures=(1.0,),
      leniences=(Lenience(), Lenience("lin", 0.5)), max_new_tokens=6, batch_size=3)]
  keys = [(r["temperature"], r["draft"], r["gamma"], r["epsilon"]) for r in rows]
  assert keys == [(1.0, d, g, e) for d in ("raw", "self") for g in (2, 3) for e in (1.0, 0.5)]
  for row in rows:
    assert 1.0 <= row["tau"] <= row["gamma"] + 1
    assert 0.0 <= row["draft_acceptance_rate"] <= 1.0
    assert math.isfinite(row["tau_stderr"]) and len(row["acceptance_by_position"]) == row[
        "gamma"]
    assert row["quality"]["count"] == 5.0 and len(row["predictions"]) == 5
    if row["draft"] == "self":  # a draft equal to the target: every drafted token accepted
      assert row["alpha_proposed"] == 1.0
      # Every test at an output position accepted, the length limit's cut rounds included.
      assert row["acceptance_by_position"] == [1.0] * row["gamma"]
  assert min(r["alpha_proposed"] for r in rows if r["draft"] == "raw") < 1.0


@pytest.mark.slow
def test_batching_scorer_and_models_alone(pair):
  target, target_params, draft, draft_params, examples = pair
  grid = lambda scorer, batch_size: evaluate_lib.speculative_grid(
      target, target_params, {"raw": (draft, draft_params)}, examples, scorer, gammas=(3,),
      temperatures=(0.0,), max_new_tokens=6, batch_size=batch_size)
  whole, = (row.to_json() for row in grid(_Scorer(), None))
  batched, = (row.to_json() for row in grid(None, 2))
  # Greedy decoding does not depend on the batching; without a scorer there is no text.
  for key in ("tau", "tau_stderr", "draft_acceptance_rate", "accepted_per_round"):
    assert batched[key] == whole[key]
  assert batched["quality"] is None and batched["predictions"] is None
  alone = evaluate_lib.quality_alone({"target": (target, target_params),
                                      "draft": (draft, draft_params)}, examples, _Scorer(),
                                     max_new_tokens=6)
  assert set(alone) == {"target", "draft"}
  for metrics in alone.values():
    assert metrics["count"] == 5.0 and math.isfinite(metrics["per_token_loss"])


def test_a_bad_grid_is_refused_by_the_engine_objects(pair):
  target, target_params, draft, draft_params, examples = pair
  with pytest.raises(ValueError, match="temperature=-1.0 must be >= 0"):
    evaluate_lib.speculative_grid(target, target_params, {"raw": (draft, draft_params)},
                                  examples, None, gammas=(3,), temperatures=(-1.0,),
                                  max_new_tokens=6)


def _calls(path: pathlib.Path) -> set:
  """Names of the attributes and functions `path` calls (x.f(...) -> 'f')."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call):
      function = node.func
      names.add(function.attr if isinstance(function, ast.Attribute) else
                getattr(function, "id", None))
  return names


@pytest.mark.parametrize("caller", ["studies/pipeline.py", "studies/garden.py",
                                    "studies/recipe_grid.py", "eval.py"])
def test_every_caller_evaluates_through_the_one_path(caller):
  calls = _calls(PACKAGE / caller)
  assert "speculative_grid" in calls
  # No second path: the engine's lower-level measurements are evaluate.py's to call.
  assert not calls & {"speculative_run", "speculative_statistics", "speculative_decode",
                      "compute_metrics"}
