"""A killed process of a two-process job (jax.distributed on localhost, 4 CPU devices each)
ends the other one with a clear error within a time bound, instead of leaving it waiting in
a collective or at a stage barrier (whose own timeout is days long). Process 1 SIGKILLs
itself: in the train binary's worker after a cross-process reduction (the survivor keeps
reducing), in the eval binary as it hands over its first evaluation batch, in the main job as
the teacher-cache stage starts; each survivor is then in a program that spans both.

The three pairs run at once: most of the test is the survivors waiting out the 10 s
heartbeat timeout, not computing."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

import testing
from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints
from test_eval_multihost import _eval_flags
from test_multihost import _env, _flags, _free_port

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "tiny_encoder_decoder"
# Seconds from the start by which both processes of a pair have ended: heartbeat 10 s, plus
# start-up (and, for the binaries, loading and one compile) on a loaded 2-core machine.
BOUND_S = {"train worker": 180, "eval binary": 240, "main job": 240}

# The train worker's survivor ends one of two ways, whichever comes first (it depends on load):
# jax.distributed's fatal error after the heartbeat timeout (the coordination service saw the
# peer stop; SIGABRT), or the failed collective raised in Python (tests/multihost_worker.py
# prints it as one SURVIVOR_ERROR line, e.g. gloo's "Connection closed by peer", exit 3).
JAX_FATAL = re.compile(r"Terminating process because the JAX distributed service detected "
                       r"fatal errors\. This most likely indicates that another task died|"
                       r"The following tasks are unhealthy \(stopped sending heartbeats\)")
COLLECTIVE_ERROR = re.compile(r"^SURVIVOR_ERROR (JaxRuntimeError|XlaRuntimeError|"
                              r"MultihostError): \S", re.MULTILINE)
# What the binaries' survivors may end with, whichever comes first: jax.distributed's fatal
# error once the heartbeat stops (the process aborts), or the collective in flight failing in
# Python (gloo's closed connection, raised as jax's runtime error, a traceback of the binary).
BINARY_ERROR = re.compile(JAX_FATAL.pattern + r"|JaxRuntimeError|XlaRuntimeError")


def _start_pair(commands, folder, kill_at: str) -> tuple:
  folder.mkdir(parents=True, exist_ok=True)
  port = _free_port()
  env = dict(_env(4), WORKER_KILL_AT=kill_at) if kill_at else _env(4)
  procs, logs = [], []
  for index, command in enumerate(commands):
    logs.append(open(folder / f"{index}.log", "w+"))
    procs.append(subprocess.Popen(
        command + _flags(port, index, heartbeat=10), env=env, cwd=ROOT, stdout=logs[-1],
        stderr=subprocess.STDOUT, text=True))
  return procs, logs


def _train_pair(folder):
  worker = os.path.join(ROOT, "tests", "multihost_worker.py")
  return _start_pair([[sys.executable, worker, "kill"]] * 2, folder, "")


def _check_train_survivor(procs, outs) -> None:
  assert "SUM 24.0" in outs[0], outs[0][-4000:]  # the reduction ran across both first
  assert "SURVIVOR_NEVER_STOPPED" not in outs[0]
  if COLLECTIVE_ERROR.search(outs[0]):  # exit 3, or jax's abort in the same instant
    assert procs[0].returncode in (3, -signal.SIGABRT), outs[0][-4000:]
  else:  # jax's fatal error aborts the process (SIGABRT)
    assert JAX_FATAL.search(outs[0]), outs[0][-4000:]


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
  for stage in testing.SHARED_STAGES:
    shutil.copytree(os.path.join(shared_dir, stage), folder / "run" / stage)
  settings = json.dumps(dict(grid=dict(gammas=[2], temperatures=[0.0]),
                             speed=dict(repeats=1, calls=1),
                             recipes=["supervised_kd"], teacher_cache_k=8,
                             teacher_cache_recipes=["supervised_kd"]))
  worker = os.path.join(ROOT, "tests", "pipeline_multihost_worker.py")
  return _start_pair([[sys.executable, worker, str(folder / "run"), settings]] * 2, folder,
                     "teacher_cache")


def _outputs(procs, logs, name, deadline: float) -> list:
  try:
    for p in procs:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    for q in procs:
      q.kill()
    raise AssertionError(f"{name}: a process was still running {BOUND_S[name]} s after the "
                         "start")
  outs = []
  for log in logs:
    log.seek(0)
    outs.append(log.read())
    log.close()
  return outs


@pytest.mark.pipeline
def test_a_killed_process_ends_the_other_with_a_clear_error(tmp_path, shared_stages):
  # The three pairs at once: each mostly waits (start-up, then the heartbeat timeout).
  start, pairs = time.monotonic(), {}
  try:
    pairs["train worker"] = _train_pair(tmp_path / "train")
    pairs["eval binary"] = _eval_pair(tmp_path / "eval")
    pairs["main job"] = _pipeline_pair(tmp_path / "job", shared_stages[0])
    for name, (procs, logs) in pairs.items():
      outs = _outputs(procs, logs, name, start + BOUND_S[name])
      assert procs[1].returncode == -9, (name, outs[1][-3000:])  # it killed itself
      assert procs[0].returncode != 0, (name, outs[0][-3000:])
      assert "RESULT" not in outs[0] and "WORKER_OK" not in outs[0], name
      if name == "train worker":
        _check_train_survivor(procs, outs)
      else:
        assert BINARY_ERROR.search(outs[0]), (name, outs[0][-4000:])
  finally:
    for procs, _ in pairs.values():
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
