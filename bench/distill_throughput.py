"""Distillation throughput of the smoke pair (smoke_target -> demo_draft).

  python bench/distill_throughput.py --out /tmp/distill_throughput.json [--recipe gkd] [--smoke]
  python bench/distill_throughput.py --out cache.json --teacher_cache 32 \
      [--target demo_target] [--target_overrides '{"emb_dim": 512}']

With --teacher_cache K the recipe is SupervisedKD (fixed data) and the same batches are
trained twice, alternately in --rounds rounds: with the live target in the step and from a
top-k teacher cache of K ids (teacher_cache.py, written first for those batches); the JSON
then has "tokens_per_s": {"live_target": ..., "teacher_cache": ...} (medians over rounds,
ranges beside them) and "cache_speedup".

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

from distillspec_jax.distill import objectives  # noqa: E402
from distillspec_jax.distill import teacher_cache  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training import partitioning  # noqa: E402
from distillspec_jax.training import trainer  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: two steps of batch 2 on 8-token rows (one round in --teacher_cache mode).
SMOKE = dict(steps=2, batch_size=2, input_length=8, target_length=8, rounds=1)


def _block(tree):
  return jax.block_until_ready(tree)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--recipe", default="gkd", choices=sorted(objectives.RECIPES))
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--input_length", type=int, default=48)
  parser.add_argument("--target_length", type=int, default=48)
  parser.add_argument("--target", default="smoke_target", help="target preset name")
  parser.add_argument("--draft", default="demo_draft", help="draft preset name")
  parser.add_argument("--target_overrides", default="{}",
                      help="JSON TransformerConfig fields for the target, e.g. a wider one")
  parser.add_argument("--teacher_cache", type=int, default=None, metavar="K",
                      help="also time SupervisedKD from a top-K teacher cache")
  parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (cache mode)")
  args = smoke.parse(parser, argv, SMOKE)

  target = Model.from_name(args.target, **json.loads(args.target_overrides))
  draft = Model.from_name(args.draft)
  if args.teacher_cache is not None:
    return _cache_comparison(args, target, draft)
  dc = objectives.DistillationConfig.from_recipe(args.recipe)
  objective = objectives.DistillationObjective(target, draft, dc)
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
      "models": {"target": args.target, "draft": args.draft,
                 "target_params": target.num_params(), "draft_params": draft.num_params()},
      "devices": [str(d) for d in jax.devices()],
  }
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  return result


def _time_steps(step_fn, state, batches, frozen, base):
  """Seconds per step and trained tokens over batches[1:] (batches[0] compiled first)."""
  state, _ = _block(step_fn(state, batches[0], base, frozen))
  tokens, t0 = 0.0, time.perf_counter()
  for s in range(1, len(batches)):
    state, metrics = step_fn(state, batches[s], jax.random.fold_in(base, s), frozen)
    tokens += float(metrics["num_tokens"])  # syncs each step
  return (time.perf_counter() - t0) / (len(batches) - 1), tokens, state


def _cache_comparison(args, target, draft):
  """SupervisedKD with the live target vs from a top-k cache, on the same batches."""
  import tempfile
  k = teacher_cache.check_k(args.teacher_cache, target.config.vocab_size)
  dc = objectives.DistillationConfig.from_recipe("supervised_kd")
  variants = {"live_target": objectives.DistillationObjective(target, draft, dc),
                "teacher_cache": teacher_cache.CachedTeacherObjective(draft, dc)}
  config = trainer.TrainConfig(model_dir="/tmp/unused", train_steps=args.steps,
                               batch_size=args.batch_size, optimizer="adafactor")
  mesh = partitioning.make_mesh()
  target_params = jax.jit(target.init)(jax.random.PRNGKey(0))
  draft_params = jax.jit(draft.init)(jax.random.PRNGKey(1))
  data = trainer.SyntheticData(args.batch_size, input_length=args.input_length,
                               target_length=args.target_length,
                               vocab_size=target.config.vocab_size)
  rows = [data.batch_at(s) for s in range(args.steps + 1)]
  arrays = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
  with tempfile.TemporaryDirectory() as cache_dir:
    t0 = time.perf_counter()
    manifest = teacher_cache.write_cache(target, target_params, arrays, cache_dir, k=k,
                                         task="synthetic_reverse", lengths={}, progress=False)
    write_s = time.perf_counter() - t0
    cache = teacher_cache.open_cache(cache_dir, target=target, target_params=target_params,
                                     arrays=arrays, k=k, task="synthetic_reverse", lengths={})
    b = args.batch_size
    host = {"live_target": rows,
            "teacher_cache": [{**r, **{n: v[np.arange(s * b, (s + 1) * b)]
                                       for n, v in cache.arrays.items()}}
                              for s, r in enumerate(rows)]}
  base = jax.random.PRNGKey(0)
  optimizer = config.optimizer_spec.make()
  times = {name: [] for name in variants}
  tokens = {}
  compiled = {}
  for name, objective in variants.items():
    compiled[name] = trainer.make_train_step(objective, config.optimizer_spec, mesh)
  for _ in range(args.rounds):
    for name in variants:
      step_fn, state_shardings, frozen_shardings = compiled[name]
      params = jax.tree.map(jnp.copy, draft_params)  # the step donates its state
      state = jax.device_put(trainer.TrainState(step=jnp.int32(0), params=params,
                                                opt_state=optimizer.init(params)),
                             state_shardings)
      frozen = jax.device_put({"target": target_params} if name == "live_target" else {},
                              frozen_shardings)
      batches = [partitioning.shard_batch(h, mesh) for h in host[name]]
      step_s, tokens[name], _ = _time_steps(step_fn, state, batches, frozen, base)
      times[name].append(step_s)
  median = lambda v: float(np.median(v))
  result = {
      "tokens_per_s": {n: tokens[n] / (median(times[n]) * args.steps) for n in variants},
      "tokens_per_s_range": {n: [tokens[n] / (max(times[n]) * args.steps),
                                 tokens[n] / (min(times[n]) * args.steps)] for n in variants},
      "step_ms": {n: 1000 * median(times[n]) for n in variants},
      "recipe": "supervised_kd", "teacher_cache_k": k, "rounds": args.rounds,
      "cache_write_s": write_s, "cache_bytes_per_token": manifest["bytes_per_token"],
      "batch_size": args.batch_size,
      "lengths": {"inputs": args.input_length, "targets": args.target_length},
      "models": {"target": args.target, "target_overrides": json.loads(args.target_overrides),
                 "draft": args.draft, "target_params": target.num_params(),
                 "draft_params": draft.num_params()},
      "devices": [str(d) for d in jax.devices()], "load_average": os.getloadavg(),
  }
  result["cache_speedup"] = (result["tokens_per_s"]["teacher_cache"]
                             / result["tokens_per_s"]["live_target"])
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
