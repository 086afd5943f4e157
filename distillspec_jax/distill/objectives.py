"""DistillSpec objectives: the data-source mixture and the distillation loss (Knowl 4).

Every training step draws u1, u2 ~ U(0, 1) from the step's key:

    u1 < lambda1             -> the fixed batch (x, y) of the dataset         (source 0, "fixed")
    else u2 < lambda2        -> y ~ draft(. | x), on-policy                  (source 1, "draft")
    else                     -> y ~ target(. | x)                            (source 2, "target")

Sampled sequences become a teacher-forced batch (targets = tokens, inputs = shift-right with
start token 0, loss weight 1 up to and including EOS), and the loss is
`divergences.sequence_divergence(divergence, target_logits, draft_logits, weights)`: gradients
flow to the draft only; the target (and the optional AdaSPEC reference) are frozen. The
divergence may be one of the four of the paper or an acceptance-targeted LK loss
(divergences.py); `position_weighting="block_acceptance"` weights each position's loss by the
detached chance that a round reaches it (block_acceptance.py). Every data source, recipe and
AdaSPEC selection takes each of them. A draft with an acceptance head trains it jointly:
`acceptance_weight` times a binary cross-entropy against the acceptance the target would give
at the same positions (acceptance_signal.py) joins the loss.

The objectives here are frozen (hashable) dataclasses so the trainer can close over them in
one jitted step. Library code: no gin here (gin_utils registers these classes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, Optional, Union

import jax
import jax.numpy as jnp

from distillspec_jax.decoding import plain
from distillspec_jax.decoding import speculative
from distillspec_jax.decoding.stats import block_efficiency_stats
from distillspec_jax.distill import acceptance_signal
from distillspec_jax.distill import block_acceptance
from distillspec_jax.distill import blocked
from distillspec_jax.distill import divergences
from distillspec_jax.distill import token_selection
from distillspec_jax.core import validation
from distillspec_jax.models.model import Model, TokenIds, check_same_layout, check_same_tokens

Array = jax.Array
Params = Any

SOURCES = ("fixed", "draft", "target")
FIXED, DRAFT, TARGET = 0, 1, 2

# Gin-facing recipe names (gin/recipes/*.gin) -> (lambda1, lambda2, default divergence).
RECIPES = {
    "supervised_kd": (1.0, 0.0, "fkl"),
    "seqkd": (0.0, 0.0, "fkl"),
    "imitkd": (0.5, 1.0, "fkl"),
    "fdistill": (0.0, 0.5, "tvd"),
    "gkd": (0.0, 1.0, "fkl"),
}


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
  """What a DistillSpec step trains on and with which divergence.

  Attributes:
    lambda1: probability of the fixed dataset batch (Knowl 4), in [0, 1].
    lambda2: probability of draft (on-policy) samples given the batch is generated, in [0, 1];
      the rest are target samples.
    divergence: "fkl", "rkl", "jsd" or "tvd" (Knowl 6), or "lk_alpha" / "lk_lambda" (the LK
      losses, divergences.py).
    beta: JSD mixing weight in (0, 1).
    lk_s, lk_eta: lk_lambda's lambda = lk_s exp(-lk_eta stopgrad(alpha)), 0 < lk_s <= 1,
      lk_eta >= 0 (1 and 3: vLLM speculators' exp(-3 alpha); SpecForge sets both).
    position_weighting: "uniform" (every loss position alike) or "block_acceptance" (each
      position's loss times the detached probability of reaching it in its block).
    block_size: positions per block of "block_acceptance" (gamma), an int >= 1.
    acceptance_weight: the weight (>= 0) of the acceptance head's binary cross-entropy in the
      loss; > 0 exactly when the draft has an acceptance head.
    acceptance_temperature: the decoding temperature whose acceptance the head learns: 0 =
      greedy (hard labels: the argmaxes agree), T > 0 = sampled (soft labels sum_v min(p, q)
      at T, the expected min(1, p/q)).
    target_temperature / draft_temperature: T_p, T_q applied inside the divergence.
    sampling_temperature: temperature of the draft/target samples (0 = greedy).
    max_new_tokens: sample length; None = the width of the batch's decoder_target_tokens.
    top_k_fraction: AdaSPEC token selection (needs a reference model); None = off.
    selection_normalization: AdaSPEC loss normalisation, "all" or "kept".
    loss_block_size: positions per block of the loss (distill/blocked.py): the logits of
      both models exist a block at a time and are recomputed on the backward pass. An int in
      [1, length], "auto" (blocks of at most 256 positions, none for shorter sequences) or
      None (no blocking: whole [batch, length, vocab] logits).
  """

  lambda1: float = 0.0
  lambda2: float = 1.0
  divergence: divergences.Divergence = "fkl"
  beta: float = 0.5
  target_temperature: float = 1.0
  draft_temperature: float = 1.0
  sampling_temperature: float = 1.0
  max_new_tokens: Optional[int] = None
  top_k_fraction: Optional[float] = None
  selection_normalization: token_selection.Normalization = "all"
  lk_s: float = divergences.LK_S
  lk_eta: float = divergences.LK_ETA
  position_weighting: block_acceptance.PositionWeighting = "uniform"
  block_size: int = 5
  loss_block_size: Union[int, Literal["auto"], None] = blocked.AUTO
  acceptance_weight: float = 0.0
  acceptance_temperature: float = 0.0

  def __post_init__(self):
    # Types and the choices of divergence / selection_normalization / position_weighting
    # (Literal fields): lambda1="0.5", beta=True, divergence="kl" are refused here.
    validation.check_field_types(self)
    blocked.check_block_size_setting(self.loss_block_size,
                                     "DistillationConfig.loss_block_size")
    for name in ("lambda1", "lambda2"):
      validation.check_probability(
          getattr(self, name), f"DistillationConfig.{name}",
          fix=f"it is a probability (Knowl 4: lambda1 = fixed-data fraction, lambda2 = "
              f"on-policy fraction of generated batches); set {name.upper()} in [0, 1].")
    validation.check_probability(self.beta, "DistillationConfig.beta", zero=False,
                                 one=False, fix="the JSD mixing weight lies in (0, 1); 0.5 "
                                                "is the symmetric JSD (gin: BETA).")
    for name in ("target_temperature", "draft_temperature"):
      validation.check_real(getattr(self, name), f"DistillationConfig.{name}", minimum=0.0,
                            above=True, fix="pass a temperature > 0 (1.0 in the paper).")
    validation.check_real(self.sampling_temperature,
                          "DistillationConfig.sampling_temperature", minimum=0.0,
                          fix="set SAMPLING_TEMPERATURE >= 0 (0 = greedy samples).")
    if self.max_new_tokens is not None:
      validation.check_positive_int(self.max_new_tokens, "DistillationConfig.max_new_tokens")
    if self.top_k_fraction is not None:
      validation.check_probability(self.top_k_fraction, "DistillationConfig.top_k_fraction",
                                   zero=False, fix="AdaSPEC keeps this fraction of tokens; "
                                   "pass a value in (0, 1], or None to disable selection.")
    divergences.validate_lk_schedule(self.lk_s, self.lk_eta)
    validation.check_positive_int(self.block_size, "DistillationConfig.block_size")
    if not (math.isfinite(self.acceptance_weight) and self.acceptance_weight >= 0.0):
      raise ValueError(f"acceptance_weight={self.acceptance_weight!r} must be finite and >= 0 "
                       "(the acceptance head's cross-entropy weight; 0 = no head). Set "
                       "DistillationConfig.acceptance_weight.")
    if not (math.isfinite(self.acceptance_temperature) and self.acceptance_temperature >= 0.0):
      raise ValueError(f"acceptance_temperature={self.acceptance_temperature!r} must be finite "
                       "and >= 0 (0 = greedy acceptance labels). Set "
                       "DistillationConfig.acceptance_temperature.")

  @classmethod
  def from_recipe(cls, recipe: str, **overrides) -> "DistillationConfig":
    if recipe not in RECIPES:
      raise ValueError(f"Unknown recipe {recipe!r}; known recipes: {sorted(RECIPES)}.")
    lambda1, lambda2, divergence = RECIPES[recipe]
    kwargs = dict(lambda1=lambda1, lambda2=lambda2, divergence=divergence)
    kwargs.update(overrides)
    return cls(**kwargs)

  @property
  def divergence_kwargs(self) -> dict:
    return dict(target_temperature=self.target_temperature,
                draft_temperature=self.draft_temperature, beta=self.beta, lk_s=self.lk_s,
                lk_eta=self.lk_eta)

  def weighted(self, per_token: Array, alpha: Array, weights: Array) -> tuple:
    """(per-token losses [b, L] times the block-acceptance reach weights when that weighting
    is on, metrics): `alpha` [b, L] is the per-position acceptance the weights read."""
    if self.position_weighting == "uniform":
      return per_token, {}
    reach = block_acceptance.reach_weights(alpha, weights, self.block_size)
    mean_reach = jnp.sum(reach * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return per_token * reach, {"mean_reach_weight": mean_reach}


# --- the data-source mixture ----------------------------------------------------------------


def select_source(rng: Array, lambda1, lambda2) -> Array:
  """Knowl 4's two coin flips: int32 scalar, 0 = fixed data, 1 = draft samples, 2 = target."""
  u1, u2 = jax.random.uniform(rng, (2,))
  # Strict '<' on U[0, 1): P(u < lam) = lam exactly, so lam = 0 / 1 never / always fire.
  return jnp.where(u1 < lambda1, FIXED, jnp.where(u2 < lambda2, DRAFT, TARGET)).astype(
      jnp.int32)


def mixed_batch(rng: Array, lambda1, lambda2, fixed: dict, draft_samples: Callable,
                target_samples: Callable) -> tuple:
  """(training batch, source int32) of one step, the source drawn by `select_source`: the
  `fixed` batch, `draft_samples(rng)` or `target_samples(rng)` (each -> a batch like
  `fixed`), without gradient. Only the chosen branch runs (lax.switch is a real conditional
  when not vmapped), so a fixed-data step costs no sampling; a source whose lambda rules it
  out is never compiled in."""
  source_rng, sample_rng = jax.random.split(rng)
  source = select_source(source_rng, lambda1, lambda2)
  branches = [lambda: fixed]
  if lambda1 < 1.0 and lambda2 > 0.0:
    branches.append(lambda: draft_samples(sample_rng))
  if lambda1 < 1.0 and lambda2 < 1.0:
    branches.append(lambda: target_samples(sample_rng))
  if len(branches) == 1:
    return fixed, source
  index = {FIXED: 0, DRAFT: 1 if lambda2 > 0.0 else 0, TARGET: len(branches) - 1}
  branch = jnp.asarray([index[FIXED], index[DRAFT], index[TARGET]], jnp.int32)[source]
  return jax.lax.stop_gradient(jax.lax.switch(branch, branches)), source


def shift_right(tokens: Array) -> Array:
  """[b, L] -> [b, L] decoder inputs: start token 0, then tokens[:, :-1]."""
  return jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]


def prompt_tokens_from_batch(batch: dict, model: Optional[Model] = None) -> Array:
  """Decoder-only prompts [b, L] right-padded with `model.tokens.pad_id` (T5's 0 when no
  model is given): `prompt_tokens` if present, else the prefix of a prefix-LM batch. With a
  start id the prefix is the target tokens before the first position with loss weight > 0;
  without one (a tokenizer's own BOS rule) the input tokens up to that position."""
  if "prompt_tokens" in batch:
    return jnp.asarray(batch["prompt_tokens"], jnp.int32)
  tokens = model.tokens if model is not None else TokenIds()
  weighted = jnp.asarray(batch["decoder_loss_weights"]) > 0
  if tokens.decoder_start_id is None:
    source = jnp.asarray(batch["decoder_input_tokens"], jnp.int32)
    in_prefix = jnp.cumsum(weighted, axis=1) - weighted == 0
  else:
    source = jnp.asarray(batch["decoder_target_tokens"], jnp.int32)
    in_prefix = jnp.cumsum(weighted, axis=1) == 0
  return jnp.where(in_prefix, source, tokens.pad_id)


def samples_to_batch(tokens: Array, lengths: Array, batch: dict, model: Model,
                     prompt_tokens: Optional[Array] = None) -> dict:
  """Teacher-forced training batch from sampled continuations.

  Args:
    tokens: [b, N] samples (EOS included, 0 after); lengths: [b] tokens up to and incl. EOS.
    batch: the fixed batch the prompts came from (its shapes are kept: width L of
      decoder_target_tokens).
    prompt_tokens: decoder-only prompts [b, P] right-padded (their tokens get weight 0).
  Returns:
    dict with encoder_input_tokens (enc-dec), decoder_input_tokens, decoder_target_tokens,
    decoder_loss_weights, all [b, L] (the sequence is cut at L).
  """
  width = batch["decoder_target_tokens"].shape[1]
  b, n = tokens.shape
  positions = jnp.arange(n)[None, :]
  sample_weights = (positions < lengths[:, None]).astype(jnp.float32)
  if model.is_encoder_decoder:
    if n < width:
      tokens = jnp.pad(tokens, ((0, 0), (0, width - n)))
      sample_weights = jnp.pad(sample_weights, ((0, 0), (0, width - n)))
    targets, weights = tokens[:, :width], sample_weights[:, :width]
    out = {"encoder_input_tokens": jnp.asarray(batch["encoder_input_tokens"], jnp.int32)}
    out.update(decoder_target_tokens=targets, decoder_input_tokens=shift_right(targets),
               decoder_loss_weights=weights)
    return out
  # Each row: its prompt, then its sample right after the prompt's last real token; the
  # sequence has one more position than the batch, which a model without a start id reads
  # shifted (inputs = sequence[:-1], targets = sequence[1:]).
  real = prompt_tokens != model.tokens.pad_id
  prompt_len = jnp.sum(real, axis=1)
  rows = jnp.arange(b)[:, None]
  columns = prompt_len[:, None] + positions
  sequence = jnp.zeros((b, width + 1), jnp.int32)
  sequence = sequence.at[:, :prompt_tokens.shape[1]].set(
      jnp.where(real, prompt_tokens, 0)[:, :width + 1])
  sequence = sequence.at[rows, columns].set(tokens, mode="drop")
  weights = jnp.zeros((b, width + 1), jnp.float32).at[rows, columns].set(sample_weights,
                                                                         mode="drop")
  if model.tokens.decoder_start_id is None:
    return {"decoder_input_tokens": sequence[:, :width],
            "decoder_target_tokens": sequence[:, 1:], "decoder_loss_weights": weights[:, 1:]}
  targets = sequence[:, :width]
  return {"decoder_target_tokens": targets, "decoder_input_tokens": shift_right(targets),
          "decoder_loss_weights": weights[:, :width]}


def sample_batch(model: Model, params: Params, batch: dict, rng: Array, *,
                 max_new_tokens: int, temperature: float,
                 eos_id: Optional[int] = None) -> dict:
  """y ~ model(. | x) for the batch's prompts (jitted `plain.decode`), as a training batch.

  The decode cache holds exactly the request (1 start token + prompt width + max_new_tokens);
  a request past the model's cache capacity (`max_decode_length`) is refused."""
  sampling = plain.SamplingConfig(temperature=temperature, eos_id=eos_id)
  max_new_tokens = validation.check_positive_int(max_new_tokens, "max_new_tokens")
  prompt_width = (0 if model.is_encoder_decoder
                  else prompt_tokens_from_batch(batch, model).shape[1])
  plain.check_capacity(1 + prompt_width, max_new_tokens, model.config.max_decode_length,
                          f"the sampler's max_new_tokens={max_new_tokens} after the prompt")
  if model.is_encoder_decoder:
    result = plain.decode(model, params, encoder_input_tokens=batch["encoder_input_tokens"],
                             max_new_tokens=max_new_tokens, sampling=sampling, rng=rng,
                             max_length=1 + max_new_tokens)
    return samples_to_batch(result.tokens, result.lengths, batch, model)
  prompts = prompt_tokens_from_batch(batch, model)
  result = plain.decode(model, params, prompt_tokens=prompts, max_new_tokens=max_new_tokens,
                           sampling=sampling, rng=rng,
                           max_length=1 + prompts.shape[1] + max_new_tokens)
  return samples_to_batch(result.tokens, result.lengths, batch, model, prompts)


def training_features(batch: dict, model: Model) -> dict:
  keys = ["decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights"]
  if model.is_encoder_decoder:
    keys.append("encoder_input_tokens")
  out = {k: jnp.asarray(batch[k]) for k in keys}
  out["decoder_loss_weights"] = out["decoder_loss_weights"].astype(jnp.float32)
  for k in keys:
    if k != "decoder_loss_weights":
      out[k] = out[k].astype(jnp.int32)
  return out


# --- objectives -------------------------------------------------------------------------------


def split_dropout(dropout_rng: Optional[Array]):
  """(key of the hidden states, block index -> key of that block's output projection), each
  None without dropout. A block's key folds its index in, so blocks draw distinct masks."""
  if dropout_rng is None:
    return None, lambda index: None
  hidden_rng, project_rng = jax.random.split(dropout_rng)
  return hidden_rng, lambda index: jax.random.fold_in(project_rng, index)


@dataclasses.dataclass(frozen=True)
class FinetuneObjective:
  """Supervised fine-tuning with token cross-entropy (to make "raw" targets and drafts).

  loss_block_size: positions per block of the loss, as `DistillationConfig.loss_block_size`.
  """

  model: Model
  loss_block_size: Union[int, Literal["auto"], None] = blocked.AUTO
  name = "finetune"
  frozen_names = ()

  def __post_init__(self):
    validation.check_field_types(self)
    blocked.check_block_size_setting(self.loss_block_size,
                                     "FinetuneObjective.loss_block_size")

  def make_batch(self, params, frozen, batch, rng):
    return training_features(batch, self.model), jnp.int32(FIXED)

  def loss(self, params, frozen, batch, dropout_rng=None):
    """Mean cross-entropy per loss-weighted token; metrics: loss, accuracy, num_tokens."""
    weights = batch["decoder_loss_weights"]
    hidden_rng, block_rng = split_dropout(dropout_rng)
    inputs = {"hidden": self.model.hidden_states(params, batch, dropout_rng=hidden_rng),
              "targets": batch["decoder_target_tokens"], "weights": weights}

    def per_position(index, block):
      logits = self.model.project(params, block["hidden"], dropout_rng=block_rng(index))
      correct = (jnp.argmax(logits, -1) == block["targets"]) * block["weights"]
      return {"nll": divergences.cross_entropy(logits, block["targets"], block["weights"]),
              "correct": jax.lax.stop_gradient(correct)}

    size = blocked.resolve_block_size(self.loss_block_size, weights.shape[1],
                                      "FinetuneObjective.loss_block_size")
    values = blocked.map_position_blocks(per_position, inputs, size)
    num_tokens = jnp.sum(weights)
    loss = jnp.sum(values["nll"]) / jnp.maximum(num_tokens, 1.0)
    return loss, {"loss": loss, "cross_entropy": loss,
                  "accuracy": jnp.sum(values["correct"]) / jnp.maximum(num_tokens, 1.0),
                  "num_tokens": num_tokens}


@dataclasses.dataclass(frozen=True)
class DistillationObjective:
  """DistillSpec: train `draft` towards the frozen `target` (and optional AdaSPEC reference).

  frozen params are passed to the step as {"target": ..., "reference": ...}.
  """

  target: Model
  draft: Model
  config: DistillationConfig = DistillationConfig()
  reference: Optional[Model] = None
  name = "distill"

  def __post_init__(self):
    check_same_tokens(self.target, self.draft)
    check_same_layout(self.target, self.draft)
    if (self.reference is None) != (self.config.top_k_fraction is None):
      raise ValueError("AdaSPEC token selection needs both a reference model and "
                       "top_k_fraction; set both (reference = a FKL-distilled copy of the draft) "
                       "or neither.")
    if self.reference is not None:
      check_same_tokens(self.target, self.reference,
                            roles=("target", "reference"))
    has_head = self.draft.acceptance_head is not None
    if self.config.acceptance_weight > 0.0 and not has_head:
      self.draft.check_acceptance_head(
          f"acceptance_weight={self.config.acceptance_weight!r}")
    if has_head and self.config.acceptance_weight == 0.0:
      raise ValueError("The draft has an acceptance head but acceptance_weight=0.0 would "
                       "leave it untrained; set DistillationConfig.acceptance_weight > 0 "
                       "(1.0 is a good start) or build the draft without the head.")

  @property
  def model(self) -> Model:
    return self.draft

  @property
  def frozen_names(self) -> tuple:
    return ("target",) if self.reference is None else ("target", "reference")

  def make_batch(self, params, frozen, batch, rng):
    """(training batch, source int32): the fixed batch or samples, chosen per Knowl 4."""
    c = self.config
    fixed = training_features(batch, self.draft)
    max_new = c.max_new_tokens or fixed["decoder_target_tokens"].shape[1]
    sample = lambda model, p, key: sample_batch(model, p, fixed, key, max_new_tokens=max_new,
                                                temperature=c.sampling_temperature)
    return mixed_batch(rng, c.lambda1, c.lambda2, fixed,
                       lambda key: sample(self.draft, params, key),
                       lambda key: sample(self.target, frozen["target"], key))

  def loss(self, params, frozen, batch, dropout_rng=None):
    """Scalar loss and metrics (loss, divergence, tvd, predicted_acceptance, num_tokens, ...).

    Every per-position value (the divergence, the TVD, AdaSPEC's margin) is computed from
    logits a block of positions at a time (`config.loss_block_size`, distill/blocked.py);
    selection and the sequence means then run on the [batch, length] values."""
    c = self.config
    weights = batch["decoder_loss_weights"]
    hidden_rng, block_rng = split_dropout(dropout_rng)
    inputs = {"target": jax.lax.stop_gradient(self.target.hidden_states(frozen["target"], batch)),
              "draft": self.draft.hidden_states(params, batch, dropout_rng=hidden_rng)}
    if self.reference is not None:
      inputs["reference"] = jax.lax.stop_gradient(
          self.reference.hidden_states(frozen["reference"], batch))

    def per_position(index, block):
      target_logits = jax.lax.stop_gradient(self.target.project(frozen["target"],
                                                                block["target"]))
      if self.draft.acceptance_head is None:
        draft_logits = self.draft.project(params, block["draft"], dropout_rng=block_rng(index))
      else:
        draft_logits, head_logits = self.draft.project_with_acceptance(
            params, block["draft"], dropout_rng=block_rng(index))
      out = {"divergence": divergences.token_divergence(c.divergence, target_logits,
                                                        draft_logits, **c.divergence_kwargs),
             # TVD is tracked whatever is trained: 1 - TVD is the expected acceptance (Knowl 2).
             "tvd": divergences.token_divergence(
                 "tvd", target_logits, jax.lax.stop_gradient(draft_logits),
                 target_temperature=c.target_temperature,
                 draft_temperature=c.draft_temperature)}
      if self.draft.acceptance_head is not None:
        out["head_logits"] = head_logits
        out["acceptance_label"] = acceptance_signal.acceptance_labels(
            target_logits, draft_logits, c.acceptance_temperature)
      if self.reference is not None:
        reference_logits = jax.lax.stop_gradient(
            self.reference.project(frozen["reference"], block["reference"]))
        out["margin"] = token_selection.token_margin(
            target_logits, draft_logits, reference_logits,
            target_temperature=c.target_temperature, draft_temperature=c.draft_temperature)
      return out

    size = blocked.resolve_block_size(c.loss_block_size, weights.shape[1],
                                      "DistillationConfig.loss_block_size")
    values = blocked.map_position_blocks(per_position, inputs, size)
    per_token = values["divergence"]
    divergence = jnp.mean(divergences.masked_sequence_mean(per_token, weights))
    metrics = {"divergence": divergence}
    per_token, weighting = c.weighted(per_token, 1.0 - values["tvd"], weights)
    metrics.update(weighting)
    if self.reference is None:
      loss = jnp.mean(divergences.masked_sequence_mean(per_token, weights))
    else:
      keep = token_selection.select_tokens(values["margin"], weights, c.top_k_fraction)
      loss = token_selection.selective_loss(per_token, keep, weights,
                                            c.selection_normalization)
      metrics.update(token_selection.selection_stats(values["margin"], keep, weights))
    if self.draft.acceptance_head is not None:
      head_loss, head_metrics = acceptance_signal.acceptance_loss(
          values["head_logits"], values["acceptance_label"], weights)
      loss = loss + c.acceptance_weight * head_loss
      metrics.update(head_metrics)
    tvd = jnp.mean(divergences.masked_sequence_mean(values["tvd"], weights))
    metrics.update(loss=loss, tvd=tvd, predicted_acceptance=1.0 - tvd,
                   num_tokens=jnp.sum(weights))
    return loss, metrics


def mean_tvd(target: Model, target_params, draft: Model, draft_params, batch: dict,
             block_size: Union[int, str, None] = blocked.AUTO) -> Array:
  """Mean per-sequence TVD(p || q) on a teacher-forced batch (scalar), from logits a block of
  positions at a time (`block_size` as `DistillationConfig.loss_block_size`)."""
  features = training_features(batch, draft)
  weights = features["decoder_loss_weights"]
  tvd = blocked.blocked_token_divergence(
      lambda q, p, w: divergences.token_divergence("tvd", p, q),
      functools.partial(draft.project, draft_params), draft.hidden_states(draft_params, features),
      functools.partial(target.project, target_params),
      target.hidden_states(target_params, features), weights,
      blocked.resolve_block_size(block_size, weights.shape[1], "block_size"))
  return jnp.mean(divergences.masked_sequence_mean(tvd, weights))


# --- periodic evaluation (trainer eval_fn builders) ------------------------------------------


def _prompt_kwargs(model: Model, batch: dict) -> dict:
  prompts = (batch["encoder_input_tokens"] if model.is_encoder_decoder
             else prompt_tokens_from_batch(batch, model))
  return plain.prompt_inputs(model, prompts)


def make_tvd_eval_fn(target: Model, target_params, draft: Model, batch: dict, *,
                     max_new_tokens: int, temperature: float = 1.0, seed: int = 0):
  """eval_fn(draft_params, step) -> {"tvd_on_target_samples", "tvd_on_draft_samples"}.

  Held-out prompts `batch` are continued once by the target (fixed samples, Knowl 2's
  acceptance is measured under the target's sequences) and, at every call, by the current
  draft (on-policy); the mean per-sequence TVD(p || q) is reported on both.
  """
  rng_target, rng_draft = jax.random.split(jax.random.PRNGKey(seed))
  features = training_features(batch, draft) if "decoder_target_tokens" in batch else batch
  target_batch = sample_batch(target, target_params, features, rng_target,
                              max_new_tokens=max_new_tokens, temperature=temperature)
  tvd = jax.jit(functools.partial(mean_tvd, target, target_params, draft))

  def eval_fn(draft_params, step):
    draft_batch = sample_batch(draft, draft_params, features, rng_draft,
                               max_new_tokens=max_new_tokens, temperature=temperature)
    return {"tvd_on_target_samples": float(tvd(draft_params, target_batch)),
            "tvd_on_draft_samples": float(tvd(draft_params, draft_batch))}

  return eval_fn


def make_speculative_eval_fn(target: Model, target_params, draft: Model, batch: dict, *,
                             max_new_tokens: int, gamma: int = 4,
                             temperature: float = 1.0, seed: int = 0,
                             speculative_decode=None):
  """eval_fn(draft_params, step) -> {"tau": block efficiency, "tau_stderr": its standard error
  over prompts, "draft_acceptance_rate": accepted / drafted (decoding/stats.py)}.

  Runs `speculative.speculative_decode` on the held-out prompts of `batch` (fixed rng, so
  successive evaluations differ only through the draft). `speculative_decode` may be injected
  (tests, other implementations); default: distillspec_jax.decoding.speculative.speculative_decode.
  """
  if speculative_decode is None:
    speculative_decode = speculative.speculative_decode
  sampling = plain.SamplingConfig(temperature=temperature)
  prompts = _prompt_kwargs(draft, batch)
  rng = jax.random.PRNGKey(seed)

  def eval_fn(draft_params, step):
    result = speculative_decode(target, target_params, draft, draft_params,
                                max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                                rng=rng, **prompts)
    stats = block_efficiency_stats(result)
    return {"tau": stats["tau"], "tau_stderr": stats["tau_stderr"],
            "draft_acceptance_rate": stats["draft_acceptance_rate"]}

  return eval_fn
