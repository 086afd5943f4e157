"""Benchmark of the speculative decoding engine against plain target decoding.

For a target/draft pair (the tiny demo shapes with random weights by default, or checkpoints),
for gamma in 1..8, T in {0, 1}, batch in {1, 8}: block efficiency tau, acceptance alpha,
c = draft step time / target step time, the measured wall-clock speedup over plain decoding
(same prompts, same number of new tokens: EOS is disabled; compiled once, timed warm, median of
several runs, all quantities of a configuration timed in interleaved turns), the cost-model
speedup = plain time / (draft steps x draft step time + verifications x verification time)
with each cost measured alone (a round's draft steps are one 2-token call and gamma - 1
single-token calls, each timed alone), and the loop overhead = speculative wall time / that
denominator.

By default the process is pinned to one core before JAX starts (`--cpus`, see pin_cores).

  python bench/speculative.py --out bench_speculative.json [--quick] [--cpus N]
      [--target_checkpoint DIR --draft_checkpoint DIR] [--target_model NAME --draft_model NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from distillspec_jax.decoding import SamplingConfig, decode
from distillspec_jax.models import Model
from distillspec_jax.speculative import cost_model_speedup, speculative_decode
from distillspec_jax.speed import interleaved_median_times, per_call_function, pin_cores


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
  gammas = args.gammas or ([1, 5] if args.quick else list(range(1, 9)))
  temperatures = args.temperatures or [0.0, 1.0]
  batches = args.batches or [1, 8]
  repeats = args.repeats or (3 if args.quick else 12)
  rows = []
  configs = [(b, t, g) for b in batches for t in temperatures for g in gammas]
  with tqdm(total=len(configs), desc="speculative bench", unit="config") as bar:
    for batch, temperature, gamma in configs:
      inputs = make_inputs(target, batch, args.input_length)
      sampling = SamplingConfig(temperature, eos_id=-1)  # fixed lengths: EOS never stops
      # Keys made once, outside the timed calls (making one costs ~0.2 ms of Python).
      plain_rng, speculative_rng = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
      spec_fn = lambda: speculative_decode(
          target, target_params, draft, draft_params, max_new_tokens=args.max_new_tokens,
          gamma=gamma, sampling=sampling, rng=speculative_rng, **inputs)
      functions, steps = {}, {}
      functions["plain"] = lambda: decode(
          target, target_params, max_new_tokens=args.max_new_tokens, sampling=sampling,
          rng=plain_rng, **inputs).tokens
      functions["speculative"] = lambda: spec_fn().tokens
      result = spec_fn()  # compiles
      start = time.perf_counter()
      result = jax.block_until_ready(spec_fn())
      duration = time.perf_counter() - start
      # Each model call alone; the engine's first draft call of a round feeds two tokens
      # ([previous, pending]), the others one.
      for name, model, params, width in [("target_step", target, target_params, 1),
                                         ("draft_step", draft, draft_params, 1),
                                         ("draft_first_step", draft, draft_params, 2),
                                         ("verification", target, target_params, gamma + 1)]:
        # --quick: one pass over the cache per timed call instead of the speculative run's
        # duration (keeps the run under two minutes, at the price of the bias noted there).
        functions[name], steps[name] = per_call_function(model, params, inputs, batch, width,
                                                         0.0 if args.quick else duration)
      seconds = interleaved_median_times(functions, repeats)
      for name, count in steps.items():
        seconds[name] /= count
      rounds = int(np.max(result.target_calls))  # loop iterations (rows move in lockstep)
      draft_time = rounds * (seconds["draft_first_step"] + (gamma - 1) * seconds["draft_step"])
      denominator = draft_time + rounds * seconds["verification"]
      rows.append(dict(
          gamma=gamma, temperature=temperature, batch=batch,
          tau=float(result.block_efficiency), alpha=float(result.acceptance_rate),
          c=seconds["draft_step"] / seconds["target_step"],
          speedup_measured=seconds["plain"] / seconds["speculative"],
          speedup_cost_model=cost_model_speedup(seconds["plain"], rounds * gamma,
                                                draft_time / (rounds * gamma), rounds,
                                                seconds["verification"]),
          overhead=seconds["speculative"] / denominator, rounds=rounds,
          **{f"{name}_s": value for name, value in seconds.items()}))
      bar.update(1)
  return dict(rows=rows, target_model=args.target_model, draft_model=args.draft_model,
              target_checkpoint=args.target_checkpoint, draft_checkpoint=args.draft_checkpoint,
              max_new_tokens=args.max_new_tokens, input_length=args.input_length,
              repeats=repeats, backend=jax.default_backend(),
              cpus=sorted(os.sched_getaffinity(0)))


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
  parser.add_argument("--quick", action="store_true",
                      help="gamma in {1, 5}, 3 timed calls per quantity, short per-call "
                           "timings, 100 tokens.")
  parser.add_argument("--target_model", default="smoke_target")
  parser.add_argument("--draft_model", default="demo_draft")
  parser.add_argument("--target_checkpoint", default=None)
  parser.add_argument("--draft_checkpoint", default=None)
  parser.add_argument("--max_new_tokens", type=int, default=None,
                      help="tokens generated per row (default 200; quick: 100)")
  parser.add_argument("--input_length", type=int, default=32)
  parser.add_argument("--max_decode_length", type=int, default=256,
                      help="cache capacity of both models")
  parser.add_argument("--gammas", type=int, nargs="*", help="default 1..8 (quick: 1 5)")
  parser.add_argument("--temperatures", type=float, nargs="*", help="default 0 1")
  parser.add_argument("--batches", type=int, nargs="*", help="default 1 8")
  parser.add_argument("--cpus", type=int, default=1,
                      help="cores to run on (default 1: the process is pinned to the last core "
                           "before JAX creates its thread pools; 0: no pinning). See pin_cores.")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls per quantity (default 12; quick: 3); medians are reported")
  args = parser.parse_args()
  if bool(args.target_checkpoint) != bool(args.draft_checkpoint):
    parser.error("pass both --target_checkpoint and --draft_checkpoint, or neither.")
  if args.max_new_tokens is None:
    args.max_new_tokens = 100 if args.quick else 200
  pin_cores(args.cpus)
  report = run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print_table(report)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
