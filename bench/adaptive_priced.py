"""Draft-length rules priced by this machine's per-call costs, with no timing noise.

Each rule decodes the run's test prompts once, untimed (`speculative_decode`, batched; a
row's rounds are the same alone as in a batch), and every round of every row is priced as
that row alone would pay for it, in target steps, by `--costs_json` (a
bench/verification_cost.py output from this machine): a round proposing m tokens with c
draft calls costs (draft_2 + (c - 1) draft_1 + verification(m + 1)) / step, plus
`--adaptive_overhead` steps under an adaptive rule (its draft loop and verification by width;
bench/adaptive_gamma.py times it). A fixed gamma makes gamma calls; an adaptive round that
stops early one more than it proposes (the call that found the next token not worth
proposing): each adaptive row also reports its speedup without that call, what a stop signal
read before the call would give. Plain decoding pays one step per token after the first, so the decode-phase
speedup is the rounds' tokens over their steps.

At T = 0 beside the rules: the per-round oracle, which knows each round's outcome and
proposes the length with the most tokens per step: the ceiling of any stop signal under
these prices. Greedy speculative decoding outputs the target's greedy text y and a round at
position t tests the draft's greedy tokens after y[:t], so one teacher-forced pass of the
draft over [prompt, y] says which tokens any round would accept
(tests/test_adaptive_priced.py checks it against the engine's rounds).

  python bench/adaptive_priced.py --out priced.json --costs_json verification_cost.json \\
      [--gin_file=gin/runs/demo.gin] [--draft_stage distill_supervised_kd] \\
      [--signal top_probability|acceptance_head] [--gamma_max 7] [--temperatures 0,1] \\
      [--thresholds 0.3,0.5,0.7,0.9] [--adaptive_overhead 0.1] [--prompts 128] [--smoke]

--smoke: random weights of the smoke run's shapes, a few prompts, gamma_max 2, unit prices
(numbers mean nothing). Prints one line per rule and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from distillspec_jax.core.validation import check_positive_int  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: gamma_max 2 runs the same kinds of rule (fixed gammas 1..gamma_max, the adaptive
# rules and the oracle at gamma_max) as a larger one, with one speculative program fewer to
# compile than 3.
SMOKE = dict(gamma_max=2, thresholds="0.5", temperatures="0", prompts=2, random=True)


@dataclasses.dataclass(frozen=True)
class Prices:
  """A round's price in target steps: draft_first (the 2-token first call), draft_step,
  verification[w] for w = 1..gamma_max + 1 (index w - 1), overhead (adaptive rounds only)."""

  draft_first: float
  draft_step: float
  verification: tuple
  overhead: float = 0.0

  def round(self, proposed, calls, adaptive: bool):
    """Steps of rounds proposing `proposed` tokens with `calls` draft calls (arrays)."""
    width_price = np.asarray(self.verification)[np.asarray(proposed)]  # width proposed + 1
    return (self.draft_first + (calls - 1) * self.draft_step + width_price
            + (self.overhead if adaptive else 0.0))


def read_prices(path, gamma_max: int, overhead: float) -> Prices:
  """Prices of a bench/verification_cost.py JSON, or unit prices (every round one step, so
  the speedup is tau) without one."""
  if path is None:
    return Prices(0.0, 0.0, (1.0,) * (gamma_max + 1), overhead)
  with open(path) as f:
    measured = json.load(f)
  step = measured["target"]["1"]["median_s"]
  widths = sorted(int(w) for w in measured["target"])
  if widths[-1] < gamma_max + 1:
    raise ValueError(f"--costs_json={path!r} prices widths up to {widths[-1]}; --gamma_max "
                     f"{gamma_max} needs {gamma_max + 1}: rerun bench/verification_cost.py "
                     f"with --max_width {gamma_max + 1}.")
  return Prices(measured["draft"]["2"]["median_s"] / step,
                measured["draft"]["1"]["median_s"] / step,
                tuple(measured["target"][str(w)]["median_s"] / step
                      for w in range(1, gamma_max + 2)), overhead)


def greedy_acceptance(pair: dict, prompts: int) -> dict:
  """{"accepted": [N, L] bool, "lengths": [N]}: the target's greedy output on the first
  `prompts` prompts (encoder-decoder pairs) and, per position, whether the draft's greedy
  token after that output's prefix is the target's (one teacher-forced pass)."""
  import jax.numpy as jnp
  from distillspec_jax.decoding.plain import decode, prompt_inputs
  from distillspec_jax.distill.objectives import training_features
  target, draft = pair["target"], pair["draft"]
  chosen = np.asarray(pair["prompts"][:prompts])
  out = decode(target, pair["target_params"], max_new_tokens=pair["max_new_tokens"],
               **prompt_inputs(target, chosen))
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  weights = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.float32)
  batch = {"encoder_input_tokens": chosen, "decoder_target_tokens": tokens,
           "decoder_input_tokens": np.pad(tokens[:, :-1], ((0, 0), (1, 0))),
           "decoder_loss_weights": weights}
  logits = draft.logits(pair["draft_params"], training_features(batch, draft))
  return {"accepted": np.asarray(jnp.argmax(logits, -1)) == tokens, "lengths": lengths}


def engine_rounds(pair: dict, rule, gamma: int, temperature: float, prompts: int) -> dict:
  """{"proposed_per_round": [N, R] (-1 after a row's last round), "produced": [N]} of one
  untimed `speculative_decode` of the first `prompts` prompts under `rule`."""
  import jax
  from distillspec_jax.decoding.plain import SamplingConfig, prompt_inputs
  from distillspec_jax.decoding.speculative import speculative_decode
  result = speculative_decode(
      pair["target"], pair["target_params"], pair["draft"], pair["draft_params"],
      max_new_tokens=pair["max_new_tokens"], gamma=gamma, sampling=SamplingConfig(temperature),
      rng=jax.random.PRNGKey(0), draft_length=rule,
      **prompt_inputs(pair["target"], pair["prompts"][:prompts]))
  return {"proposed_per_round": np.asarray(result.proposed_per_round),
          "produced": np.asarray(result.produced)}


def price_rounds(rounds: dict, rule, gamma: int, prices: Prices) -> dict:
  """Totals {"tokens", "rounds", "steps", "proposed", "calls"} of `engine_rounds`' rounds,
  each priced as its row alone pays for it."""
  proposed = rounds["proposed_per_round"]
  held = proposed >= 0
  calls = np.minimum(proposed + 1, gamma) if rule.adaptive else np.full_like(proposed, gamma)
  steps = prices.round(np.where(held, proposed, 0), calls, rule.adaptive)
  return dict(tokens=int(np.sum(rounds["produced"])), rounds=int(np.sum(held)),
              steps=float(np.sum(np.where(held, steps, 0.0))),
              proposed=int(np.sum(proposed[held])), calls=int(np.sum(calls[held])))


def oracle(arrays: dict, gamma: int, prices: Prices) -> dict:
  """The per-round oracle's totals: each round proposes the length (1..gamma, the fixed
  rule's calls) with the most tokens per step, knowing which tokens the target accepts."""
  accepted, lengths = np.pad(arrays["accepted"], ((0, 0), (0, gamma + 1))), arrays["lengths"]
  totals = dict(tokens=0, rounds=0, steps=0.0, proposed=0, calls=0)
  for row, length in enumerate(lengths):
    position = 1
    while position < length:
      def value(k):
        run = int(np.argmin(np.append(accepted[row, position:position + k], False)))
        made = min(run + 1, length - position)
        return made / float(prices.round(k, k, False)), made, k
      _, made, k = max(value(k) for k in range(1, gamma + 1))
      totals["tokens"] += made
      totals["rounds"] += 1
      totals["steps"] += float(prices.round(k, k, False))
      totals["proposed"] += k
      totals["calls"] += k
      position += made
  return totals


def summary(name: str, temperature: float, totals: dict) -> dict:
  rounds = max(totals["rounds"], 1)
  return {"rule": name, "temperature": temperature,
          "speedup": float(totals["tokens"] / max(totals["steps"], 1e-9)),
          "tau": totals["tokens"] / rounds, "mean_proposal": totals["proposed"] / rounds,
          "calls_per_round": totals["calls"] / rounds,
          "steps_per_round": totals["steps"] / rounds, "rounds": int(totals["rounds"]),
          "tokens": int(totals["tokens"])}


def rules(args) -> list:
  """(name, DraftLength, gamma) of every priced rule: each fixed gamma up to gamma_max,
  confidence and cumulative at every threshold, the cost rule when prices are given."""
  from distillspec_jax.decoding.speculative import DraftLength
  out = [(f"gamma {g}", DraftLength(), g) for g in range(1, args.gamma_max + 1)]
  out += [(f"{kind} >= {t:g}", DraftLength(kind, t, signal=args.signal), args.gamma_max)
          for kind in ("confidence", "cumulative") for t in args.thresholds]
  if args.costs_json:
    from adaptive_gamma import cost_rule  # bench/adaptive_gamma.py
    priced = dataclasses.replace(cost_rule(args.costs_json, args.gamma_max), signal=args.signal)
    out.append(("cost", priced, args.gamma_max))
  return out


def parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--costs_json", default=None,
                      help="bench/verification_cost.py's JSON (default: unit prices)")
  parser.add_argument("--draft_stage", default=None,
                      help="the run's draft stage (default: its last distillation stage)")
  parser.add_argument("--signal", default="top_probability",
                      choices=("top_probability", "acceptance_head"))
  parser.add_argument("--gamma_max", type=int, default=7)
  parser.add_argument("--thresholds", default="0.3,0.5,0.7,0.9")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--adaptive_overhead", type=float, default=0.0,
                      help="target steps an adaptive round pays beyond its calls and width")
  parser.add_argument("--prompts", type=int, default=128)
  parser.add_argument("--random", action="store_true", help="random weights (smoke)")
  args, gin_args = smoke.parse(parser, argv, SMOKE, known=True)
  args.gin_args = gin_args or list(smoke.PIPELINE_BINDINGS if args.smoke
                                   else ("--gin_file=gin/runs/demo.gin",))
  try:
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
  except ValueError:
    raise ValueError(f"--thresholds={args.thresholds!r}, --temperatures="
                     f"{args.temperatures!r}: pass comma-separated numbers, e.g. 0.3,0.5.") from None
  check_positive_int(args.gamma_max, "--gamma_max")
  check_positive_int(args.prompts, "--prompts")
  if not args.adaptive_overhead >= 0.0:
    raise ValueError(f"--adaptive_overhead={args.adaptive_overhead!r}: pass steps >= 0.")
  args.prices = read_prices(args.costs_json, args.gamma_max, args.adaptive_overhead)
  return args


def priced_rows(pair: dict, args) -> list:
  """summary rows of every rule at every temperature, and the oracle's at T = 0."""
  from tqdm import tqdm
  plan = [(t, rule) for t in args.temperatures for rule in rules(args)]
  rows = []
  for temperature, (name, rule, gamma) in tqdm(plan, desc="rules", unit="rule"):
    totals = price_rounds(engine_rounds(pair, rule, gamma, temperature, args.prompts), rule,
                          gamma, args.prices)
    row = summary(name, temperature, totals)
    if rule.adaptive:  # what a signal read before the call (a lookahead) would save
      free = totals["steps"] - (totals["calls"] - totals["proposed"]) * args.prices.draft_step
      row["speedup_without_deciding_call"] = float(totals["tokens"] / max(free, 1e-9))
    rows.append(row)
  if 0.0 in args.temperatures:
    rows.append(summary("oracle (per round, knowing the outcome)", 0.0,
                        oracle(greedy_acceptance(pair, args.prompts), args.gamma_max,
                               args.prices)))
  return rows


def main(argv=None) -> None:
  args = parse(argv)
  from latency import load_pair  # bench/latency.py
  pair = load_pair(args)
  if 0.0 in args.temperatures and not pair["target"].is_encoder_decoder:
    raise ValueError(f"{pair['models'][0]} is decoder-only; the T = 0 oracle reads "
                     "teacher-forced rows of encoder-decoder pairs only: drop 0 from "
                     "--temperatures.")
  if args.signal == "acceptance_head" and pair["draft"].acceptance_head is None:
    raise ValueError(f"--signal='acceptance_head' but the draft ({pair['weights']} weights, "
                     f"stage {pair['draft_stage']!r}) has no acceptance head; pass a stage "
                     "trained with one (PipelineConfig.acceptance_head) or drop --signal.")
  rows = priced_rows(pair, args)
  report = {"weights": pair["weights"], "models": pair["models"],
            "draft_stage": pair["draft_stage"], "signal": args.signal,
            "gamma_max": args.gamma_max, "prices": dataclasses.asdict(args.prices),
            "prompts": args.prompts, "rows": rows}
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  for temperature in args.temperatures:
    mine = [r for r in rows if r["temperature"] == temperature]
    best = max((r for r in mine if r["rule"].startswith("gamma ")), key=lambda r: r["speedup"])
    for row in mine:
      print(f"T={temperature:g} {row['rule']:40s} speedup {row['speedup']:.3f} "
            f"({row['speedup'] / best['speedup']:.3f} of the best fixed), tau {row['tau']:.2f}, "
            f"proposal {row['mean_proposal']:.2f}, calls {row['calls_per_round']:.2f}, "
            f"{row['steps_per_round']:.2f} steps a round"
            + (f"; {row['speedup_without_deciding_call'] / best['speedup']:.3f} of the best "
               "fixed without the deciding call" if "speedup_without_deciding_call" in row
               else ""))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  try:
    main()
  except ValueError as error:  # bad arguments: named by the message, no traceback
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
