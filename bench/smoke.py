"""The bench scripts' `--smoke` mode: each script on tiny shapes in seconds, so that the suite
runs every script (tests/test_bench_smoke.py) and a library change that breaks one fails CI.
A smoke run's numbers mean nothing; it checks that the script runs and writes its JSON.

Imported by the scripts beside it (`python bench/<script>.py` puts bench/ on sys.path).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The main job on a handful of steps and examples of the embedded task, as gin bindings
# (tests/testing.py's PIPELINE): what the scripts that need a finished run train in smoke
# mode (run_pipeline skips any stage already done, so a test may provide them).
PIPELINE_BINDINGS = (
    f"--gin_file={os.path.join(ROOT, 'gin', 'runs', 'demo.gin')}",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 40, 'targets': 44}",
    "--gin.PipelineConfig.target_model='smoke_target'",
    "--gin.TRAIN_STEPS=2", "--gin.DRAFT_TRAIN_STEPS=2", "--gin.DISTILL_TRAIN_STEPS=2",
    "--gin.PipelineConfig.recipe_steps={}", "--gin.BATCH_SIZE=8",
    "--gin.PipelineConfig.warmup_steps=1", "--gin.PipelineConfig.eval_examples=4",
    "--gin.SPEED_EXAMPLES=1", "--gin.PipelineConfig.max_new_tokens=8",
    "--gin.PipelineConfig.eval_every=1", "--gin.TRAIN_EXAMPLES=64",
    "--gin.SPEED_REPEATS=2", "--gin.SPEED_CALLS=2",
    "--gin.SPEED_CPUS=0", "--gin.GAMMAS=(2,)",
    "--gin.TEMPERATURES=(0.0,)", "--gin.RECIPES=('supervised_kd',)",
    "--gin.PipelineConfig.teacher_cache_recipes=()",
)


def add_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes, seconds: checks that the script runs and writes its "
                           "output (the numbers mean nothing)")


def parse(parser: argparse.ArgumentParser, argv: Optional[list], smoke_defaults: dict,
          known: bool = False):
  """Parses `argv` with a `--smoke` flag; with it, `smoke_defaults` replace the parser's
  defaults (flags given on the command line still win). `known`: parse_known_args (the
  scripts that pass the rest on to gin)."""
  add_flag(parser)
  first, _ = parser.parse_known_args(argv)
  if first.smoke:
    parser.set_defaults(**smoke_defaults)
  return parser.parse_known_args(argv) if known else parser.parse_args(argv)
