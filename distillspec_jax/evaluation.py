"""Evaluation of a target and its drafts: task quality, and speculative decoding measured.

Quality: the task metric of greedy decodes (decoded to text, scored by the task's metric
function) and the per-token cross-entropy on the references. Speculative decoding: block
efficiency tau and acceptance alpha from running the engine on the test prompts, and the
wall-clock speedup over plain target decoding timed one prompt at a time (batch 1, as in the
paper), both compiled once and timed warm. The speedup is a ratio of tokens per second, so it
stays fair at T = 1 where the two decoders' samples differ in length.

The functions take predict/score callables' ingredients (models, params, token arrays), not a
pipeline: `stage_evaluate` is the main job's glue.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.decoding import SamplingConfig, decode, prompt_inputs
from distillspec_jax.divergences import cross_entropy
from distillspec_jax.models import EOS_ID, Model
from distillspec_jax.speculative import speculative_decode


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


def _tokens_per_second(run_one: Callable[[np.ndarray], np.ndarray], prompts: np.ndarray) -> float:
  """Tokens per second of `run_one(prompt [1, P]) -> lengths`, over prompts one at a time."""
  jax.block_until_ready(run_one(prompts[:1]))  # compile and warm up
  tokens, elapsed = 0, 0.0
  for i in range(len(prompts)):
    start = time.perf_counter()
    lengths = jax.block_until_ready(run_one(prompts[i:i + 1]))
    elapsed += time.perf_counter() - start
    tokens += int(np.sum(lengths))
  return tokens / elapsed


def plain_tokens_per_second(target: Model, target_params, prompts, max_new_tokens,
                            temperature, seed=0) -> float:
  sampling = SamplingConfig(temperature)
  rng = jax.random.PRNGKey(seed)
  return _tokens_per_second(
      lambda p: decode(target, target_params, max_new_tokens=max_new_tokens, sampling=sampling,
                       rng=rng, **prompt_inputs(target, p)).lengths,
      prompts)


def speculative_metrics(target: Model, target_params, draft: Model, draft_params, prompts,
                        speed_prompts, *, gamma: int, temperature: float, max_new_tokens: int,
                        plain_tokens_per_s: float, seed: int = 0) -> dict:
  """tau and alpha over `prompts` (one batch); speedup over plain decoding on `speed_prompts`."""
  sampling = SamplingConfig(temperature)
  rng = jax.random.PRNGKey(seed)

  def run(p):
    return speculative_decode(target, target_params, draft, draft_params,
                              max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                              rng=rng, **prompt_inputs(target, p))

  result = run(prompts)
  spec_tokens_per_s = _tokens_per_second(lambda p: run(p).lengths, speed_prompts)
  return {"tau": float(result.block_efficiency), "alpha": float(result.acceptance_rate),
          "speedup": spec_tokens_per_s / plain_tokens_per_s,
          "tokens_per_s": spec_tokens_per_s}


def stage_evaluate(config, stage: str) -> dict:
  """The main job's evaluation stage: writes `<run_dir>/evaluate/eval.json`."""
  import os
  from tqdm.auto import tqdm
  from distillspec_jax import pipeline

  target, draft = pipeline.models(config)
  params = {"target": pipeline.load_params(config, "target", target),
            "draft_raw": pipeline.load_params(config, "draft_raw", draft)}
  for name in config.distill_stages:
    params[name] = pipeline.load_params(config, name, draft)
  from distillspec_jax import data as data_lib
  eval_task = config.eval_task or config.task
  examples = pipeline.heldout_prompts(config, config.eval_examples, split="test", task=eval_task)
  metric_fn = lambda targets, predictions: data_lib.compute_metrics(eval_task, targets,
                                                                    predictions)
  prompts, targets = examples["prompts"], examples["targets"]
  speed_prompts = prompts[:config.speed_examples]
  vocabulary = pipeline._register_task(config).output_features["targets"].vocabulary
  detokenize = lambda ids: vocabulary.decode([int(i) for i in ids])
  drafts = ("draft_raw",) + config.distill_stages
  total = len(params) + len(config.temperatures) * (1 + len(drafts) * len(config.gammas))
  results = {"quality": {}, "speculative": [], "plain_tokens_per_s": {}}
  with tqdm(total=total, desc="evaluate", dynamic_ncols=True,
            disable=not config.progress_bar) as bar:
    for name, model in [("target", target)] + [(d, draft) for d in drafts]:
      results["quality"][name] = quality(model, params[name], prompts, targets,
                                         examples["target_texts"], config.max_new_tokens,
                                         detokenize, metric_fn)
      bar.update(1)
    for temperature in config.temperatures:
      plain = plain_tokens_per_second(target, params["target"], speed_prompts,
                                      config.max_new_tokens, temperature, config.seed)
      results["plain_tokens_per_s"][str(temperature)] = plain
      bar.update(1)
      for name in drafts:
        for gamma in config.gammas:
          row = speculative_metrics(target, params["target"], draft, params[name], prompts,
                                    speed_prompts, gamma=gamma, temperature=temperature,
                                    max_new_tokens=config.max_new_tokens,
                                    plain_tokens_per_s=plain, seed=config.seed)
          results["speculative"].append(dict(draft=name, gamma=gamma, temperature=temperature,
                                             **row))
          bar.update(1)
  pipeline.write_json_atomic(os.path.join(config.stage_dir(stage), "eval.json"), results)
  return {"num_test_prompts": int(len(prompts))}
