"""Tiny models and tiny main-job runs shared by the tests (imported as `testing`; conftest.py
turns the expensive ones into session fixtures).

- `tiny_pair(vocab_size)`: the target/draft pair of the trainer, mesh and multi-host tests
  (tiny_encoder_decoder toward demo_draft); `random_params(model, seed)`: its random weights,
  made once per process (the same model and seed give the same arrays in every test);
  T5_TINY: the checkpoint-format tests' config.
- PIPELINE and `pipeline_config`: the main job on a handful of steps and examples (the smoke
  tests and the studies use the same settings, so they can share stages).
- `train_shared_stages` / `copy_stages`: the main job's vocab, target and raw draft trained
  once per test run and copied into each whole-pipeline test's run directory (markers' times
  kept, so run_pipeline reuses them as it reuses any finished stage).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import shutil

import jax

from distillspec_jax.evaluation.evaluate import SpeedConfig
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model

TINY_TARGET, TINY_DRAFT = "tiny_encoder_decoder", "demo_draft"
# The checkpoint-format tests' T5 (Hugging Face, T5X): every field spelled out, as a
# converted config would be.
T5_TINY = TransformerConfig(kind="encoder_decoder", vocab_size=128, emb_dim=64, num_heads=4,
                            num_encoder_layers=2, num_decoder_layers=2, head_dim=16,
                            mlp_dim=128, dropout_rate=0.0, max_decode_length=32)

# The main job's settings of every whole-pipeline test: the embedded task, smoke_target toward
# demo_draft, two steps per stage of batch 8 (an (8, 1) mesh divides it), four test prompts,
# one timed prompt in this process.
PIPELINE = dict(task_feature_lengths={"inputs": 40, "targets": 44}, target_model="smoke_target",
                target_steps=2, draft_steps=2, distill_steps=2, batch_size=8, warmup_steps=1,
                eval_examples=4, max_new_tokens=8, eval_every=1, train_examples=64,
                progress_bar=False, speed=SpeedConfig(examples=1, repeats=2, calls=2, cpus=0))
# The stages every main job and study starts from (studies.common.REUSABLE_STAGES).
SHARED_STAGES = ("vocab", "target", "draft_raw")


def tiny_pair(vocab_size: int = 64) -> tuple:
  """(target, draft) Models: tiny_encoder_decoder and demo_draft with `vocab_size` rows."""
  return (Model.from_name(TINY_TARGET, vocab_size=vocab_size),
          Model.from_name(TINY_DRAFT, vocab_size=vocab_size))


@functools.lru_cache(maxsize=32)
def _random_params(model: Model, seed: int):
  return model.init(jax.random.PRNGKey(seed))


def random_params(model: Model, seed: int):
  """`model.init(PRNGKey(seed))`, initialised once per process; fresh containers around the
  shared (immutable) arrays, so a test may replace leaves without touching another's."""
  return jax.tree.map(lambda x: x, _random_params(model, seed))


def pipeline_config(run_dir, config_class=None, grid=None, speed=None, mesh=None, **changes):
  """A PipelineConfig (or `config_class`, e.g. a study's) of PIPELINE with `changes`.

  `grid` / `speed`: a DecodingGrid / SpeedConfig, or a dict (JSON from a worker's command
  line: lists become tuples) of DecodingGrid fields / changes to PIPELINE's SpeedConfig;
  `mesh`: a MeshConfig or (data_parallel, model_parallel)."""
  from distillspec_jax.evaluation.decoding_grid import DecodingGrid
  from distillspec_jax.training.partitioning import MeshConfig
  if config_class is None:
    from distillspec_jax.studies.pipeline import PipelineConfig as config_class
  tuples = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
  if isinstance(grid, dict):
    grid = DecodingGrid(**tuples(grid))
  if isinstance(speed, dict):
    speed = dataclasses.replace(PIPELINE["speed"], **speed)
  if mesh is not None and not isinstance(mesh, MeshConfig):
    mesh = MeshConfig(*mesh)
  given = {k: v for k, v in dict(grid=grid, speed=speed, mesh=mesh).items() if v is not None}
  return config_class(run_dir=str(run_dir), **dict(PIPELINE, **given, **changes))


def train_shared_stages(root) -> tuple:
  """The SHARED_STAGES of `pipeline_config` in `<root>/run`, trained by the first caller and
  reused by every later one, in any process (a file lock: pytest-xdist workers share `root`).

  Returns (run_dir, outcome): outcome is run_pipeline's answer to the call that trained them
  ({stage: "ran"}).
  """
  from distillspec_jax.studies.pipeline import run_pipeline
  os.makedirs(root, exist_ok=True)
  run_dir, record = os.path.join(root, "run"), os.path.join(root, "outcome.json")
  with open(os.path.join(root, "lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.exists(record):  # first caller (or an earlier one failed: train again)
      outcome = run_pipeline(pipeline_config(run_dir), stages=SHARED_STAGES)
      with open(record + ".tmp", "w") as f:
        json.dump(outcome, f)
      os.replace(record + ".tmp", record)
    with open(record) as f:
      return run_dir, json.load(f)


def copy_stages(source_run_dir, config, stages=SHARED_STAGES) -> None:
  """Copies finished `stages` of `source_run_dir` into `config`'s run directory as they are:
  file times kept (shutil.copy2), so their markers stay older than anything run after."""
  for stage in stages:
    shutil.copytree(os.path.join(source_run_dir, stage), config.stage_dir(stage))


def pipeline_outcome(config) -> dict:
  """What the mesh tests compare of a finished run of `config`: each stage's final loss and
  tau curve, the evaluation's tau / draft acceptance rate rows and per-token losses, the report's row count,
  and how many of the target's evaluation parameters are split over 'model'."""
  from distillspec_jax.core.files import read_json
  from distillspec_jax.studies import pipeline
  out = {}
  for stage in ("target", "draft_raw") + config.distill_stages:
    marker = read_json(os.path.join(config.stage_dir(stage), "DONE.json"))
    out[stage] = {"final_loss": marker["final_loss"], "tau_curve": marker.get("tau_curve")}
  evaluation = read_json(os.path.join(config.stage_dir("evaluate"), "eval.json"))
  out["speculative"] = [{k: r[k] for k in ("draft", "gamma", "temperature", "tau",
                                          "draft_acceptance_rate")}
                        for r in evaluation["speculative"]]
  out["quality"] = {k: v["per_token_loss"] for k, v in evaluation["quality"].items()}
  out["report_rows"] = len(read_json(os.path.join(config.run_dir, "report.json"))["rows"])
  cache = os.path.join(config.stage_dir("teacher_cache"), "shard-00000.log_probs.npy")
  if os.path.exists(cache):
    import numpy as np
    out["cache_log_probs"] = np.load(cache)[:4, :4].tolist()
  target = pipeline.eval_models_and_params(config)[2]["target"]
  out["target_model_sharded"] = sum("model" in str(x.sharding.spec)
                                    for x in jax.tree.leaves(target))
  out["target_leaves"] = len(jax.tree.leaves(target))
  return out



def assert_refused_before_work(cli, argv: list, named: str, model_dir, capsys) -> None:
  """A binary's command-line path (`cli(argv)`, as `python -m` runs it) on bad input: exit
  status 1, an error line naming `named`, no traceback, and no MODEL_DIR (no work started)."""
  import gin
  gin.clear_config()
  try:
    code = cli(argv)
  finally:
    gin.clear_config()
  err = capsys.readouterr().err
  assert code == 1, err[-2000:]
  assert err.startswith("Error: ") and "Traceback" not in err, err[-2000:]
  assert named in err, (named, err[-2000:])
  assert not os.path.exists(model_dir), os.listdir(model_dir)  # no checkpoint, no metrics


def run_root(config, tmp_path_factory):
  """The folder all processes of one test run share (pytest-xdist workers' temporary folders
  share a parent): where `run_once` keeps what it ran."""
  root = tmp_path_factory.getbasetemp()
  return root.parent if hasattr(config, "workerinput") else root


def once(root, name: str, make) -> dict:
  """`make(folder)` (a JSON object) for `name`, computed by the first caller in this test run
  and read back by every later one, in any process (a file lock, as train_shared_stages);
  `folder` (<root>/run_once/<name>) keeps whatever it writes, for the later callers too.
  Recorded whatever it holds: several tests can each check their part of one run."""
  folder = os.path.join(str(root), "run_once", name)
  os.makedirs(folder, exist_ok=True)
  record = os.path.join(folder, "result.json")
  with open(os.path.join(folder, "lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.exists(record):
      result = make(folder)
      with open(record + ".tmp", "w") as f:
        json.dump(result, f)
      os.replace(record + ".tmp", record)
    with open(record) as f:
      return json.load(f)


def run_once(root, name: str, command: list, **kwargs) -> dict:
  """{"returncode", "stdout", "stderr"} of `subprocess.run(command, **kwargs)` (text output),
  run once per test run (`once`): several tests can check parts of one child process's
  output instead of each starting its own."""
  import subprocess

  def make(_):
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
  return once(root, name, make)


def check_section(run: dict, check: str) -> str:
  """The output of `check` in a worker run that ran several (`run_once`'s record): the lines
  between `CHECK_BEGIN <check>` and the next check's, which must end with `CHECK_OK <check>`
  (a check that raised printed its traceback there instead)."""
  text = run["stdout"].split(f"CHECK_BEGIN {check}\n", 1)
  assert len(text) == 2, (check, run["returncode"], run["stdout"][-2000:],
                          run["stderr"][-4000:])
  section = text[1].split("CHECK_BEGIN ", 1)[0]
  assert f"CHECK_OK {check}\n" in section, (check, section[-3000:], run["stderr"][-4000:])
  return section


def run_checks(checks: dict, names) -> int:
  """A worker's main: each of `names` (keys of `checks`, functions) in turn, its output
  between `CHECK_BEGIN <name>` and `CHECK_OK <name>` (`check_section`), or its traceback
  instead of the last line; a failing check does not stop the others. Exit status: 1 if any
  failed."""
  import sys
  import traceback
  failed = False
  for name in names:
    print(f"CHECK_BEGIN {name}", flush=True)
    try:
      checks[name]()
    except Exception:  # pylint: disable=broad-except  (printed; the next check still runs)
      failed = True
      traceback.print_exc(file=sys.stdout)
      sys.stdout.flush()
    else:
      print(f"CHECK_OK {name}", flush=True)
  return int(failed)
