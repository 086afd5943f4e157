"""Benchmark of the speculative decoding engine against plain target decoding.

For a target/draft pair (the tiny demo shapes with random weights by default, or checkpoints),
for gamma in 1..8, T in {0, 1}, batch in {1, 8}: block efficiency tau, acceptance alpha,
c = draft step time / target step time, the measured wall-clock speedup over plain decoding
(same prompts, same number of new tokens: EOS is disabled; compiled once, timed warm, median of
several runs), the cost-model speedup = plain time / (draft steps x draft step time +
verifications x verification time) with each cost measured alone (a round's draft steps are
one 2-token call and gamma - 1 single-token calls, each timed alone), and the loop overhead =
speculative wall time / that denominator.

  python bench/speculative.py --out bench_speculative.json [--quick]
      [--target_checkpoint DIR --draft_checkpoint DIR] [--target_model NAME --draft_model NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from distillspec_jax.decoding import SamplingConfig, decode
from distillspec_jax.models import Model
from distillspec_jax.speculative import cost_model_speedup, speculative_decode


def _median_time(fn, repeats):
  jax.block_until_ready(fn())  # compile + warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


@functools.partial(jax.jit, static_argnames=("model", "width", "steps"))
def _repeated_extend(model, params, cache, tokens, *, width, steps):
  """`steps` calls of `model.extend` on `width` tokens at a fixed cache position."""

  def body(_, carry):
    cache, total = carry
    logits, cache = model.extend(params, cache, tokens[:, :width])
    return cache.rollback(width), total + logits[:, -1, 0]

  return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(tokens.shape[0])))[1]


def per_call_time(model, params, inputs, batch, width, position, repeats, steps=64):
  """Seconds of one `extend` of `width` tokens per row, the cache filled to `position`."""
  encoder_inputs = inputs.get("encoder_input_tokens")
  cache = model.init_cache(params, batch, model.config.max_decode_length, encoder_inputs)
  cache = cache.advance(position)
  tokens = jnp.full((batch, width), 5, jnp.int32)
  run = lambda: _repeated_extend(model, params, cache, tokens, width=width, steps=steps)
  return _median_time(run, repeats) / steps


def load_pair(args):
  overrides = {"max_decode_length": args.max_decode_length} if args.max_decode_length else {}
  target = Model.from_name(args.target_model, **overrides)
  draft = Model.from_name(args.draft_model, **overrides)
  if args.target_checkpoint:
    from distillspec_jax.convert import load_initial_params
    target_params = load_initial_params(args.target_checkpoint, target)
    draft_params = load_initial_params(args.draft_checkpoint, draft)
  else:
    target_params = target.init(jax.random.PRNGKey(0))
    draft_params = draft.init(jax.random.PRNGKey(1))
  return target, target_params, draft, draft_params


def make_inputs(target, batch, input_length, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, target.config.vocab_size, size=(batch, input_length)).astype(np.int32)
  key = "encoder_input_tokens" if target.is_encoder_decoder else "prompt_tokens"
  return {key: jnp.asarray(tokens)}


def run(args):
  target, target_params, draft, draft_params = load_pair(args)
  gammas = args.gammas or ([1, 3, 5] if args.quick else list(range(1, 9)))
  temperatures = args.temperatures or [0.0, 1.0]
  batches = args.batches or [1, 8]
  repeats = 3 if args.quick else 5
  rows = []
  configs = [(b, t, g) for b in batches for t in temperatures for g in gammas]
  mid = args.max_new_tokens // 2
  call_times = {}
  with tqdm(total=len(configs), desc="speculative bench", unit="config") as bar:
    for batch in batches:
      inputs = make_inputs(target, batch, args.input_length)
      target_step = per_call_time(target, target_params, inputs, batch, 1, mid, repeats)
      draft_step = per_call_time(draft, draft_params, inputs, batch, 1, mid, repeats)
      # The engine's first draft call of a round feeds two tokens ([previous, pending]).
      draft_first_step = per_call_time(draft, draft_params, inputs, batch, 2, mid, repeats)
      for temperature in temperatures:
        sampling = SamplingConfig(temperature, eos_id=-1)  # fixed lengths: EOS never stops
        plain = _median_time(lambda: decode(target, target_params, max_new_tokens=args.max_new_tokens,
                                            sampling=sampling, rng=jax.random.PRNGKey(1),
                                            **inputs).tokens, repeats)
        for gamma in gammas:
          if (batch, gamma) not in call_times:
            call_times[(batch, gamma)] = per_call_time(
                target, target_params, inputs, batch, gamma + 1, mid, repeats)
          verification = call_times[(batch, gamma)]
          spec_fn = lambda: speculative_decode(
              target, target_params, draft, draft_params, max_new_tokens=args.max_new_tokens,
              gamma=gamma, sampling=sampling, rng=jax.random.PRNGKey(2), **inputs)
          result = spec_fn()
          spec = _median_time(lambda: spec_fn().tokens, repeats)
          rounds = int(np.max(result.target_calls))  # loop iterations (rows move in lockstep)
          draft_time = rounds * (draft_first_step + (gamma - 1) * draft_step)
          denominator = draft_time + rounds * verification
          rows.append(dict(
              gamma=gamma, temperature=temperature, batch=batch,
              tau=float(result.block_efficiency), alpha=float(result.acceptance_rate),
              c=draft_step / target_step, speedup_measured=plain / spec,
              speedup_cost_model=cost_model_speedup(plain, rounds * gamma, draft_time /
                                                    (rounds * gamma), rounds, verification),
              overhead=spec / denominator, plain_s=plain, speculative_s=spec,
              draft_step_s=draft_step, draft_first_step_s=draft_first_step,
              target_step_s=target_step,
              verification_s=verification, rounds=rounds))
          bar.update(1)
  return dict(rows=rows, target_model=args.target_model, draft_model=args.draft_model,
              target_checkpoint=args.target_checkpoint, draft_checkpoint=args.draft_checkpoint,
              max_new_tokens=args.max_new_tokens, input_length=args.input_length,
              backend=jax.default_backend())


def print_table(report):
  header = ("gamma", "temperature", "batch", "tau", "alpha", "c", "speedup_measured",
            "speedup_cost_model", "overhead")
  print(" | ".join(f"{h:>8}" for h in header))
  for row in report["rows"]:
    print(" | ".join(f"{row[h]:>8.3f}" if isinstance(row[h], float) else f"{row[h]:>8}"
                     for h in header))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write.")
  parser.add_argument("--quick", action="store_true", help="gamma in {1, 3, 5}, 3 repeats.")
  parser.add_argument("--target_model", default="demo_target")
  parser.add_argument("--draft_model", default="demo_draft")
  parser.add_argument("--target_checkpoint", default=None)
  parser.add_argument("--draft_checkpoint", default=None)
  parser.add_argument("--max_new_tokens", type=int, default=200)
  parser.add_argument("--input_length", type=int, default=32)
  parser.add_argument("--max_decode_length", type=int, default=256,
                      help="cache capacity of both models")
  parser.add_argument("--gammas", type=int, nargs="*", help="default 1..8 (quick: 1 3 5)")
  parser.add_argument("--temperatures", type=float, nargs="*", help="default 0 1")
  parser.add_argument("--batches", type=int, nargs="*", help="default 1 8")
  args = parser.parse_args()
  if bool(args.target_checkpoint) != bool(args.draft_checkpoint):
    parser.error("pass both --target_checkpoint and --draft_checkpoint, or neither.")
  report = run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print_table(report)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
