r"""The evaluation binary, T5X style: quality next to latency for a target and a draft.

  python -m distillspec_jax.eval --gin_file=gin/runs/eval_demo.gin \
      [--gin.MODEL_DIR=runs/eval_demo] [--gin.DRAFT_CHECKPOINT_PATH=...]

Macros (T5X names): MODEL_DIR, MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, BATCH_SIZE,
TARGET_CHECKPOINT_PATH and DRAFT_CHECKPOINT_PATH (our orbax format, T5X or Hugging Face,
autodetected by `importer.detect_format`; with DRAFT_KIND='head' a draft head's folder, the
main job's distill_head_<recipe>, whose head.json gives its shape), plus VOCABULARY (the
SentencePiece model the checkpoints were trained with), DATA_DIR (file-backed tasks),
BBH_DIR (the public BBH bbh/ folder) and the grid: GAMMAS, TEMPERATURES, LENIENCE_KINDS,
EPSILONS (bound to `EvalConfig.grid = @DecodingGrid()`; the timing is
`EvalConfig.speed = @SpeedConfig()`, the mesh `EvalConfig.mesh = @MeshConfig()`, the
precision `EvalConfig.precision = @PrecisionConfig()`).

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
is checked before work starts; a mistake exits with status 1 and the message naming the fix.

Both models' parameters are laid out on a (DATA_PARALLEL, MODEL_PARALLEL) mesh by the
partitioning rules (restored straight into their shards when EvalConfig.target_model /
draft_model name the presets), the target's cast to TARGET_PARAM_DTYPE
(PrecisionConfig.target_param_dtype) for the quality and tau decodes. `--dry_run` compiles
the speculative engine for that mesh and the slice SLICE instead and prints what it needs per
device (training/dry_run.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Literal, Optional, Sequence

import gin
import jax

from distillspec_jax import gin_utils
from distillspec_jax.core.files import write_text_atomic
from distillspec_jax.core.validation import (check_decode_capacity, check_feature_lengths,
                                             check_field_types, check_int, check_output_dir,
                                             check_path, check_positive_int,
                                             check_speculative_budget)
from distillspec_jax.decoding.speculative import DraftLength, check_pair
from distillspec_jax.evaluation import evaluate as evaluate_lib
from distillspec_jax.evaluation import examples as examples_lib
from distillspec_jax.evaluation import lossy
from distillspec_jax.evaluation import pinning
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig, check_checkpoint
from distillspec_jax.interop import importer
from distillspec_jax.models import precision
from distillspec_jax.models.precision import PrecisionConfig
from distillspec_jax.models.config import TransformerConfig, model_config
from distillspec_jax.models.head import HEAD_CONFIG_FILE, Head, read_head_config
from distillspec_jax.models.model import Model, TokenIds
from distillspec_jax.training import metrics_log
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning
from distillspec_jax.training.partitioning import MeshConfig


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
    chat_template: CHAT_TEMPLATE, the file-backed tasks rendered by VOCABULARY's chat template
      and DATA_DIR/chat/'s conversations as `chat_files` (data/tasks/chat_tasks.py).
    bbh_dir: the BBH folder (one JSON per subtask) for the bbh_* tasks and the 'bbh' mixture.
    split: evaluation split (None: 'test', else 'validation').
    eval_examples: prompts per task for quality, tau and alpha.
    grid: the speculative grid (evaluation.decoding_grid.DecodingGrid, shared with the main
      job; gin: EvalConfig.grid = @DecodingGrid()): gammas, temperatures, the lenience grid
      (every kind at every epsilon; epsilon 1 is lossless) and the draft-length rule
      (speculative.DraftLength: 'fixed' gamma, or an adaptive rule up to gamma as gamma_max;
      DecodingGrid.draft_length = @DraftLength()).
    max_new_tokens: decoding budget (None: task_feature_lengths["targets"]).
    speed: the timing's settings (evaluation.evaluate.SpeedConfig, shared with the main
      job; gin: EvalConfig.speed = @SpeedConfig()): the first SpeedConfig.examples
      evaluation prompts timed one at a time (0: no timing, speed fields null), the whole
      lenience grid of a task timed together.
    max_decode_length: cache capacity of both models (None: what the grid needs, rounded up to
      a multiple of 16, or the presets' when larger).
    seed: one key for every decode: batch b of every configuration uses fold_in(seed key, b).
    mesh: the (data, model) mesh of all processes' devices both models' parameters are laid
      out on by the partitioning rules (training.partitioning.MeshConfig, shared with the
      other binaries; gin: EvalConfig.mesh = @MeshConfig()): a target sharded over 'model'
      never sits whole on one device. Each batch's prompts are split over 'data' when it divides
      BATCH_SIZE (else every device decodes the whole batch); with several processes each
      hands over only the rows its devices hold.
    precision: the models' activation dtype and remat policy (None: as their presets or
      checkpoints have them) and the target's parameter dtype, cast after loading
      (models.precision.PrecisionConfig, shared with the other binaries; gin:
      EvalConfig.precision = @PrecisionConfig(), PrecisionConfig.target_param_dtype =
      %TARGET_PARAM_DTYPE; None = as stored).
    lm_prompt_length: for a task without 'inputs' (a language-modelling task such as
      lm1b_files), the first this many target tokens of each held-out row are the prompt and
      the rest its reference (None: such a task is refused before work starts).
    draft_kind: 'model' (a separate draft model) or 'head' (DRAFT_KIND): a draft head
      (models/head.py) whose folder (the main job's distill_head_<recipe>) holds head.json
      beside its parameters; it drafts from the target's hidden states.
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
  chat_template: bool = False
  bbh_dir: Optional[str] = None
  split: Optional[str] = None
  eval_examples: int = 128
  grid: DecodingGrid = DecodingGrid()
  max_new_tokens: Optional[int] = None
  speed: SpeedConfig = SpeedConfig(examples=8)
  max_decode_length: Optional[int] = None
  seed: int = 0
  progress_bar: bool = True
  mesh: MeshConfig = MeshConfig()
  precision: PrecisionConfig = PrecisionConfig()
  draft_kind: Literal["model", "head"] = "model"
  lm_prompt_length: Optional[int] = None

  def __post_init__(self):
    for name, macro, example in (
        ("model_dir", "MODEL_DIR", "<directory>"),
        ("mixture_or_task_name", "MIXTURE_OR_TASK_NAME", "embedded_arithmetic"),
        ("target_checkpoint_path", "TARGET_CHECKPOINT_PATH", "<checkpoint>"),
        ("draft_checkpoint_path", "DRAFT_CHECKPOINT_PATH", "<checkpoint>")):
      if not getattr(self, name):  # gin's unset macro is None: say which, not the type
        raise ValueError(f"{macro} is not set; pass --gin.{macro}={example}.")
    check_field_types(self)
    check_feature_lengths(self.task_feature_lengths, "TASK_FEATURE_LENGTHS")
    for name, kind in (("grid", DecodingGrid), ("speed", SpeedConfig), ("mesh", MeshConfig),
                       ("precision", PrecisionConfig)):
      if not isinstance(getattr(self, name), kind):
        raise TypeError(f"EvalConfig.{name}={getattr(self, name)!r} must be a "
                        f"{kind.__name__} (gin: EvalConfig.{name} = @{kind.__name__}()).")
    if self.chat_template and (self.vocabulary is None or self.data_dir is None):
      raise ValueError(
          f"CHAT_TEMPLATE=True with VOCABULARY={self.vocabulary!r} and DATA_DIR="
          f"{self.data_dir!r}: the file-backed tasks are rendered by the tokenizer folder's "
          "chat template; set both, or CHAT_TEMPLATE=False.")
    for name in ("batch_size", "eval_examples"):
      check_positive_int(getattr(self, name), name)
    check_int(self.seed, "seed (SEED)", 0)  # one seed rule in every binary
    if self.max_decode_length is not None:
      check_positive_int(self.max_decode_length, "max_decode_length")
    if self.lm_prompt_length is not None:
      check_positive_int(self.lm_prompt_length, "EvalConfig.lm_prompt_length")
    if self.max_new_tokens is None:
      check_positive_int(self.task_feature_lengths.get("targets"),
                         "TASK_FEATURE_LENGTHS['targets'] (the decoding budget when "
                         "EvalConfig.max_new_tokens is None)")
    check_speculative_budget(
        self.new_tokens, "EvalConfig.max_new_tokens" if self.max_new_tokens is not None else
        "TASK_FEATURE_LENGTHS['targets'] (the decoding budget when EvalConfig.max_new_tokens "
        "is None)")
    self.speed.check_prompts(self.eval_examples, "EvalConfig")
    if self.draft_kind == "head" and self.draft_model is not None:
      raise ValueError(f"EvalConfig.draft_model={self.draft_model!r} names a draft model preset "
                       "but DRAFT_KIND='head': a head's shape comes from its folder's "
                       "head.json; set EvalConfig.draft_model = None.")

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
      vocab = vocabularies.check_vocabulary(self.vocabulary, "VOCABULARY", (
          ("TARGET_CHECKPOINT_PATH", self.target_checkpoint_path),
          ("DRAFT_CHECKPOINT_PATH", self.draft_checkpoint_path)))
      if self.chat_template:
        from distillspec_jax.data.chat_template import template_of
        template_of(vocab)
    else:
      vocab = None
    importer.check_checkpoint_tokenizers(
        (("TARGET_CHECKPOINT_PATH", self.target_checkpoint_path),
         ("DRAFT_CHECKPOINT_PATH", self.draft_checkpoint_path)), vocab)
    if self.data_dir is not None:
      check_path(self.data_dir, "DATA_DIR", kind="dir",
                 fix="pass the folder with gsm8k/, mbpp/, alpaca/, ... (e.g. ../shared/data).")
    if self.bbh_dir is not None:
      from distillspec_jax.data.tasks import transfer_tasks
      transfer_tasks.check_bbh_dir(self.bbh_dir)
    check_checkpoint(self.target_checkpoint_path, "TARGET_CHECKPOINT_PATH")
    check_checkpoint(self.draft_checkpoint_path, "DRAFT_CHECKPOINT_PATH")
    holds_head = os.path.exists(os.path.join(self.draft_checkpoint_path, HEAD_CONFIG_FILE))
    if holds_head and self.draft_kind != "head":
      raise ValueError(f"DRAFT_CHECKPOINT_PATH={self.draft_checkpoint_path!r} holds a draft "
                       f"head ({HEAD_CONFIG_FILE}); pass --gin.DRAFT_KIND=\"'head'\" to "
                       "evaluate it as one.")
    if self.draft_kind == "head" and not holds_head:
      raise ValueError(f"DRAFT_KIND='head' but DRAFT_CHECKPOINT_PATH="
                       f"{self.draft_checkpoint_path!r} holds no {HEAD_CONFIG_FILE}: point it "
                       "at a head's folder (the main job's distill_head_<recipe>), or set "
                       "DRAFT_KIND='model'.")
    self._check_decode_capacity(self._check_presets(vocab))

  def _check_decode_capacity(self, target: TransformerConfig) -> None:
    """max_decode_length, when set, holds the longest request of the grid: a decoder-only
    `target`'s prompt (up to TASK_FEATURE_LENGTHS['inputs']) after its first slot, the new
    tokens and the last round's gamma - 1 more. Refused here, before MODEL_DIR exists; the
    decoders refuse it only when they run."""
    if not self.max_decode_length:
      return
    prompt = 0 if target.kind == "encoder_decoder" else self.task_feature_lengths.get("inputs", 0)
    check_decode_capacity(self.max_decode_length, "EvalConfig.max_decode_length",
                          prompt=prompt, new_tokens=self.new_tokens,
                          gamma=max(self.grid.gammas), or_else=" (or None: sized from the prompts)")

  def _check_presets(self, vocab=None) -> TransformerConfig:
    """A preset named beside a checkpoint is checked against it (shapes, and RoPE, norm and
    the other stored settings) without reading a weight: a mismatch is refused here, before
    MODEL_DIR exists, not when the weights load. A checkpoint named by no preset is checked
    as it describes itself (importer.check_own_checkpoint; `vocab`: VOCABULARY's, or None).
    Returns the target's model (its preset's, else its checkpoint's)."""
    roles = [("TARGET", self.target_checkpoint_path, self.target_model, "target_model")]
    if self.draft_kind == "model":  # a head's shapes come from its folder
      roles.append(("DRAFT", self.draft_checkpoint_path, self.draft_model, "draft_model"))
    models = []
    for role, path, preset, field in roles:
      if preset is None:
        models.append(importer.check_own_checkpoint(path, f"{role}_CHECKPOINT_PATH",
                                                    f"EvalConfig.{field}", vocab))
        continue
      models.append(model_config(preset))
      try:
        importer.check_checkpoint(path, models[-1])
      except ValueError as error:
        raise ValueError(f"{role}_CHECKPOINT_PATH={path!r} does not hold the preset "
                         f"EvalConfig.{field}={preset!r}: {error} Name the checkpoint's own "
                         f"preset, or leave EvalConfig.{field}=None to build the model from "
                         "the checkpoint.") from None
    return models[0]


# The configs a run file binds, EvalConfig's sub-configs after it (--help lists them).
CONFIGS = (EvalConfig, DecodingGrid, DraftLength, SpeedConfig, MeshConfig, PrecisionConfig)


# --- checkpoints and tasks -------------------------------------------------------------------


def load_model(path: str, macro: str, preset: Optional[str],
               max_decode_length: Optional[int]) -> tuple:
  """(Model, fp32 params) of a checkpoint in any supported format (autodetected); with
  `preset`, the checkpoint's shapes are checked against it."""
  fmt = check_checkpoint(path, macro)
  config = model_config(preset) if preset else None
  head = importer.acceptance_head_of(path) if fmt == "ours" else None
  if head is None:
    params, config = importer.load_checkpoint(path, config, fmt=fmt)
  else:  # the network's shapes and the head's: restored together
    config, params = importer.load_ours_with_head(path, config, head)
  if max_decode_length:
    config = config.replace(max_decode_length=max_decode_length)
  return Model(config, acceptance_head=head), params


def decode_capacity(config: EvalConfig, target: TransformerConfig, draft: TransformerConfig,
                    prompt_width: int) -> int:
  """Cache slots both models need for the grid (see speculative.py), at least the presets'."""
  if config.max_decode_length:
    return config.max_decode_length
  width = 1 if target.kind == "encoder_decoder" else 1 + prompt_width
  needed = width + config.new_tokens + max(config.grid.gammas)
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
      tasks.register_file_tasks(config.data_dir, vocabulary=vocabulary,
                                chat_template=config.chat_template)
    except FileNotFoundError:
      if not found:
        raise
  if config.bbh_dir:
    tasks.register_bbh_tasks(config.bbh_dir, vocabulary=vocabulary)


def task_names(name: str) -> list:
  """The tasks of a mixture, or [name]."""
  import seqio
  from distillspec_jax.data import batches
  task = batches.get_task(name)
  if isinstance(task, seqio.Mixture):
    return sorted(t.name for t in task.tasks)
  return [name]


def eval_split(task_name: str, split: Optional[str]) -> str:
  from distillspec_jax.data import batches
  splits = sorted(batches.get_task(task_name).splits)
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
  target = config.precision.apply(target, "target")
  draft, draft_params = load_draft(config, target, capacity)
  target = target.with_tokens(tokens)
  if not isinstance(draft, Head):
    draft = config.precision.apply(draft, "draft").with_tokens(tokens)
  plan = speed.TimingPlan(gammas=config.grid.gammas, temperatures=config.grid.temperatures,
                         max_new_tokens=config.new_tokens, leniences=tuple(config.grid.leniences),
                         draft_lengths=(config.grid.draft_length,), seed=config.seed,
                         **config.speed.measure_kwargs())
  return speed.measure_speed(target, target_params, {"draft": (draft, draft_params)},
                             prompts, plan, progress=config.progress_bar)


# --- the run -------------------------------------------------------------------------------


def _scalars(writer, row: evaluate_lib.EvaluationRow) -> None:
  point = row.point
  tag = (f"{row.task}/T={point.temperature}/gamma={point.gamma}/"
         f"{point.lenience}_eps={point.epsilon}")
  for name, value in row.scalars().items():
    writer.add_scalar(f"{tag}/{name}", value, 0)


def load_head(path: str, target: Model) -> Head:
  """The draft head whose folder `path` records its shape (head.json), for `target`."""
  head = Head(read_head_config(path, target.config, "DRAFT_CHECKPOINT_PATH"))
  head.check_target(target)
  return head


def load_draft(config: EvalConfig, target: Model, capacity: Optional[int]) -> tuple:
  """(draft Model or Head, fp32 params) of DRAFT_CHECKPOINT_PATH, whole on this process
  (the pinned timing process)."""
  if config.draft_kind == "model":
    return load_model(config.draft_checkpoint_path, "DRAFT_CHECKPOINT_PATH",
                      config.draft_model, capacity)
  head = load_head(config.draft_checkpoint_path, target)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                          head.param_shapes())
  return head, importer.restore_any(config.draft_checkpoint_path, abstract)


def _fewest_rows(config: EvalConfig) -> int:
  """The smallest embedding row count of the pair's models (a head's are its target's): a
  tokenizer with more ids is cut to it (vocabularies.token_ids)."""
  roles = [(config.target_checkpoint_path, config.target_model, "TARGET_CHECKPOINT_PATH")]
  if config.draft_kind == "model":
    roles.append((config.draft_checkpoint_path, config.draft_model, "DRAFT_CHECKPOINT_PATH"))
  return min((model_config(preset) if preset else importer.stored_config(
      importer.open_checkpoint(path), path, macro, "EvalConfig")).vocab_size
             for path, preset, macro in roles)


def _load_pair(config: EvalConfig, tokens: TokenIds) -> tuple:
  """(target, target params, draft, draft params), the models with the vocabulary's special
  ids `tokens` (a preset already checked against its checkpoint by `check_inputs`), checked as
  a pair by the engine now, the parameters on the EvalConfig's mesh
  (`_place`). A draft head's shape comes from its folder's head.json; its parameters are
  restored into their shards."""
  models = {}
  roles = [("target", config.target_checkpoint_path, config.target_model)]
  if config.draft_kind == "model":
    roles.append(("draft", config.draft_checkpoint_path, config.draft_model))
  for role, path, preset in roles:
    macro = f"{role.upper()}_CHECKPOINT_PATH"
    if preset:  # the shapes are known (checked in check_inputs): only this process's shards
      model, params = Model(model_config(preset)), None
    else:
      model, params = load_model(path, macro, None, None)
    models[role] = (config.precision.apply(model, role), params, path)
    try:
      models[role] = (models[role][0].with_tokens(tokens),) + models[role][1:]
    except ValueError as error:
      raise ValueError(f"{macro}={path!r} does not fit the vocabulary: {error}") from None
  if config.draft_kind == "head":
    models["draft"] = (load_head(config.draft_checkpoint_path, models["target"][0]), None,
                       config.draft_checkpoint_path)
  target, draft = models["target"][0], models["draft"][0]
  try:
    check_pair(target, draft)
  except ValueError as error:
    raise ValueError(f"TARGET_CHECKPOINT_PATH={config.target_checkpoint_path!r} and "
                     f"DRAFT_CHECKPOINT_PATH={config.draft_checkpoint_path!r} do not make a "
                     f"pair: {error}") from None
  mesh = eval_mesh(config, target, draft)
  target_params = precision.cast_params(_place(*models["target"], mesh),
                                        config.precision.target_param_dtype)
  return target, target_params, draft, _place(*models["draft"], mesh)


def eval_mesh(config: EvalConfig, target: Model, draft: Model):
  """The (DATA_PARALLEL, MODEL_PARALLEL) mesh of all processes' devices (one process: its
  own), checked against both models: the parameters are laid out on it and each evaluation
  batch's rows split over its 'data' axis (examples.read_examples)."""
  mesh = config.mesh.make(jax.devices())
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


def _evaluate_task(config: EvalConfig, name: str, examples, pair: tuple,
                   scorer: evaluate_lib.TaskScorer, bar, place) -> tuple:
  """(rows, the target alone's quality at the lowest temperature, inference lines) of one
  task: the target alone and speculative_grid at each temperature. `place`: each batch's
  rows over the mesh's 'data' axis where it divides them (with several processes each
  hands over only its rows, and all get every output)."""
  target, target_params, draft, draft_params = pair
  common = dict(max_new_tokens=config.new_tokens, batch_size=config.batch_size,
                seed=config.seed, place=place)
  texts = list(zip(examples.prompt_texts, examples.target_texts))
  rows, lines, alone_quality = [], [], None
  for temperature in config.grid.temperatures:
    alone = quality.target_alone(target, target_params, draft, draft_params, examples,
                                 temperature=temperature, detokenize=scorer.detokenize,
                                 metric_fn=scorer.metrics, **common)
    if temperature == min(config.grid.temperatures):
      alone_quality = alone.quality
    lines += [dict(decoder="target", temperature=float(temperature), input=i, reference=r,
                   prediction=p, accepted_per_round=None)
              for (i, r), p in zip(texts, alone.predictions)]
    bar.update(1)
    for run in evaluate_lib.speculative_grid(
        target, target_params, {"draft": (draft, draft_params)}, examples, scorer,
        gammas=config.grid.gammas, temperatures=(temperature,), leniences=config.grid.leniences,
        draft_length=config.grid.draft_length,
        on_done=bar.update, **common):
      rows.append(evaluate_lib.EvaluationRow.of(name, run,
                                                predicted_alpha=alone.predicted_alpha,
                                                num_examples=len(examples)))
      lines += [dict(decoder="speculative", **run.point.to_json(), input=i, reference=r,
                     prediction=p, accepted_per_round=a)
                for (i, r), p, a in zip(texts, run.predictions, run.accepted_per_round)]
  return rows, alone_quality, lines


def _add_timings(config: EvalConfig, names: list, examples: dict, capacity: int,
                 rows_by_task: dict, tokens: TokenIds) -> None:
  """Times each task's grid in a pinned process (loading the checkpoints itself) and gives
  its rows their speed.SpeedFigures (None when SpeedConfig.examples is 0, and on processes other
  than 0: the timing is one process's batch-1 decodes, and process 0 alone writes the
  rows). `tokens`: the vocabulary's special ids."""
  for name in names:
    timing = None
    if config.speed.examples and multihost.is_primary():
      timing = pinning.run_pinned(
          pinning.timing_cpus(config.speed.cpus, jax.process_count()), _timings,
          (config.target_checkpoint_path, config.draft_checkpoint_path),
          (config.target_model, config.draft_model), capacity,
          examples[name].prompts[:config.speed.examples], config, tokens)
    if timing is not None:
      rows_by_task[name] = [dataclasses.replace(row, speed=timing.row(row.draft,
                                                                        row.point).figures)
                            for row in rows_by_task[name]]


def _write_outputs(config: EvalConfig, metrics: dict, lines_by_task: dict,
                   config_gin: Optional[str] = None) -> None:
  """inferences/<task>.jsonl, config.gin (`config_gin`, the binary's), metrics.json, the
  TensorBoard scalars, the lossy trade-off: all once the evaluation is done, so that an
  interrupted rerun leaves a finished run's files as they were."""
  for name, lines in lines_by_task.items():
    write_text_atomic(os.path.join(config.model_dir, "inferences", f"{name}.jsonl"),
                      "".join(json.dumps(line) + "\n" for line in lines))
  if config_gin is not None:
    write_text_atomic(os.path.join(config.model_dir, "config.gin"), config_gin)
  write_text_atomic(os.path.join(config.model_dir, "metrics.json"),
                    json.dumps(metrics, indent=1) + "\n")  # rows keep the interface's order
  writer = metrics_log.summary_writer(os.path.join(config.model_dir, "tensorboard"))
  for row in metrics["rows"]:
    _scalars(writer, evaluate_lib.EvaluationRow.from_json(row))
  writer.close()
  if len(config.grid.leniences) > 1:
    lossy.write_tradeoff(metrics, config.model_dir)


def check_example_counts(config: EvalConfig, examples: dict, splits: dict) -> None:
  """Warns, naming the task and both counts, for each task whose split holds fewer than
  EVAL_EXAMPLES examples: it is evaluated on all it has (a mixture's tasks may differ in
  size: each gives up to EVAL_EXAMPLES), and metrics.json's rows record how many
  (EvaluationRow.num_examples)."""
  for name, read in examples.items():
    if len(read) < config.eval_examples:
      logging.warning("Task %r: EVAL_EXAMPLES=%d requested, but its %r split has %d examples; "
                      "evaluating those %d (metrics.json's rows record num_examples).", name,
                      config.eval_examples, splits[name], len(read), len(read))


def evaluate(config: EvalConfig, config_gin: Optional[str] = None) -> dict:
  """Runs the evaluation and writes every output (with `config_gin`, the binary's
  configuration, as config.gin); returns the metrics.json object."""
  from tqdm.auto import tqdm
  from distillspec_jax.data import batches
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
  vocabulary = batches.get_vocabulary(names[0])
  tokens = vocabularies.token_ids(vocabulary, rows=_fewest_rows(config))
  target, target_params, draft, draft_params = _load_pair(config, tokens)
  # Each process reads only the rows it hands to the decoders (process 0 also the timed
  # first prompts); every process gets every row's texts and lengths.
  mesh = eval_mesh(config, target, draft)
  read = {name: examples_lib.read_examples(
      name, splits[name], config.task_feature_lengths, num_examples=config.eval_examples,
      mesh=mesh, batch_size=config.batch_size, leading=config.speed.examples,
      on_long_prompt="truncate", lm_prompt_length=config.lm_prompt_length) for name in names}
  examples = {name: value[0] for name, value in read.items()}
  check_example_counts(config, examples, splits)
  for name in names:
    vocabularies.check_examples(vocabulary, examples[name], tokens.num_tokens, name)
  width = max(e.prompts.shape[1] for e in examples.values())
  capacity = decode_capacity(config, target.config, draft.config, width)
  target = Model(target.config.replace(max_decode_length=capacity), tokens)
  draft = (Head(draft.config.replace(target=target.config)) if isinstance(draft, Head)
           else Model(draft.config.replace(max_decode_length=capacity), tokens,
                      acceptance_head=draft.acceptance_head))
  if (not vocabularies.is_tokenizer(vocabulary)
      and vocabulary.vocab_size > target.config.vocab_size):
    raise ValueError(f"The task's vocabulary has {vocabulary.vocab_size} pieces but the models "
                     f"have vocab_size={target.config.vocab_size}; pass the checkpoints' "
                     "SentencePiece model as --gin.VOCABULARY=<path.model>.")
  total = len(names) * len(config.grid.temperatures) * (
      1 + len(config.grid.gammas) * len(config.grid.leniences))
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
    mixture_rows, mixture_alone = evaluate_lib.mixture_mean(config.mixture_or_task_name,
                                                            rows_by_task, alone_by_task)
    rows += mixture_rows
    alone_by_task[config.mixture_or_task_name] = mixture_alone
  metrics = {"rows": [row.to_json() for row in rows], "target_alone": alone_by_task}
  if primary:
    _write_outputs(config, metrics, lines_by_task, config_gin)
  multihost.barrier("eval_outputs_written")
  return metrics


# --- gin edge ------------------------------------------------------------------------------


def evaluate_job(config: EvalConfig) -> dict:
  """The gin entry point: `evaluate_job.config = @EvalConfig()` in a gin/runs/eval_*.gin
  (registered by `load_config`: gin_utils.register)."""
  return evaluate(config)


def load_config(argv: Sequence[str]) -> EvalConfig:
  """Parses the gin flags and builds the run file's EvalConfig (nothing runs)."""
  gin_utils.register(evaluate_job, *CONFIGS)
  gin_utils.parse_binary_flags(argv)
  try:
    reference = gin.query_parameter("evaluate_job.config")
  except ValueError as error:
    raise gin_utils.GinConfigError(
        "The run file does not bind evaluate_job.config; use a gin/runs/eval_*.gin file, "
        "e.g. gin/runs/eval_demo.gin.") from error
  if not isinstance(reference, gin.config.ConfigurableReference):
    raise gin_utils.GinConfigError(
        f"evaluate_job.config={reference!r} is not a configuration; bind evaluate_job.config = "
        "@EvalConfig() (as the run files do).")
  try:
    config = reference.scoped_configurable_fn()
  except (TypeError, ValueError) as error:
    raise gin_utils.GinConfigError(f"Invalid evaluation configuration: {error}") from error
  gin_utils.check_bindings_read(argv, "distillspec_jax.eval", later=("evaluate_job", "dry_run"))
  return config


def prepare(argv: Sequence[str]) -> EvalConfig:
  """Everything checked before work starts: flags, run file, values, input paths."""
  # --coordinator_address / --process_count / --process_index (multihost.py), before JAX starts.
  argv = multihost.initialize_from_flags(argv)
  config = load_config(argv)
  config.mesh.make(jax.devices())  # sizes that do not divide the devices: refused now
  config.check_inputs()
  check_tasks(config)
  if multihost.is_primary():  # the one writer
    check_output_dir(config.model_dir, "MODEL_DIR")
  return config


def check_tasks(config: EvalConfig) -> None:
  """Registers the run's tasks and refuses an unknown task or split (the registry's
  ValueError names it and the registered ones), or a task without prompts ('inputs') and no
  EvalConfig.lm_prompt_length, before MODEL_DIR is written."""
  from distillspec_jax.data import batches
  register_tasks(config)
  for name in task_names(config.mixture_or_task_name):
    eval_split(name, config.split)
    if ("inputs" not in batches.get_task(name).output_features
        and config.lm_prompt_length is None):
      raise ValueError(
          f"MIXTURE_OR_TASK_NAME={config.mixture_or_task_name!r}: task {name!r} has no "
          "'inputs' (a language-modelling task), so its held-out rows hold no prompt; set "
          "--gin.EvalConfig.lm_prompt_length=K to prompt with each row's first K target "
          "tokens (the rest is the reference).")


def run(config: EvalConfig) -> int:
  os.makedirs(config.model_dir, exist_ok=True)
  # config.gin is written with the outputs (process 0, the one writer), when they are done.
  metrics = evaluate(config, config_gin=gin.config_str())
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
  if config.draft_kind == "head":
    raise gin_utils.GinConfigError(
        "--dry_run compiles a separate draft model's engine; with DRAFT_KIND='head' run it "
        "with a draft preset (--gin.DRAFT_KIND=\"'model'\" --gin.EvalConfig.draft_model=...) "
        "or without --dry_run.")
  if not (config.target_model and config.draft_model):
    raise gin_utils.GinConfigError(
        "--dry_run needs the models' shapes without reading the checkpoints: set "
        "--gin.EvalConfig.target_model=<preset> and --gin.EvalConfig.draft_model=<preset>.")

  def plan() -> gin_utils.DryRunPlan:
    target = config.precision.apply(Model(model_config(config.target_model)), "target")
    draft = config.precision.apply(Model(model_config(config.draft_model)), "draft")
    inputs = int(config.task_feature_lengths.get("inputs", 0) or 1)
    stage = dry_run.Stage("evaluate", lambda mesh, batch: dry_run.speculative_program(
        target, draft, mesh, batch, inputs, config.new_tokens, gamma=max(config.grid.gammas),
        temperature=max(config.grid.temperatures),
        target_param_dtype=config.precision.target_param_dtype),
        config.batch_size, {"target": target, "draft": draft})
    levers = () if config.precision.target_param_dtype == "bfloat16" else (
        "--gin.TARGET_PARAM_DTYPE=bfloat16",)
    return gin_utils.DryRunPlan([stage], (config.mesh.data_parallel, config.mesh.model_parallel),
                                levers)

  return gin_utils.run_dry_run(plan)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  gin_utils.exit_on_help(argv, "distillspec_jax.eval", __doc__, CONFIGS)
  wanted, argv = gin_utils.take_dry_run_flag(argv)
  if wanted:
    return run_dry_run(argv)
  return run(prepare(argv))


def cli(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: `main`'s exit status (a user's mistake: 1 and the message)."""
  return gin_utils.run_binary(main, argv)


if __name__ == "__main__":
  # Through the imported module, so that the timing process (spawned) unpickles EvalConfig
  # and _timings from distillspec_jax.eval, not from __main__.
  from distillspec_jax import eval as eval_lib
  sys.exit(eval_lib.cli())
