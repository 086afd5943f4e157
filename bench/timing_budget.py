"""How many timed calls does the main job's speed measurement need? Spreads against calls.

Runs the main job's speed measurement (`pipeline.measure_run_speed`: every draft of a
finished run with its target, the run's gammas and temperatures, on one pinned core) with a
timing budget, keeps every timed call's windows, and recomputes each row's speedup from each
repeat's first k calls for several k (`speed.repeat_times`). For each k it prints the largest
spread over repeats, how many rows have a spread above 5% and 10%, and the largest deviation
from the speedups of all calls. A host that grows quiet partway shows up as estimates that
keep falling with k; a quiet one as spreads that are small from the start.

It also prints how much the plain decoding's extra calls per cycle narrow the spreads: the
same cycles recomputed with only the first of each cycle's plain calls
(`one_plain_call_per_cycle`). And it prints when the host was quiet: for plain decoding and
the largest verification, the share of (call, window) pairs within 3% of that window's
fastest time over the whole measurement, in each tenth of the timed calls (`speed.quiet_timeline`); and each row's speedup
from the fastest windows of all calls together, against the cost model
(`pooled_speedups`: every call pooled into one repeat; what each repeat would read with
enough quiet calls).

  python bench/timing_budget.py --gin_file=gin/runs/demo.gin --out timing_budget.json \
      [--budget 240] [--calls 6,12,18,24] [--gin.SPEED_CALLS=12]

Needs the run's checkpoints (the README's main command writes them). Writes the per-k
summary and every row's speedups to --out, and a PNG of max spread against calls beside it.

`--smoke`: the smoke run (bench/smoke.py) in a temporary folder, or in the `--gin.MODEL_DIR`
given; it trains the stages the measurement needs that are not done there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: no timing budget beyond the smoke run's calls, unpinned.
SMOKE = dict(budget=0.0, calls="1,2", cpus=0)


def speedups(log: list, result: dict, calls: int) -> dict:
  """(draft, gamma, T) -> speedup per repeat from each repeat's first `calls` cycles."""
  from distillspec_jax.evaluation import speed
  from distillspec_jax.decoding.speculative import Lenience
  per_cycle = {("plain", t): result["protocol"]["plain_calls_per_cycle"]
               for t in {row["temperature"] for row in result["rows"]}}
  times = speed.repeat_times(log, result["protocol"]["repeats"], calls,
                             calls_per_cycle=per_cycle)
  out = {}
  for row in result["rows"]:
    temperature = row["temperature"]
    plain_tokens = result["plain"][str(float(temperature))]["tokens"]
    spec = times[(row["draft"], row["gamma"], temperature,
                  speed.timed_lenience(Lenience(row["lenience"], row["epsilon"])))]
    plain = times[("plain", temperature)]
    out[(row["draft"], row["gamma"], temperature)] = speed.paired_speedups(
        row["tokens"], spec, plain_tokens, plain)
  return out


def _with_protocol(result: dict, **changes) -> dict:
  """`result` (a SpeedMeasurement's JSON) as if its protocol had `changes`."""
  return {**result, "protocol": {**result["protocol"], **changes}}


def row_spreads(rows: dict) -> dict:
  """row -> (max - min) / median of its speedups per repeat."""
  return {k: (max(v) - min(v)) / statistics.median(v) for k, v in rows.items()}


def summarise(log: list, result: dict, grid: list) -> list:
  calls = result["protocol"]["timed_per_repeat"]
  everything = {k: statistics.median(v) for k, v in speedups(log, result, calls).items()}
  lines = []
  for calls in grid:
    rows = speedups(log, result, calls)
    spreads = row_spreads(rows)
    deviation = max(abs(statistics.median(v) / everything[k] - 1) for k, v in rows.items())
    lines.append({"calls": calls, "max_spread": max(spreads.values()),
                  "rows_spread_over_5_percent": sum(s > 0.05 for s in spreads.values()),
                  "rows_spread_over_10_percent": sum(s > 0.10 for s in spreads.values()),
                  "max_deviation_from_all_calls": deviation,
                  "speedups": {f"{d}/gamma{g}/T{t:g}": statistics.median(v)
                               for (d, g, t), v in rows.items()}})
  return lines


def pooled_speedups(log: list, result: dict) -> dict:
  """(draft, gamma, T) -> speedup from each window's fastest time over all calls, pooled into
  one repeat."""
  one = [(key, 0, windows) for key, _, windows in log]
  return {k: v[0] for k, v in speedups(one, _with_protocol(result, repeats=1), None).items()}


def one_plain_call_per_cycle(log: list, result: dict) -> list:
  """`log` with only the first of each cycle's plain-decoding calls: the same cycles as
  timed, as if plain decoding had been called once per cycle (`plain_calls_per_cycle` = 1)."""
  per_cycle = result["protocol"]["plain_calls_per_cycle"]
  seen, kept = {}, []
  for key, repeat, windows in log:
    if key[0] == "plain":
      count = seen.get((key, repeat), 0)
      seen[(key, repeat)] = count + 1
      if count % per_cycle:
        continue
    kept.append((key, repeat, windows))
  return kept


def spread_counts(rows: dict) -> dict:
  """{"rows_spread_within_10_percent", "median_spread"} of (row -> speedups per repeat)."""
  spreads = list(row_spreads(rows).values())
  return {"rows_spread_within_10_percent": sum(s <= 0.10 for s in spreads),
          "median_spread": statistics.median(spreads)}


def plot(lines: list, path: str, timeline: dict = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  if timeline:
    figure, (axis, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for name, shares in timeline.items():
      tenths = [(i + 0.5) / len(shares) * 100 for i in range(len(shares))]
      right.plot(tenths, [100 * share for share in shares], "o-", label=name)
    right.set_xlabel("timed calls so far (%)")
    right.set_ylabel("windows within 3% of their fastest (%)")
    right.legend(fontsize=8)
  else:
    figure, axis = plt.subplots(figsize=(5, 3.2))
  calls = [line["calls"] for line in lines]
  axis.plot(calls, [100 * line["max_spread"] for line in lines], "o-",
            label="largest spread over repeats")
  axis.plot(calls, [100 * line["max_deviation_from_all_calls"] for line in lines], "s--",
            label="largest change to the all-calls speedup")
  axis.axhline(10, color="grey", lw=0.8)
  axis.set_xlabel("timed calls per repeat")
  axis.set_ylabel("%")
  axis.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--budget", type=float, default=240.0, help="seconds of timing")
  parser.add_argument("--calls", default="6,12,18,24",
                      help="calls per repeat to recompute the speedups from")
  parser.add_argument("--cpus", type=int, default=1)
  args, gin_args = smoke.parse(parser, argv, SMOKE, known=True)
  pin_cores(args.cpus)
  if not args.smoke:
    return report(args, gin_args)
  import tempfile
  from distillspec_jax.main import load_pipeline
  from distillspec_jax.studies import pipeline
  with tempfile.TemporaryDirectory() as run_dir:
    gin_args = [*smoke.PIPELINE_BINDINGS, f"--gin.MODEL_DIR='{run_dir}'", *gin_args]
    config = load_pipeline(gin_args)
    pipeline.run_pipeline(config, stages=config.distill_stages)
    return report(args, gin_args)


def report(args, gin_args: list) -> dict:
  """Measures the run of `gin_args`, prints the summaries, writes and returns the report."""
  from distillspec_jax.studies import pipeline
  from distillspec_jax.evaluation import speed
  from distillspec_jax.main import load_pipeline
  config = load_pipeline(gin_args + [f"--gin.SPEED_BUDGET_S={args.budget}"])
  log = []
  result = pipeline.measure_run_speed(config, windows_log=log).to_json()
  timed = result["protocol"]["timed_per_repeat"]
  grid = sorted({min(int(c), timed) for c in args.calls.split(",")} | {timed})
  lines = summarise(log, result, grid)
  for line in lines:
    print(f"{line['calls']:3d} calls per repeat: largest spread {line['max_spread']:.1%}, "
          f"rows above 5% / 10%: {line['rows_spread_over_5_percent']} / "
          f"{line['rows_spread_over_10_percent']}, largest change to the all-calls speedup "
          f"{line['max_deviation_from_all_calls']:.1%}")
  largest = f"verification_{max(config.grid.gammas)}"
  # Plain decoding at every temperature; the verification's timeline is the measurement's.
  timeline = {f"plain T={t:g}": speed.quiet_timeline(log, ("plain", t))
              for t in config.grid.temperatures}
  timeline[largest] = result["quiet_timeline"][largest]
  for name, shares in timeline.items():
    print(f"{name}: windows within 3% of their fastest, by tenth of the timing: "
          + " ".join(f"{share:.0%}" for share in shares))
  cost_model = {(r["draft"], r["gamma"], r["temperature"]): r["cost_model_speedup"]
                for r in result["rows"]}
  floors = {f"{d}/gamma{g}/T{t:g}": {"speedup": v, "cost_model_speedup": cost_model[(d, g, t)]}
            for (d, g, t), v in pooled_speedups(log, result).items()}
  ratios = [v["speedup"] / v["cost_model_speedup"] for v in floors.values()]
  print(f"pooled calls (every call one repeat): measured over cost model {min(ratios):.2f}-"
        f"{max(ratios):.2f}")
  # The same cycles with every plain call against the first of each cycle's only.
  plain_calls = {
      f"{result['protocol']['plain_calls_per_cycle']} per cycle": spread_counts(
          speedups(log, result, None)),
      "1 per cycle (the first)": spread_counts(
          speedups(one_plain_call_per_cycle(log, result), _with_protocol(
              result, plain_calls_per_cycle=1), None))}
  for name, counts in plain_calls.items():
    print(f"plain decoding {name}: {counts['rows_spread_within_10_percent']} of "
          f"{len(result['rows'])} spreads within 10%, median spread "
          f"{counts['median_spread']:.1%}")
  out = {"budget_s": args.budget, "timed_per_repeat": result["protocol"]["timed_per_repeat"],
         "plain_calls_per_cycle": result["protocol"]["plain_calls_per_cycle"],
         "spreads_by_plain_calls": plain_calls,
         "repeats": result["protocol"]["repeats"], "interference": result["interference"],
         "per_call_s": result["per_call_s"], "machine": result["machine"],
         "by_calls": lines, "quiet_timeline": timeline, "pooled_speedups": floors}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  plot(lines, os.path.splitext(args.out)[0] + ".png", timeline)
  print("wrote", args.out)
  return out


if __name__ == "__main__":
  main()
