"""Distilling a draft head (models/head.py): the training-time test with DistillSpec's
divergences, data sources and AdaSPEC's token selection.

The loss unrolls the head k steps from every position of a teacher-forced sequence (EAGLE-3's
training-time test, `Head.unroll`): step s (0-based) at position t reads the head's own
step s - 1 output and the token at t + s + 1 and is compared with the target's distribution
for the token at t + s + 2 (the target's logits at position t + s + 1). Per step, the chosen
divergence (FKL, RKL, JSD[beta], TVD; `DistillationConfig`) is averaged over the step's valid
tokens (optionally only AdaSPEC's selected ones, chosen within the step); the loss is
sum_s w_s loss_s / sum_s w_s with w_s = `step_weights` (default 0.8**s, as EAGLE-3). With a
reduced draft vocabulary both distributions are taken over the draft ids (the target's logits
restricted to them and renormalised).

Data sources (DistillSpec's Knowl 4 coin flips, `DistillationConfig.lambda1/lambda2`):
  fixed   the dataset's sequences;
  draft   on-policy for a head: sequences the head itself proposes, token by token, from the
          target's features of the prefix (`sample_head_batch`: each next token drawn from the
          head's first-step distribution, as a drafting round's first proposal is, then scored
          by the target). Sequences that speculative decoding outputs are not on-policy: they
          are distributed as the target's (the engine is lossless), i.e. the 'target' source;
  target  y ~ target(. | x).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from distillspec_jax.core import validation
from distillspec_jax.decoding import head_draft
from distillspec_jax.decoding import plain
from distillspec_jax.distill import divergences
from distillspec_jax.distill import token_selection
from distillspec_jax.distill.objectives import (DistillationConfig, mixed_batch,
                                                prompt_tokens_from_batch, sample_batch,
                                                samples_to_batch, training_features)
from distillspec_jax.models.head import Head, check_unroll_steps
from distillspec_jax.models.model import Model, decoder_prompt

Array = jax.Array
Params = Any


@dataclasses.dataclass(frozen=True)
class HeadTrainingConfig:
  """The training-time test.

  Attributes:
    unroll_steps: k >= 1, draft steps unrolled on the head's own features (gin:
      HEAD_UNROLL_STEPS; SpecForge trains with 7, the draft steps it serves).
    step_weights: k non-negative weights, one per step (not all 0); None = 0.8 ** s.
  """

  unroll_steps: int = 3
  step_weights: Optional[tuple] = None

  def __post_init__(self):
    validation.check_field_types(self)
    check_unroll_steps(self.unroll_steps)
    if self.step_weights is not None:
      weights = tuple(self.step_weights)
      if len(weights) != self.unroll_steps:
        raise ValueError(f"step_weights={weights} has {len(weights)} entries for "
                         f"unroll_steps={self.unroll_steps}; give one weight per step.")
      for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
          raise ValueError(f"step weight {w!r} must be a number >= 0.")
      if not sum(weights) > 0:
        raise ValueError(f"step_weights={weights} are all 0; give some step a weight > 0.")

  @property
  def weights(self) -> tuple[float, ...]:
    if self.step_weights is None:
      return tuple(0.8 ** s for s in range(self.unroll_steps))
    return tuple(float(w) for w in self.step_weights)


def _shift_left(x: Array, steps: int) -> Array:
  """x: [batch, T, ...] moved `steps` positions left along T, zero-filled."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, steps)
  return jnp.pad(x[:, steps:], pad)


def sample_head_batch(target: Model, target_params, head: Head, head_params, batch: dict,
                      rng: Array, *, max_new_tokens: int, temperature: float,
                      eos_id: Optional[int] = None) -> dict:
  """On-policy sequences for a head, as a training batch: the first token from the target
  (as in serving), each next one from the head's first draft step over the target's features
  of the prefix; the target scores each token as it is appended.

  batch: the fixed batch the prompts come from (`training_features` keys).
  eos_id: as `plain.SamplingConfig`'s: None, a sample ends at the target's EOS or any of its
    stop ids (`TokenIds.end_ids`, as the target's own samples do); an id: at that id; -1:
    never.
  Returns `samples_to_batch`'s teacher-forced batch of the same width.
  """
  max_new_tokens = validation.check_positive_int(max_new_tokens, "max_new_tokens")
  encoder = batch.get("encoder_input_tokens") if target.is_encoder_decoder else None
  prompts = None if target.is_encoder_decoder else prompt_tokens_from_batch(batch)
  rows = batch["decoder_target_tokens"].shape[0]
  prompt, lengths = decoder_prompt(target, prompts, rows)
  capacity = prompt.shape[1] + max_new_tokens
  plain.check_capacity(prompt.shape[1], max_new_tokens, target.config.max_decode_length,
                      f"the head sampler's max_new_tokens={max_new_tokens} after the prompt")
  first_rng, loop_rng = jax.random.split(rng)
  target_cache = target.init_cache(target_params, rows, capacity, encoder)
  target_cache, state, first = head_draft.prefill(
      target, target_params, head, head_params, target_cache, prompt, lengths, encoder,
      first_rng, temperature=temperature, width=1, max_length=capacity)
  drafter, ignored = head_draft.HeadDrafter(head), jnp.zeros((rows, 2), jnp.int32)

  def step(carry, step_rng):
    target_cache, state = carry
    logits, state = drafter.extend(head_params, state, ignored)
    token = plain.sample_tokens(logits[:, 1], step_rng, temperature)
    _, target_cache, features = target.extend(target_params, target_cache, state.tokens,
                                               head.feature_layers)
    return (target_cache, state.replace(features=features, tokens=token[:, None])), token

  rngs = jax.random.split(loop_rng, max_new_tokens - 1)
  _, tokens = jax.lax.scan(step, (target_cache, state), rngs)
  tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
  is_eos = plain.SamplingConfig(eos_id=eos_id).ends_row(target, tokens)
  lengths = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, max_new_tokens)
  tokens = jnp.where(jnp.arange(max_new_tokens)[None] < lengths[:, None], tokens, 0)
  return samples_to_batch(tokens, lengths.astype(jnp.int32), batch, target, prompts)


@dataclasses.dataclass(frozen=True)
class HeadDistillationObjective:
  """Train `head` towards the frozen `target` (frozen params {"target": ..., and with
  AdaSPEC "reference": a reference head's}); the trainer's objective interface."""

  target: Model
  head: Head
  config: DistillationConfig = DistillationConfig()
  training: HeadTrainingConfig = HeadTrainingConfig()
  reference: Optional[Head] = None
  name = "distill_head"

  def __post_init__(self):
    self.head.check_target(self.target)
    if (self.reference is None) != (self.config.top_k_fraction is None):
      raise ValueError("AdaSPEC token selection needs both a reference head and "
                       "top_k_fraction; set both (reference = a FKL-distilled copy of the head) "
                       "or neither.")
    if self.reference is not None:
      self.reference.check_target(self.target)
      # The reference is unrolled on the head's features and compared over its draft ids.
      mine, theirs = self.head.config, self.reference.config
      if tuple(theirs.layers) != tuple(mine.layers):
        raise ValueError(f"The AdaSPEC reference head's feature_layers={tuple(theirs.layers)} "
                         f"are not the head's {tuple(mine.layers)}: the reference reads the "
                         "head's features. Use a reference head of the head's feature layers "
                         "(an FKL-distilled copy of the head).")
      if theirs.draft_ids != mine.draft_ids:
        raise ValueError("The AdaSPEC reference head's draft_ids differ from the head's: the "
                         "token margin compares both over the head's draft vocabulary. Use a "
                         "reference head of the head's draft_ids (an FKL-distilled copy).")
    c = self.config
    if c.position_weighting != "uniform":
      raise ValueError(f"position_weighting={c.position_weighting!r}: a head's training-time "
                       "test weighs its unrolled steps by HeadTrainingConfig.step_weights, not "
                       "by block acceptance, and would ignore it; set "
                       "DistillationConfig.position_weighting='uniform' for a head.")
    if c.acceptance_weight != 0.0:
      raise ValueError(f"acceptance_weight={c.acceptance_weight} trains an acceptance head, "
                       "which a draft head has none of, so the term would be ignored; set "
                       "DistillationConfig.acceptance_weight=0 for a head.")

  @property
  def model(self) -> Head:
    return self.head

  @property
  def frozen_names(self) -> tuple:
    return ("target",) if self.reference is None else ("target", "reference")

  def make_batch(self, params, frozen, batch, rng):
    """(training batch, source int32): the fixed batch, head (on-policy) or target samples."""
    c = self.config
    fixed = training_features(batch, self.target)
    max_new = c.max_new_tokens or fixed["decoder_target_tokens"].shape[1]
    return mixed_batch(
        rng, c.lambda1, c.lambda2, fixed,
        lambda key: sample_head_batch(self.target, frozen["target"], self.head, params, fixed,
                                      key, max_new_tokens=max_new,
                                      temperature=c.sampling_temperature),
        lambda key: sample_batch(self.target, frozen["target"], fixed, key,
                                 max_new_tokens=max_new, temperature=c.sampling_temperature))

  def step_logits(self, params, frozen, batch):
    """(target logits over the draft vocabulary [batch, T, draft vocab], the head's unrolled
    logits [k, batch, T, draft vocab], the reference head's or None)."""
    target_logits, head_logits, reference = self._logits(params, frozen, batch)
    return self.head.to_draft_logits(target_logits), head_logits, reference

  def _logits(self, params, frozen, batch):
    """`step_logits` with the target's logits over its whole vocabulary [batch, T, vocab]."""
    layers = self.head.feature_layers
    target_logits, features, encoded = jax.lax.stop_gradient(
        self.target.layer_features(frozen["target"], batch, layers))
    mask = None if encoded is None else batch["encoder_input_tokens"] > 0
    tokens, k = batch["decoder_target_tokens"], self.training.unroll_steps
    head_logits = self.head.unroll(params, tokens, features, k, encoded, mask)
    reference = None
    if self.reference is not None:
      reference = jax.lax.stop_gradient(self.reference.unroll(
          frozen["reference"], tokens, features, k, encoded, mask))
    return target_logits, head_logits, reference

  def loss(self, params, frozen, batch, dropout_rng=None):
    """Scalar loss and metrics: loss, divergence, tvd and predicted_acceptance (step 1's:
    1 - TVD is the expected acceptance of the round's first draft token), per-step
    acceptance_step{s}, num_tokens, and AdaSPEC's selection stats (step 1's)."""
    del dropout_rng  # the head has no dropout
    c = self.config
    full, head_logits, reference = self._logits(params, frozen, batch)
    teacher = self.head.to_draft_logits(full)
    weights = batch["decoder_loss_weights"]
    total, metrics = 0.0, {}
    step_weights = self.training.weights
    for s, w in enumerate(step_weights):
      teacher_s, weights_s = _shift_left(teacher, s + 1), _shift_left(weights, s + 1)
      per_token = divergences.token_divergence(c.divergence, teacher_s, head_logits[s],
                                               **c.divergence_kwargs)
      if reference is None:
        loss_s = jnp.mean(divergences.masked_sequence_mean(per_token, weights_s))
      else:
        margin = token_selection.token_margin(
            teacher_s, head_logits[s], reference[s],
            target_temperature=c.target_temperature, draft_temperature=c.draft_temperature)
        keep = token_selection.select_tokens(margin, weights_s, c.top_k_fraction)
        loss_s = token_selection.selective_loss(per_token, keep, weights_s,
                                                c.selection_normalization)
        stats = token_selection.selection_stats(margin, keep, weights_s)
        metrics[f"kept_fraction_step{s + 1}"] = stats["kept_fraction"]
        if s == 0:
          metrics.update(stats)
      # 1 - TVD over the target's whole vocabulary (the head's probability 0 outside its
      # draft vocabulary): the target's mass there is never accepted, so the renormalised
      # teacher the loss reads would overstate the acceptance.
      # Averaged over the rows the step scores: a short row has no position at a deep step
      # (its TVD would read 0, acceptance 1).
      row_tvd = divergences.per_sequence_divergence(
          "tvd", _shift_left(full, s + 1),
          self.head.to_target_logits(jax.lax.stop_gradient(head_logits[s])), weights_s,
          target_temperature=c.target_temperature, draft_temperature=c.draft_temperature)
      scored = (jnp.sum(weights_s, axis=1) > 0).astype(row_tvd.dtype)
      tvd = jnp.sum(row_tvd * scored) / jnp.maximum(jnp.sum(scored), 1.0)
      metrics[f"acceptance_step{s + 1}"] = 1.0 - tvd
      metrics[f"loss_step{s + 1}"] = loss_s
      if s == 0:
        metrics.update(tvd=tvd, predicted_acceptance=1.0 - tvd,
                       num_tokens=jnp.sum(weights_s))
      total = total + w * loss_s
    loss = total / sum(step_weights)
    metrics.update(loss=loss, divergence=loss)
    return loss, metrics
