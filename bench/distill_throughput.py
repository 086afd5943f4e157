"""Distillation throughput of the smoke pair (smoke_target -> demo_draft).

  python bench/distill_throughput.py --out /tmp/distill_throughput.json [--recipe gkd]

Times the real jitted train step (`trainer.make_train_step`, sharded, state donated) after
compilation, and separately the batch-making part of the step (source draw + sampling from
the draft or target via `decoding.decode`), and writes
{"tokens_per_s": loss-weighted tokens trained per second, "sampling_share": sampling time /
step time, "recipe": ..., ...}. Random-init models: throughput does not depend on weights
except through sample lengths (EOS), so `mean_tokens_per_row` is reported too.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distillspec_jax import distillation, partitioning, trainer  # noqa: E402
from distillspec_jax.models import Model  # noqa: E402


def _block(tree):
  return jax.block_until_ready(tree)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--recipe", default="gkd", choices=sorted(distillation.RECIPES))
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--input_length", type=int, default=48)
  parser.add_argument("--target_length", type=int, default=48)
  args = parser.parse_args(argv)

  target, draft = Model.from_name("smoke_target"), Model.from_name("demo_draft")
  dc = distillation.DistillationConfig.from_recipe(args.recipe)
  objective = distillation.DistillationObjective(target, draft, dc)
  config = trainer.TrainConfig(model_dir="/tmp/unused", train_steps=args.steps,
                               batch_size=args.batch_size, optimizer="adafactor")
  mesh = partitioning.make_mesh()
  step_fn, state_shardings, frozen_shardings = trainer.make_train_step(
      objective, config.optimizer_spec, mesh)
  optimizer = config.optimizer_spec.make()
  params = draft.init(jax.random.PRNGKey(1))
  state = jax.device_put(trainer.TrainState(step=jnp.int32(0), params=params,
                                            opt_state=optimizer.init(params)), state_shardings)
  frozen = jax.device_put({"target": target.init(jax.random.PRNGKey(0))}, frozen_shardings)
  data = trainer.SyntheticData(args.batch_size, input_length=args.input_length,
                               target_length=args.target_length,
                               vocab_size=target.config.vocab_size)
  batches = [partitioning.shard_batch(data.batch_at(s), mesh) for s in range(args.steps + 1)]
  base = jax.random.PRNGKey(0)

  t0 = time.perf_counter()
  state, metrics = _block(step_fn(state, batches[0], base, frozen))  # compile
  compile_s = time.perf_counter() - t0
  tokens, t0 = 0.0, time.perf_counter()
  for s in range(1, args.steps + 1):
    state, metrics = step_fn(state, batches[s], jax.random.fold_in(base, s), frozen)
    tokens += float(metrics["num_tokens"])  # syncs each step: per-step timing is what we want
  step_s = (time.perf_counter() - t0) / args.steps

  make_batch = jax.jit(objective.make_batch)
  _block(make_batch(state.params, frozen, batches[0], base))  # compile
  t0 = time.perf_counter()
  for s in range(1, args.steps + 1):
    _block(make_batch(state.params, frozen, batches[s], jax.random.fold_in(base, s)))
  sample_s = (time.perf_counter() - t0) / args.steps

  result = {
      "tokens_per_s": tokens / (step_s * args.steps),
      "sampling_share": min(sample_s / step_s, 1.0),
      "recipe": args.recipe,
      "step_ms": 1000 * step_s,
      "sampling_ms": 1000 * sample_s,
      "compile_s": compile_s,
      "mean_tokens_per_row": tokens / (args.steps * args.batch_size),
      "batch_size": args.batch_size,
      "lengths": {"inputs": args.input_length, "targets": args.target_length},
      "models": {"target": "smoke_target", "draft": "demo_draft",
                 "target_params": target.num_params(), "draft_params": draft.num_params()},
      "devices": [str(d) for d in jax.devices()],
  }
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
