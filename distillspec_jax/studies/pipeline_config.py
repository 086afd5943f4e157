"""The main job's configuration: one frozen dataclass that gin's run files bind
(`PipelineConfig.<field> = ...`), checked when it is made. The stages are pipeline.py."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal, Optional, Union

from distillspec_jax.core.validation import (check_decode_capacity, check_distinct,
                                             check_feature_lengths,
                                             check_field_types, check_int, check_path,
                                             check_positive_int, check_real,
                                             check_speculative_budget)
from distillspec_jax.distill import blocked
from distillspec_jax.distill.head_objectives import HeadTrainingConfig
from distillspec_jax.distill.objectives import RECIPES, DistillationConfig
from distillspec_jax.decoding.speculative import Lenience
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig, check_checkpoint
from distillspec_jax.models.config import model_config
from distillspec_jax.models.head import check_feature_layers, check_unroll_steps
from distillspec_jax.models.precision import PrecisionConfig
from distillspec_jax.studies import pair_source
from distillspec_jax.studies.acceptance_head_stage import AcceptanceHeadStage
from distillspec_jax.studies.pair_source import PairSource
from distillspec_jax.training.partitioning import MeshConfig
from distillspec_jax.training import optimizers


# A head stage's name: this prefix and its recipe.
HEAD_STAGE_PREFIX = "distill_head_"


# The gamma of the training stages' tau curves (pipeline.py, common.py: T = 0, every eval_every).
TAU_CURVE_GAMMA = 5


@dataclasses.dataclass(frozen=True)
class HeadStageConfig:
  """The main job's draft-head stages (`PipelineConfig.head`; None = none): one EAGLE-3-style
  head (models/head.py) distilled from the target per recipe, in stage `distill_head_<recipe>`
  (trainer + distill/head_objectives.HeadDistillationObjective), then evaluated and timed
  like the separate drafts (report name `head_<recipe>`).

  Attributes:
    recipes: DistillSpec recipes (objectives.RECIPES: the data sources and divergence; for a
      head the on-policy source is the head's own proposals); `PipelineConfig.divergence`
      overrides theirs as for the drafts. AdaSPEC is not offered here (it needs a reference
      head).
    steps / learning_rate: each head's training steps and peak learning rate.
    mlp_dim: the head layer's MLP width (None = the target's; the demo target's 2048 would
      make a head step cost half a target step).
    feature_layers: the target's hidden-state indices the head reads (None = low, middle
      and high: models/head.default_feature_layers).
    unroll_steps: the training-time test's depth k (HeadTrainingConfig; gin
      HEAD_UNROLL_STEPS); None = the job's largest gamma (`DecodingGrid.gammas`), so that
      the head is trained for every draft position it serves: a head unrolled k steps loses
      acceptance past position k (docs/heads.md).
    step_weights: one weight per unrolled step (None = 0.8 ** s).
  """

  recipes: tuple = ("gkd",)
  steps: int = 600
  learning_rate: float = 1e-3
  mlp_dim: Optional[int] = 256
  feature_layers: Optional[tuple] = None
  unroll_steps: Optional[int] = None
  step_weights: Optional[tuple] = None

  def __post_init__(self):
    check_field_types(self)
    if not self.recipes:
      raise ValueError(f"HeadStageConfig.recipes=() is empty; name at least one of "
                       f"{sorted(RECIPES)}, or set PipelineConfig.head = None for no head.")
    for recipe in self.recipes:
      if recipe not in RECIPES:
        raise ValueError(f"HeadStageConfig.recipes has {recipe!r}; a head is distilled with "
                         f"one of {sorted(RECIPES)} (AdaSPEC needs a reference head, which "
                         "the main job does not train).")
    if len(set(self.recipes)) != len(self.recipes):
      raise ValueError(f"HeadStageConfig.recipes={self.recipes} repeats a recipe.")
    check_positive_int(self.steps, "HeadStageConfig.steps")
    check_real(self.learning_rate, "HeadStageConfig.learning_rate", minimum=0.0, above=True,
               fix="pass a learning rate > 0, e.g. 1e-3.")
    if self.mlp_dim is not None:
      check_positive_int(self.mlp_dim, "HeadStageConfig.mlp_dim")
    if self.unroll_steps is not None:
      check_unroll_steps(self.unroll_steps, "HeadStageConfig.unroll_steps")
      HeadTrainingConfig(self.unroll_steps, self.step_weights)  # one weight per step
    elif self.step_weights is not None and not self.step_weights:
      raise ValueError("HeadStageConfig.step_weights=() is empty; give one weight per "
                       "unrolled step, or None for 0.8 ** s.")

  def training(self, gammas: tuple) -> HeadTrainingConfig:
    """The training-time test for a job drafting at `gammas`: `unroll_steps`, or None = the
    largest gamma."""
    steps = self.unroll_steps if self.unroll_steps is not None else max(gammas)
    return HeadTrainingConfig(steps, self.step_weights)

  def check_target(self, target_model: str) -> None:
    """Refuses feature layers outside the target preset (before any work)."""
    if self.feature_layers is not None:
      check_feature_layers(tuple(self.feature_layers),
                           model_config(target_model).num_decoder_layers)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Everything the main job needs; the gin run files bind these fields.

  Attributes:
    run_dir: MODEL_DIR of the whole job; each stage writes a subfolder.
    task: seqio task name (MIXTURE_OR_TASK_NAME).
    task_feature_lengths: TASK_FEATURE_LENGTHS, {"inputs": ..., "targets": ...}.
    target_model / draft_model: preset names from config.MODEL_CONFIGS (vocab_size is set from
      the vocabulary); None: the model of target_checkpoint_path / draft_checkpoint_path
      (a preset named beside a checkpoint is checked against it).
    target_steps / draft_steps / distill_steps: TRAIN_STEPS of each stage.
    recipe_steps: {recipe: steps} overriding distill_steps for the named recipes (e.g. a
      SupervisedKD stage on the teacher cache, whose steps cost a fraction of a live one's).
    batch_size: BATCH_SIZE of every stage.
    optimizer / learning_rate / warmup_steps: the demo's optimiser (the paper's Adafactor
      defaults live in the trainer; the CPU demo uses AdamW with a short warm-up);
      target_learning_rate: the target's fine-tuning rate (None = learning_rate; wider models
      need a lower one).
    decay_steps: cosine decay length (None = each stage's own number of steps; the paper's
      runs use 300k).
    in_memory_data: tokenize the train split once into train.npz (small tasks, the demo);
      False streams batches from seqio (large tasks), resumed by skipping consumed batches.
    model_vocab_size: rows of the models' embeddings (None = the vocabulary's size; T5's
      32,000-piece vocabulary with 100 extra ids is padded to 32128).
    max_decode_length: decoding cache capacity of both models (None = the presets').
    save_every: checkpoint period of the training stages (None = a quarter of the steps).
    data_dir: DATA_DIR of the file-backed tasks (`gsm8k_files`, `xsum_files`, ...; see
      tasks.register_file_tasks), None for TFDS and the embedded task.
    train_vocabulary: train a `vocab_size`-piece SentencePiece model on the task's training
      text in the vocab stage (offline use of file-backed tasks) instead of T5's vocabulary.
    lm_prompt_length: for tasks without inputs (LM1B), the first tokens of each held-out
      example that form the decoding prompt.
    eval_task: the task evaluated (None = `task`; e.g. BBH for a draft distilled on GSM8K,
      the paper's cross-task transfer).
    recipes: distillation recipes to run (objectives.RECIPES names); divergence: their
      divergence (None = each recipe's default).
    grid: the speculative decoding grid of the evaluation (evaluation.decoding_grid
      .DecodingGrid, shared with the eval binary; gin: PipelineConfig.grid = @DecodingGrid(),
      DecodingGrid.gammas = ...); the main job decodes losslessly (its lenience stays the
      default) with gamma draft tokens a round, and with an adaptive
      `DecodingGrid.draft_length` also by that rule at the largest gamma (its gamma_max),
      for every draft that can read the rule's signal.
    eval_examples: test prompts for quality and tau.
    speed: the timing's settings (evaluation.evaluate.SpeedConfig, shared with the eval
      binary; gin: PipelineConfig.speed = @SpeedConfig(), SpeedConfig.calls = ...): the first
      SpeedConfig.examples test prompts (at least 1 here), each decoded alone (batch 1, as in
      the paper), timed in a fresh process.
    max_new_tokens: decoding budget in evaluation and on-policy sampling.
    eval_every: distillation steps between in-training tau evaluations (the tau curve).
    vocab_size: SentencePiece pieces of the embedded vocabulary.
    train_examples: keep only this many training examples (None = the whole split; smoke
      tests use a few).
    adaspec_reference / adaspec_top_k / adaspec_normalization: the recipe "adaspec" (AdaSPEC,
      Hu et al. 2025) distils the raw draft with token selection against a reference model:
      the draft distilled by the `adaspec_reference` recipe (which must also be in `recipes`,
      and whose data source and divergence AdaSPEC reuses); keeps the top `adaspec_top_k`
      fraction of tokens by loss margin; normalises the loss by "all" valid tokens (as the
      public AdaSPEC code) or by the "kept" ones.
    teacher_cache_k: the teacher cache switch (teacher_cache.py; None = off): the stage
      teacher_cache stores the target's top-k log-probabilities over the train split once,
      and the `teacher_cache_recipes` (fixed-data recipes only) train on them with the
      (k + 1)-bin divergence instead of running the target; the other recipes run it live.
    target_checkpoint_path / draft_checkpoint_path: a pretrained target / draft (any format:
      our orbax, T5X, Hugging Face; interop.importer): the target stage loads the target as it
      is and the raw draft is the draft, unless `pair` asks to fine-tune them from there;
      None = trained from random weights.
    pair: the user's own pair (studies/pair_source.py PairSource): VOCABULARY (the models'
      tokenizer, no vocabulary trained), FINETUNE_TARGET, FINETUNE_DRAFT.
    seed: the one seed of the job.
    mesh: the (data, model) mesh of every stage (training.partitioning.MeshConfig, shared
      with the other binaries; gin: PipelineConfig.mesh = @MeshConfig(),
      MeshConfig.data_parallel = %DATA_PARALLEL); the model axis must divide both models'
      heads, MLP widths and vocabulary.
    precision: both models' activation dtype and remat policies and the frozen target's
      parameter dtype (models.precision.PrecisionConfig, shared with the other binaries; gin:
      PipelineConfig.precision = @PrecisionConfig(), PrecisionConfig.remat_policy =
      %REMAT_POLICY); by default float32 activations, no remat, the target's parameters as
      trained.
    eval_batch_size: prompts per batch of the evaluation's decodes (None = all at once).
    loss_block_size: positions per block of every training stage's loss (LOSS_BLOCK_SIZE;
      distill/blocked.py): an int in [1, decoder length], "auto" or None (whole logits).
    head: the draft-head stages (HeadStageConfig; None = no head): a head per recipe,
      distilled from the target and evaluated beside the separate drafts.
    acceptance_head: the distilled drafts' acceptance heads (AcceptanceHeadStage; None =
      none): each chosen recipe's draft is distilled with an acceptance head trained jointly,
      its checkpoint carries the head, and the report gives the head's calibration beside
      the top probability's.
  """

  run_dir: str = "runs/demo"
  task: str = "embedded_arithmetic"
  task_feature_lengths: dict = dataclasses.field(
      default_factory=lambda: {"inputs": 40, "targets": 44})
  target_model: Optional[str] = "demo_target"
  draft_model: Optional[str] = "demo_draft"
  target_steps: int = 1500
  draft_steps: int = 1500
  distill_steps: int = 600
  recipe_steps: Optional[dict] = None
  batch_size: int = 32
  optimizer: Literal[optimizers.OPTIMIZERS] = "adamw"
  learning_rate: float = 2e-3
  target_learning_rate: Optional[float] = None
  distill_learning_rate: float = 1e-3
  warmup_steps: int = 100
  decay_steps: Optional[int] = None
  in_memory_data: bool = True
  model_vocab_size: Optional[int] = None
  save_every: Optional[int] = None
  max_decode_length: Optional[int] = None
  eval_task: Optional[str] = None
  lm_prompt_length: int = 8
  data_dir: Optional[str] = None
  train_vocabulary: bool = False
  recipes: tuple = ("gkd", "supervised_kd")
  divergence: Optional[str] = None
  grid: DecodingGrid = DecodingGrid()
  eval_examples: int = 128
  speed: SpeedConfig = SpeedConfig()
  max_new_tokens: int = 44
  eval_every: int = 100
  vocab_size: int = 256
  train_examples: Optional[int] = None
  adaspec_reference: str = "supervised_kd"
  adaspec_top_k: float = 0.4
  adaspec_normalization: str = "all"
  teacher_cache_k: Optional[int] = None
  teacher_cache_recipes: tuple = ("supervised_kd",)
  target_checkpoint_path: Optional[str] = None
  draft_checkpoint_path: Optional[str] = None
  seed: int = 0
  progress_bar: bool = True
  mesh: MeshConfig = MeshConfig()
  precision: PrecisionConfig = PrecisionConfig(activation_dtype="float32", remat_policy="none")
  eval_batch_size: Optional[int] = None
  loss_block_size: Union[int, Literal["auto"], None] = "auto"
  head: Optional[HeadStageConfig] = None
  acceptance_head: Optional[AcceptanceHeadStage] = None
  pair: PairSource = PairSource()

  def __post_init__(self):
    if not self.run_dir:  # gin's unset MODEL_DIR is None: say which macro, not the type
      raise ValueError("MODEL_DIR is not set; pass --gin.MODEL_DIR=<directory> "
                       "(PipelineConfig.run_dir; a gs:// path on a TPU slice).")
    check_field_types(self)
    check_feature_lengths(self.task_feature_lengths, "TASK_FEATURE_LENGTHS", required=("targets",))
    self._check_sub_configs()
    if self.pair.chat_template and self.data_dir is None:
      raise ValueError("CHAT_TEMPLATE=True reads conversations from DATA_DIR/chat/*.jsonl: set "
                       "DATA_DIR, or CHAT_TEMPLATE=False.")
    for role in ("target", "draft"):
      if getattr(self, f"{role}_model") is None and getattr(
          self, f"{role}_checkpoint_path") is None:
        raise ValueError(f"{role.upper()}_MODEL=None needs {role.upper()}_CHECKPOINT_PATH: "
                         f"the {role} comes from a preset or from a checkpoint.")
    for name in ("target_steps", "draft_steps", "distill_steps", "batch_size", "eval_examples",
                 "max_new_tokens", "vocab_size", "lm_prompt_length"):
      check_positive_int(getattr(self, name), name)
    check_speculative_budget(self.max_new_tokens, f"{type(self).__name__}.max_new_tokens")
    for name in ("decay_steps", "save_every", "model_vocab_size", "max_decode_length",
                 "train_examples", "eval_batch_size"):
      if getattr(self, name) is not None:
        check_positive_int(getattr(self, name), name)
    for name in ("warmup_steps", "eval_every", "seed"):  # seed: numpy's generators take >= 0
      check_int(getattr(self, name), name, 0)
    self._check_learning_rates()
    blocked.check_block_size_setting(self.loss_block_size, "loss_block_size (LOSS_BLOCK_SIZE)")
    if not self.recipes:
      raise ValueError(f"recipes=() is empty; name at least one of {sorted(RECIPES)} (e.g. "
                       "--gin.RECIPES=\"('supervised_kd',)\").")
    check_distinct(self.recipes, "recipes (RECIPES)")  # one distill_<recipe> stage each
    for recipe, steps in (self.recipe_steps or {}).items():
      if recipe not in self.recipes:
        raise ValueError(f"recipe_steps names {recipe!r}, which is not in "
                         f"recipes={self.recipes}; list only recipes the job runs.")
      check_positive_int(steps, f"recipe_steps[{recipe!r}]")
    if "adaspec" in self.recipes and self.adaspec_reference not in self.recipes:
      raise ValueError(f"The recipe 'adaspec' needs its reference recipe "
                       f"adaspec_reference={self.adaspec_reference!r} in recipes={self.recipes}.")
    for recipe in self.recipes:
      distillation_config(self, recipe)  # raises on an unknown name or bad value
    if self.teacher_cache_k is not None:
      from distillspec_jax.distill import teacher_cache
      check_positive_int(self.teacher_cache_k, "teacher_cache_k")
      check_distinct(self.cached_recipes, "teacher_cache_recipes")
      for recipe in self.cached_recipes:
        if recipe not in self.recipes:
          raise ValueError(f"teacher_cache_recipes names {recipe!r}, which is not in "
                           f"recipes={self.recipes}; list only recipes the job runs.")
        try:
          teacher_cache.check_fixed_data(distillation_config(self, recipe))
        except ValueError as error:
          raise ValueError(f"teacher_cache_recipes: recipe {recipe!r}: {error}") from error
    self.speed.check_prompts(self.eval_examples, type(self).__name__)
    if self.head is not None:
      if not set(self.head_stages) <= set(self.stages):
        raise ValueError(f"{type(self).__name__} does not run draft-head stages; set its "
                         "head = None (the main job's PipelineConfig trains heads).")
      self.head.check_target(self.target_model)
      training = self.head.training(self.grid.gammas)  # step_weights: one per unrolled step
      lengths = self.task_feature_lengths
      width = lengths["targets"] + (lengths.get("inputs", 0)
                                    if self.feature_converter == "decoder" else 0)
      if training.unroll_steps >= width:
        raise ValueError(
            f"The head's unroll_steps={training.unroll_steps} (HeadStageConfig.unroll_steps, "
            f"None = the largest gamma) reaches past its training rows' {width} positions "
            "(TASK_FEATURE_LENGTHS): step s is compared with the target at positions t + s < "
            f"{width}. Unroll fewer steps or train on longer sequences.")
      if training.unroll_steps < max(self.grid.gammas):
        logging.warning(
            "HeadStageConfig.unroll_steps=%d is below the largest gamma %d: the head is not "
            "trained for draft positions %d..%d, whose acceptance falls (docs/heads.md); "
            "None unrolls to the largest gamma.", training.unroll_steps, max(self.grid.gammas),
            training.unroll_steps + 1, max(self.grid.gammas))
      for recipe in self.head.recipes:
        distillation_config(self, recipe)
    self._check_warmup()
    self._check_acceptance_head()

  def _check_learning_rates(self) -> None:
    """Every training stage's learning rate > 0, before the first stage runs (its TrainConfig
    would refuse it only when that stage starts)."""
    for name in ("learning_rate", "distill_learning_rate", "target_learning_rate"):
      if getattr(self, name) is not None:
        check_real(getattr(self, name), name, minimum=0.0, above=True)

  def training_steps(self) -> dict:
    """{stage: steps} of every stage that trains: the target and the raw draft when they are
    trained (no checkpoint, or FINETUNE_TARGET / FINETUNE_DRAFT), each recipe's distillation
    and each draft head."""
    steps = {}
    for role, stage, count in (("target", "target", self.target_steps),
                               ("draft", "draft_raw", self.draft_steps)):
      if getattr(self, f"{role}_checkpoint_path") is None or self.pair.finetunes(role):
        steps[stage] = count
    steps.update({f"distill_{r}": self.distill_steps_of(r) for r in self.recipes})
    if self.head is not None:
      steps.update({stage: self.head.steps for stage in self.head_stages})
    return steps

  def _check_warmup(self) -> None:
    """warmup_steps within every training stage's schedule (decay_steps, else the stage's
    own steps), before any stage runs: the optimiser refuses it only when that stage starts,
    after the stages before it. The main job's stages only (a study's run their own)."""
    if hasattr(self, "stage_functions"):
      return
    for stage, steps in self.training_steps().items():
      total = self.decay_steps or steps
      if self.warmup_steps > total:
        what = "decay_steps" if self.decay_steps else "steps"
        raise ValueError(
            f"warmup_steps={self.warmup_steps} (PipelineConfig.warmup_steps) exceeds the "
            f"{total} {what} of stage {stage!r}, whose learning-rate schedule it must fit in; "
            f"set --gin.PipelineConfig.warmup_steps={total} or less, or train that stage "
            "longer.")

  def _check_sub_configs(self) -> None:
    """Each sub-config of its class (checked when it was made); the main job always times,
    and decodes losslessly with gamma draft tokens a round."""
    owner = type(self).__name__
    for name, kind, optional in (
        ("pair", PairSource, False), ("grid", DecodingGrid, False), ("speed", SpeedConfig, False),
        ("mesh", MeshConfig, False), ("precision", PrecisionConfig, False),
        ("head", HeadStageConfig, True), ("acceptance_head", AcceptanceHeadStage, True)):
      value = getattr(self, name)
      if not (isinstance(value, kind) or (optional and value is None)):
        raise TypeError(f"{owner}.{name}={value!r} must be a {kind.__name__}"
                        f"{' or None' if optional else ''} (gin: {owner}.{name} = "
                        f"@{kind.__name__}()).")
    check_positive_int(self.speed.examples, "SpeedConfig.examples (the main job always "
                       "times; SPEED_EXAMPLES)")
    if self.grid.leniences != [Lenience()]:
      raise ValueError(
          f"DecodingGrid.lenience_kinds={tuple(self.grid.lenience_kinds)}, epsilons="
          f"{tuple(self.grid.epsilons)}: the main job decodes losslessly; leave them at their "
          "defaults (('lin',), (1.0,)) and sweep leniences with python -m distillspec_jax.eval.")

  def _check_acceptance_head(self) -> None:
    """The acceptance heads' recipes, and a grid rule reading a head's signal only where a
    draft has one (before any work)."""
    owner = type(self).__name__
    if hasattr(self, "stage_functions") and (self.grid.draft_length.adaptive
                                             or self.acceptance_head is not None):
      raise ValueError(  # a study's own stages (recipe_grid.py, garden.py) run neither
          f"{owner} trains and evaluates with its own stages: leave DecodingGrid.draft_length "
          f"at DraftLength() (it is {self.grid.draft_length}) and acceptance_head at None (it "
          f"is {self.acceptance_head}); the main job's PipelineConfig runs both, and "
          "python -m distillspec_jax.eval sweeps draft lengths.")
    if self.acceptance_head is not None:
      if not self.acceptance_head_recipes:
        raise ValueError(f"AcceptanceHeadStage.recipes=None but every recipe of {owner}"
                         f".recipes={tuple(self.recipes)} trains on the teacher cache; run one "
                         "live (teacher_cache_recipes) or set acceptance_head = None.")
    if self.grid.draft_length.signal == "acceptance_head" and not self.acceptance_head_recipes:
      raise ValueError(
          f"DecodingGrid.draft_length={self.grid.draft_length} reads the draft's acceptance "
          f"head, but {owner}.acceptance_head=None trains none; set "
          "PipelineConfig.acceptance_head = @AcceptanceHeadStage() or "
          "DraftLength.signal = 'top_probability'.")

  def model_overrides(self, role: str) -> dict:
    """The TransformerConfig fields this job sets on the "target" or "draft" preset."""
    overrides = self.precision.model_overrides(role)
    if self.max_decode_length:
      overrides["max_decode_length"] = self.max_decode_length
    return overrides

  def check_inputs(self) -> None:
    """Refuses input paths that do not exist (DATA_DIR, the starting checkpoints) before
    work starts; the main binary and run_pipeline call it."""
    if self.data_dir is not None:
      check_path(self.data_dir, "DATA_DIR (PipelineConfig.data_dir)", kind="dir",
                 fix="pass the folder holding the task folders (gsm8k/, xsum/, ...), e.g. "
                     "../shared/data.")
    for name in ("target_checkpoint_path", "draft_checkpoint_path"):
      if getattr(self, name) is not None:
        check_checkpoint(getattr(self, name), f"{name.upper()} (PipelineConfig.{name})")
    pair_source.check_pair_inputs(self.pair, self.roles, self.train_vocabulary)
    self._check_decode_capacity()

  def _check_decode_capacity(self) -> None:
    """max_decode_length, when set, holds the longest request the job decodes: a
    decoder-only model's prompt (up to TASK_FEATURE_LENGTHS['inputs']) after its first slot,
    max_new_tokens and the last round's gamma - 1 more, at the grid's largest gamma or the
    training stages' tau curves' (TAU_CURVE_GAMMA). Refused before work: the decoders refuse
    it only when they first run, after the stages before them."""
    if not self.max_decode_length:
      return
    gamma = max(tuple(self.grid.gammas) + (TAU_CURVE_GAMMA,))
    decoder_only = self.feature_converter == "decoder"
    prompt = self.task_feature_lengths.get("inputs", 0) if decoder_only else 0
    check_decode_capacity(self.max_decode_length, "PipelineConfig.max_decode_length",
                          prompt=prompt, new_tokens=self.max_new_tokens, gamma=gamma)

  @property
  def roles(self) -> dict:
    """{role: (checkpoint macro, checkpoint path, preset)} of "target" and "draft"."""
    return {role: (f"{role.upper()}_CHECKPOINT_PATH", getattr(self, f"{role}_checkpoint_path"),
                   getattr(self, f"{role}_model")) for role in ("target", "draft")}

  @property
  def feature_converter(self) -> str:
    """'enc_dec' for encoder-decoder models, 'decoder' (prefix LM / LM) for decoder-only."""
    if self.target_model is not None:
      kind = model_config(self.target_model).kind
    else:
      kind = pair_source.role_config(self.target_checkpoint_path, None, None, {},
                                     "TARGET_CHECKPOINT_PATH").kind
    return "enc_dec" if kind == "encoder_decoder" else "decoder"

  def stage_dir(self, stage: str) -> str:
    return os.path.join(self.run_dir, stage)

  @property
  def cached_recipes(self) -> tuple:
    """The recipes that read the teacher cache (none when it is off)."""
    return tuple(self.teacher_cache_recipes) if self.teacher_cache_k is not None else ()

  def distill_steps_of(self, recipe: str) -> int:
    """Training steps of the recipe's distillation stage."""
    return int((self.recipe_steps or {}).get(recipe, self.distill_steps))

  @property
  def acceptance_head_recipes(self) -> tuple:
    """The recipes whose distilled drafts carry an acceptance head (none without
    `acceptance_head`)."""
    if self.acceptance_head is None:
      return ()
    return self.acceptance_head.chosen_recipes(tuple(self.recipes), self.cached_recipes)

  @property
  def distill_stages(self) -> tuple:
    return tuple(f"distill_{r}" for r in self.recipes)

  @property
  def head_stages(self) -> tuple:
    """`distill_head_<recipe>` of each head recipe (none without `head`)."""
    return tuple(f"{HEAD_STAGE_PREFIX}{r}" for r in (self.head.recipes if self.head else ()))

  @property
  def stages(self) -> tuple:
    cache = ("teacher_cache",) if self.cached_recipes else ()
    return (("vocab", "target", "draft_raw") + cache + self.distill_stages + self.head_stages
            + ("evaluate", "report"))

  def dependencies(self, stage: str) -> tuple:
    if stage in ("target", "draft_raw"):
      return ("vocab",)
    if stage.startswith(HEAD_STAGE_PREFIX):
      return ("target",)
    if stage == "distill_adaspec":
      return ("target", "draft_raw", f"distill_{self.adaspec_reference}")
    if stage == "teacher_cache":
      return ("vocab", "target")
    if stage.startswith("distill_"):
      cache = ("teacher_cache",) if stage[len("distill_"):] in self.cached_recipes else ()
      return ("target", "draft_raw") + cache
    if stage == "evaluate":
      return ("target", "draft_raw") + self.distill_stages + self.head_stages
    if stage == "report":
      return ("evaluate",)
    return ()


def distillation_config(config: PipelineConfig, recipe: str) -> DistillationConfig:
  """The DistillationConfig of a recipe name (objectives.RECIPES, or "adaspec")."""
  overrides = {"max_new_tokens": config.task_feature_lengths["targets"],
               "loss_block_size": config.loss_block_size}
  if config.divergence is not None:  # "" is refused by name, not read as the default
    overrides["divergence"] = config.divergence
  if recipe == "adaspec":
    return DistillationConfig.from_recipe(
        config.adaspec_reference, top_k_fraction=config.adaspec_top_k,
        selection_normalization=config.adaspec_normalization, **overrides)
  return DistillationConfig.from_recipe(recipe, **overrides)
