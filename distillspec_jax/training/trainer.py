"""The trainer: train state, one jitted train step, the loop, checkpoints, eval (its log:
metrics_log.py).

One trainer for both stages: fine-tuning with cross-entropy (`FinetuneObjective`) and
DistillSpec distillation (`DistillationObjective`); the objective decides the batch (fixed or
sampled) and the loss. `train(config, objective, data, ...)` is the programmatic entry point
(`train.py` is its gin binary).

Determinism and resumption:
  * one seed, split once into (init key, step base key); step s uses
    `jax.random.fold_in(base_key, s)`, so a resumed run replays the same randomness;
  * data: `data` is a *data source* (see `as_batch_iterator`): `batch_at(step)` objects are
    indexed by step; a zero-argument factory of a deterministic iterator is re-created and
    the batches consumed before the restored step are skipped (the simple T5X-free
    alternative to checkpointing the iterator). Both give the same order after a restart.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import time
from typing import Any, Callable, Iterator, Literal, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from distillspec_jax.training import checkpoints
from distillspec_jax.training import multihost
from distillspec_jax.training import optimizers
from distillspec_jax.training import partitioning
from distillspec_jax.core import validation
from distillspec_jax.models.config_json import config_to_json
from distillspec_jax.models.config import check_token_ids
from distillspec_jax.distill.objectives import (SOURCES, DistillationConfig, DistillationObjective,
                                          FinetuneObjective)
from distillspec_jax.training.metrics_log import MetricsWriter, summarize

Params = Any
Batch = dict
EvalFn = Callable[[Params, int], dict]


@flax.struct.dataclass
class TrainState:
  """What changes every step (and is checkpointed): step, trained params, optimizer state."""

  step: jax.Array
  params: Params
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop and optimiser settings. Defaults = the paper (Adafactor, 3e-4, 5k warm-up, cosine
  to 0.1x at 300k, batch 32); tiny demos override them.

  Attributes:
    model_dir: MODEL_DIR (checkpoints, metrics.jsonl, tensorboard/).
    train_steps: total steps (a resumed run continues up to this step).
    batch_size: global batch size (checked against the batches).
    seed: the one seed (initialisation, source draws, sampling, dropout).
    optimizer, learning_rate, warmup_steps, decay_steps, final_fraction: see optimizers.py.
    save_every / keep_checkpoints: orbax period and keep-last-N.
    log_every: metrics period (metrics.jsonl, TensorBoard, progress bar).
    eval_every: period of `eval_fn` (0 = never).
    mesh: the (data, model) mesh sizes (partitioning.MeshConfig; gin: TrainConfig.mesh =
      @MeshConfig()), used when the caller passes no mesh.
    initial_checkpoint_path: params to start from when MODEL_DIR has no checkpoint.
    progress_bar: tqdm with ETA.
  """

  model_dir: str
  train_steps: int
  batch_size: int = optimizers.PAPER_BATCH_SIZE
  seed: int = 0
  optimizer: Literal[optimizers.OPTIMIZERS] = "adafactor"
  learning_rate: float = optimizers.PAPER_BASE_LEARNING_RATE
  warmup_steps: int = optimizers.PAPER_WARMUP_STEPS
  decay_steps: int = optimizers.PAPER_TOTAL_STEPS
  final_fraction: float = optimizers.PAPER_FINAL_FRACTION
  save_every: int = 1000
  keep_checkpoints: Optional[int] = 3
  log_every: int = 100
  eval_every: int = 0
  mesh: partitioning.MeshConfig = partitioning.MeshConfig()
  initial_checkpoint_path: Optional[str] = None
  progress_bar: bool = True
  async_checkpointing: bool = False

  def __post_init__(self):
    if not self.model_dir:  # gin's unset MODEL_DIR is None: say which macro, not the type
      raise ValueError(f"model_dir={self.model_dir!r}: MODEL_DIR is not set; pass "
                       "--gin.MODEL_DIR=/path/to/dir (TrainConfig.model_dir).")
    validation.check_field_types(self)
    validation.check_int(self.train_steps, "TrainConfig.train_steps (TRAIN_STEPS)", 0)
    validation.check_positive_int(self.batch_size, "TrainConfig.batch_size (BATCH_SIZE)")
    # numpy's generators (the batches' order) take no negative seed: refused now, not at a step
    validation.check_int(self.seed, "TrainConfig.seed", 0)
    validation.check_positive_int(self.log_every, "TrainConfig.log_every (LOG_EVERY)")
    validation.check_positive_int(self.save_every, "TrainConfig.save_every (SAVE_EVERY)")
    validation.check_int(self.eval_every, "TrainConfig.eval_every (EVAL_EVERY; 0 = never)", 0)
    if not isinstance(self.mesh, partitioning.MeshConfig):
      raise TypeError(f"TrainConfig.mesh={self.mesh!r} must be a MeshConfig (gin: "
                      "TrainConfig.mesh = @MeshConfig()).")
    if self.keep_checkpoints is not None:
      validation.check_positive_int(self.keep_checkpoints, "TrainConfig.keep_checkpoints")
    # The schedule's own validation (one rule, shared): decay_steps is its total_steps, and a
    # warm-up longer than the decay is refused, not clamped.
    try:
      self.optimizer_spec.schedule()
    except ValueError as error:
      raise ValueError(
          f"TrainConfig(learning_rate={self.learning_rate!r}, warmup_steps={self.warmup_steps!r}"
          f", decay_steps={self.decay_steps!r}, final_fraction={self.final_fraction!r}): "
          f"{error} (TrainConfig.decay_steps is the schedule's total_steps). Set "
          "TrainConfig.warmup_steps <= TrainConfig.decay_steps (gin), e.g. a shorter warm-up "
          "or a longer decay.") from error

  @property
  def optimizer_spec(self) -> "OptimizerSpec":
    return OptimizerSpec(self.optimizer, self.learning_rate, self.warmup_steps,
                         self.decay_steps, self.final_fraction)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """The hashable optimiser description (a static part of the jitted step)."""

  name: str
  learning_rate: float
  warmup_steps: int
  decay_steps: int
  final_fraction: float

  def schedule(self) -> optax.Schedule:
    return optimizers.learning_rate_schedule(
        self.learning_rate, self.warmup_steps, self.decay_steps, self.final_fraction)

  def make(self) -> optax.GradientTransformation:
    return optimizers.make_optimizer(self.name, self.schedule())


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  history: list  # the metric records this call logged (also in MODEL_DIR/metrics.jsonl)
  # Records of earlier processes kept on resume (step <= the restored step), read back from
  # MODEL_DIR/metrics.jsonl; empty for a fresh run.
  resumed_history: list = dataclasses.field(default_factory=list)

  @property
  def full_history(self) -> list:
    """Every record of the run across restarts, each step once (what metrics.jsonl holds)."""
    return self.resumed_history + self.history


# Words for the data sources in messages (distillation.SOURCES order).
SOURCE_DESCRIPTIONS = {"fixed": "fixed data (the dataset's batch)",
                       "draft": "draft samples (on-policy)", "target": "target samples"}


class NonFiniteError(FloatingPointError):
  """A training step produced a non-finite loss or gradient; training stopped."""


# --- the step ---------------------------------------------------------------------------------


def train_step(state: TrainState, batch: Batch, rng: jax.Array, frozen: dict, *, objective,
               optimizer: optax.GradientTransformation):
  """One update: (state, batch, rng, frozen params) -> (state, metrics).

  batch: T5X features [batch, ...]; rng: this step's key (fold_in(base, step));
  frozen: {"target": ..., "reference": ...} params that receive no gradient (a separate
  argument so they are neither donated nor checkpointed with the trained params).
  """
  batch_rng, dropout_rng = jax.random.split(rng)
  train_batch, source = objective.make_batch(state.params, frozen, batch, batch_rng)
  use_dropout = objective.model.config.dropout_rate > 0.0

  def loss_fn(params):
    return objective.loss(params, frozen, train_batch, dropout_rng if use_dropout else None)

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # A non-finite loss or gradient leaves the state as it was (the loop raises when it next
  # reads the flags, before any save or evaluation), so a NaN never reaches the parameters,
  # the optimizer state or a checkpoint. The select fuses with the update; no host sync.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep_if_finite = lambda new, old: jnp.where(finite, new, old)
  params = jax.tree.map(keep_if_finite, params, state.params)
  opt_state = jax.tree.map(keep_if_finite, opt_state, state.opt_state)
  metrics = dict(metrics, source=source, grad_norm=grad_norm, finite=finite)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


@functools.lru_cache(maxsize=32)
def make_train_step(objective, optimizer_spec: "OptimizerSpec", mesh):
  """`train_step` jitted once per (objective, optimizer, mesh), with explicit in/out shardings
  and the state donated. Cached, so restarts and repeated stages in one process reuse the
  compiled step. Returns (step_fn, state_shardings, frozen_shardings)."""
  optimizer = optimizer_spec.make()
  model = objective.model
  param_sharding = partitioning.param_shardings(model, mesh)
  # Optimizer-state shardings follow the params by tree path (partitioning.py): XLA's
  # propagation leaves an initial state of zeros unsharded (every device held all of it).
  opt_sharding = partitioning.optimizer_state_shardings(
      jax.eval_shape(optimizer.init, model.param_shapes()), model.param_shapes(),
      param_sharding, mesh)
  state_shardings = TrainState(step=partitioning.replicated(mesh), params=param_sharding,
                               opt_state=opt_sharding)
  frozen_shardings = {}
  for name in objective.frozen_names:
    frozen_model = objective.target if name == "target" else objective.reference
    frozen_shardings[name] = partitioning.param_shardings(frozen_model, mesh)
  step_fn = jax.jit(
      functools.partial(train_step, objective=objective, optimizer=optimizer),
      in_shardings=(state_shardings, partitioning.batch_sharding(mesh),
                    partitioning.replicated(mesh), frozen_shardings),
      out_shardings=(state_shardings, partitioning.replicated(mesh)),
      donate_argnums=(0,))
  return step_fn, state_shardings, frozen_shardings


# --- data ---------------------------------------------------------------------------------------


def _takes_shard(fn) -> bool:
  try:
    return "shard" in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def as_batch_iterator(data: Any, start_step: int,
                      shard: Optional[multihost.DataShard] = None) -> Iterator[Batch]:
  """This process's batches for steps start_step, start_step + 1, ... from a data source.

  data may be: an object with `local_batch_at(step, shard)` (this process's rows only) or
  `batch_at(step) -> batch` (the global batch; its `shard.rows` are kept), both indexed, O(1)
  resume; a callable `batch_at(step)` when wrapped with `BatchAt`; a callable returning a
  fresh deterministic iterator, re-created and fast-forwarded past `start_step` batches:
  `factory(shard=DataShard)` yields this process's `shard.local_batch_size` rows (seqio:
  `shard.shard_info()`), a zero-argument factory the global batch (one data shard only); or
  a re-iterable (list, dataset) of global batches iterated from its start likewise.
  `shard` = None: one shard (the whole batch).
  """
  sharded = shard is not None and shard.num_shards > 1
  if hasattr(data, "local_batch_at") and shard is not None:
    return (data.local_batch_at(step, shard) for step in itertools.count(start_step))
  if hasattr(data, "batch_at"):
    if not sharded:
      return (data.batch_at(step) for step in itertools.count(start_step))
    return ({k: v[shard.rows] for k, v in data.batch_at(step).items()}
            for step in itertools.count(start_step))
  if callable(data) and _takes_shard(data):
    iterator = iter(data(shard=shard))
  elif sharded:
    raise ValueError(
        f"The data source {describe_data(data)} yields whole batches, but this process reads "
        f"data shard {shard.index} of {shard.num_shards} (rows {shard.rows.start}:"
        f"{shard.rows.stop} of {shard.global_batch_size}). Give the factory a `shard` argument "
        "and read `shard.local_batch_size` rows of `shard.shard_info()` (seqio), or pass a "
        "source with local_batch_at(step, shard) / batch_at(step).")
  else:
    iterator = iter(data() if callable(data) else data)
  if start_step:
    if iterator is data:
      logging.warning("Resuming at step %d from a one-shot iterator: batches cannot be replayed "
                      "deterministically; pass a batch_at source or an iterator factory.",
                      start_step)
    else:
      iterator = itertools.islice(iterator, start_step, None)
  return iterator


@dataclasses.dataclass(frozen=True)
class SyntheticData:
  """Indexed procedurally generated seq2seq source (tests, benchmarks, the CPU demo binary).

  Row: encoder_input_tokens = random tokens in [2, vocab) of random length, then padding;
  target = the input reversed, then EOS. `batch_at(step)` depends on (seed, step) only.
  Decoder-only models get the prefix-LM layout: [prompt, target] with loss only on the target.
  """

  batch_size: int
  input_length: int = 8
  target_length: int = 8
  vocab_size: int = 64
  seed: int = 0
  decoder_only: bool = False

  def batch_at(self, step: int) -> Batch:
    rng = np.random.default_rng((self.seed, step))
    b, li, lt = self.batch_size, self.input_length, self.target_length
    n = rng.integers(1, min(li, lt - 1) + 1, size=b)
    tokens = rng.integers(2, self.vocab_size, size=(b, li))
    inputs = np.where(np.arange(li)[None] < n[:, None], tokens, 0).astype(np.int32)
    targets = np.zeros((b, lt), np.int32)
    for i in range(b):
      targets[i, :n[i]] = inputs[i, :n[i]][::-1]
      targets[i, n[i]] = 1  # EOS
    if self.decoder_only:
      width = li + lt
      full = np.zeros((b, width), np.int32)
      weights = np.zeros((b, width), np.float32)
      for i in range(b):
        full[i, :n[i]] = inputs[i, :n[i]]
        full[i, n[i]:n[i] + n[i] + 1] = targets[i, :n[i] + 1]
        weights[i, n[i]:n[i] + n[i] + 1] = 1.0
      return {"decoder_target_tokens": full,
              "decoder_input_tokens": np.pad(full, ((0, 0), (1, 0)))[:, :-1],
              "decoder_loss_weights": weights}
    return {"encoder_input_tokens": inputs, "decoder_target_tokens": targets,
            "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
            "decoder_loss_weights": (targets > 0).astype(np.float32)}


@dataclasses.dataclass(frozen=True)
class BatchAt:
  """Wraps a function `step -> batch` as an indexed data source."""

  fn: Callable[[int], Batch]

  def batch_at(self, step: int) -> Batch:
    return self.fn(step)


# --- the loop -----------------------------------------------------------------------------------


def _check_param_shapes(params: Params, model, what: str, fix: str) -> None:
  """The checkpoint shape check (`checkpoints.shape_mismatches`) for params given in memory."""
  lines = checkpoints.shape_mismatches(model.param_shapes(), params)
  if lines:
    raise ValueError(f"{what} do not have the parameter shapes of their model "
                     f"({model.config.kind}, emb_dim={model.config.emb_dim}, vocab_size="
                     f"{model.config.vocab_size}); first mismatching parameters:\n  "
                     + "\n  ".join(lines) + f"\n{fix}")


def _initial_params(config: TrainConfig, model, init_key, abstract, restore_fn, init_params):
  if init_params is not None:
    _check_param_shapes(init_params, model, "init_params",
                        "Pass parameters of the trained model (or configure the model that "
                        "wrote them).")
    # A copy: the step donates the state, which would delete the caller's arrays (device_put
    # to the sharding they already have returns the same buffers). Host or single-device
    # params go to each process's shards only (multihost.put_global).
    return multihost.put_global(init_params, jax.tree.map(lambda a: a.sharding, abstract))
  if config.initial_checkpoint_path:
    return restore_fn(config.initial_checkpoint_path, abstract)
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  return jax.jit(model.init, out_shardings=shardings)(init_key)


def describe_data(data: Any) -> str:
  """A short name of a data source for messages: its `name`, a dataclass's repr, or its type."""
  name = getattr(data, "name", None)
  if isinstance(name, str):
    return name
  if dataclasses.is_dataclass(data):
    return repr(data)
  return getattr(data, "__qualname__", type(data).__name__)


def check_batch_token_ids(batch: Batch, vocab_size: int, where: str) -> None:
  """Every `*_tokens` feature of a host batch must hold ids in [0, vocab_size)."""
  for key, value in batch.items():
    if key.endswith("_tokens"):
      check_token_ids(value, vocab_size, f"{key} {where}")


def _raise_non_finite(checked: list, config: TrainConfig, objective, checkpointer,
                      data_name: str) -> None:
  """Raises NonFiniteError for the first of `checked` [(step, metrics)] with finite False."""
  flags = jax.device_get([m["finite"] for _, m in checked])
  bad = [i for i, ok in enumerate(flags) if not bool(ok)]
  if not bad:
    return
  step, metrics = checked[bad[0]]
  values = jax.device_get({k: metrics[k] for k in ("loss", "grad_norm", "source")})
  source = SOURCES[int(values["source"])]
  latest = checkpointer.latest_step()
  kept = (f"the last good checkpoint, step {latest}, stays in {config.model_dir}" if latest
          is not None else f"no checkpoint had been written to {config.model_dir} yet")
  checks = [f"the learning rate (learning_rate={config.learning_rate}, warmup_steps="
            f"{config.warmup_steps}: lower the rate or lengthen the warm-up)",
            f"the input ids of the batch for step {step} of {data_name}"]
  if objective.frozen_names:
    checks.append("the target checkpoint (TARGET_CHECKPOINT_PATH: NaN/inf target parameters "
                  "give NaN target logits)" + (" and the AdaSPEC reference checkpoint"
                                               if "reference" in objective.frozen_names else ""))
  raise NonFiniteError(
      f"Step {step} of {config.train_steps} ({objective.name}) gave a non-finite "
      f"loss={float(values['loss'])} / grad_norm={float(values['grad_norm'])} on a batch of "
      f"{SOURCE_DESCRIPTIONS[source]}; {len(bad)} of the {len(checked)} steps checked here "
      f"were non-finite. Training stopped: the non-finite update was not applied, nothing was "
      f"saved from it, and {kept}. Check " + "; ".join(checks) + ".")


def _checked_frozen_params(objective, frozen_params: Optional[dict]) -> dict:
  """The frozen params the objective needs ({"target"[, "reference"]}), each checked
  against its model's shapes; a ValueError names what is missing or mismatched."""
  frozen_params = dict(frozen_params or {})
  missing = [n for n in objective.frozen_names if n not in frozen_params]
  if missing:
    raise ValueError(f"The {objective.name} objective needs frozen params {missing}; pass "
                     "frozen_params={'target': ...} (gin: TARGET_CHECKPOINT_PATH).")
  for name in objective.frozen_names:
    frozen_model = objective.target if name == "target" else objective.reference
    _check_param_shapes(
        frozen_params[name], frozen_model, f"The frozen {name} params",
        f"Pass the {name} model's own parameters"
        + (" (the AdaSPEC reference is a distilled copy of the draft: same shapes as the "
           "draft)" if name == "reference" else " (gin: TARGET_CHECKPOINT_PATH and TARGET "
           "must describe the same model)") + ".")
  return {k: frozen_params[k] for k in objective.frozen_names}


def _placed_frozen_params(frozen_params: dict, frozen_shardings: dict) -> dict:
  """`frozen_params` on their shardings: arrays already there stay as they are, others are
  put on each process's shards (multihost.put_global)."""
  if any(not (isinstance(x, jax.Array) and x.sharding == s) for x, s in zip(
      jax.tree.leaves(frozen_params), jax.tree.leaves(frozen_shardings))):
    frozen_params = multihost.put_global(frozen_params, frozen_shardings)
  return frozen_params


def _start_state(config: TrainConfig, model, checkpointer, state_shardings: TrainState,
                 init_key, restore_fn, init_params) -> tuple:
  """(TrainState on `state_shardings`, its step as an int): MODEL_DIR's latest checkpoint
  (a resume), else `_initial_params` and a fresh optimizer state."""
  optimizer = config.optimizer_spec.make()
  abstract_params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                 model.param_shapes(), state_shardings.params)
  abstract_opt = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              jax.eval_shape(optimizer.init, abstract_params),
                              state_shardings.opt_state)
  latest = checkpointer.latest_step()
  if latest is not None:
    params, opt_state, meta = checkpointer.restore(latest, abstract_params, abstract_opt)
    opt_state = jax.tree.unflatten(jax.tree.structure(abstract_opt), jax.tree.leaves(opt_state))
    start_step = int(meta["step"])
    logging.info("Resuming from %s at step %d.", config.model_dir, start_step)
  else:
    params = _initial_params(config, model, init_key, abstract_params, restore_fn, init_params)
    opt_state = jax.jit(optimizer.init, out_shardings=state_shardings.opt_state)(params)
    start_step = 0
  state = TrainState(step=jnp.asarray(start_step, jnp.int32), params=params, opt_state=opt_state)
  return jax.device_put(state, state_shardings), start_step


def _step_batch(batch: Batch, step: int, config: TrainConfig, shard: multihost.DataShard,
                mesh, vocab_size: int, data_name: str):
  """This process's host `batch` for `step`, checked (rows, token ids) and made global."""
  rows = len(next(iter(batch.values())))
  if rows != shard.local_batch_size:
    where = ("" if shard.num_shards == 1 else f" (this process's shard {shard.index} of "
             f"{shard.num_shards}: {shard.local_batch_size} rows)")
    raise ValueError(f"Step {step}: the data gave {rows} rows but batch_size="
                     f"{config.batch_size}{where}; make them agree (gin: BATCH_SIZE).")
  check_batch_token_ids(batch, vocab_size, f"of the batch for step {step + 1} (data: "
                        f"{data_name}; MODEL_DIR={config.model_dir})")
  return multihost.global_batch(batch, mesh, shard)


class _LoopLog:
  """The loop's records: metric records (`history`, MODEL_DIR/metrics.jsonl, TensorBoard),
  the non-finite check of the steps' flags, and the progress bar."""

  def __init__(self, config: TrainConfig, objective, checkpointer, data_name: str,
               start_step: int):
    self.config, self.objective = config, objective
    self.checkpointer, self.data_name = checkpointer, data_name
    self.writer = MetricsWriter(config.model_dir, start_step=start_step)
    self.history = []
    self.pending = []    # the steps' metrics since the last record
    self.unchecked = []  # (step, metrics) whose finite flag is not read yet
    self.source_totals = np.zeros(len(SOURCES), np.int64)
    self.schedule = config.optimizer_spec.schedule()
    self.progress = None
    if config.progress_bar and start_step < config.train_steps:
      from tqdm.auto import tqdm  # Only the loop needs it.
      self.progress = tqdm(total=config.train_steps, initial=start_step, desc=objective.name,
                           dynamic_ncols=True)
    self.interval_start = time.perf_counter()

  def step_done(self, done: int, metrics: dict) -> None:
    self.pending.append(metrics)
    self.unchecked.append((done, metrics))

  def check_finite(self) -> None:
    """Raises NonFiniteError if a step since the last check was non-finite."""
    _raise_non_finite(self.unchecked, self.config, self.objective, self.checkpointer,
                      self.data_name)
    self.unchecked.clear()

  def log(self, done: int) -> None:
    """Writes the record of the steps since the last one (throughput included)."""
    self.check_finite()  # the record's fetch syncs here anyway
    record = summarize(self.pending, self.source_totals,
                       time.perf_counter() - self.interval_start, done, self.schedule(done - 1))
    self.pending = []
    self.history.append(record)
    self.writer.write(record)
    if self.progress is not None:
      accuracy = record.get("predicted_acceptance", record.get("accuracy", float("nan")))
      self.progress.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{accuracy:.3f}")
    self.interval_start = time.perf_counter()

  def evaluate(self, eval_fn: EvalFn, params, done: int) -> None:
    """Writes `eval_fn(params, done)`'s results as an "eval/" record."""
    self.check_finite()
    results = {f"eval/{k}": None if v is None else float(v)  # None: undefined (no round ran)
               for k, v in jax.device_get(eval_fn(params, done)).items()}
    record = dict(step=done, **results)
    self.history.append(record)
    self.writer.write(record)
    self.interval_start = time.perf_counter()  # evaluation time is not training throughput

  def close(self) -> None:
    if self.progress is not None:
      self.progress.close()
    self.writer.close()


def train(config: TrainConfig, objective, data: Any, *, frozen_params: Optional[dict] = None,
          init_params: Optional[Params] = None, eval_fn: Optional[EvalFn] = None,
          restore_fn: checkpoints.RestoreFn = checkpoints.restore_params,
          mesh: Optional[jax.sharding.Mesh] = None,
          data_name: Optional[str] = None) -> TrainResult:
  """Trains `objective.model` for `config.train_steps` steps, resuming from MODEL_DIR.

  Args:
    objective: `FinetuneObjective(model)` or `DistillationObjective(target, draft, ...)`.
    data: a data source yielding NumPy batches of `config.batch_size` rows with T5X features
      (`encoder_input_tokens`, `decoder_input_tokens`, `decoder_target_tokens`,
      `decoder_loss_weights`; [batch, length]); see `as_batch_iterator`. Token ids are
      checked against the model's vocabulary on the host as each batch arrives.
    frozen_params: {"target": params[, "reference": params]} for distillation.
    init_params: starting params (overrides INITIAL_CHECKPOINT_PATH and random init); a
      checkpoint in MODEL_DIR always wins (that is a resume). They are copied, never donated:
      the caller's arrays stay usable.
    eval_fn: `eval_fn(params, step) -> dict`, called every `config.eval_every` steps and at the
      end; results go to metrics.jsonl (keys prefixed "eval/").
    restore_fn: reader for `config.initial_checkpoint_path` (hook for T5X/HF importers).
    mesh: the device mesh (default: `config.mesh.make()`).
    data_name: where the data comes from, for messages (e.g. the task name); default
      `describe_data(data)`.
  Returns:
    TrainResult(final state, records logged by this call, records kept from before a resume).

  Raises:
    NonFiniteError: a step's loss or gradient norm was NaN/inf. The flags the step returns
      are read where the loop syncs anyway (each log, before each due save and evaluation,
      at the end); the step itself leaves the state unchanged on a non-finite update.
  """
  model = objective.model
  frozen_params = _checked_frozen_params(objective, frozen_params)
  data_name = data_name or describe_data(data)
  mesh = mesh or config.mesh.make()
  partitioning.check_batch_size(config.batch_size, mesh)
  base_key = jax.random.PRNGKey(config.seed)
  init_key, step_base_key = jax.random.split(base_key)  # split once; steps fold_in their index

  step_fn, state_shardings, frozen_shardings = make_train_step(
      objective, config.optimizer_spec, mesh)
  checkpointer = checkpoints.Checkpointer(config.model_dir, save_every=config.save_every,
                                          keep=config.keep_checkpoints,
                                          async_save=config.async_checkpointing)
  state, start_step = _start_state(config, model, checkpointer, state_shardings, init_key,
                                   restore_fn, init_params)
  frozen_params = _placed_frozen_params(frozen_params, frozen_shardings)
  meta = {"model_config": config_to_json(model.config), "objective": objective.name}
  if hasattr(model, "tokens"):  # a Model (not a head): the special ids an export needs
    meta["token_ids"] = dataclasses.asdict(model.tokens)
  shard = multihost.data_shard(mesh, config.batch_size)
  batches = as_batch_iterator(data, start_step, shard)
  log = _LoopLog(config, objective, checkpointer, data_name, start_step)
  try:
    for step in range(start_step, config.train_steps):
      batch = _step_batch(next(batches), step, config, shard, mesh,
                          getattr(model, "output_size", model.config.vocab_size),
                          data_name)
      state, metrics = step_fn(state, batch, jax.random.fold_in(step_base_key, step),
                               frozen_params)
      done = step + 1
      log.step_done(done, metrics)
      last = done == config.train_steps
      if done % config.log_every == 0 or last:
        log.log(done)
      if eval_fn is not None and config.eval_every and (done % config.eval_every == 0 or last):
        log.evaluate(eval_fn, state.params, done)
      if last or checkpointer.should_save(done):
        log.check_finite()  # a save reads the state back anyway
        checkpointer.save(done, state.params, state.opt_state, meta, force=last)
      if log.progress is not None:
        log.progress.update(1)
    log.check_finite()
  finally:
    log.close()
    checkpointer.close()
  return TrainResult(state=state, history=log.history, resumed_history=log.writer.resumed)


def distill(config: TrainConfig, target, target_params: Params, draft, data: Any,
            distillation_config: Optional[DistillationConfig] = None, *, reference=None,
            reference_params: Params = None, **kwargs) -> TrainResult:
  """DistillSpec: `train` with a `DistillationObjective(target, draft, distillation_config)`.

  target_params stay frozen; `reference`/`reference_params` (with
  distillation_config.top_k_fraction) switch on AdaSPEC token selection; **kwargs go to
  `train` (init_params, eval_fn, restore_fn, mesh).
  """
  objective = DistillationObjective(target, draft, distillation_config or DistillationConfig(),
                                    reference)
  frozen = {"target": target_params}
  if reference is not None:
    frozen["reference"] = reference_params
  return train(config, objective, data, frozen_params=frozen, **kwargs)


def finetune(config: TrainConfig, model, data: Any, *, loss_block_size="auto",
             **kwargs) -> TrainResult:
  """Supervised fine-tuning (cross-entropy) of `model`: `train` with a FinetuneObjective
  (`loss_block_size`: positions per block of the loss, distill/blocked.py)."""
  return train(config, FinetuneObjective(model, loss_block_size), data, **kwargs)
