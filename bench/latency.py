"""What one request waits: per-request latency of plain and speculative decoding at batch 1.

Every request goes through the public calls a user makes, `plain.decode` and
`speculative.speculative_decode`, one prompt at a time, and is timed from the call to its
result on the host (`jax.block_until_ready`): dispatch, the argument checks, the encoder and
prefill, and every decoding step included. speed.measure_speed's figures leave dispatch out
(one call there holds all its prompts); this is the figure a user serving single requests
sees. Both functions are compiled before the timing (every prompt has one padded shape).

For each temperature, pass and prompt the plain request and the speculative ones run back to
back, in an order that alternates from prompt to prompt, so the host's contention falls on
all of them alike. Reported per decoder: median and 90th percentile of the request latency
over every (prompt, pass), the median per-token latency, and tau; per speculative decoder
the ratio of medians (plain / speculative: the speedup of a typical request) and the median
over requests of each request's plain / speculative latency. The host: its CPU, the pinned
cores, the load average before and after.

The pair: a finished main job's target and distilled draft on its test prompts
(`--gin_file=gin/runs/demo.gin`, the README's main command writes them), or, without one,
the run file's model shapes with random weights on random prompts (`"weights": "random"` in
the output: a random draft is rarely accepted, so those numbers show the costs, not a
distilled draft's speedup).

  python bench/latency.py --out docs/benchmarks/latency.json [--gin_file=gin/runs/demo.gin]
      [--prompts 64] [--passes 2] [--gammas 3,5] [--temperatures 0,1] [--cpus 1]
      [--draft_stage distill_supervised_kd] [--random] [--smoke]

Writes --out (JSON) and a PNG beside it (the latency's distribution per decoder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core.validation import check_positive_int  # noqa: E402
from distillspec_jax.evaluation.pinning import pin_cores  # noqa: E402  (no JAX computation yet)
import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: random weights of the smoke run's shapes (smoke.PIPELINE_BINDINGS), two requests.
SMOKE = dict(prompts=2, passes=1, gammas="2", temperatures="0", random=True, cpus=0)


def cpu_name() -> str:
  """The CPU's model name (Linux), else platform.processor()."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def percentile(values, q: float) -> float:
  """The q-quantile (0..1) of `values`, linear between order statistics."""
  import numpy as np
  return float(np.quantile(np.asarray(values, np.float64), q))


def summarise(latencies: dict, tokens: dict, tau: dict) -> dict:
  """Per decoder: {median_s, p90_s, per_token_median_s, mean_tokens, requests, tau}; per
  speculative decoder also the speedups against "plain" (ratio of medians, and the median
  of each request's plain / speculative latency).

  latencies, tokens: decoder name -> [request] (the same requests, in the same order, for
  every decoder); tau: decoder name -> tau (None for plain).
  """
  out = {}
  for name, seconds in latencies.items():
    per_token = [s / max(n, 1) for s, n in zip(seconds, tokens[name])]
    out[name] = {"median_s": statistics.median(seconds), "p90_s": percentile(seconds, 0.9),
                 "per_token_median_s": statistics.median(per_token),
                 "mean_tokens": statistics.fmean(tokens[name]), "requests": len(seconds),
                 "tau": tau.get(name)}
    if name != "plain":
      plain = latencies["plain"]
      out[name]["speedup_of_medians"] = statistics.median(plain) / statistics.median(seconds)
      out[name]["median_request_speedup"] = statistics.median(
          p / s for p, s in zip(plain, seconds))
      out[name]["p90_speedup"] = percentile(plain, 0.9) / percentile(seconds, 0.9)
  return out


def load_pair(args) -> dict:
  """{"target", "target_params", "draft", "draft_params", "prompts" [N, P], "weights",
  "max_new_tokens", "draft_stage", "models"} of the run file's job: its checkpoints and test prompts
  when the run has them (and --random is not given), else random weights and prompts."""
  import jax
  import numpy as np
  from distillspec_jax.main import load_pipeline
  from distillspec_jax.models.config import model_config
  from distillspec_jax.models.model import Model
  from distillspec_jax.studies import pipeline

  config = load_pipeline(args.gin_args)
  stage = args.draft_stage or config.distill_stages[-1]
  trained = all(os.path.isdir(config.stage_dir(s)) for s in ("vocab", "target", stage))
  if trained and not args.random:
    target, draft = pipeline.models(config)
    draft = pipeline.distilled_draft(config, stage, draft)  # with its acceptance head, if any
    prompts = pipeline.heldout_prompts(config, args.prompts, split="test",
                                       task=config.eval_task or config.task).prompts
    if len(prompts) < args.prompts:
      raise ValueError(f"--prompts={args.prompts} but the test split holds {len(prompts)}; "
                       "lower --prompts.")
    return dict(target=target, target_params=pipeline.load_params(config, "target", target),
                draft=draft, draft_params=pipeline.load_params(config, stage, draft),
                prompts=np.asarray(prompts), weights=f"trained ({config.run_dir})",
                max_new_tokens=config.max_new_tokens, draft_stage=stage,
                models=[config.target_model, config.draft_model])
  target = Model(model_config(config.target_model))
  draft = Model(model_config(config.draft_model))
  length = config.task_feature_lengths["inputs"]
  prompts = np.random.default_rng(0).integers(3, target.config.vocab_size,
                                              (args.prompts, length)).astype(np.int32)
  return dict(target=target, target_params=target.init(jax.random.PRNGKey(0)), draft=draft,
              draft_params=draft.init(jax.random.PRNGKey(1)), prompts=prompts,
              weights="random", max_new_tokens=config.max_new_tokens, draft_stage=None,
              models=[config.target_model, config.draft_model])


def decoders(pair: dict, gammas, temperature: float) -> dict:
  """name -> request(prompt [1, P], rng) -> (tokens produced, produced, target calls)."""
  import jax
  from distillspec_jax.decoding.plain import SamplingConfig, decode, prompt_inputs
  from distillspec_jax.decoding.speculative import speculative_decode
  target, draft = pair["target"], pair["draft"]
  sampling = SamplingConfig(float(temperature))
  new = pair["max_new_tokens"]

  def plain(prompt, rng):
    result = jax.block_until_ready(decode(target, pair["target_params"], max_new_tokens=new,
                                          sampling=sampling, rng=rng,
                                          **prompt_inputs(target, prompt)))
    return int(result.lengths[0]), None, None

  def speculative(gamma):
    def request(prompt, rng):
      result = jax.block_until_ready(speculative_decode(
          target, pair["target_params"], draft, pair["draft_params"], max_new_tokens=new,
          gamma=gamma, sampling=sampling, rng=rng, **prompt_inputs(target, prompt)))
      return (int(result.lengths[0]), int(result.produced[0]), int(result.target_calls[0]))
    return request

  return {"plain": plain, **{f"speculative_gamma{g}": speculative(g) for g in gammas}}


def time_requests(pair: dict, gammas, temperature: float, passes: int) -> dict:
  """Every request's latency at one temperature: {"latencies", "tokens", "tau"} (see
  `summarise`). Request i of a pass uses key fold_in(PRNGKey(pass), i) for every decoder."""
  import jax
  functions = decoders(pair, gammas, temperature)
  names = list(functions)
  prompts = pair["prompts"]
  for fn in functions.values():  # compiles (one shape for every prompt)
    fn(prompts[:1], jax.random.PRNGKey(0))
  latencies = {name: [] for name in names}
  tokens = {name: [] for name in names}
  counts = {name: [0, 0] for name in names}  # produced, target calls
  for index in range(passes):
    for i in range(len(prompts)):
      rng = jax.random.fold_in(jax.random.PRNGKey(index), i)
      order = names if (index * len(prompts) + i) % 2 == 0 else names[::-1]
      for name in order:
        start = time.perf_counter()
        length, produced, calls = functions[name](prompts[i:i + 1], rng)
        latencies[name].append(time.perf_counter() - start)
        tokens[name].append(length)
        if calls is not None:
          counts[name][0] += produced
          counts[name][1] += calls
  tau = {name: (p / c if c else None) for name, (p, c) in counts.items()}
  return {"latencies": latencies, "tokens": tokens, "tau": tau}


def plot(results: dict, path: str, title: str) -> None:
  """One panel per temperature: each decoder's request latencies as a cumulative share."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
  for axis, (temperature, result) in zip(axes[0], results.items()):
    for name, seconds in result["latencies"].items():
      ms = np.sort(np.asarray(seconds)) * 1e3
      axis.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=name)
    axis.axhline(0.5, color="gray", lw=0.6, ls=":")
    axis.axhline(0.9, color="gray", lw=0.6, ls=":")
    axis.set_xlabel("request latency (ms, dispatch included)")
    axis.set_ylabel("share of requests")
    axis.set_title(f"T = {temperature}")
    axis.legend(fontsize=8)
  figure.suptitle(title, fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="JSON file to write (PNG beside it).")
  parser.add_argument("--prompts", type=int, default=64, help="requests per pass (>= 1)")
  parser.add_argument("--passes", type=int, default=2, help="passes over the prompts")
  parser.add_argument("--gammas", default="3,5", help="speculative decoders' gammas")
  parser.add_argument("--temperatures", default="0,1")
  parser.add_argument("--draft_stage", default=None,
                      help="the run's draft stage (default: its last distillation stage)")
  parser.add_argument("--random", action="store_true",
                      help="random weights even when the run has checkpoints")
  parser.add_argument("--cpus", type=int, default=1,
                      help="cores to run on (default 1; 0: no pinning). See pinning.pin_cores.")
  args, gin_args = smoke.parse(parser, argv, SMOKE, known=True)
  default = smoke.PIPELINE_BINDINGS if args.smoke else ("--gin_file=gin/runs/demo.gin",)
  args.gin_args = gin_args or list(default)
  check_positive_int(args.prompts, "--prompts")
  check_positive_int(args.passes, "--passes")
  try:
    args.gammas = [int(g) for g in args.gammas.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
  except ValueError:
    raise ValueError(f"--gammas={args.gammas!r} / --temperatures={args.temperatures!r}: pass "
                     "comma-separated numbers, e.g. --gammas 3,5 --temperatures 0,1.") from None
  for gamma in args.gammas:
    check_positive_int(gamma, "--gammas entry")
  return args


def main(argv=None) -> None:
  args = parse(argv)
  pinned = pin_cores(args.cpus)
  import jax
  pair = load_pair(args)
  load_before = os.getloadavg()
  started = time.time()
  results = {f"{t:g}": time_requests(pair, args.gammas, t, args.passes)
             for t in args.temperatures}
  report = {
      "weights": pair["weights"], "target_model": pair["models"][0],
      "draft_model": pair["models"][1], "draft_stage": pair["draft_stage"],
      "prompts": int(len(pair["prompts"])),
      "passes": args.passes, "max_new_tokens": pair["max_new_tokens"], "gammas": args.gammas,
      "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "pinned": pinned,
               "load_average_before": list(load_before),
               "load_average_after": list(os.getloadavg()),
               "backend": jax.default_backend(), "seconds": time.time() - started,
               "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started))},
      "by_temperature": {t: summarise(r["latencies"], r["tokens"], r["tau"])
                         for t, r in results.items()},
      "latencies_s": {t: r["latencies"] for t, r in results.items()}}
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  title = (f"{report['weights']} weights, {report['prompts']} prompts x {args.passes} passes, "
           f"batch 1, {report['host']['cpu']}, pinned {pinned}")
  plot(results, os.path.splitext(args.out)[0] + ".png", title)
  for temperature, rows in report["by_temperature"].items():
    print(f"T = {temperature}:")
    for name, row in rows.items():
      line = (f"  {name:22s} median {row['median_s'] * 1e3:7.2f} ms, p90 "
              f"{row['p90_s'] * 1e3:7.2f} ms, {row['per_token_median_s'] * 1e3:6.3f} ms/token")
      if name != "plain":
        line += (f", tau {row['tau']:.2f}, speedup of medians {row['speedup_of_medians']:.3f}"
                 f", median request {row['median_request_speedup']:.3f}")
      print(line)
  print(f"weights: {report['weights']}; host: {report['host']['cpu']}, pinned {pinned}, "
        f"load average {load_before[0]:.2f} before, {report['host']['load_average_after'][0]:.2f}"
        " after")
  print("wrote", args.out)


if __name__ == "__main__":
  main()
