"""The main job: train a target, a raw draft and DistillSpec drafts, then measure them.

Stages (each writes `<run_dir>/<stage>/` and a `DONE.json` marker last, atomically):
  vocab            SentencePiece vocabulary + tokenized train split (NumPy, no TF afterwards)
  target           fine-tune the target with cross-entropy
  draft_raw        fine-tune the draft with cross-entropy (the "w/o distillation" draft)
  teacher_cache    (only with teacher_cache_k) the target's top-k log-probs over the train split
  distill_<recipe> distil the raw draft toward the target with each recipe (GKD, SupervisedKD..);
                   with `acceptance_head`, the chosen recipes' drafts carry an acceptance head
                   trained jointly, and the stage measures its calibration on held-out data
  distill_head_<recipe>  (only with `head`) distil a draft head (EAGLE-3 style, reading the
                   target's hidden states) from the target with each head recipe
  evaluate         task quality of every model; tau, alpha and speedup of every draft (heads
                   included) with the target at each gamma and temperature, by running the
                   speculative engine
  report           report.md, report.json and the PNG plots

A stage whose marker exists and is newer than its inputs' markers, and whose recorded settings
(`stage_settings`: the PipelineConfig fields that stage reads, kept in its marker) equal the
current ones, is skipped; a stage that was interrupted resumes from its checkpoints; a stage
whose inputs or settings changed starts over (and so do the stages that depend on it). So
running the job twice reuses everything, changing TARGET_STEPS reruns the target and what
depends on it, changing only the evaluation's settings reruns only evaluate and report, and
deleting one stage's folder reruns that stage and what depends on it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Optional

import jax
import numpy as np

from distillspec_jax.training import checkpoints
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning
from distillspec_jax.models.precision import cast_params
from distillspec_jax.core.files import read_json, write_json_atomic
from distillspec_jax.decoding.plain import prompt_inputs
from distillspec_jax.decoding.speculative import DraftLength
from distillspec_jax.distill.objectives import make_speculative_eval_fn
from distillspec_jax.evaluation.placement import BatchPlacement
from distillspec_jax.models.model import Model
from distillspec_jax.distill.teacher_cache import (CachedTeacherObjective, check_k, open_cache,
                                           with_cache, write_cache)
from distillspec_jax.training.trainer import TrainConfig, distill, finetune, train
# Re-exported: pipeline.PipelineConfig, pipeline.distillation_config.
from distillspec_jax.studies import pair_source
from distillspec_jax.studies.pipeline_config import (HEAD_STAGE_PREFIX, TAU_CURVE_GAMMA,
                                                     PipelineConfig, distillation_config)
from distillspec_jax.distill.head_objectives import HeadDistillationObjective
from distillspec_jax.models.head import Head, HeadConfig, write_head_config

DONE = "DONE.json"
# Stages that only process 0 runs (host-side files: vocabulary, report); the training stages,
# the teacher cache and the evaluation run on every process (SPMD). The others wait for them
# at a barrier this long (a dead process ends the others sooner: jax.distributed's heartbeat).
PRIMARY_ONLY_STAGES = ("vocab", "report")
STAGE_BARRIER_TIMEOUT_S = 7 * 24 * 3600


# --- stage bookkeeping ---------------------------------------------------------------------------


def _marker(config: PipelineConfig, stage: str) -> str:
  return os.path.join(config.stage_dir(stage), DONE)


# The key of a marker's recorded settings (stage_settings).
SETTINGS_KEY = "settings"
# Fields that change where or how a stage runs, not what it computes: never compared (a run
# moved to another folder or mesh, or run without a progress bar, reuses its stages).
UNCOMPARED_FIELDS = ("run_dir", "progress_bar", "mesh", "save_every")
# What every stage reads: the task's data and the vocabulary.
_DATA_FIELDS = ("task", "task_feature_lengths", "data_dir", "train_vocabulary", "vocab_size",
                "train_examples", "in_memory_data", "lm_prompt_length", "pair")
# What every training stage reads besides: the models' shapes and the optimiser.
_TRAINING_FIELDS = _DATA_FIELDS + ("batch_size", "optimizer", "warmup_steps", "decay_steps",
                                   "seed", "precision", "loss_block_size", "model_vocab_size",
                                   "max_decode_length")
_ROLE_FIELDS = {"target": ("target_model", "target_checkpoint_path"),
                "draft": ("draft_model", "draft_checkpoint_path")}


def _jsonable(value):
  """`value` as JSON values (dataclasses as {field: value}, tuples as lists), so that it
  compares equal to itself read back from a marker."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return repr(value)


def stage_settings(config: PipelineConfig, stage: str) -> Optional[dict]:
  """{name: JSON value} of the settings `stage` reads (PipelineConfig fields, and a few values
  derived from them: a recipe's steps, a head's unroll depth), recorded in its marker and
  compared on a rerun (stage_status). Conservative: a field a stage might read is in. The
  evaluation's settings (grid, eval_examples, speed, eval_batch_size, eval_task) belong to
  evaluate and report only, but for a distillation with an acceptance head, whose stage
  measures the head's calibration on eval_examples rows. None for a study's own config (its
  stages are its own; nothing recorded or compared)."""
  if hasattr(config, "stage_functions"):
    return None
  names, derived = (), {}
  if stage == "vocab":
    names = _DATA_FIELDS
  elif stage == "target":
    names = _TRAINING_FIELDS + _ROLE_FIELDS["target"] + (
        "target_steps", "learning_rate", "target_learning_rate")
  elif stage == "draft_raw":
    names = _TRAINING_FIELDS + _ROLE_FIELDS["draft"] + ("draft_steps", "learning_rate")
  elif stage == "teacher_cache":
    names = _TRAINING_FIELDS + _ROLE_FIELDS["target"] + ("teacher_cache_k",)
  elif stage.startswith(HEAD_STAGE_PREFIX):
    names = _TRAINING_FIELDS + _ROLE_FIELDS["target"] + _ROLE_FIELDS["draft"] + (
        "head", "divergence", "max_new_tokens", "eval_every")
    derived["head unroll_steps (HEAD_UNROLL_STEPS, else the largest gamma)"] = (
        config.head.training(config.grid.gammas).unroll_steps)
  elif stage.startswith("distill_"):
    recipe = stage[len("distill_"):]
    names = _TRAINING_FIELDS + _ROLE_FIELDS["target"] + _ROLE_FIELDS["draft"] + (
        "distill_learning_rate", "divergence", "max_new_tokens", "eval_every")
    derived[f"steps (distill_steps / recipe_steps[{recipe!r}])"] = config.distill_steps_of(
        recipe)
    if recipe == "adaspec":
      names += ("adaspec_reference", "adaspec_top_k", "adaspec_normalization")
    if recipe in config.cached_recipes:
      names += ("teacher_cache_k",)
    if recipe in config.acceptance_head_recipes:
      names += ("acceptance_head", "eval_examples")
  else:  # evaluate, report: every field
    names = tuple(f.name for f in dataclasses.fields(config)
                  if f.name not in UNCOMPARED_FIELDS)
  settings = {name: getattr(config, name) for name in names}
  settings.update(derived)
  return _jsonable(settings)


def changed_settings(config: PipelineConfig, stage: str) -> Optional[dict]:
  """{name: (recorded, current)} of the settings that differ from those `stage`'s marker
  recorded ({} when none); None when the marker recorded none (written before markers kept
  them, or by a study), whose settings cannot be compared."""
  current = stage_settings(config, stage)
  recorded = read_json(_marker(config, stage)).get(SETTINGS_KEY)
  if current is None or recorded is None:
    return None
  return {name: (recorded.get(name, "<not recorded>"), current.get(name, "<not read>"))
          for name in sorted(set(recorded) | set(current))
          if recorded.get(name) != current.get(name)}


def stage_status(config: PipelineConfig, stage: str) -> str:
  """'done', 'stale' (an input finished after it, or its recorded settings differ from the
  current ones: changed_settings) or 'todo'."""
  marker = _marker(config, stage)
  if not os.path.exists(marker):
    return "todo"
  mtime = os.path.getmtime(marker)
  for dependency in config.dependencies(stage):
    dep_marker = _marker(config, dependency)
    if not os.path.exists(dep_marker) or os.path.getmtime(dep_marker) > mtime:
      return "stale"
  return "stale" if changed_settings(config, stage) else "done"


def _log_status(config: PipelineConfig, stage: str, status: str) -> None:
  """Says why a finished stage is rerun (changed settings, each old -> new) or that an old
  marker's settings cannot be compared."""
  if not os.path.exists(_marker(config, stage)):
    return
  changed = changed_settings(config, stage)
  if changed is None and status == "done" and stage_settings(config, stage) is not None:
    logging.info("Stage %s: its marker (%s) records no settings (written before markers kept "
                 "them), so they cannot be compared with this run's; reusing it.", stage,
                 _marker(config, stage))
  elif changed:
    logging.warning(
        "Stage %s: settings changed since it ran: %s; the stage and the stages that depend "
        "on it start over.", stage,
        "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changed.items()))


def check_run_dir(run_dir: str) -> None:
  """Fails before any training when the run directory cannot be written."""
  try:
    os.makedirs(run_dir, exist_ok=True)
    probe = os.path.join(run_dir, f".write-probe-{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as error:
    raise ValueError(f"MODEL_DIR={run_dir!r} is not writable ({error}); pass a directory you "
                     "can write to with --gin.MODEL_DIR=...") from error


def required_stages(config: PipelineConfig, requested: Optional[tuple] = None) -> tuple:
  """The requested stages and everything they depend on, in run order (None = all)."""
  if requested is None:
    return config.stages
  unknown = [s for s in requested if s not in config.stages]
  if unknown:
    raise ValueError(f"Unknown stage(s) {unknown}; this job's stages are {config.stages}.")
  needed, frontier = set(), list(requested)
  while frontier:
    stage = frontier.pop()
    if stage not in needed:
      needed.add(stage)
      frontier.extend(config.dependencies(stage))
  return tuple(s for s in config.stages if s in needed)


def run_pipeline(config: PipelineConfig, stage_fns: Optional[dict] = None,
                 stages: Optional[tuple] = None) -> dict:
  """Runs the `stages` (default all) and their inputs that are not done.

  Returns {stage: "ran" | "skipped"}.
  """
  check_run_dir(config.run_dir)
  config.check_inputs()
  stage_fns = stage_fns or default_stage_functions()
  outcome = {}
  for stage in required_stages(config, stages):
    status = stage_status(config, stage)
    _log_status(config, stage, status)
    if status == "done":
      logging.info("Stage %s: done, skipped.", stage)
      outcome[stage] = "skipped"
      continue
    stage_dir = config.stage_dir(stage)
    primary = multihost.is_primary()  # the one writer of markers (multihost.py)
    if status == "stale" and os.path.exists(stage_dir) and primary:
      logging.info("Stage %s: inputs or settings changed, starting over.", stage)
      shutil.rmtree(stage_dir)
    multihost.barrier(f"stage_start:{stage}")
    os.makedirs(stage_dir, exist_ok=True)
    print(f"=== stage {stage} ===", flush=True)
    start = time.time()
    fn = (stage_fns["distill_head"] if stage.startswith(HEAD_STAGE_PREFIX)
          else stage_fns["distill"] if stage.startswith("distill_") else stage_fns[stage])
    if primary or stage not in PRIMARY_ONLY_STAGES:
      summary = fn(config, stage) or {}
      summary["wall_clock_s"] = time.time() - start
      settings = stage_settings(config, stage)
      if settings is not None:
        summary[SETTINGS_KEY] = settings
      if primary:
        write_json_atomic(_marker(config, stage), summary)
    # The next stage reads this one's outputs: every process waits for the marker.
    multihost.barrier(f"stage_done:{stage}", timeout_s=STAGE_BARRIER_TIMEOUT_S)
    outcome[stage] = "ran"
  return outcome


def default_stage_functions() -> dict:
  return {"vocab": stage_vocab, "target": stage_finetune, "draft_raw": stage_finetune,
          "distill": stage_distill, "distill_head": stage_distill_head,
          "evaluate": stage_evaluate, "report": stage_report,
          "teacher_cache": stage_teacher_cache}


# --- data ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InMemoryData:
  """An indexed, reshuffled-every-epoch data source over tokenized arrays (no TF per step).

  `batch_at(step)` depends on (seed, step) only, so a resumed run sees the same batches.
  """

  arrays: dict
  batch_size: int
  seed: int = 0

  @property
  def num_examples(self) -> int:
    return len(next(iter(self.arrays.values())))

  def _rows(self, step: int) -> np.ndarray:
    per_epoch = self.num_examples // self.batch_size
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)
    return order[index * self.batch_size:(index + 1) * self.batch_size]

  def batch_at(self, step: int) -> dict:
    rows = self._rows(step)
    return {k: v[rows] for k, v in self.arrays.items()}

  def local_batch_at(self, step: int, shard) -> dict:
    """This process's rows (`multihost.DataShard`) of the global batch of `step`."""
    rows = self._rows(step)[shard.rows]
    return {k: v[rows] for k, v in self.arrays.items()}


def _trained_vocabulary_path(config: PipelineConfig) -> str:
  return os.path.join(config.stage_dir("vocab"), "sentencepiece.model")


def register_task(config: PipelineConfig, vocabulary=None):
  """Registers the task with the job's vocabulary (the embedded task's own, or the one the
  vocab stage trained, or the task's default)."""
  from distillspec_jax.data import batches as batches_lib
  from distillspec_jax.data import tasks
  if vocabulary is None and config.pair.vocabulary is not None:
    vocabulary = config.pair.vocabulary  # the user's tokenizer: nothing built or trained
    if config.task == tasks.EMBEDDED_TASK_NAME:
      tasks.register_embedded_task(vocabulary=vocabulary)
    elif config.data_dir:
      tasks.register_file_tasks(config.data_dir, vocabulary=vocabulary,
                                chat_template=config.pair.chat_template)
    else:
      tasks.register_tfds_tasks(vocabulary)
  elif config.task == tasks.EMBEDDED_TASK_NAME:
    vocabulary = tasks.embedded.embedded_vocabulary(config.stage_dir("vocab"), config.vocab_size)
    tasks.register_embedded_task(vocabulary=vocabulary)
  elif config.data_dir:
    if vocabulary is None and config.train_vocabulary:
      vocabulary = _trained_vocabulary_path(config)
    tasks.register_file_tasks(config.data_dir, vocabulary=vocabulary)
  return batches_lib.get_task(config.task)


def check_task(config: PipelineConfig) -> None:
  """Refuses a MIXTURE_OR_TASK_NAME that no registration of this job provides (the registry's
  ValueError names the registered ones), before the vocab stage writes MODEL_DIR/vocab: the
  task registered as the vocab stage first registers it (register_task with the user's
  tokenizer, or with T5's default vocabulary path, read lazily); every stage registers it
  again with the job's vocabulary. A file task's records are read once, so that a malformed
  line is refused here too. The embedded task needs no check (its name is fixed)."""
  from distillspec_jax.data import tasks, vocabularies
  if config.task == tasks.EMBEDDED_TASK_NAME:
    from distillspec_jax.data.tasks import embedded
    check_train_examples(config, embedded.DEFAULT_NUM_EXAMPLES["train"])
    return
  own = config.pair.vocabulary is not None
  register_task(config, vocabulary=None if own else vocabularies.T5_DEFAULT_SPM_PATH)
  from distillspec_jax.data import batches as batches_lib
  batches_lib.check_records(config.task)
  try:
    total = batches_lib.get_task(config.task).num_input_examples("train")
  except Exception:  # pylint: disable=broad-except  # a size the source does not know
    total = None
  check_train_examples(config, total)


def check_train_examples(config: PipelineConfig, available: Optional[int]) -> None:
  """Refuses a TRAIN_EXAMPLES (PipelineConfig.train_examples) above the `available` examples
  of the task's train split (None: not known before reading it; the vocab stage then refuses
  it): it was cut silently to the split's size."""
  if (config.in_memory_data and config.train_examples and available
      and config.train_examples > available):
    raise ValueError(
        f"TRAIN_EXAMPLES (PipelineConfig.train_examples)={config.train_examples} exceeds the "
        f"{available:,} examples of task {config.task!r}'s train split; pass at most "
        f"{available} (or None for the whole split).")


def stage_vocab(config: PipelineConfig, stage: str) -> dict:
  """Builds the vocabulary and tokenizes the train split once into train.npz."""
  from distillspec_jax.data import batches as batches_lib
  from distillspec_jax.data.tasks import embedded
  if config.pair.vocabulary is not None:
    pass  # the user's tokenizer (PairSource.vocabulary): nothing to build
  elif config.task == embedded.TASK_NAME:
    embedded.build_embedded_vocabulary(config.stage_dir(stage), config.vocab_size)
  elif config.train_vocabulary:
    from distillspec_jax.data import train_vocabulary, vocabularies
    register_task(config, vocabulary=vocabularies.T5_DEFAULT_SPM_PATH)  # texts only
    train_vocabulary.train_vocabulary_for_task(config.task, _trained_vocabulary_path(config),
                                               vocab_size=config.vocab_size)
  task = register_task(config)
  vocabulary = task.output_features["targets"].vocabulary
  summary = {"vocab_size": int(config.model_vocab_size or vocabulary.vocab_size)}
  if not config.in_memory_data:
    return summary
  from tqdm.auto import tqdm
  try:
    total = task.num_input_examples("train") or None
  except Exception:  # pylint: disable=broad-except  # only the progress bar's length
    total = None
  if config.train_examples and total:
    total = min(total, config.train_examples)
  arrays, count = {}, 0
  batches = batches_lib.get_dataset(config.task, "train", config.task_feature_lengths,
                                 batch_size=1024, feature_converter=config.feature_converter)
  progress = tqdm(batches, desc="tokenize train split", unit="batch", dynamic_ncols=True,
                  total=-(-total // 1024) if total else None, disable=not config.progress_bar)
  for batch in progress:
    for key, value in batch.items():
      arrays.setdefault(key, []).append(value)
    count += len(value)
    if config.train_examples and count >= config.train_examples:
      break
  arrays = {k: np.concatenate(v)[:config.train_examples] for k, v in arrays.items()}
  check_train_examples(config, len(arrays["decoder_target_tokens"]))
  if len(arrays["decoder_target_tokens"]) < config.batch_size:
    raise ValueError(f"The train split has {len(arrays['decoder_target_tokens'])} examples, "
                     f"fewer than batch_size={config.batch_size}; lower BATCH_SIZE.")
  path = os.path.join(config.stage_dir(stage), "train.npz")
  np.savez(path + ".tmp.npz", **arrays)
  os.replace(path + ".tmp.npz", path)
  summary["train_examples"] = int(len(arrays["decoder_target_tokens"]))
  return summary


def vocab_size(config: PipelineConfig) -> int:
  return int(read_json(_marker(config, "vocab"))["vocab_size"])


def train_data(config: PipelineConfig):
  """The training data source: indexed in-memory arrays, or a deterministic seqio stream
  factory (the trainer re-creates it and skips the consumed batches on resume)."""
  if not config.in_memory_data:
    from distillspec_jax.data import batches as batches_lib
    register_task(config)
    # Each process streams its own seqio shard (multihost.DataShard.shard_info()).
    return lambda shard=None: batches_lib.get_dataset(
        config.task, "train", config.task_feature_lengths,
        shard.local_batch_size if shard else config.batch_size, shuffle=True,
        seed=config.seed, num_epochs=None, drop_remainder=True,
        feature_converter=config.feature_converter,
        shard_info=shard.shard_info() if shard and shard.num_shards > 1 else None)
  with np.load(os.path.join(config.stage_dir("vocab"), "train.npz")) as arrays:
    return InMemoryData({k: arrays[k] for k in arrays.files}, config.batch_size, config.seed)


def models(config: PipelineConfig, vocab: Optional[int] = None) -> tuple:
  """(target, draft) Models: a preset's with the vocabulary's size (`vocab`: before the vocab
  stage), or a checkpoint's own model when no preset is named (pair_source.role_config); both
  with the vocabulary's special ids."""
  presets = [config.target_model, config.draft_model]
  vocab = vocab or (vocab_size(config) if any(presets) else None)
  configs = [pair_source.role_config(path, preset, vocab, config.model_overrides(role), macro)
             for role, (macro, path, preset) in config.roles.items()]
  tokens = config.pair.tokens_for(min(c.vocab_size for c in configs))
  return tuple(Model(c, tokens) for c in configs)


def job_mesh(config: PipelineConfig, target: Model, draft: Model):
  """The (DATA_PARALLEL, MODEL_PARALLEL) mesh of every stage, checked against the batch and
  both models (ValueError naming the value and the fix)."""
  mesh = config.mesh.make()
  partitioning.check_batch_size(config.batch_size, mesh)
  partitioning.check_model_axis({"target": target, "draft": draft}, mesh)
  return mesh


def load_params(config: PipelineConfig, stage: str, model: Model, mesh=None,
                dtype: Optional[str] = None):
  """The final parameters a training stage saved in its folder; with `mesh`, restored
  straight into the rules' shards (each process reads its own), else whole on this process's
  first device (not the layout the stage was saved with, which may span other devices);
  cast to `dtype` (None: as saved)."""
  shapes = model.param_shapes()
  if mesh is not None:
    shapes = checkpoints.abstract_like(shapes, partitioning.param_shardings(model, mesh))
  else:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = checkpoints.abstract_like(shapes, jax.tree.map(lambda _: device, shapes))
  return cast_params(checkpoints.restore_params(config.stage_dir(stage), shapes), dtype)


# --- training stages -------------------------------------------------------------------------


def stage_train_config(config: PipelineConfig, stage: str, steps: int, learning_rate: float,
                  eval_every: int = 0, initial_checkpoint_path: Optional[str] = None
                  ) -> TrainConfig:
  return TrainConfig(model_dir=config.stage_dir(stage), train_steps=steps,
                     initial_checkpoint_path=initial_checkpoint_path,
                     batch_size=config.batch_size, seed=config.seed, optimizer=config.optimizer,
                     learning_rate=learning_rate, warmup_steps=config.warmup_steps,
                     decay_steps=config.decay_steps or steps, final_fraction=0.1,
                     save_every=config.save_every or max(steps // 4, 1),
                     keep_checkpoints=1, log_every=max(min(50, steps // 10), 1),
                     eval_every=eval_every, progress_bar=config.progress_bar,
                     mesh=config.mesh)


def tau_curve(start: dict, history: list) -> list:
  """[{step, tau, tau_stderr, draft_acceptance_rate}] of a distillation: `start` (the eval
  function's result before training, at step 0) then every logged evaluation of `history`
  (the trainer's records, whose evaluation keys are "eval/<key>")."""
  curve = [dict(step=0, **start)]
  curve += [dict(step=r["step"], **{k: r.get(f"eval/{k}") for k in start})
            for r in history if "eval/tau" in r]
  return curve


def _last_loss(history: list) -> float:
  losses = [r["loss"] for r in history if "loss" in r]
  return float(losses[-1]) if losses else float("nan")


def stage_finetune(config: PipelineConfig, stage: str) -> dict:
  """Cross-entropy fine-tuning of the target ("target") or the raw draft ("draft_raw"),
  from its starting checkpoint when the config names one (any format: importer.restore_any)."""
  from distillspec_jax.interop import importer
  target, draft = models(config)
  job_mesh(config, target, draft)
  model = target if stage == "target" else draft
  steps = config.target_steps if stage == "target" else config.draft_steps
  start = (config.target_checkpoint_path if stage == "target"
           else config.draft_checkpoint_path)
  role = "target" if stage == "target" else "draft"
  if start is not None and not config.pair.finetunes(role):
    return _load_pretrained(config, stage, model, start)
  learning_rate = config.learning_rate
  if stage == "target" and config.target_learning_rate is not None:
    learning_rate = config.target_learning_rate
  result = finetune(stage_train_config(config, stage, steps, learning_rate,
                                  initial_checkpoint_path=start), model, train_data(config),
                    restore_fn=importer.restore_any, loss_block_size=config.loss_block_size)
  return {"final_loss": _last_loss(result.history), "num_params": model.num_params()}


def _load_pretrained(config: PipelineConfig, stage: str, model: Model, path: str) -> dict:
  """The stage's model is the pretrained checkpoint at `path` as it is: its weights (every
  shape checked) are written to the stage's folder in our format, with their configuration,
  unchanged (fp32, bit for bit)."""
  from distillspec_jax.interop import importer
  params, _ = importer.load_checkpoint(path, model.config)
  if multihost.is_primary():
    importer.save_ours(params, config.stage_dir(stage), model.config)
  return {"loaded_from": path, "num_params": model.num_params()}


def heldout_prompts(config: PipelineConfig, num_examples: int, split: str = "validation",
                    task: Optional[str] = None):
  """The held-out examples' batches.Examples (data.get_prompts_and_targets, every one read
  by this process). Prompts longer than the input length are truncated (as in
  training)."""
  return _heldout_examples(config, num_examples, split, task)[0]


def _heldout_examples(config: PipelineConfig, num_examples: int, split: str,
                      task: Optional[str], mesh=None, batch_size: Optional[int] = None
                      ) -> tuple:
  """(examples, placement) of held-out examples: evaluation.examples.read_examples, so that
  on a `mesh` spanning processes each reads only the rows of every `batch_size` it holds
  (placement None without a mesh)."""
  from distillspec_jax.data import batches as batches_lib
  from distillspec_jax.data import vocabularies
  from distillspec_jax.evaluation import examples as examples_lib
  register_task(config)
  task = task or config.task
  split = split if split in batches_lib.get_task(task).splits else "test"
  examples, place = examples_lib.read_examples(
      task, split, config.task_feature_lengths, num_examples=num_examples, mesh=mesh,
      batch_size=batch_size, on_long_prompt="truncate", lm_prompt_length=config.lm_prompt_length)
  if config.pair.vocabulary is not None:  # ids past the models' rows (a cut tokenizer)
    vocabularies.check_examples(batches_lib.get_vocabulary(task), examples,
                                models(config)[0].tokens.num_tokens, task)
  return examples, place



def stage_distill(config: PipelineConfig, stage: str) -> dict:
  """Distils the raw draft toward the target with the stage's recipe."""
  recipe = stage[len("distill_"):]
  distillation = distillation_config(config, recipe)
  target, draft = models(config)
  mesh = job_mesh(config, target, draft)
  # Straight into the mesh's shards: no host or device holds a whole model-sharded array.
  target_params = load_params(config, "target", target, mesh,
                              config.precision.target_param_dtype)
  draft_params = load_params(config, "draft_raw", draft, mesh)
  reference = {}
  if recipe == "adaspec":
    reference_stage = f"distill_{config.adaspec_reference}"
    reference_model = distilled_draft(config, reference_stage, draft)
    reference = dict(reference=reference_model, reference_params=load_params(
        config, reference_stage, reference_model, mesh))
  if recipe in config.acceptance_head_recipes:  # the raw draft gains a fresh head
    distillation = config.acceptance_head.distillation(distillation)
    draft, draft_params = draft.with_acceptance_head(
        draft_params, config.acceptance_head.head, jax.random.PRNGKey(config.seed))
  prompts = heldout_prompts(config, 32).prompts
  eval_fn = make_speculative_eval_fn(target, target_params, draft,
                                     prompt_inputs(draft, prompts),
                                     max_new_tokens=config.max_new_tokens, gamma=TAU_CURVE_GAMMA,
                                     temperature=0.0, seed=config.seed)
  train_config = stage_train_config(config, stage, config.distill_steps_of(recipe),
                               config.distill_learning_rate, eval_every=config.eval_every)
  start = eval_fn(draft_params, 0)
  if recipe in config.cached_recipes:
    cache = open_teacher_cache(config, target, target_params, distillation)
    result = train(train_config, CachedTeacherObjective(draft, distillation),
                   _cached_train_data(config, cache), init_params=draft_params, eval_fn=eval_fn)
  else:
    result = distill(train_config, target, target_params, draft, train_data(config),
                     distillation, init_params=draft_params, eval_fn=eval_fn, **reference)
  curve = tau_curve(start, result.full_history)
  kept = [r["kept_fraction"] for r in result.history if "kept_fraction" in r]
  summary = {"recipe": recipe, "divergence": distillation.divergence,
             "lambda1": distillation.lambda1, "lambda2": distillation.lambda2,
             "top_k_fraction": distillation.top_k_fraction,
             "teacher_cache_k": (config.teacher_cache_k if recipe in config.cached_recipes
                                 else None),
             "kept_fraction_last": kept[-1] if kept else None,
             "final_loss": _last_loss(result.history), "tau_curve": curve}
  if draft.acceptance_head is not None:
    summary.update(acceptance_head_summary(config, result.full_history, target,
                                           target_params, draft, result.state.params))
  return summary


def distilled_draft(config: PipelineConfig, stage: str, draft: Model) -> Model:
  """The Model of distillation stage `stage`'s draft: `draft` with the job's acceptance head
  where the stage's recipe gets one (PipelineConfig.acceptance_head)."""
  if stage[len("distill_"):] in config.acceptance_head_recipes:
    return dataclasses.replace(draft, acceptance_head=config.acceptance_head.head)
  return draft


def calibration_batches(config: PipelineConfig, rows: int):
  """Teacher-forced batches (T5X features) of the first `rows` held-out examples (the
  validation split, else the test split) for the stop signals' calibration."""
  from distillspec_jax.data import batches as batches_lib
  register_task(config)
  splits = batches_lib.get_task(config.task).splits
  split = "validation" if "validation" in splits else "test"
  seen = 0
  for batch in batches_lib.get_dataset(config.task, split, config.task_feature_lengths,
                                       batch_size=min(rows, 64),
                                       feature_converter=config.feature_converter):
    batch = {k: v[:rows - seen] for k, v in batch.items()}
    seen += len(batch["decoder_target_tokens"])
    yield batch
    if seen >= rows:
      return


def acceptance_head_summary(config: PipelineConfig, history: list, target: Model,
                            target_params, draft: Model, draft_params) -> dict:
  """The marker's record of a draft's acceptance head: its width, loss weight and label
  temperature; its cross-entropy at the first and last logged steps; and both stop signals'
  calibration at that temperature on `eval_examples` held-out rows ({signal: Reliability
  .as_dict()}: evaluation/calibration.py)."""
  from distillspec_jax.evaluation import calibration
  stage = config.acceptance_head
  losses = [float(r["acceptance_bce"]) for r in history if "acceptance_bce" in r]
  tables = calibration.pooled_calibration(
      target, target_params, draft, draft_params,
      calibration_batches(config, config.eval_examples), temperature=stage.temperature)
  return {"acceptance_head": {
      "width": stage.width, "weight": stage.weight, "temperature": stage.temperature,
      "bce_first": losses[0] if losses else None, "bce_last": losses[-1] if losses else None,
      "calibration": {name: table.as_dict() for name, table in tables.items()}}}


def head_model(config: PipelineConfig, target: Model) -> Head:
  """The job's draft head for `target` (PipelineConfig.head's shape)."""
  return Head(HeadConfig(target.config, feature_layers=config.head.feature_layers,
                         mlp_dim=config.head.mlp_dim))


def stage_distill_head(config: PipelineConfig, stage: str) -> dict:
  """Distils a draft head from the target with the stage's recipe: the trainer with a
  HeadDistillationObjective (the training-time test; distill/head_objectives.py), the head's
  embedding starting as the target's; its tau curve at gamma 5, T = 0 as the drafts'. Writes
  head.json (the head's shape) beside the checkpoints, for the eval binary."""
  recipe = stage[len(HEAD_STAGE_PREFIX):]
  distillation = distillation_config(config, recipe)
  target, draft = models(config)
  mesh = job_mesh(config, target, draft)
  target_params = load_params(config, "target", target, mesh,
                              config.precision.target_param_dtype)
  head = head_model(config, target)
  if multihost.is_primary():  # the one writer (run_pipeline)
    write_head_config(config.stage_dir(stage), head.config)
  prompts = heldout_prompts(config, 32).prompts
  eval_fn = make_speculative_eval_fn(target, target_params, head,
                                     prompt_inputs(target, prompts),
                                     max_new_tokens=config.max_new_tokens, gamma=TAU_CURVE_GAMMA,
                                     temperature=0.0, seed=config.seed)
  train_config = stage_train_config(config, stage, config.head.steps,
                                    config.head.learning_rate, eval_every=config.eval_every)
  init = head.init(jax.random.PRNGKey(config.seed), target_params)
  start = eval_fn(init, 0)
  training = config.head.training(config.grid.gammas)
  objective = HeadDistillationObjective(target, head, distillation, training)
  result = train(train_config, objective, train_data(config),
                 frozen_params={"target": target_params}, init_params=init, eval_fn=eval_fn,
                 mesh=mesh)
  last = [r for r in result.history if "predicted_acceptance" in r]
  return {"recipe": recipe, "divergence": distillation.divergence,
          "lambda1": distillation.lambda1, "lambda2": distillation.lambda2,
          "unroll_steps": training.unroll_steps, **head.config.to_json(),
          "num_params": head.num_params(), "final_loss": _last_loss(result.history),
          "predicted_acceptance_last": last[-1]["predicted_acceptance"] if last else None,
          "tau_curve": tau_curve(start, result.full_history)}


def _train_arrays(config: PipelineConfig) -> dict:
  if not config.in_memory_data:
    raise ValueError("teacher_cache_k needs in_memory_data=True: the cache is row-aligned with "
                     "the tokenized train split (train.npz); set in_memory_data=True or turn "
                     "the cache off (teacher_cache_k=None).")
  with np.load(os.path.join(config.stage_dir("vocab"), "train.npz")) as arrays:
    return {k: arrays[k] for k in arrays.files}


def stage_teacher_cache(config: PipelineConfig, stage: str) -> dict:
  """Runs the target once over the train split; writes `<run_dir>/teacher_cache/` (resumed
  shard by shard after a kill: teacher_cache.write_cache). On the job's mesh, across
  processes too: the target restored into its shards, each batch's rows split over 'data'
  (each process hands the program only its rows), the bins gathered back; process 0 writes."""
  target, draft = models(config)
  mesh = job_mesh(config, target, draft)
  # A multiple of the job's batch (which the data axis divides), about 64 rows a call.
  rows = config.batch_size * max(1, 64 // config.batch_size)
  place = BatchPlacement(mesh, rows)
  manifest = write_cache(
      target, load_params(config, "target", target, mesh), _train_arrays(config),
      config.stage_dir(stage), k=check_k(config.teacher_cache_k, target.config.vocab_size),
      task=config.task, lengths=config.task_feature_lengths,
      temperature=distillation_config(config, config.cached_recipes[0]).target_temperature,
      batch_size=rows, progress=config.progress_bar,
      place=lambda batch: jax.tree.map(place.put, batch), gather=place.gather,
      writer=multihost.is_primary())
  return {k: manifest[k] for k in ("bytes_per_token", "total_bytes", "reused_shards")} | {
      "k": config.teacher_cache_k}


def open_teacher_cache(config: PipelineConfig, target: Model, target_params, distillation):
  return open_cache(config.stage_dir("teacher_cache"), target=target,
                    target_params=target_params, arrays=_train_arrays(config),
                    k=config.teacher_cache_k, task=config.task,
                    lengths=config.task_feature_lengths,
                    temperature=distillation.target_temperature,
                    write_command="run the main job's teacher_cache stage")


def _cached_train_data(config: PipelineConfig, cache) -> "InMemoryData":
  """The train split with the cache's rows beside it (same order: row i is example i)."""
  return InMemoryData(with_cache(_train_arrays(config), cache), config.batch_size, config.seed)


# --- evaluation and report -----------------------------------------------------------------------


def eval_models_and_params(config: PipelineConfig, mesh: bool = True) -> tuple:
  """(target, draft, {stage name: params}) of every trained model of the job (draft heads
  included: `job_drafts`), restored straight into their shards on the job's mesh (over every
  process's devices; `mesh` False: whole on this process's default device, e.g. the pinned
  timing process)."""
  target, draft = models(config)
  on = job_mesh(config, target, draft) if mesh else None
  params = {"target": load_params(config, "target", target, on,
                                  config.precision.target_param_dtype),
            "draft_raw": load_params(config, "draft_raw", draft, on)}
  for name in config.distill_stages:
    params[name] = load_params(config, name, distilled_draft(config, name, draft), on)
  if config.head_stages:
    head = head_model(config, target)
    for name in config.head_stages:
      params[name] = load_params(config, name, head, on)
  return target, draft, params


def job_drafts(config: PipelineConfig, target: Model, draft: Model, params: dict) -> dict:
  """{stage name: (draft Model or Head, params)} of every draft of the job, in report order:
  the raw draft, the distilled drafts, the heads."""
  drafts = {"draft_raw": (draft, params["draft_raw"])}
  drafts.update({name: (distilled_draft(config, name, draft), params[name])
                 for name in config.distill_stages})
  if config.head_stages:
    head = head_model(config, target)
    drafts.update({name: (head, params[name]) for name in config.head_stages})
  return drafts


def draft_summaries(drafts: dict) -> dict:
  """{name: {"kind": "model" | "head", "num_params"}} of `job_drafts`' drafts (eval.json's
  "drafts": the report's parameter counts)."""
  return {name: {"kind": "head" if isinstance(model, Head) else "model",
                 "num_params": int(model.num_params())}
          for name, (model, _) in drafts.items()}


def check_speed_prompts(config: PipelineConfig, examples) -> None:
  """Refuses more timed prompts (SpeedConfig.examples) than the test examples hold."""
  if len(examples) < config.speed.examples:
    raise ValueError(f"SpeedConfig.examples={config.speed.examples} but the test split of "
                     f"{config.eval_task or config.task!r} holds {len(examples)} "
                     "prompts; lower SpeedConfig.examples (SPEED_EXAMPLES).")


def test_examples(config: PipelineConfig, mesh=None) -> tuple:
  """(examples, placement) of the evaluation's test prompts, in batches of eval_batch_size on
  `mesh` (with several processes each reads only its rows; evaluation/examples.py)."""
  examples, place = _heldout_examples(config, config.eval_examples, "test",
                                      config.eval_task or config.task, mesh,
                                      config.eval_batch_size)
  check_speed_prompts(config, examples)
  return examples, place


def measure_run_speed(config: PipelineConfig, windows_log: Optional[list] = None) -> dict:
  """speed.measure_speed of every draft of the job with its target, on the first
  `SpeedConfig.examples` test prompts. Loads what it needs, so it can run in a pinned process.
  `windows_log`: as measure_speed's (in this process only)."""
  from distillspec_jax.evaluation import pinning
  from distillspec_jax.evaluation import speed
  target, draft, params = eval_models_and_params(config, mesh=False)
  prompts = test_examples(config)[0].prompts[:config.speed.examples]
  drafts = job_drafts(config, target, draft, params)
  plan = speed.TimingPlan(gammas=config.grid.gammas, temperatures=config.grid.temperatures,
                         max_new_tokens=config.max_new_tokens, seed=config.seed,
                         draft_lengths=job_draft_lengths(config),
                         **config.speed.measure_kwargs())
  return speed.measure_speed(target, params["target"], drafts, prompts, plan,
                             before_timing=pinning.wait_for_release,
                             windows_log=windows_log, progress=config.progress_bar)


def job_draft_lengths(config: PipelineConfig) -> tuple:
  """The draft-length rules the job decodes by: the fixed rule at every gamma, and the grid's
  adaptive rule (if any) at the largest gamma, on the drafts that can run it."""
  rule = config.grid.draft_length
  return (DraftLength(), rule) if rule.adaptive else (DraftLength(),)


def adaptive_drafts(config: PipelineConfig, drafts: dict) -> dict:
  """The `job_drafts` the grid's adaptive rule runs on (none for the fixed rule): those that
  can read its signal (`DraftLength.runs_on`)."""
  rule = config.grid.draft_length
  return {name: d for name, d in drafts.items() if rule.adaptive and rule.runs_on(d[0])}


def stage_evaluate(config: PipelineConfig, stage: str) -> dict:
  """Quality of every model; tau, alpha and measured speedup of every draft with the target
  at each gamma and temperature (evaluation.evaluate, the one evaluation path). Writes
  `<run_dir>/evaluate/eval.json`. Runs on every process: the models on the job's mesh, each
  evaluation batch's rows over 'data' (each process hands over its own rows, all get every
  output); process 0 alone times (batch 1, pinned) and writes."""
  from tqdm.auto import tqdm
  from distillspec_jax.evaluation import evaluate as evaluate_lib
  from distillspec_jax.evaluation import pinning
  target, draft, params = eval_models_and_params(config)
  # Each batch's rows over the 'data' axis of the mesh the parameters are on; each process
  # reads only its rows of the test split.
  examples, place = test_examples(config, job_mesh(config, target, draft))
  primary = multihost.is_primary()
  scorer = evaluate_lib.task_scorer(config.eval_task or config.task, register_task(
      config).output_features["targets"].vocabulary)
  drafts = job_drafts(config, target, draft, params)
  # A head does not decode alone: the quality of the target and the separate drafts.
  alone_models = {name: (target if name == "target" else draft, p)
                  for name, p in params.items() if name not in config.head_stages}
  adaptive = adaptive_drafts(config, drafts)
  total = len(alone_models) + len(config.grid.temperatures) * (
      len(drafts) * len(config.grid.gammas) + len(adaptive))
  # The timing process loads and compiles on its pinned core while this one evaluates; it
  # starts timing only once released, when nothing else runs.
  timing = ((pinning.timing_cpus(config.speed.cpus, jax.process_count()), measure_run_speed)
            if primary else (0, _no_timing))
  with pinning.start_pinned(*timing, config) as timing_run, \
      tqdm(total=total, desc="evaluate (quality, tau)", dynamic_ncols=True,
           disable=not (config.progress_bar and primary)) as bar:
    alone = evaluate_lib.quality_alone(
        alone_models, examples, scorer, max_new_tokens=config.max_new_tokens, on_done=bar.update,
        batch_size=config.eval_batch_size, place=place)
    common = dict(max_new_tokens=config.max_new_tokens, batch_size=config.eval_batch_size,
                  seed=config.seed, on_done=bar.update, place=place,
                  temperatures=config.grid.temperatures)
    rows = evaluate_lib.speculative_grid(target, params["target"], drafts, examples, scorer,
                                         gammas=config.grid.gammas, **common)
    if adaptive:  # the grid's adaptive rule at its gamma_max
      rows += evaluate_lib.speculative_grid(
          target, params["target"], adaptive, examples, scorer,
          gammas=(max(config.grid.gammas),), draft_length=config.grid.draft_length, **common)
    bar.close()
    summaries = draft_summaries(drafts)
    del params, drafts, alone_models, adaptive  # the timing process loads its own copy
    timing = timing_run.result()
  if not primary:  # process 0 writes eval.json; the others only took part in the decodes
    return {"num_test_prompts": int(len(examples))}
  rows = [evaluate_lib.EvaluationRow.of(config.task, run,
                                        timing.row(run.draft, run.point).figures,
                                        num_examples=len(examples))
          for run in rows]
  write_json_atomic(os.path.join(config.stage_dir(stage), "eval.json"),
                    evaluation_json(alone, rows, timing, summaries))
  return {"num_test_prompts": int(len(examples))}


def evaluation_json(quality: dict, rows: list, timing, drafts: Optional[dict] = None) -> dict:
  """eval.json: the models' quality, the drafts' EvaluationRows ("speculative"), each draft's
  kind and parameter count ("drafts": `draft_summaries`) and the timing's plain decoding,
  per-call costs, machine and protocol (a speed.SpeedMeasurement)."""
  measured = timing.to_json()
  return {"quality": quality, "speculative": [row.to_json() for row in rows],
          "drafts": drafts or {},
          "plain": measured["plain"], "per_call_s": measured["per_call_s"],
          "machine": measured["machine"], "interference": measured["interference"],
          "quiet_timeline": measured["quiet_timeline"], "speed_protocol": measured["protocol"]}


def _no_timing(config: PipelineConfig) -> None:
  """The timing of processes other than 0: none (process 0 times, batch 1, pinned)."""
  del config


def stage_report(config: PipelineConfig, stage: str) -> dict:
  """report.json, report.md and the PNG plots in `run_dir`, from the evaluation and the
  stages' markers."""
  from distillspec_jax.evaluation import report as report_lib
  evaluation = read_json(os.path.join(config.stage_dir("evaluate"), "eval.json"))
  wall_clock, curves = {}, {}
  for name in config.stages:
    if os.path.exists(_marker(config, name)):
      wall_clock[name] = read_json(_marker(config, name)).get("wall_clock_s")
  for name in config.distill_stages:
    curves[name[len("distill_"):]] = read_json(_marker(config, name)).get("tau_curve", [])
  for name in config.head_stages:
    curves[report_lib.draft_names(config)[name]] = read_json(_marker(config, name)).get(
        "tau_curve", [])
  heads = {report_lib.draft_names(config)[name]: read_json(_marker(config, name))[
      "acceptance_head"] for name in config.distill_stages
      if name[len("distill_"):] in config.acceptance_head_recipes}
  report = report_lib.build_report(config, evaluation, wall_clock, curves,
                                   acceptance_heads=heads)
  return {"plots": report_lib.write_report(config, report, config.run_dir)}
