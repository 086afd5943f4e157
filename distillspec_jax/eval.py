r"""The evaluation binary, T5X style: quality next to latency for a target and a draft.

  python -m distillspec_jax.eval --gin_file=gin/runs/eval_demo.gin \
      [--gin.MODEL_DIR=runs/eval_demo] [--gin.DRAFT_CHECKPOINT_PATH=...]

Macros (T5X names): MODEL_DIR, MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, BATCH_SIZE,
TARGET_CHECKPOINT_PATH and DRAFT_CHECKPOINT_PATH (our orbax format, T5X or Hugging Face,
autodetected by `importer.detect_format`), plus VOCABULARY (the SentencePiece model the
checkpoints were trained with), DATA_DIR (file-backed tasks), BBH_DIR (the public BBH bbh/
folder) and the grid: GAMMAS, TEMPERATURES, LENIENCE_KINDS, EPSILONS.

For each task of the mixture (or the one task), on its evaluation split, it decodes with the
target alone and with speculative decoding at every (temperature, gamma, lenience) and writes
  MODEL_DIR/metrics.json            {"rows": [...], "target_alone": {task: {metric: value}}}
  MODEL_DIR/inferences/<task>.jsonl input, reference, prediction, accepted count per round
  MODEL_DIR/tensorboard/            the rows' scalars
  MODEL_DIR/lossy_tradeoff.{md,png} when the lenience grid has more than one point
  MODEL_DIR/config.gin              the configuration used
The evaluation itself is `evaluation.py` (models, params, prompts, callables); wall-clock
speed is `speed.measure_speed`, one measurement per task for the whole grid (its leniences
timed in the same interleaved cycles), in a process pinned to SPEED_CPUS cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Optional, Sequence

import gin

from distillspec_jax.interop import importer
from distillspec_jax.evaluation import quality as evaluation
from distillspec_jax import gin_utils
from distillspec_jax.evaluation import lossy
from distillspec_jax.training import multihost
from distillspec_jax.evaluation import pinning
from distillspec_jax.evaluation import speed
from distillspec_jax.models.config import TransformerConfig, model_config
from distillspec_jax.core.files import write_text_atomic
from distillspec_jax.models.model import Model
from distillspec_jax.decoding.speculative import LENIENCE_FUNCTIONS, Lenience


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What the evaluation binary runs; the gin run files bind these fields.

  Attributes:
    model_dir: MODEL_DIR, where every output goes.
    mixture_or_task_name: a seqio task or mixture (a mixture's tasks are evaluated one by one
      and their mean is reported under the mixture's name).
    task_feature_lengths: {"inputs": ..., "targets": ...}; prompts longer than "inputs" are
      truncated, max_new_tokens defaults to "targets".
    batch_size: prompts per batch for the quality/tau decodes (timing is batch 1).
    target_checkpoint_path / draft_checkpoint_path: checkpoints in any supported format.
    target_model / draft_model: preset names (config.MODEL_CONFIGS) to check the checkpoints'
      shapes against; None infers the model from the checkpoint.
    vocabulary: SentencePiece model path of the checkpoints (None: the task's own).
    data_dir: DATA_DIR of the file-backed tasks (gsm8k_files, mbpp_files, ...).
    bbh_dir: the BBH folder (one JSON per subtask) for the bbh_* tasks and the 'bbh' mixture.
    split: evaluation split (None: 'test', else 'validation').
    eval_examples: prompts per task for quality, tau and alpha.
    gammas / temperatures: the speculative grid.
    lenience_kinds / epsilons: the lenience grid, every kind at every epsilon
      (speculative.Lenience; epsilon 1 is lossless).
    max_new_tokens: decoding budget (None: task_feature_lengths["targets"]).
    speed_examples: the first test prompts timed one at a time (0: no timing, speed fields
      null); speed_repeats: interleaved timing turns; speed_calls: timed calls per repeat,
      at least; speed_budget_s: seconds of timing per task, the whole lenience grid timed
      together (more calls while another round fits; 0 = exactly speed_calls;
      speed.measure_speed); speed_cpus: cores of the timing process
      (0: this process, unpinned).
    max_decode_length: cache capacity of both models (None: what the grid needs, rounded up to
      a multiple of 16, or the presets' when larger).
    seed: one key for every decode: batch b of every configuration uses fold_in(seed key, b).
  """

  model_dir: str = ""
  mixture_or_task_name: str = ""
  task_feature_lengths: dict = dataclasses.field(default_factory=dict)
  batch_size: int = 32
  target_checkpoint_path: Optional[str] = None
  draft_checkpoint_path: Optional[str] = None
  target_model: Optional[str] = None
  draft_model: Optional[str] = None
  vocabulary: Optional[str] = None
  data_dir: Optional[str] = None
  bbh_dir: Optional[str] = None
  split: Optional[str] = None
  eval_examples: int = 128
  gammas: tuple = (3, 5, 7)
  temperatures: tuple = (0.0, 1.0)
  lenience_kinds: tuple = ("lin",)
  epsilons: tuple = (1.0,)
  max_new_tokens: Optional[int] = None
  speed_examples: int = 8
  speed_repeats: int = 7
  speed_calls: int = 6
  speed_budget_s: float = 0.0
  speed_cpus: int = 1
  max_decode_length: Optional[int] = None
  seed: int = 0
  progress_bar: bool = True

  def __post_init__(self):
    if not self.model_dir:
      raise ValueError("MODEL_DIR is not set; pass --gin.MODEL_DIR=<directory>.")
    if not self.mixture_or_task_name:
      raise ValueError("MIXTURE_OR_TASK_NAME is not set; pass e.g. "
                       "--gin.MIXTURE_OR_TASK_NAME=embedded_arithmetic.")
    for name in ("target_checkpoint_path", "draft_checkpoint_path"):
      if not getattr(self, name):
        raise ValueError(f"{name.upper()} is not set; pass --gin.{name.upper()}=<path> (our "
                         "MODEL_DIR, a T5X checkpoint or a Hugging Face directory).")
    try:  # the engine's grid check (one rule for the binaries and speed.measure_speed)
      speed.check_grid(self.gammas, self.temperatures)
    except ValueError as error:
      macro = "TEMPERATURES" if str(error).startswith("temperatures") else "GAMMAS"
      value = tuple(self.temperatures if macro == "TEMPERATURES" else self.gammas)
      raise ValueError(f"{macro}={value} (--gin.{macro}): {error}") from None
    if not self.epsilons:
      raise ValueError("EPSILONS=() is empty; pass at least one epsilon in (0, 1], e.g. "
                       "--gin.EPSILONS=(1.0,) for lossless decoding.")
    if not self.lenience_kinds:
      raise ValueError(f"LENIENCE_KINDS=() is empty; pass some of {LENIENCE_FUNCTIONS}.")
    for kind in self.lenience_kinds:
      if kind not in LENIENCE_FUNCTIONS:
        raise ValueError(f"LENIENCE_KINDS has {kind!r}; use some of {LENIENCE_FUNCTIONS}.")
    for eps in self.epsilons:
      if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= 1:
        raise ValueError(f"EPSILONS has {eps!r}; every epsilon must lie in (0, 1] "
                         "(1 is lossless).")
    speed.check_budget(self.speed_budget_s, "speed_budget_s")
    for name in ("batch_size", "eval_examples", "speed_repeats", "speed_calls"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    if self.speed_examples > self.eval_examples:
      raise ValueError(f"speed_examples={self.speed_examples} exceeds eval_examples="
                       f"{self.eval_examples}: the timed prompts are the first evaluation "
                       "prompts; lower speed_examples or raise eval_examples.")

  @property
  def leniences(self) -> list:
    return [Lenience(kind, float(eps)) for kind in self.lenience_kinds for eps in self.epsilons]

  @property
  def new_tokens(self) -> int:
    if self.max_new_tokens:
      return int(self.max_new_tokens)
    if "targets" not in self.task_feature_lengths:
      raise ValueError("TASK_FEATURE_LENGTHS has no 'targets' length; pass e.g. "
                       "{'inputs': 40, 'targets': 44}, or set EvalConfig.max_new_tokens.")
    return int(self.task_feature_lengths["targets"])


# --- checkpoints and tasks -------------------------------------------------------------------


def _checkpoint_format(path: str, macro: str) -> str:
  if not os.path.exists(path):
    raise ValueError(f"{macro}={path!r} does not exist; pass an existing checkpoint: our "
                     "MODEL_DIR (<step>/params), a T5X checkpoint_<step> directory or a "
                     "Hugging Face directory (config.json + model.safetensors).")
  try:
    return importer.detect_format(path)
  except ValueError as error:
    raise ValueError(f"{macro}={path!r}: {error} Point {macro} at one of those.") from None


def load_model(path: str, macro: str, preset: Optional[str],
               max_decode_length: Optional[int]) -> tuple:
  """(Model, fp32 params) of a checkpoint in any supported format (autodetected); with
  `preset`, the checkpoint's shapes are checked against it."""
  fmt = _checkpoint_format(path, macro)
  config = model_config(preset) if preset else None
  params, config = importer.load_checkpoint(path, config, fmt=fmt)
  if max_decode_length:
    config = config.replace(max_decode_length=int(max_decode_length))
  return Model(config), params


def decode_capacity(config: EvalConfig, target: TransformerConfig, draft: TransformerConfig,
                    prompt_width: int) -> int:
  """Cache slots both models need for the grid (see speculative.py), at least the presets'."""
  if config.max_decode_length:
    return int(config.max_decode_length)
  width = 1 if target.kind == "encoder_decoder" else 1 + prompt_width
  needed = width + config.new_tokens + max(config.gammas)
  rounded = -(-needed // 16) * 16
  presets = [model_config(n).max_decode_length for n in (config.target_model,
                                                         config.draft_model) if n]
  return max([rounded] + presets)


def register_tasks(config: EvalConfig) -> None:
  """Registers what the task name needs: the embedded task with VOCABULARY, the file-backed
  tasks of DATA_DIR, the BBH tasks of BBH_DIR."""
  from distillspec_jax.data import tasks
  from distillspec_jax.data import vocabularies
  from distillspec_jax.data.tasks import transfer_tasks
  vocabulary = vocabularies.as_vocabulary(config.vocabulary) if config.vocabulary else None
  if config.mixture_or_task_name == tasks.EMBEDDED_TASK_NAME and vocabulary is not None:
    tasks.register_embedded_task(vocabulary=vocabulary)
  if config.data_dir:
    if not os.path.isdir(config.data_dir):
      raise ValueError(f"DATA_DIR={config.data_dir!r} is not a directory; pass the folder "
                       "with gsm8k/, mbpp/, alpaca/, ... (e.g. ../shared/data).")
    found = transfer_tasks.register_prompt_tasks(config.data_dir, vocabulary)
    try:
      tasks.register_file_tasks(config.data_dir, vocabulary=vocabulary)
    except FileNotFoundError:
      if not found:
        raise
  if config.bbh_dir:
    transfer_tasks.check_bbh_dir(config.bbh_dir)
    tasks.register_bbh_tasks(config.bbh_dir, vocabulary=vocabulary)


def task_names(name: str) -> list:
  """The tasks of a mixture, or [name]."""
  import seqio
  from distillspec_jax.data import batches as data
  task = data.get_task(name)
  if isinstance(task, seqio.Mixture):
    return sorted(t.name for t in task.tasks)
  return [name]


def eval_split(task_name: str, split: Optional[str]) -> str:
  from distillspec_jax.data import batches as data
  splits = sorted(data.get_task(task_name).splits)
  if split:
    if split not in splits:
      raise ValueError(f"Task {task_name!r} has no split {split!r} (it has {splits}); pass "
                       "--gin.EVAL_SPLIT=<one of them>.")
    return split
  for candidate in ("test", "validation"):
    if candidate in splits:
      return candidate
  raise ValueError(f"Task {task_name!r} has no evaluation split: its splits are {splits}, "
                   "neither 'test' nor 'validation'. Pass --gin.EVAL_SPLIT=<split> to "
                   "evaluate on one of them, or give the task a test split.")


# --- timing --------------------------------------------------------------------------------


def _timings(paths: tuple, presets: tuple, capacity: int, prompts, config: EvalConfig) -> dict:
  """measure_speed of the pair over the whole lenience grid in one measurement (its
  leniences interleaved in the same cycles, against one plain decoding). Loads the
  checkpoints itself (run_pinned)."""
  target, target_params = load_model(paths[0], "TARGET_CHECKPOINT_PATH", presets[0], capacity)
  draft, draft_params = load_model(paths[1], "DRAFT_CHECKPOINT_PATH", presets[1], capacity)
  return speed.measure_speed(target, target_params, {"draft": (draft, draft_params)},
                             prompts, gammas=config.gammas, temperatures=config.temperatures,
                             max_new_tokens=config.new_tokens, repeats=config.speed_repeats,
                             timed_per_turn=config.speed_calls,
                             budget_s=config.speed_budget_s, seed=config.seed,
                             leniences=config.leniences, progress=config.progress_bar)


# --- the run -------------------------------------------------------------------------------


def _finite(value) -> bool:
  return value is None or (isinstance(value, (int, float)) and math.isfinite(value))


def _scalars(writer, row: dict) -> None:
  tag = (f"{row['task']}/T={row['temperature']}/gamma={row['gamma']}/"
         f"{row['lenience']}_eps={row['epsilon']}")
  values = dict(tau=row["tau"], alpha=row["alpha"], predicted_alpha=row["predicted_alpha"],
                speedup=row["speedup"], cost_model_speedup=row["cost_model_speedup"],
                **{f"quality/{k}": v for k, v in row["quality"].items()})
  for name, value in values.items():
    if value is not None:
      writer.add_scalar(f"{tag}/{name}", value, 0)


def evaluate(config: EvalConfig) -> dict:
  """Runs the evaluation and writes every output; returns the metrics.json object."""
  from tqdm.auto import tqdm
  from distillspec_jax.data import batches as data
  # Every process evaluates (the same decodes; no cross-process arrays); process 0 alone
  # writes, and the others wait at a barrier until its files are complete.
  primary = multihost.is_primary()
  if primary:
    os.makedirs(os.path.join(config.model_dir, "inferences"), exist_ok=True)
  register_tasks(config)
  names = task_names(config.mixture_or_task_name)
  splits = {name: eval_split(name, config.split) for name in names}
  for path, macro in ((config.target_checkpoint_path, "TARGET_CHECKPOINT_PATH"),
                      (config.draft_checkpoint_path, "DRAFT_CHECKPOINT_PATH")):
    _checkpoint_format(path, macro)
  examples = {name: data.get_prompts_and_targets(
      name, splits[name], config.task_feature_lengths, num_examples=config.eval_examples,
      on_long_prompt="truncate") for name in names}
  width = max(e["prompts"].shape[1] for e in examples.values())
  target, target_params = load_model(config.target_checkpoint_path, "TARGET_CHECKPOINT_PATH",
                                     config.target_model, None)
  draft, draft_params = load_model(config.draft_checkpoint_path, "DRAFT_CHECKPOINT_PATH",
                                   config.draft_model, None)
  if target.config.vocab_size != draft.config.vocab_size:
    raise ValueError(
        f"DRAFT_CHECKPOINT_PATH={config.draft_checkpoint_path!r} has vocab_size="
        f"{draft.config.vocab_size} but TARGET_CHECKPOINT_PATH="
        f"{config.target_checkpoint_path!r} has vocab_size={target.config.vocab_size}; "
        "speculative decoding needs one vocabulary: pass a draft trained with the target's "
        "SentencePiece model (and vocab_size).")
  if target.config.kind != draft.config.kind:
    raise ValueError(f"The target checkpoint is {target.config.kind} but the draft is "
                     f"{draft.config.kind}; pass a pair of the same kind.")
  capacity = decode_capacity(config, target.config, draft.config, width)
  target = Model(target.config.replace(max_decode_length=capacity))
  draft = Model(draft.config.replace(max_decode_length=capacity))
  vocabulary = data.get_vocabulary(names[0])
  if vocabulary.vocab_size > target.config.vocab_size:
    raise ValueError(f"The task's vocabulary has {vocabulary.vocab_size} pieces but the models "
                     f"have vocab_size={target.config.vocab_size}; pass the checkpoints' "
                     "SentencePiece model as --gin.VOCABULARY=<path.model>.")
  detokenize = lambda ids: vocabulary.decode([int(i) for i in ids])
  leniences = config.leniences
  total = len(names) * len(config.temperatures) * (1 + len(config.gammas) * len(leniences))
  rows_by_task, alone_by_task = {}, {}
  common = dict(max_new_tokens=config.new_tokens, batch_size=config.batch_size,
                detokenize=detokenize, seed=config.seed)
  with tqdm(total=total, desc="evaluate", dynamic_ncols=True,
            disable=not config.progress_bar) as bar:
    for name in names:
      metric_fn = lambda refs, predictions, name=name: data.compute_metrics(name, refs,
                                                                            predictions)
      ex = examples[name]
      rows, lines = [], []
      for temperature in config.temperatures:
        alone = evaluation.target_alone(target, target_params, draft, draft_params, ex,
                                        temperature=temperature, metric_fn=metric_fn, **common)
        if temperature == min(config.temperatures):
          alone_by_task[name] = alone["quality"]
        lines += [dict(decoder="target", temperature=float(temperature), input=i,
                       reference=r, prediction=p, accepted_per_round=None)
                  for i, r, p in zip(ex["prompt_texts"], ex["target_texts"],
                                     alone["predictions"])]
        bar.update(1)
        for gamma in config.gammas:
          for lenience in leniences:
            run = evaluation.speculative_run(target, target_params, draft, draft_params, ex,
                                             gamma=gamma, temperature=temperature,
                                             lenience=lenience, metric_fn=metric_fn, **common)
            rows.append(dict(task=name, temperature=float(temperature), gamma=int(gamma),
                             lenience=lenience.kind, epsilon=lenience.epsilon,
                             quality=run["quality"], tau=run["tau"],
                             tau_stderr=run["tau_stderr"], alpha=run["alpha"],
                             predicted_alpha=alone["predicted_alpha"],
                             acceptance_by_position=run["acceptance_by_position"]))
            lines += [dict(decoder="speculative", temperature=float(temperature),
                           gamma=int(gamma), lenience=lenience.kind,
                           epsilon=lenience.epsilon, input=i, reference=r, prediction=p,
                           accepted_per_round=a)
                      for i, r, p, a in zip(ex["prompt_texts"], ex["target_texts"],
                                            run["predictions"], run["accepted_per_round"])]
            bar.update(1)
      if primary:
        with open(os.path.join(config.model_dir, "inferences", f"{name}.jsonl"), "w") as f:
          for line in lines:
            f.write(json.dumps(line) + "\n")
      rows_by_task[name] = rows
  del target_params, draft_params
  for name in names:
    timing = None
    if config.speed_examples:
      timing = pinning.run_pinned(
          config.speed_cpus, _timings,
          (config.target_checkpoint_path, config.draft_checkpoint_path),
          (config.target_model, config.draft_model), capacity,
          examples[name]["prompts"][:config.speed_examples], config)
    for row in rows_by_task[name]:
      row.update(evaluation.speed_fields(timing, row["gamma"], row["temperature"],
                                         Lenience(row["lenience"], row["epsilon"])))
  rows = [r for name in names for r in rows_by_task[name]]
  if len(names) > 1:
    mixture_rows, mixture_alone = evaluation.mixture_mean(config.mixture_or_task_name,
                                                          rows_by_task, alone_by_task)
    rows += mixture_rows
    alone_by_task[config.mixture_or_task_name] = mixture_alone
  rows = [{k: row[k] for k in evaluation.ROW_FIELDS} for row in rows]
  metrics = {"rows": rows, "target_alone": alone_by_task}
  if primary:
    write_text_atomic(os.path.join(config.model_dir, "metrics.json"),
                      json.dumps(metrics, indent=1) + "\n")  # rows keep the interface's order
    from tensorboardX import SummaryWriter
    writer = SummaryWriter(os.path.join(config.model_dir, "tensorboard"))
    for row in rows:
      _scalars(writer, row)
    writer.close()
    if len(leniences) > 1:
      lossy.write_tradeoff(metrics, config.model_dir)
  multihost.barrier("eval_outputs_written")
  return metrics


# --- gin edge ------------------------------------------------------------------------------


def evaluate_job(config: EvalConfig) -> dict:
  """The gin entry point: `evaluate_job.config = @EvalConfig()` in a gin/runs/eval_*.gin.
  Registered by `load_config` (not at import: run as __main__, this module is also imported
  as distillspec_jax.eval, and gin would see two configurables of one name)."""
  return evaluate(config)


_REGISTERED = []


def load_config(argv: Sequence[str]) -> EvalConfig:
  """Parses the gin flags and builds the run file's EvalConfig (nothing runs)."""
  if not _REGISTERED:
    gin.external_configurable(EvalConfig, name="EvalConfig")
    gin.external_configurable(evaluate_job, name="evaluate_job")
    _REGISTERED.append(True)
  gin_utils.parse_binary_flags(argv)
  try:
    reference = gin.query_parameter("evaluate_job.config")
  except ValueError as error:
    raise gin_utils.GinConfigError(
        "The run file does not bind evaluate_job.config; use a gin/runs/eval_*.gin file, "
        "e.g. gin/runs/eval_demo.gin.") from error
  try:
    return reference.scoped_configurable_fn()
  except (TypeError, ValueError) as error:
    raise gin_utils.GinConfigError(f"Invalid evaluation configuration: {error}") from error


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # --coordinator_address / --process_count / --process_index (multihost.py), before JAX starts.
  argv = multihost.initialize_from_flags(argv)
  config = load_config(argv)
  os.makedirs(config.model_dir, exist_ok=True)
  if multihost.is_primary():  # process 0 is the one writer
    with open(os.path.join(config.model_dir, "config.gin"), "w") as f:
      f.write(gin.config_str())
  metrics = evaluate(config)
  if multihost.is_primary():
    print(lossy.rows_markdown(metrics), flush=True)
    print(f"Wrote {os.path.join(config.model_dir, 'metrics.json')}")
  return 0


if __name__ == "__main__":
  # Through the imported module, so that the timing process (spawned) unpickles EvalConfig
  # and _timings from distillspec_jax.eval, not from __main__.
  from distillspec_jax import eval as _eval_module
  try:
    sys.exit(_eval_module.main())
  except (gin_utils.GinConfigError, ValueError, FileNotFoundError) as error:
    print(f"Error: {error}", file=sys.stderr)
    sys.exit(2)
