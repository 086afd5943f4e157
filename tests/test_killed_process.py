"""A killed process of a two-process eval binary or main job (jax.distributed on localhost, 4
CPU devices each, a (4, 2) mesh spanning both) ends the other one with a clear error within a
time bound, instead of leaving it waiting in a collective or at a stage barrier (whose own
timeout is days long). Process 1 kills itself (SIGKILL) as it hands over its first evaluation
batch, or as the main job's teacher-cache stage starts; the survivor is then in the middle
of a program that spans both processes.

Both pairs run at once: most of the test is the survivors waiting out the 10 s heartbeat
timeout, not computing. The train binary's kill test is tests/test_multihost.py's."""

import os
import subprocess
import sys

import jax
import pytest

import testing
from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints
from test_eval_multihost import _eval_flags
from test_multihost import _env, _flags, _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "tiny_encoder_decoder"
BOUND_S = 240  # heartbeat 10 s, plus start-up and one compile on a loaded 2-core machine

# What the survivor may end with, whichever comes first: jax.distributed's fatal error once
# the heartbeat stops (the process aborts), or the collective in flight failing in Python
# (gloo's closed connection, raised as jax's runtime error, a traceback of the binary).
CLEAR_ERRORS = ("Terminating process because the JAX distributed service detected fatal "
                "errors", "The following tasks are unhealthy (stopped sending heartbeats)",
                "JaxRuntimeError", "XlaRuntimeError")


def _start_pair(commands, folder, kill_at: str) -> tuple:
  folder.mkdir(parents=True, exist_ok=True)
  port = _free_port()
  env = dict(_env(4), WORKER_KILL_AT=kill_at)
  procs, logs = [], []
  for index, command in enumerate(commands):
    logs.append(open(folder / f"{index}.log", "w+"))
    procs.append(subprocess.Popen(
        command + _flags(port, index, heartbeat=10), env=env, cwd=ROOT, stdout=logs[-1],
        stderr=subprocess.STDOUT, text=True))
  return procs, logs


def _eval_pair(folder):
  from distillspec_jax.data.tasks import embedded
  embedded.build_embedded_vocabulary(str(folder / "vocab"))
  for name, seed in (("target", 0), ("draft", 1)):
    checkpoints.save_params(str(folder / name),
                            Model.from_name(PRESET).init(jax.random.PRNGKey(seed)))
  worker = os.path.join(ROOT, "tests", "eval_multihost_worker.py")
  return _start_pair([[sys.executable, worker, str(folder / f"rows_{i}.json")]
                      + _eval_flags(folder, folder / "run") for i in (0, 1)],
                     folder, "first_batch")


def _pipeline_pair(folder, shared_dir):
  import json
  import shutil
  for stage in testing.SHARED_STAGES:
    shutil.copytree(os.path.join(shared_dir, stage), folder / "run" / stage)
  settings = json.dumps(dict(gammas=[2], temperatures=[0.0], speed_repeats=1, speed_calls=1,
                             recipes=["supervised_kd"], teacher_cache_k=8,
                             teacher_cache_recipes=["supervised_kd"]))
  worker = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
  return _start_pair([[sys.executable, worker, str(folder / "run"), settings]] * 2, folder,
                     "teacher_cache")


def _outputs(procs, logs, name) -> list:
  try:
    for p in procs:
      p.wait(timeout=BOUND_S)
  except subprocess.TimeoutExpired:
    for q in procs:
      q.kill()
    raise AssertionError(f"{name}: a process was still running {BOUND_S} s after the start")
  outs = []
  for log in logs:
    log.seek(0)
    outs.append(log.read())
    log.close()
  return outs


@pytest.mark.pipeline
def test_a_killed_process_ends_the_other_with_a_clear_error(tmp_path, shared_stages):
  # Both pairs at once: each mostly waits (start-up, then the heartbeat timeout).
  pairs = {"eval binary": _eval_pair(tmp_path / "eval"),
           "main job": _pipeline_pair(tmp_path / "job", shared_stages[0])}
  try:
    for name, (procs, logs) in pairs.items():
      outs = _outputs(procs, logs, name)
      assert procs[1].returncode == -9, (name, outs[1][-3000:])  # it killed itself
      assert procs[0].returncode != 0, (name, outs[0][-3000:])
      assert "RESULT" not in outs[0] and "WORKER_OK" not in outs[0], name
      assert any(error in outs[0] for error in CLEAR_ERRORS), (name, outs[0][-4000:])
  finally:
    for procs, _ in pairs.values():
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
