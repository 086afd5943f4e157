"""Forward and forward+backward time of a model's teacher-forced loss, and of its gated-GELU
MLP written two ways: the flattened [rows, in] x [in, out] matmul DenseGeneral uses, and a
dot_general contracting x's last axis over [batch, length, in] (the weight gradient then
contracts two batch axes).

  python bench/train_step.py --out /tmp/train_step.json [--model demo_target] [--batch 32]
      [--smoke]

Random weights and tokens (the cost does not depend on them); every time is the fastest of
--repeats calls after one warm-up call, on all cores the process may use. Prints a line per
quantity and writes {"model", "batch", "loss_ms": {"forward", "forward_backward"},
"mlp_ms": {"flattened": {...}, "multi_axis": {...}}}.
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

from distillspec_jax.models.model import Model  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: the demo draft on two 8-token rows, one timed call.
SMOKE = dict(model="demo_draft", batch=2, inputs=8, targets=8, repeats=1)


def fastest_ms(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * min(times)


def mlp_times(batch, length, embed, mlp, repeats):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(keys[0], (batch, length, embed))
  weights = (jax.random.normal(keys[1], (embed, mlp)) * 0.05,
             jax.random.normal(keys[2], (embed, mlp)) * 0.05,
             jax.random.normal(keys[3], (mlp, embed)) * 0.02)

  def flattened(w, x):
    rows = x.reshape(-1, embed)
    hidden = jax.nn.gelu(rows @ w[0], approximate=True) * (rows @ w[1])
    return jnp.sum((hidden @ w[2]) ** 2)

  def multi_axis(w, x):
    dot = lambda a, b: jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))
    hidden = jax.nn.gelu(dot(x, w[0]), approximate=True) * dot(x, w[1])
    return jnp.sum(dot(hidden, w[2]) ** 2)

  return {name: {"forward": fastest_ms(jax.jit(f), weights, x, repeats=repeats),
                 "forward_backward": fastest_ms(jax.jit(jax.grad(f)), weights, x,
                                                repeats=repeats)}
          for name, f in (("flattened", flattened), ("multi_axis", multi_axis))}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--model", default="demo_target")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--inputs", type=int, default=40)
  parser.add_argument("--targets", type=int, default=44)
  parser.add_argument("--repeats", type=int, default=5)
  args = smoke.parse(parser, argv, SMOKE)
  if args.batch < 1 or args.repeats < 1:
    raise SystemExit(f"--batch={args.batch} and --repeats={args.repeats} must be >= 1.")
  model = Model.from_name(args.model)
  params = model.init(jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  batch = {"decoder_input_tokens": jnp.asarray(rng.integers(1, vocab, (args.batch, args.targets)),
                                               jnp.int32)}
  if model.is_encoder_decoder:
    batch["encoder_input_tokens"] = jnp.asarray(
        rng.integers(1, vocab, (args.batch, args.inputs)), jnp.int32)
  targets = jnp.asarray(rng.integers(1, vocab, (args.batch, args.targets)), jnp.int32)

  def loss(p):
    log_probs = jax.nn.log_softmax(model.logits(p, batch))
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], -1))

  out = {"model": args.model, "batch": args.batch, "cpus": len(os.sched_getaffinity(0)),
         "loss_ms": {"forward": fastest_ms(jax.jit(loss), params, repeats=args.repeats),
                     "forward_backward": fastest_ms(jax.jit(jax.value_and_grad(loss)), params,
                                                    repeats=args.repeats)},
         "mlp_ms": mlp_times(args.batch, args.targets, model.config.emb_dim,
                             model.config.mlp_dim, args.repeats)}
  print(f"{args.model} loss, batch {args.batch}: forward {out['loss_ms']['forward']:.1f} ms, "
        f"forward+backward {out['loss_ms']['forward_backward']:.1f} ms")
  for name, times in out["mlp_ms"].items():
    print(f"one MLP block, {name}: forward {times['forward']:.1f} ms, forward+backward "
          f"{times['forward_backward']:.1f} ms")
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
