"""CPU cost of one token draw: `plain.sample_from_probabilities` and `plain.sample_tokens`.

For vocabularies 256 and 32,128 (T5's) and batch 1 and 8, each quantity is timed as a jitted
`lax.fori_loop` of `--draws` draws (a fresh key per draw, every token summed so that none is
dead code, and each draw's input tied to the previous draw so that nothing is hoisted out of
the loop), so the per-call dispatch does not swamp the microsecond kernels; median over
`--repeats` timed calls after one warm-up, reported as microseconds per draw (one draw = one
token for every row of the batch).

  sampler:      sample_from_probabilities(probs, uniforms): uniforms drawn from the draw's
                key, probabilities given.
  sample_tokens: sample_tokens(logits, key, temperature=1): softmax + uniforms + sampler, what
                the engine pays per sampled token.

By default the process is pinned to one core before JAX starts (`--cpus`; 0 = no pinning).

  python bench/sampler.py --out bench_sampler.json [--draws 200] [--repeats 15] [--cpus 1]
      [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import smoke  # noqa: E402  (bench/smoke.py)

VOCABS = (256, 32128)
BATCHES = (1, 8)
# --smoke: two draws, one repeat, the small vocabulary at batch 1.
SMOKE = dict(draws=2, repeats=1, cpus=0, vocabs=(256,), batches=(1,))


def per_draw_seconds(fn, args, draws, repeats):
  import jax
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) / draws


def run(draws: int, repeats: int, vocabs=VOCABS, batches=BATCHES) -> dict:
  import jax
  import jax.numpy as jnp
  from distillspec_jax.decoding import plain

  # The uniforms one draw takes per row: [batch, UNIFORMS_PER_DRAW] (a plain [batch] before
  # the two-level sampler, which this benchmark was first run against).
  per_draw = getattr(plain, "UNIFORMS_PER_DRAW", None)
  uniform_shape = () if per_draw is None else (per_draw,)

  def looped(step):
    def fn(x, key):
      def body(i, total):
        # Tied to the previous draw, so XLA cannot hoist the work on `x` out of the loop (a
        # select the compiler cannot fold: `total` is never negative).
        fresh = jnp.where(total < 0, 2 * x, x)
        return total + jnp.sum(step(fresh, jax.random.fold_in(key, i)))
      return jax.lax.fori_loop(0, draws, body, jnp.int32(0))
    return jax.jit(fn)

  sampler = looped(lambda probs, key: plain.sample_from_probabilities(
      probs, jax.random.uniform(key, probs.shape[:1] + uniform_shape)))
  sample_tokens = looped(lambda logits, key: plain.sample_tokens(logits, key, 1.0))
  rows = []
  for vocab in vocabs:
    for batch in batches:
      logits = 3.0 * jax.random.normal(jax.random.PRNGKey(vocab + batch), (batch, vocab))
      probs = jax.nn.softmax(logits, axis=-1)
      key = jax.random.PRNGKey(0)
      row = dict(vocab=vocab, batch=batch,
                 sampler_us=1e6 * per_draw_seconds(sampler, (probs, key), draws, repeats),
                 sample_tokens_us=1e6 * per_draw_seconds(sample_tokens, (logits, key), draws,
                                                         repeats))
      rows.append(row)
      print(f"vocab {vocab:6d} batch {batch}: sampler {row['sampler_us']:8.2f} us/draw   "
            f"sample_tokens {row['sample_tokens_us']:8.2f} us/draw", flush=True)
  return dict(draws=draws, repeats=repeats, uniform_shape=list(uniform_shape),
              jax_version=jax.__version__, results=rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="bench_sampler.json")
  parser.add_argument("--draws", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--cpus", type=int, default=1)
  parser.set_defaults(vocabs=VOCABS, batches=BATCHES)
  args = smoke.parse(parser, argv, SMOKE)
  from distillspec_jax.evaluation.pinning import pin_cores  # imports no JAX
  pin_cores(args.cpus)
  report = run(args.draws, args.repeats, args.vocabs, args.batches)
  report["cpus"] = args.cpus
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
