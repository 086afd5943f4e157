"""The one evaluation path of the main job, the garden, the recipe grid and the eval binary.

  scorer = task_scorer(task)                                 # text and metric of the task
  alone = quality_alone({"target": (model, params)}, examples, scorer, max_new_tokens=44)
  rows = speculative_grid(target, target_params, {"draft": (draft, params)}, examples,
                          scorer, gammas=(3, 5), temperatures=(0.0, 1.0), max_new_tokens=44)

`examples` is data.get_prompts_and_targets' dict: "prompts" [N, P] and "targets" [N, T]
token arrays, "target_texts" (and "prompt_texts") strings. tau and alpha come from
decoding/stats.py (through quality.speculative_run); wall-clock speed is speed.py's, with
the settings of one `SpeedConfig`, shared by the main job's and the eval binary's configs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

from distillspec_jax.core.validation import (check_budget, check_field_types, check_grid,
                                             check_int, check_path, check_positive_int)
from distillspec_jax.decoding.speculative import DraftLength, Lenience
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.placement import BatchPlacement
from distillspec_jax.interop import importer

# The flat fields of PipelineConfig and EvalConfig (the gin run files bind them) that make
# their SpeedConfig: SpeedConfig field -> config field.
SPEED_FIELDS = {"examples": "speed_examples", "repeats": "speed_repeats",
                "calls": "speed_calls", "budget_s": "speed_budget_s", "cpus": "speed_cpus"}


@dataclasses.dataclass(frozen=True)
class SpeedConfig:
  """How wall-clock speed is timed (speed.measure_speed), for every job that times.

  Errors name the configs' flat fields (`speed_calls`, ...), which the run files set.

  Attributes:
    examples: the first evaluation prompts, each timed alone (batch 1); 0 = no timing.
    repeats: interleaved timing turns (medians and ranges are over them).
    calls: timed calls of each decoder per repeat, at least.
    budget_s: seconds of timing: after `calls`, each repeat gets one more call at a time
      while another round fits (0 = exactly `calls`).
    cpus: cores the timing process is pinned to (0 = this process, unpinned).
  """

  examples: int = 16
  repeats: int = 7
  calls: int = 6
  budget_s: float = 0.0
  cpus: int = 1

  def __post_init__(self):
    check_field_types(self)
    check_int(self.examples, "speed_examples", 0)
    check_positive_int(self.repeats, "speed_repeats")
    check_positive_int(self.calls, "speed_calls")
    check_budget(self.budget_s, "speed_budget_s")
    check_int(self.cpus, "speed_cpus", 0)

  @classmethod
  def of(cls, config) -> "SpeedConfig":
    """The SpeedConfig of a config's flat `speed_*` fields (SPEED_FIELDS)."""
    return cls(**{field: getattr(config, flat) for field, flat in SPEED_FIELDS.items()})

  def check_prompts(self, eval_examples: int) -> None:
    """Refuses more timed prompts than evaluation prompts (the timed are the first ones)."""
    if self.examples > eval_examples:
      raise ValueError(f"speed_examples={self.examples} exceeds eval_examples={eval_examples}: "
                       "the timed prompts are the first evaluation prompts; lower "
                       "speed_examples or raise eval_examples.")

  def measure_kwargs(self) -> dict:
    """speed.measure_speed's keyword arguments of these settings."""
    return dict(repeats=self.repeats, timed_per_turn=self.calls, budget_s=self.budget_s)


CHECKPOINT_FIX = ("pass an existing checkpoint: our MODEL_DIR (<step>/params), a T5X "
                  "checkpoint_<step> directory or a Hugging Face directory (config.json + "
                  "model.safetensors).")


def check_checkpoint(path: str, name: str) -> str:
  """The format ('hf', 't5x' or 'ours'; interop.importer) of the checkpoint at `path`, or a
  ValueError naming `name`, the path and the fix (checked before work starts)."""
  check_path(path, name, fix=CHECKPOINT_FIX)
  try:
    return importer.detect_format(path)
  except ValueError as error:
    raise ValueError(f"{name}={path!r}: {error} Point {name} at one of those.") from None


@dataclasses.dataclass(frozen=True)
class TaskScorer:
  """Detokenization and the task metric of one task: how every evaluation scores text."""

  task: str
  vocabulary: Any  # seqio.Vocabulary

  def detokenize(self, ids: Sequence[int]) -> str:
    return self.vocabulary.decode([int(i) for i in ids])

  def metrics(self, references: Sequence[str], predictions: Sequence[str]) -> dict:
    from distillspec_jax.data import batches as data
    return data.compute_metrics(self.task, list(references), list(predictions))


def task_scorer(task: str, vocabulary: Any = None) -> TaskScorer:
  """The scorer of a registered task (`vocabulary` None: its targets' vocabulary)."""
  from distillspec_jax.data import batches as data
  return TaskScorer(task, vocabulary if vocabulary is not None else data.get_vocabulary(task))


def quality_alone(models: Mapping[str, tuple], examples: dict, scorer: TaskScorer, *,
                  max_new_tokens: int, on_done: Optional[Callable[[], None]] = None,
                  batch_size: Optional[int] = None,
                  place: Optional[BatchPlacement] = None) -> dict:
  """{name: task metrics of greedy decodes, per_token_loss, example_prediction} of each
  (Model, params) in `models` decoding the examples' prompts alone, in batches of
  `batch_size` (None: one batch; `place`: their layout, a placement.BatchPlacement of that
  many)."""
  results = {}
  for name, (model, params) in models.items():
    results[name] = quality.quality(model, params, examples["prompts"], examples["targets"],
                                    examples["target_texts"], max_new_tokens,
                                    scorer.detokenize, scorer.metrics, place, batch_size)
    if on_done:
      on_done()
  return results


def speculative_grid(target, target_params, drafts: Mapping[str, tuple], examples: dict,
                     scorer: Optional[TaskScorer], *, gammas: Sequence[int],
                     temperatures: Sequence[float],
                     leniences: Sequence[Lenience] = (Lenience(),), max_new_tokens: int,
                     batch_size: Optional[int] = None, seed: int = 0,
                     on_done: Optional[Callable[[], None]] = None,
                     draft_length: DraftLength = DraftLength(),
                     place: Optional[BatchPlacement] = None) -> list:
  """Speculative decoding of the examples' prompts with the target and each draft at every
  (temperature, gamma, lenience), in that order per draft, temperatures outermost.

  `drafts`: {name: (Model, params)}; `batch_size` None: all prompts in one batch (batch b
  samples with fold_in(PRNGKey(seed), b)); `scorer` None: no task metric (quality None);
  `draft_length`: the draft length rule of every configuration (gamma is its gamma_max);
  `place`: where each batch's rows go and how the outputs come back (a
  placement.BatchPlacement; examples.read_examples gives it with the examples).
  Returns rows {draft, temperature, gamma, lenience, epsilon, quality, tau, tau_stderr, the
  acceptance statistics of decoding/stats.py (mean_acceptance_length,
  draft_acceptance_rate, alpha, alpha_proposed, alpha_distillspec, acceptance_by_position,
  draft_acceptance_rate_by_position), predictions, accepted_per_round}.
  """
  check_grid(gammas, temperatures)
  speed.check_leniences(leniences)
  batch_size = batch_size or len(examples["prompts"])
  rows = []
  for temperature in temperatures:
    for name, (draft, draft_params) in drafts.items():
      for gamma in gammas:
        for lenience in leniences:
          run = quality.speculative_run(
              target, target_params, draft, draft_params, examples, gamma=int(gamma),
              temperature=float(temperature), lenience=lenience,
              max_new_tokens=max_new_tokens, batch_size=batch_size,
              detokenize=scorer.detokenize if scorer else None,
              metric_fn=scorer.metrics if scorer else None, seed=seed,
              draft_length=draft_length, place=place)
          rows.append(dict(draft=name, temperature=float(temperature), gamma=int(gamma),
                           lenience=lenience.kind, epsilon=float(lenience.epsilon),
                           **{k: v for k, v in run.items() if k != "tokens"}))
          if on_done:
            on_done()
  return rows
