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
The decodes are the one evaluation path, `evaluation/evaluate.py` (`speculative_grid`; the
target alone is `quality.target_alone`); wall-clock speed is `speed.measure_speed` with the
run's `SpeedConfig`, one measurement per task for the whole grid (its leniences timed in the
same interleaved cycles), in a process pinned to SPEED_CPUS cores. Every value and input path
is checked before work starts; a mistake exits with status 2 and the message naming the fix.

Both models' parameters are laid out on a (DATA_PARALLEL, MODEL_PARALLEL) mesh by the
partitioning rules (restored straight into their shards when EvalConfig.target_model /
draft_model name the presets), the target's cast to TARGET_PARAM_DTYPE. `--dry_run` compiles
the speculative engine for that mesh and the slice SLICE instead and prints what it needs per
device (training/dry_run.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

import gin
import jax

from distillspec_jax import gin_utils
from distillspec_jax.core.files import write_text_atomic
from distillspec_jax.core.validation import check_field_types, check_path, check_positive_int
from distillspec_jax.decoding.speculative import DraftLength, Lenience, check_pair
from distillspec_jax.evaluation import evaluate as evaluate_lib
from distillspec_jax.evaluation import examples as examples_lib
from distillspec_jax.evaluation import lossy
from distillspec_jax.evaluation import pinning
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.evaluate import SpeedConfig, check_checkpoint
from distillspec_jax.interop import importer
from distillspec_jax.models import precision
from distillspec_jax.models.config import TransformerConfig, model_config
from distillspec_jax.models.model import Model, TokenIds
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning


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
    vocabulary: the checkpoints' vocabulary: a Hugging Face model folder, its tokenizer.json
      (ids, special tokens and BOS rule as transformers has them) or a SentencePiece .model
      (T5's conventions); None: the task's own.
    data_dir: DATA_DIR of the file-backed tasks (gsm8k_files, mbpp_files, ...).
    bbh_dir: the BBH folder (one JSON per subtask) for the bbh_* tasks and the 'bbh' mixture.
    split: evaluation split (None: 'test', else 'validation').
    eval_examples: prompts per task for quality, tau and alpha.
    gammas / temperatures: the speculative grid.
    lenience_kinds / epsilons: the lenience grid, every kind at every epsilon
      (speculative.Lenience; epsilon 1 is lossless).
    max_new_tokens: decoding budget (None: task_feature_lengths["targets"]).
    speed_examples / speed_repeats / speed_calls / speed_budget_s / speed_cpus: the timing's
      settings, the fields of `self.speed` (evaluation.evaluate.SpeedConfig, shared with the
      main job): the first evaluation prompts timed one at a time (0: no timing, speed
      fields null); interleaved timing turns; timed calls per repeat, at least; seconds of
      timing per task, the whole lenience grid timed together (0 = exactly speed_calls);
      cores of the timing process (0: this process, unpinned).
    max_decode_length: cache capacity of both models (None: what the grid needs, rounded up to
      a multiple of 16, or the presets' when larger).
    seed: one key for every decode: batch b of every configuration uses fold_in(seed key, b).
    data_parallel / model_parallel: the (data, model) mesh of all processes' devices both
      models' parameters are laid out on by the partitioning rules (DATA_PARALLEL,
      MODEL_PARALLEL; -1 = the devices left over): a target sharded over 'model' never sits
      whole on one device. Each batch's prompts are split over 'data' when it divides
      BATCH_SIZE (else every device decodes the whole batch); with several processes each
      hands over only the rows its devices hold.
    draft_length_rule / draft_length_threshold: how many draft tokens a row proposes per
      round (speculative.DraftLength; DRAFT_LENGTH_RULE, DRAFT_LENGTH_THRESHOLD): 'fixed'
      (gamma), 'confidence' (up to gamma as gamma_max, while the draft's top probability
      is at least the threshold), 'cumulative' (while the product of the round's top
      probabilities is) or 'cost' (while a longer proposal pays, by draft_length_costs: a
      round verifying w tokens costs entry w - 1, in target steps, and a draft call
      draft_length_draft_cost; DRAFT_LENGTH_COSTS, DRAFT_LENGTH_DRAFT_COST).
    target_param_dtype: the target's parameters cast after loading (TARGET_PARAM_DTYPE; None
      = as stored).
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
  data_parallel: int = -1
  model_parallel: int = 1
  target_param_dtype: Optional[str] = None
  draft_length_rule: str = "fixed"
  draft_length_threshold: float = 0.0
  draft_length_costs: tuple = ()
  draft_length_draft_cost: float = 0.0

  def __post_init__(self):
    for name, macro, example in (
        ("model_dir", "MODEL_DIR", "<directory>"),
        ("mixture_or_task_name", "MIXTURE_OR_TASK_NAME", "embedded_arithmetic"),
        ("target_checkpoint_path", "TARGET_CHECKPOINT_PATH", "<checkpoint>"),
        ("draft_checkpoint_path", "DRAFT_CHECKPOINT_PATH", "<checkpoint>")):
      if not getattr(self, name):  # gin's unset macro is None: say which, not the type
        raise ValueError(f"{macro} is not set; pass --gin.{macro}={example}.")
    check_field_types(self)
    try:  # the one grid check and the engine's SamplingConfig, early
      evaluate_lib.check_decoding_grid(self.gammas, self.temperatures)
    except (TypeError, ValueError) as error:
      macro = "TEMPERATURES" if "temperature" in str(error) else "GAMMAS"
      value = tuple(self.temperatures if macro == "TEMPERATURES" else self.gammas)
      raise ValueError(f"{macro}={value} (--gin.{macro}): {error}") from None
    if not self.epsilons:
      raise ValueError("EPSILONS=() is empty; pass at least one epsilon in (0, 1], e.g. "
                       "--gin.EPSILONS=(1.0,) for lossless decoding.")
    if not self.lenience_kinds:
      raise ValueError("LENIENCE_KINDS=() is empty; pass e.g. --gin.LENIENCE_KINDS=('lin',).")
    _ = self.leniences  # the engine's Lenience refuses a bad kind or epsilon now
    _ = self.draft_length  # and DraftLength a bad rule or threshold
    for name in ("batch_size", "eval_examples"):
      check_positive_int(getattr(self, name), name)
    if self.max_decode_length is not None:
      check_positive_int(self.max_decode_length, "max_decode_length")
    if self.data_parallel != -1:
      check_positive_int(self.data_parallel, "data_parallel (DATA_PARALLEL; -1 = the rest)")
    check_positive_int(self.model_parallel, "model_parallel (MODEL_PARALLEL)")
    precision.check_param_dtype(self.target_param_dtype)
    if self.max_new_tokens is None:
      check_positive_int(self.task_feature_lengths.get("targets"),
                         "TASK_FEATURE_LENGTHS['targets'] (the decoding budget when "
                         "EvalConfig.max_new_tokens is None)")
    self.speed.check_prompts(self.eval_examples)

  @property
  def speed(self) -> SpeedConfig:
    """The timing's settings (checked when the config is made)."""
    return SpeedConfig.of(self)

  @property
  def leniences(self) -> list:
    """Every kind at every epsilon, as the engine's Lenience objects (their own checks)."""
    for kind in self.lenience_kinds:
      _lenience("LENIENCE_KINDS", kind, kind)
    return [_lenience("EPSILONS", epsilon, kind, epsilon) for kind in self.lenience_kinds
            for epsilon in self.epsilons]

  @property
  def draft_length(self) -> DraftLength:
    """The engine's DraftLength of the draft_length_* fields."""
    try:
      return DraftLength(self.draft_length_rule, self.draft_length_threshold,
                         costs=self.draft_length_costs,
                         draft_cost=self.draft_length_draft_cost)
    except (TypeError, ValueError) as error:
      raise ValueError(f"DRAFT_LENGTH_RULE={self.draft_length_rule!r}, DRAFT_LENGTH_THRESHOLD="
                       f"{self.draft_length_threshold!r}, DRAFT_LENGTH_COSTS="
                       f"{self.draft_length_costs!r}, DRAFT_LENGTH_DRAFT_COST="
                       f"{self.draft_length_draft_cost!r}: {error}") from None

  @property
  def new_tokens(self) -> int:
    if self.max_new_tokens is not None:
      return self.max_new_tokens
    return self.task_feature_lengths["targets"]

  def check_inputs(self) -> None:
    """Refuses, before work starts, input paths that do not exist or hold no checkpoint."""
    if self.vocabulary is not None:
      check_path(self.vocabulary, "VOCABULARY", kind="any",
                 fix="pass the checkpoints' tokenizer: a Hugging Face model folder, its "
                     "tokenizer.json, or the SentencePiece .model they were trained with (e.g. "
                     "runs/demo/vocab/embedded_arithmetic_v2_bpe256.model); or None for the "
                     "task's own.")
      from distillspec_jax.data import vocabularies
      vocabularies.check_vocabulary(self.vocabulary, "VOCABULARY", (
          ("TARGET_CHECKPOINT_PATH", self.target_checkpoint_path),
          ("DRAFT_CHECKPOINT_PATH", self.draft_checkpoint_path)))
    if self.data_dir is not None:
      check_path(self.data_dir, "DATA_DIR", kind="dir",
                 fix="pass the folder with gsm8k/, mbpp/, alpaca/, ... (e.g. ../shared/data).")
    if self.bbh_dir is not None:
      from distillspec_jax.data.tasks import transfer_tasks
      transfer_tasks.check_bbh_dir(self.bbh_dir)
    check_checkpoint(self.target_checkpoint_path, "TARGET_CHECKPOINT_PATH")
    check_checkpoint(self.draft_checkpoint_path, "DRAFT_CHECKPOINT_PATH")


def _lenience(macro: str, value, *args) -> Lenience:
  """Lenience(*args), its error naming the macro and the value that made it."""
  try:
    return Lenience(*args)
  except (TypeError, ValueError) as error:
    raise ValueError(f"{macro} has {value!r}: {error}") from None


# --- checkpoints and tasks -------------------------------------------------------------------


def load_model(path: str, macro: str, preset: Optional[str],
               max_decode_length: Optional[int]) -> tuple:
  """(Model, fp32 params) of a checkpoint in any supported format (autodetected); with
  `preset`, the checkpoint's shapes are checked against it."""
  fmt = check_checkpoint(path, macro)
  config = model_config(preset) if preset else None
  params, config = importer.load_checkpoint(path, config, fmt=fmt)
  if max_decode_length:
    config = config.replace(max_decode_length=max_decode_length)
  return Model(config), params


def decode_capacity(config: EvalConfig, target: TransformerConfig, draft: TransformerConfig,
                    prompt_width: int) -> int:
  """Cache slots both models need for the grid (see speculative.py), at least the presets'."""
  if config.max_decode_length:
    return config.max_decode_length
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
  if config.data_dir:  # its path was checked by EvalConfig.check_inputs
    found = transfer_tasks.register_prompt_tasks(config.data_dir, vocabulary)
    try:
      tasks.register_file_tasks(config.data_dir, vocabulary=vocabulary)
    except FileNotFoundError:
      if not found:
        raise
  if config.bbh_dir:
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


def _timings(paths: tuple, presets: tuple, capacity: int, prompts, config: EvalConfig,
             tokens: TokenIds = TokenIds()) -> dict:
  """measure_speed of the pair over the whole lenience grid in one measurement (its
  leniences interleaved in the same cycles, against one plain decoding). Loads the
  checkpoints itself (run_pinned); `tokens`: the vocabulary's special ids."""
  target, target_params = load_model(paths[0], "TARGET_CHECKPOINT_PATH", presets[0], capacity)
  draft, draft_params = load_model(paths[1], "DRAFT_CHECKPOINT_PATH", presets[1], capacity)
  target, draft = target.with_tokens(tokens), draft.with_tokens(tokens)
  return speed.measure_speed(target, target_params, {"draft": (draft, draft_params)},
                             prompts, gammas=config.gammas, temperatures=config.temperatures,
                             max_new_tokens=config.new_tokens,
                             **config.speed.measure_kwargs(), seed=config.seed,
                             leniences=config.leniences, progress=config.progress_bar,
                             draft_lengths=(config.draft_length,))


# --- the run -------------------------------------------------------------------------------


def _scalars(writer, row: dict) -> None:
  tag = (f"{row['task']}/T={row['temperature']}/gamma={row['gamma']}/"
         f"{row['lenience']}_eps={row['epsilon']}")
  values = dict(tau=row["tau"], mean_acceptance_length=row["mean_acceptance_length"],
                draft_acceptance_rate=row["draft_acceptance_rate"],
                alpha_distillspec=row["alpha_distillspec"],
                predicted_alpha=row["predicted_alpha"], speedup=row["speedup"],
                speedup_end_to_end=row["speedup_end_to_end"],
                speedup_typical=row["speedup_typical"],
                cost_model_speedup=row["cost_model_speedup"],
                **{f"quality/{k}": v for k, v in row["quality"].items()})
  for name, value in values.items():
    if value is not None:
      writer.add_scalar(f"{tag}/{name}", value, 0)


def _load_pair(config: EvalConfig, tokens: TokenIds) -> tuple:
  """(target, target params, draft, draft params), both models with the vocabulary's special
  ids `tokens`, checked as a pair by the engine now, the parameters on the EvalConfig's mesh
  (`_place`)."""
  models = {}
  for role, path, preset in (("target", config.target_checkpoint_path, config.target_model),
                             ("draft", config.draft_checkpoint_path, config.draft_model)):
    macro = f"{role.upper()}_CHECKPOINT_PATH"
    if preset:  # the shapes are known: nothing read but this process's shards
      check_checkpoint(path, macro)
      try:
        importer.check_checkpoint(path, model_config(preset))
      except ValueError as error:
        raise ValueError(f"{macro}={path!r} does not hold the {role} model {preset!r}: "
                         f"{error}") from None
      models[role] = (Model(model_config(preset)), None, path)
    else:
      model, params = load_model(path, macro, None, None)
      models[role] = (model, params, path)
    try:
      models[role] = (models[role][0].with_tokens(tokens),) + models[role][1:]
    except ValueError as error:
      raise ValueError(f"{macro}={path!r} does not fit the vocabulary: {error}") from None
  target, draft = models["target"][0], models["draft"][0]
  try:
    check_pair(target, draft)
  except ValueError as error:
    raise ValueError(f"TARGET_CHECKPOINT_PATH={config.target_checkpoint_path!r} and "
                     f"DRAFT_CHECKPOINT_PATH={config.draft_checkpoint_path!r} do not make a "
                     f"pair: {error}") from None
  mesh = eval_mesh(config, target, draft)
  target_params = precision.cast_params(_place(*models["target"], mesh),
                                        config.target_param_dtype)
  return target, target_params, draft, _place(*models["draft"], mesh)


def eval_mesh(config: EvalConfig, target: Model, draft: Model):
  """The (DATA_PARALLEL, MODEL_PARALLEL) mesh of all processes' devices (one process: its
  own), checked against both models: the parameters are laid out on it and each evaluation
  batch's rows split over its 'data' axis (examples.read_examples)."""
  mesh = partitioning.make_mesh(config.data_parallel, config.model_parallel,
                                devices=jax.devices())
  partitioning.check_model_axis({"target": target, "draft": draft}, mesh)
  return mesh


def _place(model: Model, params, path: str, mesh):
  """`model`'s parameters on `mesh` by the rules: restored straight into the shards
  (`importer.restore_any` on abstract sharded parameters) when `params` is None, else the
  loaded host arrays sliced into them (`multihost.put_global`)."""
  shardings = partitioning.param_shardings(model, mesh)
  if params is None:
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            model.param_shapes(), shardings)
    return importer.restore_any(path, abstract)
  return multihost.put_global(params, shardings)


# A metrics.json row's fields that come from the speculative_grid row as they are.
_RUN_FIELDS = ("temperature", "gamma", "lenience", "epsilon", "quality", "tau", "tau_stderr",
               "mean_acceptance_length", "draft_acceptance_rate", "alpha", "alpha_distillspec",
               "acceptance_by_position", "draft_acceptance_rate_by_position")


def _evaluate_task(config: EvalConfig, name: str, examples: dict, pair: tuple,
                   scorer: evaluate_lib.TaskScorer, bar, place) -> tuple:
  """(rows, the target alone's quality at the lowest temperature, inference lines) of one
  task: the target alone and speculative_grid at each temperature. `place`: each batch's
  rows over the mesh's 'data' axis where it divides them (with several processes each
  hands over only its rows, and all get every output)."""
  target, target_params, draft, draft_params = pair
  common = dict(max_new_tokens=config.new_tokens, batch_size=config.batch_size,
                seed=config.seed, place=place)
  texts = list(zip(examples["prompt_texts"], examples["target_texts"]))
  rows, lines, alone_quality = [], [], None
  for temperature in config.temperatures:
    alone = quality.target_alone(target, target_params, draft, draft_params, examples,
                                 temperature=temperature, detokenize=scorer.detokenize,
                                 metric_fn=scorer.metrics, **common)
    if temperature == min(config.temperatures):
      alone_quality = alone["quality"]
    lines += [dict(decoder="target", temperature=float(temperature), input=i, reference=r,
                   prediction=p, accepted_per_round=None)
              for (i, r), p in zip(texts, alone["predictions"])]
    bar.update(1)
    for run in evaluate_lib.speculative_grid(
        target, target_params, {"draft": (draft, draft_params)}, examples, scorer,
        gammas=config.gammas, temperatures=(temperature,), leniences=config.leniences,
        draft_length=config.draft_length,
        on_done=bar.update, **common):
      rows.append(dict(task=name, **{k: run[k] for k in _RUN_FIELDS},
                       predicted_alpha=alone["predicted_alpha"]))
      settings = {k: run[k] for k in ("temperature", "gamma", "lenience", "epsilon")}
      lines += [dict(decoder="speculative", **settings, input=i, reference=r, prediction=p,
                     accepted_per_round=a)
                for (i, r), p, a in zip(texts, run["predictions"], run["accepted_per_round"])]
  return rows, alone_quality, lines


def _add_timings(config: EvalConfig, names: list, examples: dict, capacity: int,
                 rows_by_task: dict, tokens: TokenIds) -> None:
  """Times each task's grid in a pinned process (loading the checkpoints itself) and adds
  the speed fields to its rows (None when speed_examples is 0, and on processes other than
  0: the timing is one process's batch-1 decodes, and process 0 alone writes the rows)."""
  for name in names:
    timing = None
    if config.speed.examples and multihost.is_primary():
      timing = pinning.run_pinned(
          pinning.timing_cpus(config.speed.cpus, jax.process_count()), _timings,
          (config.target_checkpoint_path, config.draft_checkpoint_path),
          (config.target_model, config.draft_model), capacity,
          examples[name]["prompts"][:config.speed.examples], config, tokens)
    for row in rows_by_task[name]:
      row.update(quality.speed_fields(timing, row["gamma"], row["temperature"],
                                      Lenience(row["lenience"], row["epsilon"]),
                                      config.draft_length))


def _write_outputs(config: EvalConfig, metrics: dict, lines_by_task: dict) -> None:
  """metrics.json, inferences/<task>.jsonl, the TensorBoard scalars, the lossy trade-off."""
  for name, lines in lines_by_task.items():
    with open(os.path.join(config.model_dir, "inferences", f"{name}.jsonl"), "w") as f:
      for line in lines:
        f.write(json.dumps(line) + "\n")
  write_text_atomic(os.path.join(config.model_dir, "metrics.json"),
                    json.dumps(metrics, indent=1) + "\n")  # rows keep the interface's order
  from tensorboardX import SummaryWriter
  writer = SummaryWriter(os.path.join(config.model_dir, "tensorboard"))
  for row in metrics["rows"]:
    _scalars(writer, row)
  writer.close()
  if len(config.leniences) > 1:
    lossy.write_tradeoff(metrics, config.model_dir)


def evaluate(config: EvalConfig) -> dict:
  """Runs the evaluation and writes every output; returns the metrics.json object."""
  from tqdm.auto import tqdm
  from distillspec_jax.data import batches as data
  from distillspec_jax.data import vocabularies
  config.check_inputs()
  # Every process takes part in every decode (one mesh over all of them, each process
  # handing over its rows of each batch) and gets every output; process 0 alone writes, and
  # the others wait at a barrier until its files are complete.
  primary = multihost.is_primary()
  if primary:
    os.makedirs(os.path.join(config.model_dir, "inferences"), exist_ok=True)
  register_tasks(config)
  names = task_names(config.mixture_or_task_name)
  splits = {name: eval_split(name, config.split) for name in names}
  vocabulary = data.get_vocabulary(names[0])
  tokens = vocabularies.token_ids(vocabulary)
  target, target_params, draft, draft_params = _load_pair(config, tokens)
  # Each process reads only the rows it hands to the decoders (process 0 also the timed
  # first prompts); every process gets every row's texts and lengths.
  mesh = eval_mesh(config, target, draft)
  read = {name: examples_lib.read_examples(
      name, splits[name], config.task_feature_lengths, num_examples=config.eval_examples,
      mesh=mesh, batch_size=config.batch_size, leading=config.speed.examples,
      on_long_prompt="truncate") for name in names}
  examples = {name: value[0] for name, value in read.items()}
  width = max(e["prompts"].shape[1] for e in examples.values())
  capacity = decode_capacity(config, target.config, draft.config, width)
  target = Model(target.config.replace(max_decode_length=capacity), tokens)
  draft = Model(draft.config.replace(max_decode_length=capacity), tokens)
  if vocabulary.vocab_size > target.config.vocab_size:
    raise ValueError(f"The task's vocabulary has {vocabulary.vocab_size} pieces but the models "
                     f"have vocab_size={target.config.vocab_size}; pass the checkpoints' "
                     "SentencePiece model as --gin.VOCABULARY=<path.model>.")
  total = len(names) * len(config.temperatures) * (
      1 + len(config.gammas) * len(config.leniences))
  rows_by_task, alone_by_task, lines_by_task = {}, {}, {}
  with tqdm(total=total, desc="evaluate", dynamic_ncols=True,
            disable=not config.progress_bar) as bar:
    for name in names:
      rows_by_task[name], alone_by_task[name], lines_by_task[name] = _evaluate_task(
          config, name, examples[name], (target, target_params, draft, draft_params),
          evaluate_lib.TaskScorer(name, vocabulary), bar, read[name][1])
  del target_params, draft_params
  _add_timings(config, names, examples, capacity, rows_by_task, tokens)
  rows = [r for name in names for r in rows_by_task[name]]
  if len(names) > 1:
    mixture_rows, mixture_alone = quality.mixture_mean(config.mixture_or_task_name,
                                                       rows_by_task, alone_by_task)
    rows += mixture_rows
    alone_by_task[config.mixture_or_task_name] = mixture_alone
  metrics = {"rows": [{k: row[k] for k in quality.ROW_FIELDS} for row in rows],
             "target_alone": alone_by_task}
  if primary:
    _write_outputs(config, metrics, lines_by_task)
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


def prepare(argv: Sequence[str]) -> EvalConfig:
  """Everything checked before work starts: flags, run file, values, input paths."""
  # --coordinator_address / --process_count / --process_index (multihost.py), before JAX starts.
  argv = multihost.initialize_from_flags(argv)
  config = load_config(argv)
  config.check_inputs()
  return config


def run(config: EvalConfig) -> int:
  os.makedirs(config.model_dir, exist_ok=True)
  if multihost.is_primary():  # process 0 is the one writer
    with open(os.path.join(config.model_dir, "config.gin"), "w") as f:
      f.write(gin.config_str())
  metrics = evaluate(config)
  if multihost.is_primary():
    print(lossy.rows_markdown(metrics), flush=True)
    print(f"Wrote {os.path.join(config.model_dir, 'metrics.json')}")
  return 0


def run_dry_run(argv: Sequence[str]) -> int:
  """--dry_run: the speculative engine (both models, both caches) compiled at the grid's
  largest gamma and temperature on BATCH_SIZE prompts for the gin mesh and slice (SLICE,
  default v4-8); 0 when it fits, 1 when it does not. Needs the presets (no checkpoint read)."""
  from distillspec_jax.training import dry_run
  config = load_config(argv)
  settings = gin_utils.start_dry_run()  # before JAX starts: the slice's simulated devices
  if not (config.target_model and config.draft_model):
    raise gin_utils.GinConfigError(
        "--dry_run needs the models' shapes without reading the checkpoints: set "
        "--gin.EvalConfig.target_model=<preset> and --gin.EvalConfig.draft_model=<preset>.")
  target, draft = Model(model_config(config.target_model)), Model(model_config(config.draft_model))
  inputs = int(config.task_feature_lengths.get("inputs", 0) or 1)
  stages = [dry_run.Stage("evaluate", lambda mesh, batch: dry_run.speculative_program(
      target, draft, mesh, batch, inputs, config.new_tokens, gamma=max(config.gammas),
      temperature=max(config.temperatures), target_param_dtype=config.target_param_dtype),
      config.batch_size, {"target": target, "draft": draft})]
  devices = dry_run.dry_run_devices(settings.devices)
  rows = dry_run.run(stages, (config.data_parallel, config.model_parallel), devices,
                     settings.chip, proxy_data=settings.proxy_data,
                     peak_fraction=settings.peak_fraction)
  levers = [] if config.target_param_dtype == "bfloat16" else ["--gin.TARGET_PARAM_DTYPE=bfloat16"]
  return gin_utils.finish_dry_run(rows, stages, devices, settings, levers)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  gin_utils.exit_on_help(argv, "distillspec_jax.eval", __doc__)
  wanted, argv = gin_utils.take_dry_run_flag(argv)
  if wanted:
    return run_dry_run(argv)
  return run(prepare(argv))


if __name__ == "__main__":
  # Through the imported module, so that the timing process (spawned) unpickles EvalConfig
  # and _timings from distillspec_jax.eval, not from __main__. The evaluation's own refusals
  # (a split the task lacks, checkpoints that do not pair) come before its decodes: every
  # user error exits 2 with its message.
  from distillspec_jax import eval as _eval_module
  sys.exit(gin_utils.exit_on_user_error(_eval_module.main))
