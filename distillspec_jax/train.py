r"""The gin binary: fine-tuning and DistillSpec distillation, T5X style.

  python -m distillspec_jax.train --gin_file=gin/runs/distill_tiny.gin \
      --gin.MODEL_DIR=/tmp/distill --gin.TRAIN_STEPS=200 \
      --gin.TARGET_CHECKPOINT_PATH=/tmp/finetune_target

Macros (T5X names): MODEL_DIR, MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, TRAIN_STEPS,
BATCH_SIZE, INITIAL_CHECKPOINT_PATH (start of the trained model), TARGET_CHECKPOINT_PATH
(the frozen target of a distillation run), DATA_DIR (file-backed tasks such as gsm8k_files),
VOCABULARY (the models' tokenizer: a Hugging Face folder, tokenizer.json or .model), plus the
recipe macros LAMBDA1, LAMBDA2, DIVERGENCE, BETA, SAMPLING_TEMPERATURE, LK_S, LK_ETA,
POSITION_WEIGHTING, BLOCK_SIZE (gin/recipes/distill_base.gin).

Multi-host (multihost.py): --coordinator_address=HOST:PORT --process_count=N
--process_index=I on every process (GPU clusters, localhost tests); none on a TPU VM slice,
where jax.distributed.initialize() finds the hosts itself.

The whole configuration is resolved into a `RunSpec` (models built, files checked) before
any training, so a bad binding, gin file or model name fails in seconds.
INITIAL_CHECKPOINT_PATH and TARGET_CHECKPOINT_PATH accept our orbax format, T5X and Hugging
Face (detected; `interop.importer`); both are checked against their models from stored shapes
(`importer.check_checkpoint`, no weight read) before MODEL_DIR/config.gin is written, and a
bad one exits with status 1 and a message naming the macro and the fix.
MIXTURE_OR_TASK_NAME = 'synthetic_reverse' is a built-in procedurally generated task
(`trainer.SyntheticData`, reversal of random tokens) for tests and CPU smoke runs; every
other name goes to `distillspec_jax.data.batches.get_dataset` (seqio).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Literal, Mapping, Optional, Sequence, Union

import gin
import jax

from distillspec_jax.training import checkpoints
from distillspec_jax.data import vocabularies
from distillspec_jax.data.task_source import TaskSource
from distillspec_jax.distill import blocked
from distillspec_jax.distill import objectives
from distillspec_jax import gin_utils
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning
from distillspec_jax.training import trainer
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.interop import importer
from distillspec_jax.core.validation import (check_feature_lengths, check_field_types,
                                             check_output_dir, check_positive_int, check_real,
                                             is_remote)
from distillspec_jax.models import precision
from distillspec_jax.models.precision import PrecisionConfig
from distillspec_jax.models.model import Model
from distillspec_jax.training import dry_run

SYNTHETIC_TASK = "synthetic_reverse"
# The synthetic task's two streams (make_data: another seed for any split but "train").
SYNTHETIC_SPLITS = ("train", "validation")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything a run needs, bound in gin as `run.<field>` (train_base.gin) and checked when
  it is built, before anything is trained.

  Attributes:
    mode: 'distill' (run.target toward run.model by run.distillation_config) or 'finetune'.
    model: the trained model (run.model = @draft/model_by_name()).
    train_config: the loop and optimiser (run.train_config = @TrainConfig()).
    mixture_or_task_name / task_feature_lengths: the data (MIXTURE_OR_TASK_NAME, ...).
    target / target_checkpoint_path: the frozen target of a distillation run.
    distillation_config: the recipe (gin/recipes/*.gin).
    split / eval_split / eval_batch_size / eval_gamma / eval_temperature: the data splits
      (the task's; the synthetic task's are SYNTHETIC_SPLITS) and the speculative
      evaluation every EVAL_EVERY steps.
    precision: both models' activation dtype and remat policy and the frozen target's
      parameter dtype, cast after restoring (models.precision.PrecisionConfig, shared with
      the other binaries; gin: run.precision = @PrecisionConfig(), bound to ACTIVATION_DTYPE,
      REMAT_POLICY and TARGET_PARAM_DTYPE in train_base.gin). The trained model is the
      "draft" (draft_remat_policy), run.target the "target"; a fine-tuning run trains one
      model and has no frozen target, so it takes neither a per-model policy nor
      target_param_dtype.
    loss_block_size: positions per block of the fine-tuning loss (LOSS_BLOCK_SIZE, which also
      sets DistillationConfig.loss_block_size; distill/blocked.py).
    data: DATA_DIR and VOCABULARY (a TaskSource; None = the default one); both models take
      the vocabulary's special ids.
  """

  mode: Literal["finetune", "distill"] = "distill"
  model: Optional[Model] = None
  train_config: Optional[trainer.TrainConfig] = None
  mixture_or_task_name: Optional[str] = None
  task_feature_lengths: Optional[Mapping[str, int]] = None
  target: Optional[Model] = None
  target_checkpoint_path: Optional[str] = None
  distillation_config: Optional[DistillationConfig] = None
  split: str = "train"
  eval_split: str = "validation"
  eval_batch_size: int = 16
  eval_gamma: int = 4
  eval_temperature: float = 1.0
  precision: PrecisionConfig = PrecisionConfig()
  loss_block_size: Union[int, Literal["auto"], None] = "auto"
  data: Optional[TaskSource] = None

  def __post_init__(self):
    if self.model is None:
      raise gin_utils.GinConfigError("run.model is not set; bind e.g. "
                                     "run.model = @draft/model_by_name() in the gin file.")
    if self.train_config is None:
      raise gin_utils.GinConfigError("run.train_config is not set; include "
                                     "gin/recipes/train_base.gin.")
    if not self.mixture_or_task_name:
      raise gin_utils.GinConfigError("MIXTURE_OR_TASK_NAME is not set; pass "
                                     f"--gin.MIXTURE_OR_TASK_NAME=... (or '{SYNTHETIC_TASK}').")
    check_field_types(self)
    self._apply_precision()
    check_positive_int(self.eval_batch_size, "run.eval_batch_size")
    check_positive_int(self.eval_gamma, "run.eval_gamma")
    check_real(self.eval_temperature, "run.eval_temperature", minimum=0.0)
    # Every length the data needs is given: none is defaulted (the synthetic task and an
    # encoder-decoder read 'inputs'; every run reads 'targets').
    needs_inputs = self.model.is_encoder_decoder or self.mixture_or_task_name == SYNTHETIC_TASK
    object.__setattr__(self, "task_feature_lengths", check_feature_lengths(
        self.task_feature_lengths, "TASK_FEATURE_LENGTHS",
        required=("inputs", "targets") if needs_inputs else ("targets",)))
    # DATA_DIR and VOCABULARY: both models take the vocabulary's special ids.
    data = self.data or TaskSource()
    data.check((("INITIAL_CHECKPOINT_PATH", self.train_config.initial_checkpoint_path or None),
                ("TARGET_CHECKPOINT_PATH", self.target_checkpoint_path)))
    object.__setattr__(self, "data", data)
    # A tokenizer with more ids than the smallest embedding is cut to its rows (token_ids).
    rows = min(m.config.vocab_size for m in (self.model, self.target) if m is not None)
    tokens = data.tokens_for(rows)
    object.__setattr__(self, "model", self.model.with_tokens(tokens))
    if self.target is not None:
      object.__setattr__(self, "target", self.target.with_tokens(tokens))
    if self.mode == "distill":
      if self.target is None:
        raise gin_utils.GinConfigError("Distillation needs run.target "
                                       "(TARGET = @target/model_by_name()).")
      if self.distillation_config is None:
        raise gin_utils.GinConfigError(
            "Distillation needs a recipe: include one of "
            "gin/recipes/{supervised_kd,seqkd,imitkd,fdistill,gkd}.gin.")
      # Vocabulary / kind checks now, not after data loading.
      objectives.DistillationObjective(self.target, self.model, self.distillation_config)
    # The loss's block size against the decoder's length, now, not at the first step's trace.
    block_size = (self.loss_block_size if self.mode == "finetune"
                  else self.distillation_config.loss_block_size)
    blocked.resolve_block_size(
        block_size, _decoder_length(self.model, self.mixture_or_task_name,
                                    self.task_feature_lengths), "LOSS_BLOCK_SIZE")


  def _apply_precision(self) -> None:
    """Both models with `precision`'s activation dtype and remat policy; a fine-tuning run's
    one model refuses the settings of the distillation pair."""
    if not isinstance(self.precision, PrecisionConfig):
      raise gin_utils.GinConfigError(f"run.precision={self.precision!r} must be a "
                                     "PrecisionConfig (gin: run.precision = @PrecisionConfig()).")
    if self.mode == "finetune":
      pair_only = [f"PrecisionConfig.{name}={getattr(self.precision, name)!r}" for name in
                   ("target_remat_policy", "draft_remat_policy", "target_param_dtype")
                   if getattr(self.precision, name) is not None]
      if pair_only:
        raise gin_utils.GinConfigError(
            f"{', '.join(pair_only)}: a fine-tuning run trains one model and has no frozen "
            "target; set PrecisionConfig.remat_policy (REMAT_POLICY) for it and leave these "
            "None (TARGET_PARAM_DTYPE = None).")
    object.__setattr__(self, "model", self.precision.apply(self.model, "draft"))
    if self.target is not None:
      object.__setattr__(self, "target", self.precision.apply(self.target, "target"))


def register_configurables() -> None:
  """This binary's configurables (`run` is RunSpec), before its gin files are parsed."""
  gin_utils.register(partitioning.MeshConfig, PrecisionConfig, run=RunSpec)


def _decoder_length(model: Model, mixture_or_task_name: str, task_feature_lengths) -> int:
  """The decoder's positions per row (make_data's layouts): the targets, after the inputs for
  a decoder-only prefix LM."""
  lengths = dict(task_feature_lengths or {})
  if model.is_encoder_decoder:
    return int(lengths.get("targets", 8))
  if mixture_or_task_name == SYNTHETIC_TASK:
    return int(lengths.get("inputs", 8)) + int(lengths.get("targets", 8))
  return int(lengths.get("inputs", 0)) + int(lengths.get("targets", 8))


def resolve(argv: Sequence[str] = ()) -> RunSpec:
  """Calls the gin-configured `run`; a configuration error becomes a GinConfigError (the
  macros were checked when gin parsed: gin_utils.check_macros), and so does a binding of
  `argv` that the run does not read (gin_utils.check_bindings_read)."""
  try:
    spec = gin_utils.configurable("run")()
  except gin_utils.GinConfigError:
    raise
  except (TypeError, ValueError) as error:
    raise gin_utils.GinConfigError(f"Invalid configuration: {error}") from error
  gin_utils.check_bindings_read(argv, "distillspec_jax.train", later=("dry_run",))
  return spec


def _lengths(spec: RunSpec) -> tuple[int, int]:
  lengths = spec.task_feature_lengths
  return int(lengths.get("inputs", 8)), int(lengths.get("targets", 8))


def make_data(spec: RunSpec, split: str, batch_size: int, seed: int, repeat: bool):
  """A data source for the trainer: SyntheticData (indexed) or a seqio iterator factory."""
  inputs, targets = _lengths(spec)
  decoder_only = not spec.model.is_encoder_decoder
  if spec.mixture_or_task_name == SYNTHETIC_TASK:
    return trainer.SyntheticData(batch_size, input_length=inputs, target_length=targets,
                                 vocab_size=spec.model.config.vocab_size,
                                 seed=seed + (0 if split == "train" else 10_000),
                                 decoder_only=decoder_only)
  from distillspec_jax.data import batches as batches_lib
  converter = "decoder" if decoder_only else "enc_dec"
  spec.data.register()

  def factory(shard=None):
    # Seeded shuffle: the same order after a restart; the trainer skips consumed batches.
    # Multi-host: each process streams its own seqio shard of local_batch_size rows.
    sharded = shard is not None and shard.num_shards > 1
    return batches_lib.get_dataset(spec.mixture_or_task_name, split, spec.task_feature_lengths,
                            shard.local_batch_size if sharded else batch_size,
                            feature_converter=converter, shuffle=repeat, seed=seed,
                            num_epochs=None if repeat else 1, drop_remainder=True,
                            shard_info=shard.shard_info() if sharded else None)

  return factory


def _first_batch(source) -> dict:
  if hasattr(source, "batch_at"):
    return source.batch_at(0)
  return next(iter(source()))


def execute(spec: RunSpec) -> trainer.TrainResult:
  """Trains according to `spec` (fine-tuning or distillation)."""
  config = spec.train_config
  train_data = make_data(spec, spec.split, config.batch_size, config.seed, repeat=True)
  data_name = f"task {spec.mixture_or_task_name!r}, split {spec.split!r}"
  if spec.mode == "finetune":
    mesh = spec.train_config.mesh.make()
    partitioning.check_model_axis({"model": spec.model}, mesh)
    return trainer.finetune(config, spec.model, train_data, data_name=data_name, mesh=mesh,
                            restore_fn=importer.restore_any,
                            loss_block_size=spec.loss_block_size)
  if not spec.target_checkpoint_path:
    raise gin_utils.GinConfigError("Distillation needs the frozen target's parameters: pass "
                                   "--gin.TARGET_CHECKPOINT_PATH=/path/to/target/MODEL_DIR.")
  # Restored into the mesh's shards: no device holds the whole target (our format: each host
  # reads its own shards; T5X / HF: each host reads the file and keeps its shards).
  mesh = spec.train_config.mesh.make()
  partitioning.check_model_axis({"target": spec.target, "draft": spec.model}, mesh)
  target_params = precision.cast_params(importer.restore_any(
      spec.target_checkpoint_path, checkpoints.abstract_like(
          spec.target.param_shapes(), partitioning.param_shardings(spec.target, mesh))),
      spec.precision.target_param_dtype)
  eval_fn = None
  if config.eval_every:
    held_out = _first_batch(make_data(spec, spec.eval_split, spec.eval_batch_size,
                                      config.seed, repeat=False))
    new_tokens = held_out["decoder_target_tokens"].shape[1]
    eval_fn = objectives.make_speculative_eval_fn(
        spec.target, target_params, spec.model, held_out, max_new_tokens=new_tokens,
        gamma=spec.eval_gamma, temperature=spec.eval_temperature, seed=config.seed)
  return trainer.distill(config, spec.target, target_params, spec.model, train_data,
                         spec.distillation_config, eval_fn=eval_fn, data_name=data_name,
                         mesh=mesh, restore_fn=importer.restore_any)


def main(argv: Sequence[str]) -> trainer.TrainResult:
  gin_utils.exit_on_help(argv, "distillspec_jax.train", __doc__,
                         (("run", RunSpec), partitioning.MeshConfig, PrecisionConfig,
                          trainer.TrainConfig, DistillationConfig))
  wanted, argv = gin_utils.take_dry_run_flag(argv)
  if wanted:
    return run_dry_run(argv)
  argv = multihost.initialize_from_flags(argv)  # first: before any JAX backend starts
  register_configurables()
  gin_utils.parse_binary_flags(argv)
  spec = resolve(argv)
  check_mesh(spec)
  check_checkpoint_paths(spec)
  check_task(spec)
  check_output_dir(spec.train_config.model_dir, "MODEL_DIR")
  resumed = check_resume(spec)
  print(f"distillspec_jax.train: {spec.mode} of {spec.model.config.kind} model "
        f"({spec.model.num_params():,} params) for {spec.train_config.train_steps} steps "
        f"in {spec.train_config.model_dir}; devices: {jax.devices()}", flush=True)
  if resumed is not None:
    print(f"Resuming from MODEL_DIR's checkpoint at step {resumed} of "
          f"{spec.train_config.train_steps}" + (": already trained, nothing to do."
          if resumed == spec.train_config.train_steps else "."), flush=True)
  if multihost.is_primary():
    with open(_config_path(spec.train_config.model_dir), "w") as f:
      f.write(gin.config_str())
  result = execute(spec)
  last = next((r for r in reversed(result.history) if "loss" in r), None)
  if last is not None:
    print(json.dumps(last), flush=True)
  return result


def dry_run_stages(spec: RunSpec) -> list:
  """The programs this run compiles: its training step and, with EVAL_EVERY, the speculative
  evaluation (the frozen target cast to TARGET_PARAM_DTYPE, the trained draft as it is)."""
  config = spec.train_config
  inputs, targets = _lengths(spec)
  lengths = {"inputs": inputs, "targets": targets}
  if spec.mode == "finetune":
    objective = objectives.FinetuneObjective(spec.model, spec.loss_block_size)
    models = {"model": spec.model}
  else:
    objective = objectives.DistillationObjective(spec.target, spec.model,
                                                 spec.distillation_config)
    models = {"target": spec.target, "draft": spec.model}
  stages = [dry_run.Stage(spec.mode, lambda mesh, batch: dry_run.train_step_program(
      objective, config.optimizer_spec, mesh, batch, lengths,
      frozen_param_dtype=spec.precision.target_param_dtype), config.batch_size, models)]
  if spec.mode == "distill" and config.eval_every:
    stages.append(dry_run.Stage("eval (tau)", lambda mesh, batch: dry_run.speculative_program(
        spec.target, spec.model, mesh, batch, inputs, targets, gamma=spec.eval_gamma,
        temperature=spec.eval_temperature,
        target_param_dtype=spec.precision.target_param_dtype),
        spec.eval_batch_size, models))
  return stages


def run_dry_run(argv: Sequence[str]) -> int:
  """--dry_run: compiles the run's programs for the gin mesh and slice; 0 when all fit."""
  register_configurables()
  gin_utils.parse_binary_flags(argv)

  def plan() -> gin_utils.DryRunPlan:
    spec = resolve(argv)  # builds the models: after the slice's devices are simulated
    levers = [] if spec.model.config.remat_policy != "none" else [
        "--gin.REMAT_POLICY=minimal (or full)"]
    if spec.mode == "distill" and spec.precision.target_param_dtype != "bfloat16":
      levers.append("--gin.TARGET_PARAM_DTYPE=bfloat16")
    mesh = spec.train_config.mesh
    return gin_utils.DryRunPlan(dry_run_stages(spec), (mesh.data_parallel, mesh.model_parallel),
                                tuple(levers))

  return gin_utils.run_dry_run(plan)


def check_task(spec: RunSpec) -> None:
  """Refuses an unknown MIXTURE_OR_TASK_NAME or split before MODEL_DIR is written (the
  registry's ValueError names the task and the registered ones)."""
  if spec.mixture_or_task_name == SYNTHETIC_TASK:
    splits = list(SYNTHETIC_SPLITS)
  else:
    from distillspec_jax.data import batches as batches_lib
    spec.data.register()
    splits = sorted(batches_lib.get_task(spec.mixture_or_task_name).splits)
  evaluates = spec.mode == "distill" and spec.train_config.eval_every
  for name in ("split", "eval_split") if evaluates else ("split",):
    if getattr(spec, name) not in splits:
      raise ValueError(f"run.{name}={getattr(spec, name)!r}: task "
                       f"{spec.mixture_or_task_name!r} has the splits {splits}; set run.{name} "
                       "to one of them.")


def check_mesh(spec: RunSpec) -> None:
  """Refuses, before MODEL_DIR is touched, mesh sizes that do not divide the devices or a
  model axis the models cannot be split over, naming the macros."""
  models = {"model": spec.model} if spec.mode == "finetune" else {"target": spec.target,
                                                                   "draft": spec.model}
  sizes = spec.train_config.mesh
  mesh = sizes.make()  # its error names both sizes
  try:
    partitioning.check_model_axis(models, mesh)
  except ValueError as error:
    raise gin_utils.GinConfigError(f"MeshConfig.model_parallel={sizes.model_parallel} "
                                   f"(MODEL_PARALLEL): {error}") from None


def check_checkpoint_paths(spec: RunSpec) -> None:
  """Refuses a missing, unreadable or mis-shaped INITIAL/TARGET_CHECKPOINT_PATH up front.

  Checked from stored shapes only (`importer.check_checkpoint`), before MODEL_DIR is touched;
  raises GinConfigError (exit status 1) naming the macro, the value and the fix.
  """
  checks = [("INITIAL_CHECKPOINT_PATH", spec.train_config.initial_checkpoint_path, spec.model,
             "run.model", "trained")]
  if spec.mode == "distill":
    if not spec.target_checkpoint_path:
      raise gin_utils.GinConfigError(
          "Distillation needs the frozen target's parameters: pass "
          "--gin.TARGET_CHECKPOINT_PATH=/path/to/target (our MODEL_DIR, a T5X checkpoint or a "
          "Hugging Face folder).")
    checks.append(("TARGET_CHECKPOINT_PATH", spec.target_checkpoint_path, spec.target,
                   "run.target", "target"))
  try:
    given = [(macro, path) for macro, path, *_ in checks if isinstance(path, str)]
    importer.check_checkpoint_tokenizers(given, None if spec.data.vocabulary is None else
                                         vocabularies.as_vocabulary(spec.data.vocabulary))
  except ValueError as error:
    raise gin_utils.GinConfigError(str(error)) from None
  for macro, path, model, binding, role in checks:
    if path is None or (macro == "INITIAL_CHECKPOINT_PATH" and path == ""):
      continue  # no initial checkpoint: random initialisation
    try:
      if not isinstance(path, str):
        raise ValueError(f"its type is {type(path).__name__}, not str (a path).")
      importer.check_checkpoint(path, model.config)
    except (ValueError, OSError) as error:
      reason = " ".join(str(error).split())  # one paragraph
      raise gin_utils.GinConfigError(
          f"{macro}={path!r} cannot start this run: {reason} Fix: point --gin.{macro} at a "
          f"checkpoint of the {role} model ({binding}) in one of the accepted formats (our "
          "MODEL_DIR or <step> directory, a T5X checkpoint_<step> directory or MODEL_DIR, a "
          "Hugging Face folder with config.json + model.safetensors), or configure "
          f"{binding} as the model that wrote it.") from None


def check_resume(spec: RunSpec) -> Optional[int]:
  """The step a MODEL_DIR holding checkpoints is resumed from (its latest), else None. One of
  another model shape is refused here, from stored shapes (no weight read), before config.gin
  is overwritten (the trainer refuses it at its restore, after the refused run's
  configuration had replaced the one of the run that wrote them); so is one past TRAIN_STEPS
  (the run trained nothing and ended, status 0, with the later step's model)."""
  model_dir = spec.train_config.model_dir
  if is_remote(model_dir):
    return None
  try:
    params_dir, step_dir = checkpoints.params_dir_of(model_dir)
  except FileNotFoundError:
    return None  # nothing to resume
  lines = checkpoints.shape_mismatches(spec.model.param_shapes(),
                                       checkpoints.params_metadata(params_dir))
  if lines:
    raise gin_utils.GinConfigError(
        f"MODEL_DIR={model_dir!r} holds checkpoints of another model, which this run would "
        f"resume from ({step_dir}); first mismatching parameters (checkpoint vs run.model): "
        + "; ".join(lines) + ". Fix: pass a fresh --gin.MODEL_DIR for this model (or delete "
        "the old checkpoints), or configure run.model as the model that wrote them.")
  step, train_steps = int(os.path.basename(step_dir)), spec.train_config.train_steps
  if step > train_steps:
    raise gin_utils.GinConfigError(
        f"MODEL_DIR={model_dir!r} holds a checkpoint at step {step}, past TRAIN_STEPS="
        f"{train_steps}: the run would train nothing and end with the step-{step} model. Fix: "
        f"pass --gin.TRAIN_STEPS={step} or more to resume it, or a fresh --gin.MODEL_DIR.")
  return step


def _config_path(model_dir: str) -> str:
  os.makedirs(model_dir, exist_ok=True)
  return os.path.join(model_dir, "config.gin")


def cli(argv: Optional[Sequence[str]] = None) -> int:
  """The command line: `main`'s exit status (a user's mistake: 1 and the message)."""
  return gin_utils.run_binary(main, argv)


if __name__ == "__main__":
  sys.exit(cli())
