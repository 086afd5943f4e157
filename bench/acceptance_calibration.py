"""The acceptance head against the top probability as the adaptive rules' stop signal.

On a tiny encoder-decoder pair trained here (the target fine-tuned on the synthetic reversal
task, trainer.SyntheticData; the draft distilled from it by `--recipe` with an acceptance head
trained jointly, one draft per temperature, its head learning that temperature's acceptance):

  * calibration at each temperature on held-out rows: both signals' reliability tables and
    expected calibration errors (evaluation/calibration.py), and a reliability diagram PNG;
  * speculative decoding of the held-out prompts with the `confidence` rule at each
    threshold, reading either signal: tau and the mean proposal per round (counts, not
    timings: bench/adaptive_gamma.py times rules on a real pair).

  python bench/acceptance_calibration.py --out docs/benchmarks/acceptance_calibration.json
      [--temperatures 0,1] [--target_steps 400] [--steps 400] [--recipe supervised_kd]
      [--acceptance_weight 1.0] [--head_width 64] [--gamma_max 5]
      [--thresholds 0.3,0.5,0.7,0.9] [--prompts 64] [--smoke]

--smoke: tiny shapes, a few steps, T = 1 only (what the test suite runs). Writes --out (JSON)
and one PNG per temperature beside it (`<out>_T<temperature>.png`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from distillspec_jax.core.validation import check_positive_int  # noqa: E402
from distillspec_jax.decoding.plain import SamplingConfig  # noqa: E402
from distillspec_jax.decoding.speculative import DraftLength, speculative_decode  # noqa: E402
from distillspec_jax.distill.objectives import (RECIPES, DistillationConfig,  # noqa: E402
                                                DistillationObjective, FinetuneObjective)
from distillspec_jax.evaluation import calibration  # noqa: E402
from distillspec_jax.models.acceptance_head import AcceptanceHeadConfig  # noqa: E402
from distillspec_jax.models.config import TransformerConfig  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training.trainer import SyntheticData  # noqa: E402

SMOKE = dict(target_steps=10, steps=10, prompts=8, thresholds=[0.5], head_width=8, vocab=32,
             emb=32, temperatures=[1.0])


def parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write (PNGs beside it)")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--target_steps", type=int, default=400)
  parser.add_argument("--steps", type=int, default=400, help="distillation steps per draft")
  parser.add_argument("--recipe", default="supervised_kd", help=f"one of {sorted(RECIPES)}")
  parser.add_argument("--acceptance_weight", type=float, default=1.0)
  parser.add_argument("--head_width", type=int, default=64)
  parser.add_argument("--gamma_max", type=int, default=5)
  parser.add_argument("--thresholds", default="0.3,0.5,0.7,0.9")
  parser.add_argument("--prompts", type=int, default=64, help="held-out rows")
  parser.add_argument("--vocab", type=int, default=64)
  parser.add_argument("--emb", type=int, default=64, help="the target's width (draft: half)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps")
  args = parser.parse_args(argv)
  try:
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
  except ValueError:
    raise ValueError(f"--temperatures={args.temperatures!r}, --thresholds={args.thresholds!r}:"
                     " pass comma-separated numbers, e.g. --thresholds 0.3,0.5.") from None
  if args.smoke:
    for name, value in SMOKE.items():
      setattr(args, name, value)
  for name in ("target_steps", "steps", "head_width", "gamma_max", "prompts", "vocab", "emb"):
    check_positive_int(getattr(args, name), f"--{name}")
  if args.recipe not in RECIPES:
    raise ValueError(f"--recipe={args.recipe!r}; use one of {sorted(RECIPES)}.")
  for threshold in args.thresholds:
    DraftLength("confidence", threshold)  # refuses a threshold outside [0, 1], naming it
  DistillationConfig(acceptance_weight=args.acceptance_weight)  # refuses a weight < 0
  return args


def _configs(args) -> tuple:
  common = dict(kind="encoder_decoder", vocab_size=args.vocab, head_dim=16, dropout_rate=0.0,
                max_decode_length=64)
  target = TransformerConfig(emb_dim=args.emb, num_heads=4, mlp_dim=4 * args.emb,
                             num_encoder_layers=2, num_decoder_layers=2, **common)
  draft = TransformerConfig(emb_dim=args.emb // 2, num_heads=2, mlp_dim=args.emb,
                            num_encoder_layers=1, num_decoder_layers=1, **common)
  return target, draft


def train(objective, params, data: SyntheticData, steps: int, frozen: dict, seed: int):
  """`steps` Adam steps of `objective` (make_batch, then loss) from `params`."""
  optimizer = optax.adam(3e-3)

  @jax.jit
  def step(params, state, batch, rng):
    features, _ = objective.make_batch(params, frozen, batch, rng)
    grads = jax.grad(lambda p: objective.loss(p, frozen, features)[0])(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = optimizer.init(params)
  for i in range(steps):
    batch = {k: jnp.asarray(v) for k, v in data.batch_at(i).items()}
    params, state = step(params, state, batch, jax.random.PRNGKey(seed * 100003 + i))
  return params


def rule_rows(target, tp, draft, dp, prompts, args, temperature) -> list:
  """tau and the mean proposal of the confidence rule at each threshold, on each signal."""
  rows = []
  for signal in calibration.SIGNALS:
    for threshold in args.thresholds:
      result = speculative_decode(
          target, tp, draft, dp, encoder_input_tokens=prompts, max_new_tokens=16,
          gamma=args.gamma_max, sampling=SamplingConfig(temperature),
          rng=jax.random.PRNGKey(1), draft_length=DraftLength("confidence", threshold,
                                                              signal=signal))
      rounds = int(np.sum(result.target_calls))
      rows.append(dict(signal=signal, threshold=threshold, tau=float(result.block_efficiency),
                       mean_proposal=int(np.sum(result.drafted)) / max(rounds, 1),
                       acceptance_rate=float(result.acceptance_rate)))
  return rows


def run(args) -> dict:
  started = time.time()
  target_config, draft_config = _configs(args)
  target, draft = Model(target_config), Model(
      draft_config, acceptance_head=AcceptanceHeadConfig(args.head_width))
  data = SyntheticData(batch_size=16, vocab_size=args.vocab, seed=0)
  tp = train(FinetuneObjective(target), target.init(jax.random.PRNGKey(0)), data,
             args.target_steps, {}, seed=0)
  held_out = SyntheticData(batch_size=args.prompts, vocab_size=args.vocab, seed=1).batch_at(0)
  held_out = {k: jnp.asarray(v) for k, v in held_out.items()}
  report = {"recipe": args.recipe, "steps": args.steps, "target_steps": args.target_steps,
            "acceptance_weight": args.acceptance_weight, "head_width": args.head_width,
            "gamma_max": args.gamma_max, "held_out_rows": args.prompts, "temperatures": {}}
  for temperature in args.temperatures:
    config = DistillationConfig.from_recipe(
        args.recipe, acceptance_weight=args.acceptance_weight,
        acceptance_temperature=temperature, sampling_temperature=temperature)
    objective = DistillationObjective(target, draft, config)
    dp = train(objective, draft.init(jax.random.PRNGKey(1)), data, args.steps,
               {"target": tp}, seed=1)
    tables = calibration.signal_calibration(target, tp, draft, dp, held_out,
                                            temperature=temperature)
    png = f"{os.path.splitext(args.out)[0]}_T{temperature:g}.png"
    calibration.write_reliability_diagram(
        png, tables, f"T={temperature:g}: {args.recipe}, {args.steps} steps, held-out rows")
    report["temperatures"][f"{temperature:g}"] = {
        "calibration": {name: table.as_dict() for name, table in tables.items()},
        "rules": rule_rows(target, tp, draft, dp, held_out["encoder_input_tokens"], args,
                           temperature),
        "diagram": os.path.basename(png)}
  report["seconds"] = time.time() - started
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
    eces = {name: table["ece"] for name, table in entry["calibration"].items()}
    print(f"T={temperature}: ECE " + ", ".join(f"{k} {v:.3f}" for k, v in eces.items()))
    for row in entry["rules"]:
      print(f"  confidence >= {row['threshold']:g} on {row['signal']:15s} tau {row['tau']:.2f}"
            f", proposal {row['mean_proposal']:.2f}, alpha {row['acceptance_rate']:.3f}")
  print(f"wrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
  main()
