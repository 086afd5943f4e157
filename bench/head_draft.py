"""A distilled draft head on a target: tau by gamma and temperature, per-call costs, projection.

Trains an EAGLE-3-style head (models/head.py) on the target with the training-time test
(distill/head_objectives.py) through the trainer, then measures with the one engine:

  * tau (tokens per verification round) per gamma and temperature, with its standard error
    over prompts, and the acceptance of each draft position (accepted / proposed);
  * per-call costs, timed here on the same machine: a target step (one token), a verification
    (gamma + 1 tokens) and a head step (one token), medians over turns;
  * the cost-model speedup tau x step / (verification + gamma x head step), and its projection
    to a 32-layer target of the same width: the target step's per-layer cost from timing the
    target with its depth and twice its depth (random weights: cost does not depend on values).

Data: the trainer's synthetic reversal task (random prompts, no files), which the demo-free
smoke run and a random or given target both read.

  python bench/head_draft.py --out head_draft.json [--target_model demo_target]
      [--target_checkpoint PATH] [--train_steps 300] [--unroll_steps GAMMA] [--head_mlp_dim 256]
      [--gammas 5,7] [--temperatures 0,1] [--prompts 32] [--smoke]
  python bench/head_draft.py --out projection.json --from_report runs/demo_head/report.json
      [--target_model demo_target] [--vocab_size N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core.validation import check_grid, check_positive_int  # noqa: E402


def _median_seconds(fn, turns: int) -> dict:
  """Median and [min, max] seconds of `fn()` (already compiled) over `turns` calls."""
  import jax
  seconds = []
  for _ in range(turns):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    seconds.append(time.perf_counter() - start)
  return {"median_s": statistics.median(seconds), "range_s": [min(seconds), max(seconds)]}


def _target_call(model, params, inputs, width, calls, turns) -> dict:
  """Per-call seconds of `width`-token extends of `model` (batch 1)."""
  import jax
  import jax.numpy as jnp
  cache = model.init_cache(params, 1, model.config.max_decode_length,
                           inputs.get("encoder_input_tokens"))

  @jax.jit
  def run(params, cache):
    tokens = jnp.full((1, width), 5, jnp.int32)
    def body(_, cache):
      _, cache = model.extend(params, cache, tokens)
      return cache.replace(positions=cache.positions * 0)
    return jax.lax.fori_loop(0, calls, body, cache).positions
  run(params, cache)
  timed = _median_seconds(lambda: run(params, cache), turns)
  return {"median_s": timed["median_s"] / calls, "range_s": [r / calls for r in
                                                             timed["range_s"]]}


def _call_costs(target, target_params, head, head_params, inputs, widths, calls, turns):
  """Per-call seconds: target extends of each width, a head step (one token, own feature)."""
  import jax
  import jax.numpy as jnp
  from distillspec_jax.decoding import head_draft
  encoder = inputs.get("encoder_input_tokens")
  capacity = target.config.max_decode_length
  out = {f"target_{w}": _target_call(target, target_params, inputs, w, calls, turns)
         for w in widths}
  prompt = jnp.zeros((1, 1), jnp.int32)
  cache = target.init_cache(target_params, 1, capacity, encoder)
  _, state, _ = head_draft.prefill(target, target_params, head, head_params, cache, prompt,
                                   jnp.ones((1,), jnp.int32), encoder, jax.random.PRNGKey(0),
                                   temperature=0.0, width=2, max_length=capacity)
  drafter = head_draft.HeadDrafter(head)

  @jax.jit
  def head_run(params, state):
    token = jnp.full((1, 1), 5, jnp.int32)
    def body(_, state):
      _, state = drafter.extend(params, state, token)
      return state.replace(cache=state.cache.replace(positions=state.cache.positions * 0))
    return jax.lax.fori_loop(0, calls, body, state).own
  head_run(head_params, state)
  timed = _median_seconds(lambda: head_run(head_params, state), turns)
  out["head_1"] = {"median_s": timed["median_s"] / calls,
                   "range_s": [r / calls for r in timed["range_s"]]}
  return out


def _tau_rows(target, target_params, head, head_params, inputs, gammas, temperatures,
              max_new_tokens, seed):
  import jax
  import numpy as np
  from distillspec_jax.decoding.plain import SamplingConfig
  from distillspec_jax.decoding.speculative import speculative_decode
  rows = []
  for gamma in gammas:
    for temperature in temperatures:
      result = speculative_decode(target, target_params, head, head_params, gamma=gamma,
                                  max_new_tokens=max_new_tokens,
                                  sampling=SamplingConfig(temperature),
                                  rng=jax.random.PRNGKey(seed), **inputs)
      calls = np.maximum(np.asarray(result.target_calls), 1)
      per_row = np.asarray(result.produced) / calls
      accepted = np.asarray(result.accepted_per_round)
      proposed = np.asarray(result.proposed_per_round)
      by_position = []
      for j in range(gamma):  # rounds that proposed position j + 1, and accepted it
        tried = proposed > j
        by_position.append(float(np.sum(accepted[tried] > j) / max(np.sum(tried), 1)))
      rows.append({"gamma": gamma, "temperature": temperature,
                   "tau": float(np.sum(result.produced) / np.sum(calls)),
                   "tau_stderr": float(np.std(per_row, ddof=1) / np.sqrt(len(per_row)))
                   if len(per_row) > 1 else 0.0,
                   "acceptance_by_position": by_position})
  return rows


def _deeper_step_cost(config, depth_factor, inputs, calls, turns) -> float:
  """A one-token step of the target's shape with `depth_factor` times its decoder layers."""
  import jax
  from distillspec_jax.models.model import Model
  deeper = Model(config.replace(num_decoder_layers=config.num_decoder_layers * depth_factor))
  params = deeper.init(jax.random.PRNGKey(0))
  return _target_call(deeper, params, inputs, 1, calls, turns)["median_s"]


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from distillspec_jax.distill.head_objectives import (HeadDistillationObjective,
                                                       HeadTrainingConfig)
  from distillspec_jax.distill.objectives import DistillationConfig
  from distillspec_jax.interop.importer import load_checkpoint
  from distillspec_jax.models.head import Head, HeadConfig
  from distillspec_jax.models.model import Model
  from distillspec_jax.training import trainer as T

  gammas = tuple(int(g) for g in args.gammas.split(","))
  unroll = max(gammas) if args.unroll_steps is None else args.unroll_steps
  temperatures = tuple(float(t) for t in args.temperatures.split(","))
  check_grid(gammas, temperatures)
  for name in ("train_steps", "prompts", "turns", "max_new_tokens"):
    check_positive_int(getattr(args, name), f"--{name}")
  target = Model.from_name(args.target_model)
  if args.target_checkpoint:
    target_params = load_checkpoint(args.target_checkpoint, target.config)
  else:
    target_params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, mlp_dim=args.head_mlp_dim))
  decoder_only = not target.is_encoder_decoder
  vocab = target.config.vocab_size
  data = T.SyntheticData(args.batch_size, vocab_size=vocab, decoder_only=decoder_only)
  objective = HeadDistillationObjective(
      target, head, DistillationConfig(lambda1=args.lambda1, lambda2=args.lambda2,
                                       divergence=args.divergence),
      HeadTrainingConfig(unroll))
  with tempfile.TemporaryDirectory() as model_dir:
    config = T.TrainConfig(model_dir=model_dir, train_steps=args.train_steps,
                           batch_size=args.batch_size, optimizer="adamw",
                           learning_rate=args.learning_rate, warmup_steps=0,
                           decay_steps=args.train_steps, save_every=10**9,
                           log_every=max(1, args.train_steps // 5), progress_bar=False)
    trained = T.train(config, objective, lambda: (data.batch_at(s) for s in range(10**9)),
                      frozen_params={"target": target_params},
                      init_params=head.init(jax.random.PRNGKey(1), target_params))
  head_params = trained.state.params
  history = [{k: r[k] for k in ("step", "loss", "predicted_acceptance") if k in r}
             for r in trained.history if "loss" in r]
  prompts = T.SyntheticData(args.prompts, vocab_size=vocab, seed=7).batch_at(0)
  key = "prompt_tokens" if decoder_only else "encoder_input_tokens"
  inputs = {key: jnp.asarray(prompts["encoder_input_tokens"])}
  rows = _tau_rows(target, target_params, head, head_params, inputs, gammas, temperatures,
                   args.max_new_tokens, args.seed)
  single = {key: inputs[key][:1]}
  costs = _call_costs(target, target_params, head, head_params, single,
                      sorted({1} | {g + 1 for g in gammas}), args.calls, args.turns)
  step, head_step = costs["target_1"]["median_s"], costs["head_1"]["median_s"]
  doubled = _deeper_step_cost(target.config, 2, single, args.calls, args.turns)
  per_layer = max(doubled - step, 0.0) / target.config.num_decoder_layers
  step_32 = step + per_layer * (32 - target.config.num_decoder_layers)
  for row in rows:
    g = row["gamma"]
    verification = costs[f"target_{g + 1}"]["median_s"]
    row["cost_model_speedup"] = row["tau"] * step / (verification + g * head_step)
    # A 32-layer target: steps and verifications grow by the per-layer cost, the head not.
    scale = step_32 / step
    row["projected_speedup_32_layers"] = row["tau"] * step_32 / (
        verification * scale + g * head_step)
  return {"target_model": args.target_model, "target_checkpoint": args.target_checkpoint,
          "head_params": head.num_params(), "target_params": target.num_params(),
          "head_mlp_dim": args.head_mlp_dim, "feature_layers": list(head.feature_layers),
          "unroll_steps": unroll, "train_steps": args.train_steps,
          "divergence": args.divergence, "training": history, "rows": rows,
          "per_call_s": costs, "per_layer_step_s": per_layer, "backend": jax.default_backend()}


def project_report(args) -> dict:
  """--from_report: a finished main job's drafts (report.json: tau rows, per-call costs, all
  from one timing) projected to a 32-layer target of the same width. Only the per-layer cost
  is timed here (a one-token step of the target's shape at its depth and at twice it), as a
  ratio: the report's target step and verifications are scaled by it, the drafts' own calls
  not (a draft or head does not grow with the target's depth)."""
  import jax.numpy as jnp
  from distillspec_jax.models.config import model_config
  with open(args.from_report) as f:
    report = json.load(f)
  config = model_config(args.target_model, **(
      {"vocab_size": args.vocab_size} if args.vocab_size else {}))
  single = ({"encoder_input_tokens": jnp.full((1, 8), 5, jnp.int32)}
            if config.kind == "encoder_decoder" else {})
  base = _deeper_step_cost(config, 1, single, args.calls, args.turns)
  doubled = _deeper_step_cost(config, 2, single, args.calls, args.turns)
  layers = config.num_decoder_layers
  scale = (base + max(doubled - base, 0.0) / layers * (32 - layers)) / base
  costs = report["per_call_s"]
  rows = []
  for row in report["draft_rows"]:
    draft = report["drafts"].get(row["draft"])
    g = row["gamma"]
    first = (draft or {}).get("first_call_s", {}).get(str(g))
    verification = costs.get(f"verification_{g}")
    if draft is None or first is None or verification is None:
      continue  # a draft the timing did not price at this gamma
    draft_cost = first + (g - 1) * draft["step_s"]
    rows.append({"draft": row["draft"], "gamma": g, "temperature": row["temperature"],
                 "tau": row["tau"],
                 "cost_model_speedup": row["tau"] * costs["target_step"] / (
                     verification + draft_cost),
                 "projected_speedup_32_layers": row["tau"] * costs["target_step"] * scale / (
                     verification * scale + draft_cost)})
  return {"from_report": args.from_report, "target_model": args.target_model,
          "vocab_size": config.vocab_size, "target_layers": layers, "step_scale_32_layers": scale,
          "timed_step_s": {"depth_1x": base, "depth_2x": doubled}, "rows": rows}


def print_report(report: dict) -> None:
  if "from_report" in report:
    print(f"32-layer step = {report['step_scale_32_layers']:.1f} x the {report['target_layers']}"
          "-layer target's")
    for row in report["rows"]:
      print(f"{row['draft']} gamma {row['gamma']} T {row['temperature']}: tau {row['tau']:.2f}, "
            f"cost model {row['cost_model_speedup']:.2f}x, 32 layers "
            f"{row['projected_speedup_32_layers']:.2f}x")
    return
  costs = report["per_call_s"]
  print(f"head {report['head_params']} params, target {report['target_params']}; "
        f"per call: target step {costs['target_1']['median_s'] * 1e6:.1f} us, head step "
        f"{costs['head_1']['median_s'] * 1e6:.1f} us")
  for row in report["rows"]:
    print(f"gamma {row['gamma']} T {row['temperature']}: tau {row['tau']:.2f} +- "
          f"{row['tau_stderr']:.2f}, cost-model speedup {row['cost_model_speedup']:.2f}, "
          f"32-layer projection {row['projected_speedup_32_layers']:.2f}, acceptance by "
          f"position {[round(a, 2) for a in row['acceptance_by_position']]}")


def parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write.")
  parser.add_argument("--target_model", default="demo_target")
  parser.add_argument("--target_checkpoint", default=None)
  parser.add_argument("--vocab_size", type=int, default=None,
                      help="--from_report: the run's vocabulary size, where it trained its own "
                           "(default: the preset's)")
  parser.add_argument("--head_mlp_dim", type=int, default=256)
  parser.add_argument("--unroll_steps", type=int, default=None,
                      help="training-time test depth (default: the largest of --gammas)")
  parser.add_argument("--divergence", default="fkl")
  parser.add_argument("--lambda1", type=float, default=0.0, help="fixed-data fraction")
  parser.add_argument("--lambda2", type=float, default=0.5, help="on-policy (head) fraction")
  parser.add_argument("--train_steps", type=int, default=300)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--gammas", default="5,7")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--max_new_tokens", type=int, default=16)
  parser.add_argument("--calls", type=int, default=50, help="calls per timed turn")
  parser.add_argument("--turns", type=int, default=7)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--from_report", default=None,
                      help="a finished main job's report.json: project its drafts' measured "
                           "rows to a 32-layer target (times only the per-layer cost)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny target, a few steps, one gamma: seconds")
  args = parser.parse_args(argv)
  if args.smoke:
    args.target_model, args.head_mlp_dim, args.train_steps = "tiny_encoder_decoder", 32, 2
    args.batch_size, args.gammas, args.temperatures = 4, "2", "0,1"
    args.prompts, args.max_new_tokens, args.calls, args.turns = 3, 6, 2, 2
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  report = project_report(args) if args.from_report else run(args)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print_report(report)
  print(f"wrote {args.out}")
  return report


if __name__ == "__main__":
  main()
