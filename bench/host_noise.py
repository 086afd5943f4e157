"""How contended is this machine right now? Per-call times of a target step and a verification.

Times a one-token step and a (gamma + 1)-token verification of a random-weight target
(`demo_target` by default) in alternating calls of about 5 ms each, on one pinned core, for
`--seconds`, and prints per kind: the fastest call, the 10th, 50th and 90th percentiles, the
share of calls within 10% of the fastest, and interference = median / fastest - 1. That is
the kind of number the main job's report gives for its own timing (docs/speed.md), there
over calls of about 30 ms, so the two differ in size. Run it before timing anything, and
compare its runs over time: on a shared host every measured speedup falls while the
verification's interference is high.

  python bench/host_noise.py --out host_noise.json [--seconds 30] [--gamma 7] [--cpus 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: a fraction of a second of the smoke target's calls, unpinned.
SMOKE = dict(seconds=0.2, gamma=2, cpus=0, target_model="smoke_target")


def summary(seconds_per_extend: list) -> dict:
  """Percentiles (microseconds), the share within 10% of the fastest, and interference."""
  values = sorted(seconds_per_extend)
  count = len(values)
  fastest = values[0]
  at = lambda q: values[min(count - 1, int(q * count))] * 1e6
  return {"calls": count, "fastest_us": fastest * 1e6, "p10_us": at(0.1), "p50_us": at(0.5),
          "p90_us": at(0.9),
          "within_10_percent": sum(v <= 1.1 * fastest for v in values) / count,
          "interference": at(0.5) / (fastest * 1e6) - 1}


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  from tqdm.auto import tqdm

  from distillspec_jax.models.model import Model
  from distillspec_jax.evaluation.pinning import machine_info
  from distillspec_jax.evaluation.speed import per_call_function, window_seconds

  target = Model.from_name(args.target_model)
  params = target.init(jax.random.PRNGKey(0))
  inputs = {"encoder_input_tokens": jnp.full((1, 40), 5, jnp.int32)}
  kinds = {"target_step": 1, f"verification_{args.gamma}": args.gamma + 1}
  functions = {name: per_call_function(target, params, inputs, 1, width, 0.005, windows=1)
               for name, width in kinds.items()}
  times = {name: [] for name in kinds}
  start = time.perf_counter()
  with tqdm(total=args.seconds, desc="host noise", unit="s", dynamic_ncols=True) as bar:
    while (elapsed := time.perf_counter() - start) < args.seconds:
      for name, (fn, extends) in functions.items():
        _, stamps = jax.block_until_ready(fn())
        times[name].append(float(window_seconds(stamps).sum()) / extends)
      bar.n = min(args.seconds, round(elapsed, 1))
      bar.refresh()
  return {"machine": machine_info(), "target_model": args.target_model,
          "seconds": args.seconds, **{name: summary(v) for name, v in times.items()}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="host_noise.json")
  parser.add_argument("--seconds", type=float, default=30.0)
  parser.add_argument("--gamma", type=int, default=7)
  parser.add_argument("--cpus", type=int, default=1)
  parser.add_argument("--target_model", default="demo_target")
  args = smoke.parse(parser, argv, SMOKE)
  if args.seconds <= 0:
    parser.error(f"--seconds={args.seconds} must be > 0")
  if args.gamma < 1:
    parser.error(f"--gamma={args.gamma} must be >= 1")
  pin_cores(args.cpus)
  report = run(args)
  for name in ("target_step", f"verification_{args.gamma}"):
    s = report[name]
    print(f"{name}: fastest {s['fastest_us']:.0f} us, p10 {s['p10_us']:.0f}, p50 "
          f"{s['p50_us']:.0f}, p90 {s['p90_us']:.0f}; {s['within_10_percent']:.1%} of "
          f"{s['calls']} calls within 10% of the fastest; interference {s['interference']:.0%}")
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
