"""Evaluation of a target and its drafts: task quality, and speculative decoding measured.

Quality: the task metric of greedy decodes (decoded to text, scored by the task's metric
function) and the per-token cross-entropy on the references. Speculative decoding: block
efficiency tau with its standard error over prompts, and acceptance alpha, from running the
engine on the test prompts. Wall-clock speed is measured by `speed.py`.

The functions take models, params and token arrays, not a pipeline (`pipeline.stage_evaluate`
is the main job's glue).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.decoding import SamplingConfig, decode, prompt_inputs
from distillspec_jax.divergences import cross_entropy
from distillspec_jax.models import EOS_ID, Model
from distillspec_jax.speculative import Lenience, speculative_decode


def _teacher_forcing(model: Model, prompts: np.ndarray, targets: np.ndarray):
  """(batch, decoder targets, loss mask) scoring `targets` after `prompts`: encoder inputs for
  an encoder-decoder; [prompt, target] with loss on the target part for a decoder-only model."""
  if model.is_encoder_decoder:
    sequence, mask = targets, targets > 0
    batch = {"encoder_input_tokens": jnp.asarray(prompts, jnp.int32)}
  else:
    width = prompts.shape[1] + targets.shape[1]
    sequence = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, (prompt, target) in enumerate(zip(prompts, targets)):
      p, t = prompt[prompt > 0], target[target > 0]
      sequence[i, :len(p) + len(t)] = np.concatenate([p, t])
      mask[i, len(p):len(p) + len(t)] = True
    batch = {}
  sequence = jnp.asarray(sequence, jnp.int32)
  batch["decoder_input_tokens"] = jnp.pad(sequence, ((0, 0), (1, 0)))[:, :-1]
  return batch, sequence, jnp.asarray(mask, jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: Model, params, batch: dict):
  # One compiled function per model config, shared by every model evaluated with it.
  return model.logits(params, batch)


def per_token_loss(model: Model, params, prompts: np.ndarray, targets: np.ndarray) -> float:
  """Mean cross-entropy (nats) of the reference `targets: [N, T]` given `prompts: [N, P]`."""
  batch, targets, mask = _teacher_forcing(model, np.asarray(prompts), np.asarray(targets))
  logits = _logits(model, params, batch)
  losses = cross_entropy(logits, targets, mask)
  return float(jnp.sum(losses) / jnp.sum(mask))


def greedy_predictions(model: Model, params, prompts: np.ndarray, max_new_tokens: int,
                       detokenize: Callable[[Sequence[int]], str]) -> list:
  result = decode(model, params, max_new_tokens=max_new_tokens, **prompt_inputs(model, prompts))
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  return [detokenize([t for t in row[:n] if t != EOS_ID]) for row, n in zip(tokens, lengths)]


def quality(model: Model, params, prompts, targets, target_texts, max_new_tokens, detokenize,
            metric_fn) -> dict:
  """Task metric of greedy decodes plus per-token loss on the references."""
  predictions = greedy_predictions(model, params, prompts, max_new_tokens, detokenize)
  metrics = {k: float(v) for k, v in metric_fn(list(target_texts), predictions).items()}
  metrics["per_token_loss"] = per_token_loss(model, params, prompts, targets)
  metrics["example_prediction"] = predictions[0]
  return metrics


def ratio_stderr(numerators, denominators) -> float:
  """Standard error over items of the ratio estimate sum(num) / sum(den) (delta method),
  e.g. tau = sum(produced) / sum(target calls) over prompts. 0 for fewer than two items."""
  num = np.asarray(numerators, np.float64)
  den = np.asarray(denominators, np.float64)
  n = len(num)
  if n < 2 or den.sum() <= 0:
    return 0.0
  residual = num - num.sum() / den.sum() * den
  return float(np.sqrt(np.sum(residual ** 2) / (n * (n - 1))) / den.mean())


def block_efficiency_stats(result) -> dict:
  """tau with its standard error over prompts (rows), and alpha, of a SpeculativeResult.

  alpha counts the accepted draft tokens that reach the output (see speculative.py);
  `alpha_proposed` also counts those an EOS or the length limit cut off."""
  produced, calls = np.asarray(result.produced), np.asarray(result.target_calls)
  return {"tau": float(result.block_efficiency), "tau_stderr": ratio_stderr(produced, calls),
          "alpha": float(result.acceptance_rate),
          "alpha_proposed": float(result.proposed_acceptance_rate)}


def speculative_statistics(target: Model, target_params, draft: Model, draft_params, prompts,
                           *, gamma: int, temperature: float, max_new_tokens: int,
                           seed: int = 0, lenience: Lenience = Lenience()) -> dict:
  """tau (with its standard error over prompts) and alpha of speculative decoding of
  `prompts: [N, P]` in one batch (the statistics do not depend on the batching)."""
  result = speculative_decode(target, target_params, draft, draft_params,
                              max_new_tokens=max_new_tokens, gamma=gamma,
                              sampling=SamplingConfig(temperature), lenience=lenience,
                              rng=jax.random.PRNGKey(seed), **prompt_inputs(target, prompts))
  return block_efficiency_stats(result)
