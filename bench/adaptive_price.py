"""The adaptive draft length's own price per round, by cache capacity.

An adaptive rule (`speculative.DraftLength`) drafts in a `while_loop` and verifies in a branch
per proposal width (`lax.switch`); the fixed rule drafts in a
`lax.scan` of fixed length and verifies one width. This script times the two on
the same tokens: fixed gamma G against the `confidence >= 0` rule at gamma_max G, which
proposes all G tokens every round, so both decode the same tokens in the same rounds and the
difference is the adaptive machinery alone. It does so at several cache capacities
(`max_length`): a verification branch that writes the target's cache makes XLA copy all of
it every round, a price that grows with the capacity; one that reads it (`Model.score_block`,
the engine's) does not.

Random weights (the price does not depend on them), batch 1, one pinned core, interleaved
turns; per capacity and rule the median milliseconds per round and its [min, max] over turns,
and the adaptive path's price as the ratio of the medians.

  python bench/adaptive_price.py --out adaptive_price.json [--capacities 128,1024,4096]
      [--gamma 4] [--prompts 8] [--turns 5] [--cpus 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core.validation import check_positive_int  # noqa: E402
from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

SMOKE = dict(target_model="smoke_target", draft_model="smoke_target", capacities="48",
             gamma=2, prompts=1, turns=1, max_new_tokens=8, prompt_length=4, cpus=0)


def _capacities(text: str) -> list:
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or any(v < 1 for v in values):
    raise ValueError(f"--capacities={text!r}: give cache capacities as positive integers "
                     "separated by commas, e.g. --capacities 128,1024,4096.")
  return values


def _decoder(target, target_params, draft, draft_params, prompts, args, capacity, rule):
  """One prompt's decode under `rule` at `capacity`, and its rounds."""
  import jax

  from distillspec_jax.decoding.plain import prompt_inputs
  from distillspec_jax.decoding.speculative import speculative_decode

  def one(i):
    result = speculative_decode(target, target_params, draft, draft_params,
                                max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                                max_length=capacity, draft_length=rule,
                                **prompt_inputs(target, prompts[i:i + 1]))
    return jax.block_until_ready(result)
  return one


def run(args) -> dict:
  import jax
  import numpy as np
  from tqdm import tqdm

  from distillspec_jax.decoding.speculative import DraftLength
  from distillspec_jax.evaluation.pinning import machine_info
  from distillspec_jax.models.model import Model

  capacities = _capacities(args.capacities)
  for value, name in ((args.gamma, "--gamma"), (args.prompts, "--prompts"),
                      (args.turns, "--turns"), (args.max_new_tokens, "--max_new_tokens"),
                      (args.prompt_length, "--prompt_length")):
    check_positive_int(value, name)
  need = args.prompt_length + 1 + args.max_new_tokens + args.gamma - 1
  if min(capacities) < need:
    raise ValueError(f"--capacities={args.capacities}: each capacity must hold the prompt, the "
                     f"new tokens and one block ({need}); raise the smallest to {need}.")
  target, draft = Model.from_name(args.target_model), Model.from_name(args.draft_model)
  target_params = target.init(jax.random.PRNGKey(0))
  draft_params = draft.init(jax.random.PRNGKey(1))
  prompts = np.random.default_rng(0).integers(
      2, target.config.vocab_size, (args.prompts, args.prompt_length)).astype(np.int32)
  rules = {"fixed": DraftLength(), "adaptive": DraftLength("confidence", 0.0)}
  functions, rounds = {}, {}
  for capacity in capacities:
    outputs = {}
    for name, rule in rules.items():
      fn = _decoder(target, target_params, draft, draft_params, prompts, args, capacity, rule)
      outputs[name] = [fn(i) for i in range(args.prompts)]  # compiles
      functions[(capacity, name)] = fn
      rounds[(capacity, name)] = sum(int(r.target_calls[0]) for r in outputs[name])
    for fixed, adaptive in zip(outputs["fixed"], outputs["adaptive"]):
      if not np.array_equal(fixed.tokens, adaptive.tokens):
        raise AssertionError("the confidence >= 0 rule decoded other tokens than fixed gamma: "
                             "the comparison would not be at equal work")
  turns = {key: [] for key in functions}
  for _ in tqdm(range(args.turns), desc="turns"):
    for key, fn in functions.items():
      start = time.perf_counter()
      for i in range(args.prompts):
        fn(i)
      turns[key].append((time.perf_counter() - start) * 1e3 / rounds[key])
  rows = []
  for capacity in capacities:
    row = {"capacity": capacity, "rounds": rounds[(capacity, "fixed")]}
    for name in rules:
      values = turns[(capacity, name)]
      row[name] = {"ms_per_round": statistics.median(values),
                   "range_ms": [min(values), max(values)]}
    row["price"] = row["adaptive"]["ms_per_round"] / row["fixed"]["ms_per_round"]
    rows.append(row)
  return {"target_model": args.target_model, "draft_model": args.draft_model,
          "gamma": args.gamma, "prompts": args.prompts, "turns": args.turns,
          "max_new_tokens": args.max_new_tokens, "machine": machine_info(), "rows": rows}


def print_report(report: dict) -> None:
  print(f"{'capacity':>8} | {'fixed ms/round':>22} | {'adaptive ms/round':>22} | price")
  for row in report["rows"]:
    cells = [f"{row[n]['ms_per_round']:.3f} [{row[n]['range_ms'][0]:.3f}, "
             f"{row[n]['range_ms'][1]:.3f}]" for n in ("fixed", "adaptive")]
    print(f"{row['capacity']:>8} | {cells[0]:>22} | {cells[1]:>22} | {row['price']:.3f}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write.")
  parser.add_argument("--target_model", default="demo_target")
  parser.add_argument("--draft_model", default="demo_draft")
  parser.add_argument("--capacities", default="128,1024,4096",
                      help="cache capacities (max_length), comma-separated")
  parser.add_argument("--gamma", type=int, default=4, help="fixed gamma and gamma_max")
  parser.add_argument("--prompts", type=int, default=8, help="prompts per turn")
  parser.add_argument("--turns", type=int, default=5, help="interleaved turns (medians)")
  parser.add_argument("--max_new_tokens", type=int, default=32)
  parser.add_argument("--prompt_length", type=int, default=20,
                      help="prompt tokens (the encoder input of an encoder-decoder)")
  parser.add_argument("--cpus", type=int, default=1,
                      help="cores to run on (default 1; 0: no pinning). See pinning.pin_cores.")
  args = smoke.parse(parser, argv, SMOKE)
  pin_cores(args.cpus)
  report = run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print_report(report)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
