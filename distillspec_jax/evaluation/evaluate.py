"""The one evaluation path of the main job, the garden, the recipe grid and the eval binary.

  scorer = task_scorer(task)                                 # text and metric of the task
  alone = quality_alone({"target": (model, params)}, examples, scorer, max_new_tokens=44)
  rows = speculative_grid(target, target_params, {"draft": (draft, params)}, examples,
                          scorer, gammas=(3, 5), temperatures=(0.0, 1.0), max_new_tokens=44)

`examples` is a data.batches.Examples (batches.get_prompts_and_targets, or
examples.read_examples on a mesh): `prompts` [N, P] and `targets` [N, T] token arrays,
`target_texts` (and `prompt_texts`) strings. tau and the acceptance rates
come from decoding/stats.py (through quality.speculative_run, a QualityRow per draft and
grid point); wall-clock speed is speed.py's, with the settings of one `SpeedConfig`, shared
by the main job's and the eval binary's configs. `EvaluationRow` joins a QualityRow and its
timing (speed.SpeedFigures): the row both report.json and metrics.json write.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from distillspec_jax.core.records import JsonRecord, flattened
from distillspec_jax.core.validation import (check_budget, check_field_types, check_grid,
                                             check_int, check_path, check_positive_int)
from distillspec_jax.decoding.speculative import DraftLength, Lenience
from distillspec_jax.evaluation import pinning
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.grid_point import GridPoint
from distillspec_jax.evaluation.placement import BatchPlacement
from distillspec_jax.evaluation.quality import Acceptance, QualityRow
from distillspec_jax.evaluation.speed import SpeedFigures

if TYPE_CHECKING:  # the data layer's reader (TensorFlow) is imported only where it reads
  from distillspec_jax.data.batches import Examples
from distillspec_jax.interop import importer

@dataclasses.dataclass(frozen=True)
class SpeedConfig:
  """How wall-clock speed is timed (speed.measure_speed), for every job that times: the eval
  binary's `EvalConfig.speed` and the main job's `PipelineConfig.speed` (gin:
  `EvalConfig.speed = @SpeedConfig()`, `SpeedConfig.calls = %SPEED_CALLS`).

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
    check_int(self.examples, "SpeedConfig.examples", 0)
    check_positive_int(self.repeats, "SpeedConfig.repeats")
    check_positive_int(self.calls, "SpeedConfig.calls")
    check_budget(self.budget_s, "SpeedConfig.budget_s")
    check_int(self.cpus, "SpeedConfig.cpus", 0)
    if self.examples:  # it times: the cores must exist here, before any training
      pinning.check_cores(self.cpus, "SpeedConfig.cpus (SPEED_CPUS)")

  def check_prompts(self, eval_examples: int, owner: str) -> None:
    """Refuses more timed prompts than evaluation prompts (the timed are the first ones);
    `owner`: the config whose `eval_examples` they are."""
    if self.examples > eval_examples:
      raise ValueError(f"SpeedConfig.examples={self.examples} exceeds {owner}.eval_examples="
                       f"{eval_examples}: the timed prompts are the first evaluation prompts; "
                       "lower SpeedConfig.examples (SPEED_EXAMPLES) or raise eval_examples.")

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
    from distillspec_jax.data import batches as batches_lib
    return batches_lib.compute_metrics(self.task, list(references), list(predictions))


def task_scorer(task: str, vocabulary: Any = None) -> TaskScorer:
  """The scorer of a registered task (`vocabulary` None: its targets' vocabulary)."""
  from distillspec_jax.data import batches as batches_lib
  return TaskScorer(task, vocabulary if vocabulary is not None
                    else batches_lib.get_vocabulary(task))


def quality_alone(models: Mapping[str, tuple], examples: "Examples", scorer: TaskScorer, *,
                  max_new_tokens: int, on_done: Optional[Callable[[], None]] = None,
                  batch_size: Optional[int] = None,
                  place: Optional[BatchPlacement] = None) -> dict:
  """{name: task metrics of greedy decodes, per_token_loss, example_prediction} of each
  (Model, params) in `models` decoding the examples' prompts alone, in batches of
  `batch_size` (None: one batch; `place`: their layout, a placement.BatchPlacement of that
  many)."""
  results = {}
  for name, (model, params) in models.items():
    results[name] = quality.quality(model, params, examples.prompts, examples.targets,
                                    examples.target_texts, max_new_tokens,
                                    scorer.detokenize, scorer.metrics, place, batch_size)
    if on_done:
      on_done()
  return results


def speculative_grid(target, target_params, drafts: Mapping[str, tuple], examples: "Examples",
                     scorer: Optional[TaskScorer], *, gammas: Sequence[int],
                     temperatures: Sequence[float],
                     leniences: Sequence[Lenience] = (Lenience(),), max_new_tokens: int,
                     batch_size: Optional[int] = None, seed: int = 0,
                     on_done: Optional[Callable[[], None]] = None,
                     draft_length: DraftLength = DraftLength(),
                     place: Optional[BatchPlacement] = None) -> list:
  """Speculative decoding of the examples' prompts with the target and each draft at every
  (temperature, gamma, lenience), in that order per draft, temperatures outermost: one
  quality.QualityRow each (its `draft` the name in `drafts`).

  `drafts`: {name: (Model, params)}; `batch_size` None: all prompts in one batch (batch b
  samples with fold_in(PRNGKey(seed), b)); `scorer` None: no task metric (quality None);
  `draft_length`: the draft length rule of every configuration (gamma is its gamma_max);
  `place`: where each batch's rows go and how the outputs come back (a
  placement.BatchPlacement; examples.read_examples gives it with the examples).
  """
  check_grid(gammas, temperatures)
  speed.check_leniences(leniences, temperatures)
  batch_size = batch_size or len(examples)
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
          rows.append(dataclasses.replace(run, draft=name))
          if on_done:
            on_done()
  return rows


@dataclasses.dataclass(frozen=True)
class EvaluationRow(JsonRecord):
  """One draft at one grid point, evaluated: the row of the main job's report.json
  (`draft_rows`) and of the eval binary's metrics.json (`rows`), one key per quantity.

  Attributes:
    task: the task (or the mixture, for the mean over its tasks).
    draft: the draft's name (the main job: its recipe, or "raw").
    point: the GridPoint (gamma, temperature, lenience, draft length rule).
    acceptance: quality.Acceptance (tau, tau_stderr, the acceptance rates).
    quality: the task's metrics of the speculative outputs (None: not scored).
    predicted_alpha: the draft's 1 - TVD along the target's own samples (the eval binary;
      None in the main job).
    speed: speed.SpeedFigures of the timed prompts (None: not timed; every key null).
    num_examples: the prompts evaluated (fewer than EVAL_EXAMPLES when the task's split is
      smaller; a mixture's row: the sum over its tasks; None: not recorded, as in a
      metrics.json or report.json written before it was).
  """

  task: str
  draft: str
  point: GridPoint = flattened(GridPoint)
  acceptance: Acceptance = flattened(Acceptance)
  quality: Optional[dict] = None
  predicted_alpha: Optional[float] = None
  speed: Optional[SpeedFigures] = flattened(SpeedFigures, default=None)
  num_examples: Optional[int] = None

  @classmethod
  def of(cls, task: str, run: QualityRow, speed: Optional[SpeedFigures] = None,
         predicted_alpha: Optional[float] = None, draft: Optional[str] = None,
         num_examples: Optional[int] = None) -> "EvaluationRow":
    """The row of a speculative_grid QualityRow and its timing (`draft`: a name for the
    report, default the run's; `num_examples`: the prompts it evaluated)."""
    return cls(task=task, draft=run.draft if draft is None else draft, point=run.point,
               quality=run.quality, acceptance=run.acceptance,
               predicted_alpha=predicted_alpha, speed=speed, num_examples=num_examples)

  def scalars(self) -> dict:
    """{name: number} of every scalar quantity that is set (TensorBoard's tags), the task's
    metrics as quality/<metric>."""
    point = set(GridPoint.json_keys())
    values = {k: v for k, v in self.to_json().items()
              if k not in point and isinstance(v, (int, float)) and not isinstance(v, bool)}
    values.update({f"quality/{k}": v for k, v in (self.quality or {}).items()})
    return values


def _mean(values):
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def _mean_field(values: list):
  """The mixture's value of one field from its tasks' `values` (None where a task has
  none): the mean; of a [low, high] range or interval, the mean of each end; of a
  per-position list, the mean at each position over the tasks that have it; of a flag, any."""
  present = [v for v in values if v is not None]
  if not present:
    return None
  if isinstance(present[0], bool):
    return any(present)
  if isinstance(present[0], list):
    width = max(len(v) for v in present)
    return [_mean(v[i] if i < len(v) else None for v in present) for i in range(width)]
  return _mean(present)


def mixture_mean(name: str, rows_by_task: Mapping[str, Sequence[EvaluationRow]],
                 target_alone_by_task: Mapping[str, dict]) -> tuple:
  """(rows, target_alone) of a mixture: each EvaluationRow every number the mean over its
  tasks of the same (draft, grid point) row (`_mean_field`: ranges end by end, positions
  one by one, a flag if any task has it); tau_stderr is the standard error of that mean
  (sqrt(sum se^2) / n, tasks independent); a metric or field missing in some task is
  averaged over the tasks that have it."""
  tasks = list(rows_by_task)
  keyed = [{(r.draft, r.point): r for r in rows_by_task[t]} for t in tasks]
  measured = Acceptance.json_keys() + SpeedFigures.json_keys()
  rows = []
  for key, first in keyed[0].items():
    group = [k[key] for k in keyed if key in k]
    as_json = [r.to_json() for r in group]
    metric_names = sorted({m for r in group for m in (r.quality or {})})
    row = dict(first.to_json(), task=name,
               quality={m: _mean((r.quality or {}).get(m) for r in group)
                        for m in metric_names},
               predicted_alpha=_mean(r.predicted_alpha for r in group))
    row.update({k: _mean_field([j[k] for j in as_json]) for k in measured})
    counts = [r.num_examples for r in group]
    row["num_examples"] = None if None in counts else int(sum(counts))
    se = [r.acceptance.tau_stderr for r in group]
    row["tau_stderr"] = float(np.sqrt(np.sum(np.square(se)))) / len(se)
    rows.append(EvaluationRow.from_json(row))
  metric_names = sorted({m for t in tasks for m in target_alone_by_task[t]})
  alone = {m: _mean(target_alone_by_task[t].get(m) for t in tasks) for m in metric_names}
  return rows, alone
