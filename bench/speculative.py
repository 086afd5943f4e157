"""Benchmark of the speculative decoding engine against plain target decoding.

For a target/draft pair (the demo's shapes with random weights by default, or checkpoints),
for gamma in 1..8 and T in {0, 1}, at batch 1: block efficiency tau, c = draft step time /
target step time, the measured wall-clock speedup over plain decoding (median and [min, max]
over interleaved turns), the cost-model speedup from per-call costs timed in the same turns,
and the loop overhead = cost-model speedup / measured speedup (how much slower the engine's
loop is than its model calls alone). It uses the library's one measurement, `speed.measure_speed`
(see its docstring for the protocol). EOS is disabled, so every prompt decodes exactly
`--max_new_tokens` tokens with both decoders.

The process is pinned to one core before JAX starts (`--cpus`, see pinning.pin_cores).

  python bench/speculative.py --out bench_speculative.json [--quick | --smoke] [--cpus N]
      [--target_checkpoint DIR --draft_checkpoint DIR] [--target_model NAME --draft_model NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402
from distillspec_jax.evaluation.speed import TimingPlan, measure_speed  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: the smoke target and the demo draft on one short prompt, one gamma, greedy.
SMOKE = dict(target_model="smoke_target", max_new_tokens=4, prompts=1, input_length=8,
             gammas=[2], temperatures=[0.0], repeats=1, cpus=0)


def load_pair(args):
  overrides = {"max_decode_length": args.max_decode_length} if args.max_decode_length else {}
  target = Model.from_name(args.target_model, **overrides)
  draft = Model.from_name(args.draft_model, **overrides)
  if args.target_checkpoint:
    from distillspec_jax.interop.importer import load_initial_params
    target_params = load_initial_params(args.target_checkpoint, target)
    draft_params = load_initial_params(args.draft_checkpoint, draft)
  else:
    target_params = target.init(jax.random.PRNGKey(0))
    draft_params = draft.init(jax.random.PRNGKey(1))
  return target, target_params, draft, draft_params


def run(args):
  target, target_params, draft, draft_params = load_pair(args)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, target.config.vocab_size,
                         size=(args.prompts, args.input_length)).astype(np.int32)
  plan = TimingPlan(gammas=args.gammas or ([1, 5] if args.quick else list(range(1, 9))),
                    temperatures=args.temperatures or [0.0, 1.0],
                    max_new_tokens=args.max_new_tokens,
                    repeats=args.repeats or (3 if args.quick else 7), eos_id=-1)
  out = measure_speed(target, target_params, {"draft": (draft, draft_params)}, prompts,
                      plan).to_json()
  step = out["per_call_s"]["target_step"]
  for row in out["rows"]:
    row["c"] = out["per_call_s"]["draft:draft_step_1"] / step
    row["overhead"] = row["cost_model_speedup"] / row["speedup"]
  out.update(target_model=args.target_model, draft_model=args.draft_model,
             target_checkpoint=args.target_checkpoint, draft_checkpoint=args.draft_checkpoint,
             input_length=args.input_length, backend=jax.default_backend())
  return out


def print_table(report):
  header = ("gamma", "temperature", "tau", "c", "speedup", "spread", "cost_model", "overhead")
  keys = ("gamma", "temperature", "timed_tau", "c", "speedup", "speedup_spread",
          "cost_model_speedup", "overhead")
  print(" | ".join(f"{h:>11}" for h in header))
  for row in report["rows"]:
    print(" | ".join(f"{row[k]:>11.3f}" if isinstance(row[k], float) else f"{row[k]:>11}"
                     for k in keys))
  print("per call (us):", {k: round(v * 1e6, 1) for k, v in report["per_call_s"].items()})


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write.")
  parser.add_argument("--quick", action="store_true", help="gamma in {1, 5}, 3 turns.")
  parser.add_argument("--target_model", default="demo_target")
  parser.add_argument("--draft_model", default="demo_draft")
  parser.add_argument("--target_checkpoint", default=None)
  parser.add_argument("--draft_checkpoint", default=None)
  parser.add_argument("--max_new_tokens", type=int, default=44,
                      help="tokens generated per prompt (EOS disabled)")
  parser.add_argument("--prompts", type=int, default=8, help="prompts, each decoded alone")
  parser.add_argument("--input_length", type=int, default=32)
  parser.add_argument("--max_decode_length", type=int, default=None,
                      help="cache capacity of both models (default: the presets')")
  parser.add_argument("--gammas", type=int, nargs="*", help="default 1..8 (quick: 1 5)")
  parser.add_argument("--temperatures", type=float, nargs="*", help="default 0 1")
  parser.add_argument("--cpus", type=int, default=1,
                      help="cores to run on (default 1: pinned to the last core before JAX "
                           "creates its thread pools; 0: no pinning). See pinning.pin_cores.")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timing turns (default 7; quick: 3); medians are reported")
  args = smoke.parse(parser, argv, SMOKE)
  if bool(args.target_checkpoint) != bool(args.draft_checkpoint):
    parser.error("pass both --target_checkpoint and --draft_checkpoint, or neither.")
  pin_cores(args.cpus)
  report = run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print_table(report)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
