"""Adaptive speculation length against fixed gamma, timed in one measurement.

Times, with the library's one measurement (`speed.measure_speed`: batch 1, interleaved
cycles, one pinned core), plain decoding, speculative decoding at each fixed gamma, and the
adaptive draft length rules (`speculative.DraftLength`, up to gamma_max tokens a round:
`confidence`, each row proposes while its confidence in the next token is at least the
threshold; `cumulative`, while the product of the round's confidences is) at every threshold
of the sweep, and the `cost` rule (no threshold: it drafts on while a longer proposal promises
more tokens per unit of time, by the verification prices of `--costs_json`, a
bench/verification_cost.py output from the same machine), all in the same cycles against the
same plain decoding. The confidence is `--signal`'s: the draft's top probability, or the
acceptance head of a draft stage trained with one. Prints per temperature and configuration
the end-to-end and decode-phase speedups with their [min, max] over repeats, tau, the mean
proposal length (draft tokens proposed per round), the draft calls and decode seconds per
round (an adaptive round that stops early pays one call more than it proposes: the call that
found the next token not worth proposing), and whether the best adaptive row's end-to-end
speedup reaches the best fixed gamma's.

The pair: a finished main job's target and distilled draft on its test prompts (the run file,
default gin/runs/demo.gin, when its run has the checkpoints), else the run file's shapes with
random weights on random prompts (`"weights": "random"`: a random draft is rarely accepted,
so those rows show the rule's costs, not what it gains with a distilled draft).

  python bench/adaptive_gamma.py --out docs/benchmarks/adaptive_gamma.json
      [--gin_file=gin/runs/demo.gin] [--gammas 3,5,7] [--gamma_max 7]
      [--thresholds 0.3,0.5,0.7,0.9] [--rules confidence,cumulative,cost]
      [--costs_json docs/benchmarks/verification_cost.json] [--signal top_probability]
      [--temperatures 0,1]
      [--prompts 12] [--repeats 5]
      [--calls 4] [--budget 120] [--cpus 1] [--random] [--smoke]

Writes --out (JSON: the rows and the host) and a PNG beside it (end-to-end speedup against
the threshold, the fixed gammas as horizontal lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distillspec_jax.core.validation import check_positive_int  # noqa: E402
from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: random weights of the smoke run's shapes (smoke.PIPELINE_BINDINGS), one prompt,
# gamma 2 against the confidence rule at one threshold, one repeat of one call.
SMOKE = dict(gammas="2", gamma_max=2, thresholds="0.5", rules="confidence", temperatures="0",
             prompts=1, repeats=1, calls=1, budget=0.0, random=True, cpus=0)


def best_rows(rows: list) -> dict:
  """temperature -> {"fixed": the fixed-gamma row with the best end-to-end speedup,
  "adaptive": the best adaptive row, "adaptive_reaches_fixed": bool}."""
  out = {}
  for temperature in sorted({r["temperature"] for r in rows}):
    mine = [r for r in rows if r["temperature"] == temperature]
    best = {kind: max((r for r in mine if (r["draft_length"] == "fixed") == (kind == "fixed")),
                      key=lambda r: r["end_to_end_speedup"], default=None)
            for kind in ("fixed", "adaptive")}
    reached = (best["fixed"] is not None and best["adaptive"] is not None
               and best["adaptive"]["end_to_end_speedup"] >= best["fixed"]["end_to_end_speedup"])
    out[f"{temperature:g}"] = dict(best, adaptive_reaches_fixed=reached)
  return out


def cost_rule(path, gamma_max: int):
  """The 'cost' DraftLength of a bench/verification_cost.py JSON: each width's target call
  and the one-token draft call, in target steps."""
  from distillspec_jax.decoding.speculative import DraftLength
  if not path or not os.path.exists(path):
    raise ValueError(f"--costs_json={path!r}: the cost rule needs this machine's prices; run "
                     f"python bench/verification_cost.py --max_width {gamma_max + 1} "
                     "--out costs.json first and pass --costs_json costs.json.")
  with open(path) as f:
    measured = json.load(f)
  step = measured["target"]["1"]["median_s"]
  widths = sorted(int(w) for w in measured["target"])
  if widths[-1] < gamma_max + 1:
    raise ValueError(f"--costs_json={path!r} prices widths up to {widths[-1]}; --gamma_max "
                     f"{gamma_max} needs {gamma_max + 1}: rerun verification_cost.py with "
                     f"--max_width {gamma_max + 1}.")
  costs = tuple(measured["target"][str(w)]["median_s"] / step for w in range(1, gamma_max + 2))
  return DraftLength("cost", costs=costs, draft_cost=measured["draft"]["1"]["median_s"] / step)


def _on_signal(row: dict) -> str:
  """The label's suffix for a rule reading the calibrated signal (" on acceptance head");
  rows written before GridPoint had `signal` read the top probability."""
  signal = row.get("signal", "top_probability")
  return "" if signal == "top_probability" else f" on {signal.replace('_', ' ')}"


def label(row: dict) -> str:
  if row["draft_length"] == "fixed":
    return f"gamma {row['gamma']}"
  if row["draft_length"] == "cost":
    return f"cost (gamma_max {row['gamma']})"
  return (f"{row['draft_length']} >= {row['threshold']:g}{_on_signal(row)} "
            f"(gamma_max {row['gamma']})")


def plot(rows: list, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  temperatures = sorted({r["temperature"] for r in rows})
  figure, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4),
                              squeeze=False)
  for axis, temperature in zip(axes[0], temperatures):
    for row in rows:
      if row["temperature"] == temperature and row["draft_length"] == "cost":
        axis.axhline(row["end_to_end_speedup"], lw=1.2, color="black",
                     label=f"cost rule (gamma_max {row['gamma']})")
    for rule in sorted({r["draft_length"] for r in rows} - {"fixed", "cost"}):
      adaptive = sorted((r for r in rows if r["temperature"] == temperature
                         and r["draft_length"] == rule), key=lambda r: r["threshold"])
      values = [r["end_to_end_speedup"] for r in adaptive]
      errors = [[v - r["end_to_end_speedup_range"][0] for v, r in zip(values, adaptive)],
                [r["end_to_end_speedup_range"][1] - v for v, r in zip(values, adaptive)]]
      axis.errorbar([r["threshold"] for r in adaptive], values, yerr=errors, marker="o",
                    capsize=3, label=f"{rule} rule")
    for row in rows:
      if row["temperature"] == temperature and row["draft_length"] == "fixed":
        line = axis.axhline(row["end_to_end_speedup"], ls="--", lw=0.8)
        axis.annotate(f"gamma {row['gamma']}", (0.0, row["end_to_end_speedup"]),
                      color=line.get_color(), fontsize=7, xycoords=("axes fraction", "data"))
    axis.axhline(1.0, color="gray", lw=0.6)
    axis.set_xlabel("threshold (confidence: the token's; cumulative: the round's product)")
    axis.set_ylabel("end-to-end speedup over plain decoding")
    axis.set_title(f"T = {temperature:g} (bars: [min, max] over repeats)")
    axis.legend(fontsize=8)
  figure.suptitle(title, fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write (PNG beside it).")
  parser.add_argument("--gammas", default="3,5,7", help="fixed gammas")
  parser.add_argument("--gamma_max", type=int, default=7, help="the adaptive rule's gamma_max")
  parser.add_argument("--thresholds", default="0.3,0.5,0.7,0.9")
  parser.add_argument("--rules", default="confidence,cumulative",
                      help="adaptive rules: confidence and cumulative at every threshold, "
                           "cost once (needs --costs_json)")
  parser.add_argument("--costs_json", default=None,
                      help="bench/verification_cost.py's JSON from this machine (cost rule)")
  parser.add_argument("--signal", default="top_probability",
                      choices=("top_probability", "acceptance_head"),
                      help="the confidence every adaptive rule reads: acceptance_head needs a "
                           "draft stage trained with one (PipelineConfig.acceptance_head)")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=12, help="timed prompts (batch 1)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--calls", type=int, default=4, help="timed calls per repeat, at least")
  parser.add_argument("--budget", type=float, default=120.0, help="seconds of timing")
  parser.add_argument("--draft_stage", default=None,
                      help="the run's draft stage (default: its last distillation stage)")
  parser.add_argument("--random", action="store_true",
                      help="random weights even when the run has checkpoints")
  parser.add_argument("--cpus", type=int, default=1)
  args, gin_args = smoke.parse(parser, argv, SMOKE, known=True)
  default = smoke.PIPELINE_BINDINGS if args.smoke else ("--gin_file=gin/runs/demo.gin",)
  args.gin_args = gin_args or list(default)
  try:
    args.gammas = [int(g) for g in args.gammas.split(",")]
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.rules = [r for r in args.rules.split(",") if r]
  except ValueError:
    raise ValueError(f"--gammas={args.gammas!r}, --thresholds={args.thresholds!r}, "
                     f"--temperatures={args.temperatures!r}: pass comma-separated numbers, "
                     "e.g. --thresholds 0.3,0.5.") from None
  for name in ("prompts", "repeats", "calls", "gamma_max"):
    check_positive_int(getattr(args, name), f"--{name}")
  return args


def main(argv=None) -> None:
  args = parse(argv)
  pinned = pin_cores(args.cpus)
  from distillspec_jax.decoding.speculative import DraftLength
  rules = (DraftLength(),) + tuple(DraftLength(rule, t, signal=args.signal)
                                   for rule in args.rules if rule != "cost"
                                   for t in args.thresholds)
  if "cost" in args.rules:
    rules += (dataclasses.replace(cost_rule(args.costs_json, args.gamma_max),
                                  signal=args.signal),)
  from latency import cpu_name, load_pair
  from distillspec_jax.evaluation.speed import TimingPlan, measure_speed
  pair = load_pair(args)
  if not rules[-1].runs_on(pair["draft"]):
    raise ValueError(f"--signal={args.signal!r} but the draft ({pair['weights']} weights, "
                     f"stage {pair['draft_stage']!r}) has no acceptance head; pass a "
                     "finished run's --draft_stage trained with one "
                     "(PipelineConfig.acceptance_head) or drop --signal.")
  gammas = sorted(set(args.gammas))
  if args.gamma_max < max(gammas):
    raise ValueError(f"--gamma_max={args.gamma_max} is below the largest fixed gamma "
                     f"{max(gammas)}; the adaptive rule is timed at the largest gamma of the "
                     "grid, so pass --gamma_max >= every --gammas entry.")
  gammas = sorted(set(gammas) | {args.gamma_max})
  load_before, started = os.getloadavg(), time.time()
  plan = TimingPlan(gammas=gammas, temperatures=args.temperatures,
                    max_new_tokens=pair["max_new_tokens"], draft_lengths=rules,
                    repeats=args.repeats, timed_per_turn=args.calls, budget_s=args.budget)
  result = measure_speed(pair["target"], pair["target_params"],
                         {"draft": (pair["draft"], pair["draft_params"])},
                         pair["prompts"][:args.prompts], plan).to_json()
  rows = [r for r in result["rows"] if r["draft_length"] != "fixed" or r["gamma"] in args.gammas]
  for row in rows:
    row["mean_proposal"] = row["drafted"] / max(row["rounds"], 1)
    row["calls_per_round"] = row["draft_calls"] / max(row["rounds"], 1)
    # A round's whole price as timed: the decode time (the setup call apart) per round.
    row["seconds_per_round"] = (row["seconds"] - row["setup_s"]) / max(row["rounds"], 1)
  report = {"weights": pair["weights"], "models": pair["models"],
            "draft_stage": pair["draft_stage"], "gamma_max": args.gamma_max, "rows": rows,
            "best": best_rows(rows), "plain": result["plain"], "per_call_s": result["per_call_s"],
            "interference": result["interference"],
            "timed_per_repeat": result["protocol"]["timed_per_repeat"],
            "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "pinned": pinned,
                     "load_average_before": list(load_before),
                     "load_average_after": list(os.getloadavg()),
                     "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                     "seconds": time.time() - started}}
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  plot(rows, os.path.splitext(args.out)[0] + ".png",
       f"{pair['weights']} weights, {args.prompts} prompts, {cpu_name()}, pinned {pinned}")
  for row in rows:
    low, high = row["end_to_end_speedup_range"]
    print(f"T={row['temperature']:g} {label(row):34s} end to end {row['end_to_end_speedup']:.3f}"
          f" [{low:.3f}, {high:.3f}], decode {row['speedup']:.3f}, tau {row['timed_tau']:.2f}, "
          f"proposal {row['mean_proposal']:.2f}, draft calls {row['calls_per_round']:.2f}, "
          f"{1e3 * row['seconds_per_round']:.3f} ms a round"
          + (" unreliable" if row["speedup_unreliable"] else ""))
  for temperature, best in report["best"].items():
    print(f"T={temperature}: best fixed {label(best['fixed'])}, best adaptive "
          f"{label(best['adaptive'])}: adaptive reaches fixed: {best['adaptive_reaches_fixed']}")
  print(f"weights: {report['weights']}; interference {result['interference']}; wrote {args.out}")


if __name__ == "__main__":
  try:
    main()
  except ValueError as error:  # bad arguments: named by the message, no traceback
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
