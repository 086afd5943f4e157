"""Evaluation of a target and its drafts: task quality, and speculative decoding measured.

Quality: the task metric of greedy decodes (decoded to text, scored by the task's metric
function) and the per-token cross-entropy on the references. Speculative decoding: block
efficiency tau with its standard error over prompts, and the acceptance rates, from running the
engine on the test prompts. Wall-clock speed is measured by `speed.py`.

For the evaluation binary (`eval.py`): `target_alone` (plain decoding's quality, and the
predicted alpha, the mean of 1 - TVD(p, q) along its samples) and `speculative_run` (a
QualityRow: quality, tau, the acceptance statistics and acceptance by draft position of
speculative decoding at one grid point).

The functions take models, params, token arrays and callables (detokenize, metric_fn), not a
pipeline. The jobs and the eval binary reach them through one path, `evaluate.py`
(`quality_alone`, `speculative_grid`, one `TaskScorer` per task).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.records import JsonRecord, flattened
from distillspec_jax.decoding.plain import SamplingConfig, decode, default_rng, prompt_inputs
from distillspec_jax.distill.acceptance_signal import acceptance_labels
from distillspec_jax.distill.divergences import cross_entropy, expected_acceptance
from distillspec_jax.models.head import Head
from distillspec_jax.models.model import Model
from distillspec_jax.decoding.speculative import DraftLength, Lenience, speculative_decode
from distillspec_jax.decoding.stats import (acceptance_by_position, block_efficiency_stats,
                                            block_statistics,
                                            draft_acceptance_rate_by_position)
from distillspec_jax.evaluation.grid_point import GridPoint

if TYPE_CHECKING:  # the data layer's reader (TensorFlow) is imported only where it reads
  from distillspec_jax.data.batches import Examples


@dataclasses.dataclass(frozen=True)
class Acceptance(JsonRecord):
  """How much of the draft the target accepted (decoding/stats.py defines each statistic).

  Attributes:
    tau: block efficiency, tokens per target call; tau_stderr: its standard error over
      prompts. Both None when no target call ran (every row ended at its first token).
    mean_acceptance_length: 1 + accepted / rounds (vLLM, llama.cpp); None without a round.
    draft_acceptance_rate: accepted / drafted (vLLM); None when nothing was drafted (and
      alpha_proposed).
    alpha_proposed: accepted by the test (before EOS or the length limit cut) / drafted.
    alpha_distillspec: accepted / acceptance tests run (DistillSpec's alpha; None when no
      test ran).
    acceptance_by_position: DistillSpec's conditional rate at draft positions 1..gamma.
    draft_acceptance_rate_by_position: the fraction of all rounds accepting position i.
  """

  tau: Optional[float]
  tau_stderr: Optional[float]
  mean_acceptance_length: Optional[float] = None
  draft_acceptance_rate: Optional[float] = None
  alpha_proposed: Optional[float] = None
  alpha_distillspec: Optional[float] = None
  acceptance_by_position: Optional[list] = None
  draft_acceptance_rate_by_position: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class QualityRow(JsonRecord):
  """Speculative decoding of an evaluation's prompts at one grid point (`speculative_run`).

  Attributes:
    draft: the draft's name ("" until `evaluate.speculative_grid` names it).
    point: the GridPoint decoded.
    acceptance: the Acceptance statistics.
    quality: the task's metrics of the outputs (None without a scorer).
    predictions: each prompt's output text (None without a detokenizer).
    accepted_per_round: each prompt's accepted draft tokens per round.
  """

  draft: str
  point: GridPoint = flattened(GridPoint)
  acceptance: Acceptance = flattened(Acceptance)
  quality: Optional[dict] = None
  predictions: Optional[list] = None
  accepted_per_round: list = dataclasses.field(default_factory=list)


def _teacher_forcing(model: Model, prompts: np.ndarray, targets: np.ndarray):
  """(batch, decoder targets, loss mask) scoring `targets` after `prompts` (rows padded with
  the model's pad id): encoder inputs for an encoder-decoder; [prompt, target] with loss on
  the target part for a decoder-only model, read shifted by one where the model has no start
  id (its prompts begin as the tokenizer encoded them)."""
  pad, start = model.tokens.pad_id, model.tokens.decoder_start_id
  if model.is_encoder_decoder:
    sequence, mask = targets, targets > 0
    batch = {"encoder_input_tokens": jnp.asarray(prompts, jnp.int32)}
  else:
    shift = 1 if start is None else 0
    width = prompts.shape[1] + targets.shape[1]
    sequence = np.zeros((len(prompts), width + shift), np.int32)
    mask = np.zeros((len(prompts), width + shift), bool)
    for i, (prompt, target) in enumerate(zip(prompts, targets)):
      p, t = prompt[prompt != pad], target[target != pad]
      sequence[i, :len(p) + len(t)] = np.concatenate([p, t])
      mask[i, len(p):len(p) + len(t)] = True
    if start is None:
      batch = {"decoder_input_tokens": jnp.asarray(sequence[:, :-1], jnp.int32)}
      return batch, jnp.asarray(sequence[:, 1:], jnp.int32), jnp.asarray(mask[:, 1:],
                                                                         jnp.float32)
    batch = {}
  sequence = jnp.asarray(sequence, jnp.int32)
  batch["decoder_input_tokens"] = jnp.pad(sequence, ((0, 0), (1, 0)),
                                          constant_values=start)[:, :-1]
  return batch, sequence, jnp.asarray(mask, jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: Model, params, batch: dict):
  # One compiled function per model config, shared by every model evaluated with it.
  return model.logits(params, batch)


def _loss_sums(model: Model, params, prompts: np.ndarray, targets: np.ndarray, place,
               real: int) -> tuple:
  """(sum of the per-token cross-entropies, tokens scored) of the first `real` rows of one
  batch. With `place`, both come back from the devices (`place.gather`): each row's loss and
  mask are those of the process that holds the row, so every process gets every row's."""
  batch, targets, mask = _teacher_forcing(model, np.asarray(prompts), np.asarray(targets))
  if place is None:
    losses = cross_entropy(_logits(model, params, batch), targets, mask)
    return jnp.sum(losses[:real]), jnp.sum(mask[:real])
  logits = _logits(model, params, {k: place.put(np.asarray(v)) for k, v in batch.items()})
  placed_mask = place.put(np.asarray(mask))
  losses, mask = place.gather((cross_entropy(logits, place.put(np.asarray(targets)),
                                             placed_mask), placed_mask))
  return np.sum(losses[:real]), np.sum(mask[:real])


def per_token_loss(model: Model, params, prompts: np.ndarray, targets: np.ndarray,
                   place=None, batch_size: Optional[int] = None) -> float:
  """Mean cross-entropy (nats) of the reference `targets: [N, T]` given `prompts: [N, P]`, in
  batches of `batch_size` rows (None: one batch). `place` (a placement.BatchPlacement of
  `batch_size` rows): each batch laid out by it; the sums are taken on the host from every
  row (the same value however the rows are split)."""
  prompts, targets = np.asarray(prompts), np.asarray(targets)
  batch_size = batch_size or len(prompts)
  total, count = 0.0, 0.0
  for index, chunk, real in _batches(prompts, batch_size, model):
    start = index * batch_size
    rows = targets[start:start + batch_size]
    padding = np.full((batch_size - real,) + rows.shape[1:], model.tokens.pad_id, rows.dtype)
    rows = np.concatenate([rows, padding])  # no target tokens: the model's pad, never id 0
    loss, tokens = _loss_sums(model, params, chunk, rows, place, real)
    if len(prompts) <= batch_size:  # one batch: the ratio in the arrays' own precision
      return float(loss / tokens)
    total, count = total + float(loss), count + float(tokens)
  return total / count


def greedy_predictions(model: Model, params, prompts: np.ndarray, max_new_tokens: int,
                       detokenize: Callable[[Sequence[int]], str], place=None,
                       batch_size: Optional[int] = None) -> list:
  """Texts of greedy decodes of `prompts: [N, P]` in batches of `batch_size` (None: one
  batch; `place`: each laid out by a placement.BatchPlacement of `batch_size` rows, the
  outputs gathered to every process)."""
  prompts = np.asarray(prompts)
  # Greedy: the key is not read, but across processes every input must be a global array.
  rng = None if place is None else place.key(default_rng())
  predictions = []
  for _, chunk, real in _batches(prompts, batch_size or len(prompts), model):
    result = _fetched(decode(model, params, max_new_tokens=max_new_tokens, rng=rng,
                             **_placed(prompt_inputs(model, chunk), place)), place)
    predictions += _texts(np.asarray(result.tokens)[:real], np.asarray(result.lengths)[:real],
                          detokenize, model)
  return predictions


def quality(model: Model, params, prompts, targets, target_texts, max_new_tokens, detokenize,
            metric_fn, place=None, batch_size: Optional[int] = None) -> dict:
  """Task metric of greedy decodes plus per-token loss on the references, in batches of
  `batch_size` rows (None: one batch; `place`: as `greedy_predictions`')."""
  predictions = greedy_predictions(model, params, prompts, max_new_tokens, detokenize, place,
                                   batch_size)
  metrics = {k: float(v) for k, v in metric_fn(list(target_texts), predictions).items()}
  metrics["per_token_loss"] = per_token_loss(model, params, prompts, targets, place,
                                             batch_size)
  metrics["example_prediction"] = predictions[0]
  return metrics


def speculative_statistics(target: Model, target_params, draft: Model, draft_params, prompts,
                           *, gamma: int, temperature: float, max_new_tokens: int,
                           seed: int = 0, lenience: Lenience = Lenience()) -> Acceptance:
  """The Acceptance statistics (without the per-position ones) of speculative decoding of
  `prompts: [N, P]` in one batch (the statistics do not depend on the batching)."""
  result = speculative_decode(target, target_params, draft, draft_params,
                              max_new_tokens=max_new_tokens, gamma=gamma,
                              sampling=SamplingConfig(temperature), lenience=lenience,
                              rng=jax.random.PRNGKey(seed), **prompt_inputs(target, prompts))
  return Acceptance.from_json(block_efficiency_stats(result))


# --- the evaluation binary's measurements (distillspec_jax/eval.py) ------------------------------


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _token_acceptance(target: Model, target_params, draft: Model, draft_params, batch: dict,
                      temperature: float):
  target_logits = target.logits(target_params, batch)
  draft_logits = draft.logits(draft_params, batch)
  if temperature == 0.0:  # greedy: a draft token is accepted iff it is the target's argmax
    return acceptance_labels(target_logits, draft_logits, 0.0)  # NaN where a logit is NaN
  return expected_acceptance(target_logits, draft_logits, target_temperature=temperature,
                             draft_temperature=temperature)


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _head_token_acceptance(target: Model, target_params, head: Head, head_params, batch: dict,
                           temperature: float):
  """`_token_acceptance` of a draft head: its first draft step at position t (the target's
  features at t and the token at t + 1) against the target's distribution at t + 1, placed at
  t + 1 (position 0, which a head never proposes, gets 0; the caller's mask is shifted to
  match)."""
  target_logits, features, encoded = target.layer_features(target_params, batch,
                                                           head.feature_layers)
  mask = None if encoded is None else batch["encoder_input_tokens"] > 0
  tokens = jnp.pad(batch["decoder_input_tokens"][:, 1:], ((0, 0), (0, 1)))
  (head_logits,) = head.unroll(head_params, tokens, features, 1, encoded, mask)
  draft_logits = head.to_target_logits(head_logits)[:, :-1]
  target_logits = target_logits[:, 1:]
  if temperature == 0.0:
    acceptance = acceptance_labels(target_logits, draft_logits, 0.0)  # NaN where a logit is NaN
  else:
    acceptance = expected_acceptance(target_logits, draft_logits,
                                     target_temperature=temperature,
                                     draft_temperature=temperature)
  return jnp.pad(acceptance, ((0, 0), (1, 0)))


def predicted_alpha(target: Model, target_params, draft: Model, draft_params, prompts,
                    samples, temperature: float, place=None, real: Optional[int] = None
                    ) -> float:
  """Mean of 1 - TVD(p, q) over the tokens of target samples (DistillSpec Knowl 2): the
  acceptance rate lossless speculative sampling would have along them, predicted without
  running the speculative engine. `samples: [N, T]` are target decodes at `temperature`
  (EOS included, 0 after); both models are teacher-forced on [prompt, sample]. At T = 0 the
  distributions are one-hot and the rate is the fraction of positions where the draft's
  argmax equals the target's. A draft head (models/head.py) is scored by its first draft
  step over the target's features (`_head_token_acceptance`: the positions after the first
  one). `place` (a placement.BatchPlacement for N rows): the teacher-forced batch laid out by
  it, only the first `real` rows counted (the rest pad)."""
  batch, sequence, mask = _teacher_forcing(target, np.asarray(prompts), np.asarray(samples))
  del sequence
  token_acceptance = _token_acceptance
  if isinstance(draft, Head):
    token_acceptance = _head_token_acceptance
    mask = jnp.pad(mask[:, 1:], ((0, 0), (1, 0)))  # a head never proposes position 0
  if place is not None:
    # Summed on the host from every row, so that the value does not depend on how the
    # rows are split over devices and processes (a cross-process sum adds in another order).
    # The mask comes back from the devices too: each row's is that of the process holding
    # the row's prompt (a process holds only its rows' prompts; evaluation/examples.py).
    placed_mask = place.put(np.asarray(mask))
    acceptance, mask = place.gather((token_acceptance(
        target, target_params, draft, draft_params,
        {k: place.put(np.asarray(v)) for k, v in batch.items()}, float(temperature)),
        placed_mask))
    mask = np.array(mask)
    mask[real:] = 0.0  # the padding rows of the last batch
    return float(np.sum(acceptance * mask) / max(np.sum(mask), 1.0))
  acceptance = token_acceptance(target, target_params, draft, draft_params, batch,
                                float(temperature))
  return float(jnp.sum(acceptance * mask) / jnp.maximum(jnp.sum(mask), 1.0))


def _batches(prompts: np.ndarray, batch_size: int, model: Model):
  """(index, [batch_size, P] prompts, real rows) per batch; the last one is padded with
  one-token prompts (EOS) so every batch has one shape (one compilation). The padding is the
  same on every process: it does not depend on which rows a process holds."""
  padding = np.full((1,) + prompts.shape[1:], model.tokens.pad_id, prompts.dtype)
  padding[:, 0] = model.tokens.eos_id
  for index, start in enumerate(range(0, len(prompts), batch_size)):
    chunk = prompts[start:start + batch_size]
    real = len(chunk)
    if real < batch_size:
      chunk = np.concatenate([chunk, np.repeat(padding, batch_size - real, axis=0)])
    yield index, chunk, real


def _placed(inputs: dict, place) -> dict:
  """The decoders' prompt arrays where `place` (a placement.BatchPlacement) puts them
  (None: as they are)."""
  return inputs if place is None else {k: place.put(v) for k, v in inputs.items()}


def _key(rng, place):
  return rng if place is None else place.key(rng)


def _fetched(result, place):
  """The decoders' outputs on the host, every row (gathered across processes by `place`)."""
  return jax.device_get(result) if place is None else place.gather(result)


def _texts(tokens, lengths, detokenize, model: Model) -> list:
  """Each row's text: its `lengths` tokens less the EOS or stop id that ended it
  (`Model.ends_row`: `TokenIds.end_ids`)."""
  ends = set(model.tokens.end_ids)
  return [detokenize([int(t) for t in row[:n] if int(t) not in ends]) for row, n in
          zip(np.asarray(tokens), np.asarray(lengths))]


def _metrics(metric_fn, references, predictions) -> dict:
  return {k: float(v) for k, v in metric_fn(list(references), list(predictions)).items()}


@dataclasses.dataclass(frozen=True)
class TargetAlone:
  """Plain target decoding of an evaluation's prompts (`target_alone`).

  Attributes:
    quality: the task's metrics of the outputs.
    predictions: each prompt's output text.
    predicted_alpha: the draft's 1 - TVD along these samples (`predicted_alpha`).
  """

  quality: dict
  predictions: list
  predicted_alpha: float


def target_alone(target: Model, target_params, draft: Model, draft_params, examples: "Examples", *,
                 temperature: float, max_new_tokens: int, batch_size: int, detokenize,
                 metric_fn, seed: int = 0, place=None) -> "TargetAlone":
  """Plain target decoding of the examples' prompts at `temperature` (batch b samples with
  fold_in(PRNGKey(seed), b)): its TargetAlone. `place` (placement.BatchPlacement): each
  [batch_size, P] batch's rows over the mesh's 'data' axis (this process's rows only when
  the mesh spans processes) and the outputs gathered back to every process."""
  prompts = np.asarray(examples.prompts)
  key = jax.random.PRNGKey(seed)
  sampling = SamplingConfig(float(temperature))
  predictions, acceptance, weights = [], [], []
  for index, chunk, real in _batches(prompts, batch_size, target):
    result = _fetched(decode(target, target_params, max_new_tokens=max_new_tokens,
                             sampling=sampling, rng=_key(jax.random.fold_in(key, index), place),
                             **_placed(prompt_inputs(target, chunk), place)), place)
    tokens, lengths = np.asarray(result.tokens)[:real], np.asarray(result.lengths)[:real]
    predictions += _texts(tokens, lengths, detokenize, target)
    if place is None:
      acceptance.append(predicted_alpha(target, target_params, draft, draft_params,
                                        chunk[:real], tokens, temperature))
    else:  # the whole padded batch, laid out like the decode's; only the real rows count
      acceptance.append(predicted_alpha(target, target_params, draft, draft_params, chunk,
                                        np.asarray(result.tokens), temperature, place, real))
    weights.append(float(np.sum(lengths)))
  return TargetAlone(quality=_metrics(metric_fn, examples.target_texts, predictions),
                     predictions=predictions,
                     predicted_alpha=float(np.average(acceptance, weights=weights)))


def speculative_run(target: Model, target_params, draft: Model, draft_params,
                    examples: "Examples",
                    *, gamma: int, temperature: float, lenience: Lenience,
                    max_new_tokens: int, batch_size: int,
                    detokenize: Optional[Callable] = None, metric_fn: Optional[Callable] = None,
                    seed: int = 0, draft_length: DraftLength = DraftLength(),
                    place=None) -> QualityRow:
  """Speculative decoding of the examples' prompts in batches of `batch_size` (batch b with
  fold_in(PRNGKey(seed), b), the keys `target_alone` uses): a QualityRow of the task metric
  of its outputs, the Acceptance statistics of decoding/stats.py, and per prompt the
  prediction and the accepted draft tokens of each round. Without `detokenize` /
  `metric_fn`, predictions / quality are None. `place`: as `target_alone`'s."""
  prompts = np.asarray(examples.prompts)
  key = jax.random.PRNGKey(seed)
  sampling = SamplingConfig(float(temperature))
  predictions, rounds, tests = [], [], []
  produced, calls, accepted, drafted, proposed, rejections = [], [], [], [], [], []
  for index, chunk, real in _batches(prompts, batch_size, target):
    result = speculative_decode(target, target_params, draft, draft_params,
                                max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                                lenience=lenience,
                                rng=_key(jax.random.fold_in(key, index), place),
                                draft_length=draft_length,
                                **_placed(prompt_inputs(target, chunk), place))
    result = _fetched(result, place)
    tokens, lengths = np.asarray(result.tokens)[:real], np.asarray(result.lengths)[:real]
    if detokenize is not None:
      predictions += _texts(tokens, lengths, detokenize, target)
    per_round = np.asarray(result.accepted_per_round)[:real]
    rounds += [[int(n) for n in row if n >= 0] for row in per_round]
    tests += [[int(k) for k in row if k >= 0]
              for row in np.asarray(result.tested_per_round)[:real]]
    for name, store in (("produced", produced), ("target_calls", calls),
                        ("accepted", accepted), ("drafted", drafted),
                        ("accepted_proposed", proposed), ("output_rejections", rejections)):
      store.append(np.asarray(getattr(result, name))[:real])
  scored = detokenize is not None and metric_fn is not None
  per_round = [np.asarray(r, np.int64) for r in rounds] or [np.zeros(0)]
  tested_rounds = [np.asarray(k, np.int64) for k in tests] or [np.zeros(0)]
  statistics = block_statistics(*map(np.concatenate, (produced, calls, accepted, drafted)),
                                accepted_proposed=np.concatenate(proposed),
                                output_rejections=np.concatenate(rejections))
  acceptance = Acceptance.from_json(dict(
      statistics, acceptance_by_position=acceptance_by_position(
          per_round, gamma, tested_per_round=tested_rounds),
      draft_acceptance_rate_by_position=draft_acceptance_rate_by_position(per_round, gamma)))
  return QualityRow(
      draft="", point=GridPoint.of(gamma, temperature, lenience, draft_length),
      quality=_metrics(metric_fn, examples.target_texts, predictions) if scored else None,
      acceptance=acceptance, predictions=predictions if detokenize is not None else None,
      accepted_per_round=rounds)
