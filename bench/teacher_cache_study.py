"""tau of SupervisedKD drafts distilled from a top-k teacher cache against the live target.

  python bench/teacher_cache_study.py --out runs/teacher_cache_study/study.json \
      [--source runs/demo] [--steps 500] [--ks 8 32 256]
  python bench/teacher_cache_study.py --smoke --out /tmp/study.json [--source RUN_DIR]

Starts from a finished demo job (`--source`, read only): its vocab, target and draft_raw
stages are copied into `<work_dir>/<variant>/`, then each variant runs the main job's
distill_supervised_kd stage with the demo's settings and `--steps` distillation steps:
"live" against the running target, "k<K>" from a teacher cache of K ids (the stage
teacher_cache writes it first; K = vocabulary size is the full distribution). Every variant
sees the same batches (same seed). tau and the draft acceptance rate at gamma = 5, T = 0 and T = 1
(`--temperatures`), on the demo's 128 test prompts, are written to `--out` with the stages'
wall clocks and the cache sizes.

`--smoke`: the smoke run's settings (bench/smoke.py: a few steps, 4 test prompts), 2 steps,
K = 8, gamma 2, T = 0, in a temporary folder; without `--source` it trains the inputs there first.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core import files  # noqa: E402
from distillspec_jax.evaluation import quality  # noqa: E402
from distillspec_jax.main import load_pipeline  # noqa: E402
from distillspec_jax.studies import pipeline  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

INPUTS = ("vocab", "target", "draft_raw")
# --smoke: 2 steps, one cache of 8 ids; source and work_dir None: see main.
SMOKE = dict(source=None, work_dir=None, steps=2, ks=[8], gamma=2, temperatures=[0.0])


def _copy_inputs(source: str, run_dir: str) -> None:
  for stage in INPUTS:
    if not os.path.exists(os.path.join(run_dir, stage, pipeline.DONE)):
      shutil.copytree(os.path.join(source, stage), os.path.join(run_dir, stage),
                      dirs_exist_ok=True)  # copy2 keeps the markers' order of mtimes


def _mean_tokens_per_s(stage_dir: str) -> float:
  records = [json.loads(line) for line in open(os.path.join(stage_dir, "metrics.jsonl"))]
  rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
  return sorted(rates)[len(rates) // 2] if rates else float("nan")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--source", default="runs/demo")
  parser.add_argument("--work_dir", default="runs/teacher_cache_study")
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--ks", type=int, nargs="+", default=[8, 32, 256])
  parser.add_argument("--gamma", type=int, default=5)
  parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
  args = smoke.parse(parser, argv, SMOKE)
  if not args.smoke:
    return study(args, ("--gin_file=gin/runs/demo.gin",))
  with tempfile.TemporaryDirectory() as work_dir:
    args.work_dir = args.work_dir or work_dir
    if args.source is None:  # the inputs, trained once for every variant
      args.source = os.path.join(args.work_dir, "inputs")
      config = load_pipeline(smoke.PIPELINE_BINDINGS + (f"--gin.MODEL_DIR='{args.source}'",))
      pipeline.run_pipeline(config, stages=INPUTS)
    return study(args, smoke.PIPELINE_BINDINGS)


def study(args, run_file: tuple) -> dict:
  """Runs every variant of `args` on `run_file`'s settings; writes and returns the results."""
  variants = [("live", None)] + [(f"k{k}", k) for k in args.ks]
  results = {"steps": args.steps, "gamma": args.gamma, "source": args.source, "variants": {}}
  for name, k in variants:
    run_dir = os.path.join(args.work_dir, name)
    _copy_inputs(args.source, run_dir)
    bindings = [f"--gin.MODEL_DIR='{run_dir}'", "--gin.RECIPES=('supervised_kd',)",
                f"--gin.DISTILL_TRAIN_STEPS={args.steps}",
                "--gin.PipelineConfig.recipe_steps={}",
                f"--gin.PipelineConfig.eval_every={args.steps}"]
    # The run file may distil from a cache already (demo.gin does): "live" names none.
    if k is None:
      bindings += ["--gin.PipelineConfig.teacher_cache_recipes=()"]
    else:
      bindings += ["--gin.PipelineConfig.teacher_cache_recipes=('supervised_kd',)",
                   f"--gin.PipelineConfig.teacher_cache_k={k}"]
    config = load_pipeline(list(run_file) + bindings)
    print(f"=== {name}: {config.stages}", flush=True)
    pipeline.run_pipeline(config, stages=("distill_supervised_kd",))
    target, draft = pipeline.models(config)
    target_params = pipeline.load_params(config, "target", target)
    draft_params = pipeline.load_params(config, "distill_supervised_kd", draft)
    prompts = pipeline.heldout_prompts(config, config.eval_examples, split="test",
                                       task=config.eval_task or config.task).prompts
    row = {"k": k}
    for temperature in args.temperatures:
      stats = quality.speculative_statistics(
          target, target_params, draft, draft_params, prompts, gamma=args.gamma,
          temperature=temperature, max_new_tokens=config.max_new_tokens, seed=config.seed)
      row[f"T{temperature:g}"] = stats.to_json()
    distill_dir = config.stage_dir("distill_supervised_kd")
    marker = files.read_json(os.path.join(distill_dir, pipeline.DONE))
    row.update(distill_wall_clock_s=marker["wall_clock_s"], final_loss=marker["final_loss"],
               median_tokens_per_s=_mean_tokens_per_s(distill_dir))
    if k is not None:
      cache = files.read_json(os.path.join(config.stage_dir("teacher_cache"), pipeline.DONE))
      row.update(cache_wall_clock_s=cache["wall_clock_s"], cache_bytes=cache["total_bytes"],
                 bytes_per_token=cache["bytes_per_token"])
    results["variants"][name] = row
    print(json.dumps({name: row}), flush=True)
  files.write_json_atomic(args.out, results)
  temperatures = [f"T{t:g}" for t in args.temperatures]
  print("\n| variant | " + " | ".join(f"tau {t} | draft acceptance rate {t}" for t in temperatures)
        + " | distill s | cache MB |")
  print("|---|" + "---:|" * (2 * len(temperatures) + 2))
  for name, row in results["variants"].items():
    cells = [f"{row[t]['tau']:.3f} ± {row[t]['tau_stderr']:.3f} | {row[t]['draft_acceptance_rate']:.3f}"
             for t in temperatures]
    print(f"| {name} | " + " | ".join(cells) + f" | {row['distill_wall_clock_s']:.0f} | "
          f"{row.get('cache_bytes', 0) / 2**20:.0f} |")
  return results


if __name__ == "__main__":
  main()
