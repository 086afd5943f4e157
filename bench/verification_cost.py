"""Does speculative decoding pay on this machine? A k-token call's cost in target steps.

Times `Model.extend` of the target on k = 1..K tokens per call (batch 1, random weights; the
cost does not depend on the values) and one- and two-token calls of the draft, in
interleaved turns on one pinned core, each call fed the previous call's outputs
(`speed.per_call_function`, the same per-call timing as the main job's cost model). Prints
per k the median cost, its [min, max] over turns and the ratio to a one-token step, and per
gamma the perfect-draft ceiling: the cost-model speedup if every drafted token were accepted
(tau = gamma + 1),

  ceiling(gamma) = (gamma + 1) x step / (verification(gamma + 1) + draft_2 + (gamma - 1) x draft_1),

which no draft can beat on this machine. Speculative decoding pays when the target's step
is dominated by reading its weights: then a verification of a few tokens costs about one
step. Where the weights sit in a fast cache, a verification is bound by arithmetic instead
and costs nearly k steps, and the ceiling falls (docs/speed.md, "Where the target's weights
live").

  python bench/verification_cost.py --out verification_cost.json [--max_width 9] [--turns 7]
      [--target_model demo_target] [--draft_model demo_draft] [--cpus 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core.validation import check_positive_int
from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: widths up to 3, one turn of short calls, unpinned.
SMOKE = dict(target_model="smoke_target", max_width=3, turns=1, input_length=8,
             call_seconds=0.002, cpus=0)


def perfect_draft_ceiling(step_s: float, verification_s: dict, draft_one_s: float,
                          draft_two_s: float) -> dict:
  """gamma -> the cost-model speedup with every drafted token accepted.

  verification_s: k -> seconds of a k-token target call (k >= 2; gamma = k - 1).
  One round: a two-token and gamma - 1 one-token draft calls, one (gamma + 1)-token
  verification; it yields gamma + 1 tokens, which plain decoding makes in gamma + 1 steps.
  """
  return {k - 1: k * step_s / (cost + draft_two_s + (k - 2) * draft_one_s)
          for k, cost in sorted(verification_s.items()) if k >= 2}


def summarise(turns: dict) -> dict:
  """key -> {"median_s", "range_s"} over the turns' per-call seconds."""
  return {key: {"median_s": statistics.median(v), "range_s": [min(v), max(v)]}
          for key, v in turns.items()}


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tqdm import tqdm

  from distillspec_jax.models.model import Model
  from distillspec_jax.evaluation.pinning import machine_info
  from distillspec_jax.evaluation.speed import per_call_function, window_seconds

  if args.max_width < 2:
    raise ValueError(f"--max_width={args.max_width}: a verification scores at least 2 tokens "
                     "(gamma >= 1); pass --max_width 2 or more.")
  check_positive_int(args.turns, "--turns")
  functions = {}
  for role, name, widths in (("target", args.target_model, range(1, args.max_width + 1)),
                             ("draft", args.draft_model, (1, 2))):
    model = Model.from_name(name)
    params = model.init(jax.random.PRNGKey(0))
    inputs = ({"encoder_input_tokens": jnp.full((1, args.input_length), 7, jnp.int32)}
              if model.config.kind == "encoder_decoder" else {})
    for width in widths:
      functions[(role, width)] = per_call_function(model, params, inputs, 1, width,
                                                   args.call_seconds)
  turns = {key: [] for key in functions}
  for _ in tqdm(range(args.turns), desc="turns"):
    for key, (fn, calls) in functions.items():
      _, stamps = jax.block_until_ready(fn())
      turns[key].append(float(np.sum(window_seconds(stamps))) / calls)
  costs = summarise(turns)
  step = costs[("target", 1)]["median_s"]
  verification = {width: costs[("target", width)]["median_s"]
                  for width in range(2, args.max_width + 1)}
  ceiling = perfect_draft_ceiling(step, verification, costs[("draft", 1)]["median_s"],
                                  costs[("draft", 2)]["median_s"])
  return {"target_model": args.target_model, "draft_model": args.draft_model,
          "machine": machine_info(), "backend": jax.default_backend(), "turns": args.turns,
          "target": {str(w): costs[("target", w)] | {
              "steps": costs[("target", w)]["median_s"] / step}
                     for w in range(1, args.max_width + 1)},
          "draft": {str(w): costs[("draft", w)] for w in (1, 2)},
          "perfect_draft_ceiling": {str(g): s for g, s in ceiling.items()}}


def print_report(report: dict) -> None:
  print(f"{'k':>3} | {'target us':>10} | {'[min, max]':>16} | {'steps':>6}")
  for width, row in report["target"].items():
    low, high = (v * 1e6 for v in row["range_s"])
    print(f"{width:>3} | {row['median_s'] * 1e6:>10.1f} | [{low:6.1f}, {high:6.1f}] | "
          f"{row['steps']:>6.2f}")
  print("draft us:", {w: round(r["median_s"] * 1e6, 1) for w, r in report["draft"].items()})
  print("perfect-draft ceiling by gamma:",
        {g: round(s, 2) for g, s in report["perfect_draft_ceiling"].items()})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write.")
  parser.add_argument("--target_model", default="demo_target")
  parser.add_argument("--draft_model", default="demo_draft")
  parser.add_argument("--max_width", type=int, default=9, help="largest k (gamma + 1)")
  parser.add_argument("--turns", type=int, default=7, help="interleaved turns (medians)")
  parser.add_argument("--input_length", type=int, default=40, help="encoder input tokens")
  parser.add_argument("--call_seconds", type=float, default=0.05,
                      help="about how long one timed call of a width runs")
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
