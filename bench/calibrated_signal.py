"""The acceptance head on a finished run's draft, then its signal timed against fixed gamma.

On a main job's pair (default: gin/runs/demo.gin's run, its `--draft_stage` draft):

  1. trains an acceptance head (models/acceptance_head.py) per temperature on the frozen
     draft: `--head_steps` Adam steps of the head's binary cross-entropy against the
     acceptance the target gives at that temperature (distill/acceptance_signal.py), on the
     run's training rows (teacher-forced, the fixed data). The head reads the draft's hidden
     state through a stop-gradient, so the draft's tokens are the stage's own and every
     fixed-gamma row is that draft's;
  2. reports, on `--calibration_rows` training rows the head never saw, both stop signals'
     reliability tables and expected calibration errors (evaluation/calibration.py);
  3. times per temperature, in one `speed.measure_speed` session (batch 1, interleaved
     cycles, pinned), plain decoding, each fixed gamma and the `confidence` rule at each
     threshold up to `--gamma_max` (and, with `--costs_json`, the `cost` rule at this
     machine's verification prices), reading the head's signal and the top probability, on
     the run's test prompts; and says whether an adaptive rule on the head reaches the best
     fixed gamma, and whether the pre-chosen threshold (`--preset_threshold`, fixed before
     the run: a calibrated 0.5 is even odds of acceptance) does.

  python bench/calibrated_signal.py --out docs/benchmarks/calibrated_signal.json \\
      [--gin_file=gin/runs/demo.gin --gin.MODEL_DIR="'runs/demo'"] \\
      [--draft_stage distill_supervised_kd] [--head_steps 300] [--head_width 64] \\
      [--gammas 3,5,7] [--gamma_max 7] [--thresholds 0.3,0.5,0.7] [--temperatures 0,1] \\
      [--costs_json verification_cost.json] [--prompts 8] [--repeats 5] [--calls 3]
      [--budget 0] [--cpus 1] [--save_dir DIR]
      [--smoke]

--smoke: random weights of the smoke run's shapes, a few steps, one prompt (numbers mean
nothing). Writes --out (JSON) and a reliability diagram per temperature beside it.
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

SMOKE = dict(gammas="2", gamma_max=2, thresholds="0.5", temperatures="0", head_steps=2,
             head_batch=4, calibration_rows=4, prompts=1, repeats=1, calls=1, budget=0.0,
             random=True, cpus=0)


def parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write (PNGs beside it)")
  parser.add_argument("--draft_stage", default="distill_supervised_kd")
  parser.add_argument("--head_steps", type=int, default=300)
  parser.add_argument("--head_width", type=int, default=64)
  parser.add_argument("--head_batch", type=int, default=64)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--calibration_rows", type=int, default=512,
                      help="training rows held out from the head's steps (ECE)")
  parser.add_argument("--gammas", default="3,5,7", help="fixed gammas")
  parser.add_argument("--gamma_max", type=int, default=7)
  parser.add_argument("--thresholds", default="0.3,0.5,0.7")
  parser.add_argument("--costs_json", default=None,
                      help="bench/verification_cost.py's JSON from this machine: adds the "
                           "'cost' rule on both signals (no threshold)")
  parser.add_argument("--preset_threshold", type=float, default=0.5,
                      help="the head rule's threshold chosen before timing")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=8, help="timed test prompts (batch 1)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--calls", type=int, default=3, help="timed calls per repeat, at least")
  parser.add_argument("--budget", type=float, default=0.0, help="seconds of timing")
  parser.add_argument("--save_dir", default=None,
                      help="write each temperature's draft with its head as our checkpoint, "
                           "<save_dir>/head_T<T> (the eval binary's DRAFT_CHECKPOINT_PATH)")
  parser.add_argument("--random", action="store_true", help="random weights (smoke)")
  parser.add_argument("--cpus", type=int, default=1)
  args, gin_args = smoke.parse(parser, argv, SMOKE, known=True)
  args.gin_args = gin_args or list(smoke.PIPELINE_BINDINGS if args.smoke
                                   else ("--gin_file=gin/runs/demo.gin",))
  try:
    args.gammas = [int(g) for g in args.gammas.split(",")]
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
  except ValueError:
    raise ValueError(f"--gammas={args.gammas!r}, --thresholds={args.thresholds!r}, "
                     f"--temperatures={args.temperatures!r}: pass comma-separated numbers, "
                     "e.g. --thresholds 0.3,0.5.") from None
  for name in ("head_steps", "head_width", "head_batch", "calibration_rows", "prompts",
               "repeats", "calls", "gamma_max"):
    check_positive_int(getattr(args, name), f"--{name}")
  if args.gamma_max < max(args.gammas):
    raise ValueError(f"--gamma_max={args.gamma_max} is below the largest fixed gamma "
                     f"{max(args.gammas)}; pass --gamma_max >= every --gammas entry.")
  args.priced = None
  if args.costs_json:  # the prices, read and checked before any work
    from adaptive_gamma import cost_rule  # bench/adaptive_gamma.py
    args.priced = cost_rule(args.costs_json, args.gamma_max)
  if not 0.0 <= args.preset_threshold <= 1.0:
    raise ValueError(f"--preset_threshold={args.preset_threshold!r} must be in [0, 1].")
  return args


def training_rows(pair: dict, args) -> dict:
  """Teacher-forced rows (T5X features): the run's tokenized train split, or random tokens
  for random weights."""
  import numpy as np
  if pair["weights"] == "random":
    rng = np.random.default_rng(0)
    rows = args.head_batch + args.calibration_rows
    vocab, width = pair["target"].config.vocab_size, pair["max_new_tokens"]
    targets = rng.integers(3, vocab, (rows, width)).astype(np.int32)
    return {"encoder_input_tokens": np.tile(pair["prompts"][:1], (rows, 1)),
            "decoder_target_tokens": targets,
            "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
            "decoder_loss_weights": np.ones_like(targets, np.float32)}
  with np.load(os.path.join(pair["run_dir"], "vocab", "train.npz")) as arrays:
    return {k: arrays[k] for k in arrays.files}


def train_head(pair: dict, rows: dict, args, temperature: float) -> tuple:
  """(draft Model with a head, its params, [bce per step]) after `--head_steps` Adam steps on
  the head alone; the last `--calibration_rows` rows are never read."""
  import jax
  import numpy as np
  import optax
  from distillspec_jax.distill.acceptance_signal import acceptance_labels, acceptance_loss
  from distillspec_jax.distill.objectives import training_features
  from distillspec_jax.models.acceptance_head import PARAMS_KEY, AcceptanceHeadConfig
  target, tp = pair["target"], pair["target_params"]
  draft, params = pair["draft"].with_acceptance_head(
      pair["draft_params"], AcceptanceHeadConfig(args.head_width), jax.random.PRNGKey(7))
  network = {k: v for k, v in params.items() if k != PARAMS_KEY}
  optimizer = optax.adam(args.learning_rate)

  @jax.jit
  def step(head, state, batch):
    labels = acceptance_labels(target.logits(tp, batch), draft.logits(network, batch),
                               temperature)

    def loss(head):
      _, logits = draft.logits_with_acceptance(dict(network, **{PARAMS_KEY: head}), batch)
      return acceptance_loss(logits, labels, batch["decoder_loss_weights"])[0]

    value, grads = jax.value_and_grad(loss)(head)
    updates, state = optimizer.update(grads, state, head)
    return optax.apply_updates(head, updates), state, value

  head, usable = params[PARAMS_KEY], len(rows["decoder_target_tokens"]) - args.calibration_rows
  state, losses = optimizer.init(head), []
  order = np.random.default_rng(int(temperature * 1000) + 1).permutation(usable)
  for i in range(args.head_steps):
    pick = order[(np.arange(args.head_batch) + i * args.head_batch) % usable]
    batch = training_features({k: v[pick] for k, v in rows.items()}, draft)
    head, state, value = step(head, state, batch)
    losses.append(float(value))
  return draft, dict(network, **{PARAMS_KEY: head}), losses


def save_draft(draft, params, path: str) -> None:
  """The draft with its head at `path` (our format, its model config in the meta)."""
  from distillspec_jax.models.config_json import config_to_json
  from distillspec_jax.training import checkpoints
  checkpoints.save_params(path, params, meta={"model_config": config_to_json(draft.config)})


def calibration_tables(pair: dict, draft, params, rows: dict, args, temperature: float) -> dict:
  """{signal: Reliability} on the held-out rows, 64 at a time, pooled."""
  import numpy as np
  from distillspec_jax.evaluation import calibration
  held = {k: v[-args.calibration_rows:] for k, v in rows.items()}
  signals, outcomes, weights = {}, [], []
  for start in range(0, args.calibration_rows, 64):
    chunk = {k: v[start:start + 64] for k, v in held.items()}
    values = calibration.raw_signals(pair["target"], pair["target_params"], draft, params,
                                     chunk, temperature=temperature)
    for name, value in values["signals"].items():
      signals.setdefault(name, []).append(np.asarray(value))
    outcomes.append(np.asarray(values["outcome"]))
    weights.append(np.asarray(values["weights"]))
  outcome, weight = np.concatenate(outcomes), np.concatenate(weights)
  return {name: calibration.reliability(np.concatenate(value), outcome, weight)
          for name, value in signals.items()}


def timed_rows(pair: dict, draft, params, args, temperature: float) -> dict:
  """measure_speed's JSON at one temperature: plain, each fixed gamma, the confidence rule at
  each threshold on both signals (at gamma_max), all in the same cycles."""
  from distillspec_jax.decoding.speculative import DraftLength
  from distillspec_jax.evaluation.speed import TimingPlan, measure_speed
  signals = ("acceptance_head", "top_probability")
  rules = (DraftLength(),) + tuple(DraftLength("confidence", t, signal=s)
                                   for s in signals for t in args.thresholds)
  if args.priced:
    rules += tuple(dataclasses.replace(args.priced, signal=s) for s in signals)
  plan = TimingPlan(gammas=sorted(set(args.gammas) | {args.gamma_max}),
                    temperatures=[temperature], max_new_tokens=pair["max_new_tokens"],
                    draft_lengths=rules, repeats=args.repeats, timed_per_turn=args.calls,
                    budget_s=args.budget)
  result = measure_speed(pair["target"], pair["target_params"], {"draft": (draft, params)},
                         pair["prompts"][:args.prompts], plan).to_json()
  for row in result["rows"]:
    row["mean_proposal"] = row["drafted"] / max(row["rounds"], 1)
  return result


def verdict(rows: list, preset: float) -> dict:
  """The best fixed gamma (gamma_max's included: the strictest bar), the best head rule, the preset head rule; whether each reaches the
  best fixed gamma's end-to-end speedup (median), and by how much."""
  speedup = lambda r: r["end_to_end_speedup"]
  fixed = max((r for r in rows if r["draft_length"] == "fixed"), key=speedup)
  head = [r for r in rows if r.get("signal") == "acceptance_head"]
  best = max(head, key=speedup)
  chosen = [r for r in head if abs(r["threshold"] - preset) < 1e-9]
  out = {"best_fixed": _brief(fixed), "best_head_rule": _brief(best),
         "best_top_probability_rule": _brief(max(
             (r for r in rows if r["draft_length"] != "fixed"
              and r.get("signal") == "top_probability"), key=speedup)),
         "head_reaches_fixed": speedup(best) >= speedup(fixed),
         "head_minus_fixed": speedup(best) - speedup(fixed)}
  if chosen:
    out.update(preset_head_rule=_brief(chosen[0]),
               preset_reaches_fixed=speedup(chosen[0]) >= speedup(fixed),
               preset_minus_fixed=speedup(chosen[0]) - speedup(fixed))
  return out


def _brief(row: dict) -> dict:
  keys = ("gamma", "draft_length", "threshold", "signal", "end_to_end_speedup",
          "end_to_end_speedup_range", "speedup", "timed_tau", "mean_proposal")
  return {k: row.get(k) for k in keys}


def label(row: dict) -> str:
  if row["draft_length"] == "fixed":
    return f"gamma {row['gamma']}"
  if row["draft_length"] == "cost":
    return f"cost on {row['signal']} (gamma_max {row['gamma']})"
  return f"confidence >= {row['threshold']:g} on {row['signal']} (gamma_max {row['gamma']})"


def run(args) -> dict:
  pinned = pin_cores(args.cpus)
  from latency import cpu_name, load_pair
  from distillspec_jax.evaluation import calibration
  from distillspec_jax.main import load_pipeline
  pair = load_pair(args)
  pair["run_dir"] = load_pipeline(args.gin_args).run_dir
  rows = training_rows(pair, args)
  report = {"weights": pair["weights"], "models": pair["models"],
            "draft_stage": pair["draft_stage"], "head_steps": args.head_steps,
            "head_width": args.head_width, "head_batch": args.head_batch,
            "calibration_rows": args.calibration_rows, "gamma_max": args.gamma_max,
            "preset_threshold": args.preset_threshold, "prompts": args.prompts,
            "temperatures": {}}
  load_before, started = os.getloadavg(), time.time()
  for temperature in args.temperatures:
    draft, params, losses = train_head(pair, rows, args, temperature)
    tables = calibration_tables(pair, draft, params, rows, args, temperature)
    if args.save_dir:
      save_draft(draft, params, os.path.join(args.save_dir, f"head_T{temperature:g}"))
    png = f"{os.path.splitext(args.out)[0]}_T{temperature:g}.png"
    calibration.write_reliability_diagram(
        png, tables, f"T={temperature:g}: {pair['draft_stage']} + head, "
                     f"{args.head_steps} steps, {args.calibration_rows} held-out rows")
    timing = timed_rows(pair, draft, params, args, temperature)
    report["temperatures"][f"{temperature:g}"] = {
        "head_bce_first_last": [losses[0], losses[-1]],
        "ece": {name: table.ece for name, table in tables.items()},
        "calibration": {name: table.as_dict() for name, table in tables.items()},
        "diagram": os.path.basename(png), "rows": timing["rows"], "plain": timing["plain"],
        "interference": timing["interference"],
        "verdict": verdict(timing["rows"], args.preset_threshold)}
  report["host"] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "pinned": pinned,
                    "load_average_before": list(load_before),
                    "load_average_after": list(os.getloadavg()),
                    "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                    "seconds": time.time() - started}
  return report


def main(argv=None) -> None:
  try:
    args = parse(argv)
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
  report = run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  for temperature, entry in report["temperatures"].items():
    print(f"T={temperature}: ECE " + ", ".join(f"{k} {v:.3f}" for k, v in entry["ece"].items()))
    for row in entry["rows"]:
      low, high = row["end_to_end_speedup_range"]
      print(f"  {label(row):55s} end to end {row['end_to_end_speedup']:.3f} "
            f"[{low:.3f}, {high:.3f}], tau {row['timed_tau']:.2f}, "
            f"proposal {row['mean_proposal']:.2f}")
    v = entry["verdict"]
    print(f"  head rule reaches best fixed: {v['head_reaches_fixed']} "
          f"({v['head_minus_fixed']:+.3f}); preset: {v.get('preset_reaches_fixed')}")
  print(f"host load {report['host']['load_average_before']} -> "
        f"{report['host']['load_average_after']}; wrote {args.out}")


if __name__ == "__main__":
  main()
