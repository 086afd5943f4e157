"""kill -9 during head training resumes bit-identically (tests/head_resume_worker.py: a draft
head on a tiny encoder-decoder pair, every data source in play): a run SIGKILLed once a
checkpoint is on disk, with an unfinished save left beside it, restarted on its MODEL_DIR,
ends with exactly the parameters and losses of a run never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from distillspec_jax.training import checkpoints
import head_resume_worker as worker

pytestmark = [pytest.mark.integration, pytest.mark.long]

STEPS = 10
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "head_resume_worker.py")
DEADLINE_S = 240  # start-up and compiles on a loaded 2-core host


def _start(model_dir, *flags):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  return subprocess.Popen([sys.executable, WORKER, str(model_dir), str(STEPS), *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finished(proc) -> str:
  out, _ = proc.communicate(timeout=DEADLINE_S)
  assert proc.returncode == 0, out[-4000:]
  return out


def _finalized_steps(model_dir) -> list:
  """Step directories orbax has renamed into place (a save in flight is `<step>.orbax-...`)."""
  if not os.path.isdir(model_dir):
    return []
  return sorted(int(d) for d in os.listdir(model_dir) if d.isdigit())


def _logged(out: str) -> list:
  line = [l for l in out.splitlines() if l.startswith("LOGGED ")]
  assert line, out[-4000:]
  return json.loads(line[-1][len("LOGGED "):])


def _losses(model_dir) -> list:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_head_training_killed_with_sigkill_resumes_bit_identically(tmp_path):
  straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
  straight = _start(straight_dir)
  killed = None
  try:
    deadline = time.monotonic() + DEADLINE_S
    # The killed run starts once the straight one has a checkpoint: its programs are then in
    # the run's compilation cache (conftest.py), read instead of compiled a second time.
    while not _finalized_steps(straight_dir) and straight.poll() is None:
      assert time.monotonic() < deadline, "no checkpoint was written in time"
      time.sleep(0.02)
    killed = _start(killed_dir, "--slow")
    while not _finalized_steps(killed_dir):
      assert killed.poll() is None, killed.communicate()[0][-4000:]
      assert time.monotonic() < deadline, "no checkpoint was written in time"
      time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    at_kill = _finalized_steps(killed_dir)[-1]
    assert 0 < at_kill < STEPS  # killed between two checkpoints, not after the last
    # What a kill during a save leaves: an unfinished save of a later step. Never restored.
    unfinished = killed_dir / f"{at_kill + 1}{checkpoints.TMP_DIR_MARKER}"
    (unfinished / "params").mkdir(parents=True, exist_ok=True)
    (unfinished / "params" / "half_written").write_bytes(b"\0" * 64)
    resumed_out = _finished(_start(killed_dir))
    straight_out = _finished(straight)
  finally:
    for proc in (straight, killed):
      if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()

  assert _logged(straight_out) == list(range(1, STEPS + 1))
  assert _logged(resumed_out) == list(range(at_kill + 1, STEPS + 1))  # resumed, not restarted
  assert not unfinished.exists()
  _, _, head, _ = worker.pair()
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), head.param_shapes())
  want = checkpoints.restore_params(str(straight_dir / str(STEPS)), abstract)
  got = checkpoints.restore_params(str(killed_dir / str(STEPS)), abstract)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               want, got)
  # The kept log holds each step once, with the uninterrupted run's losses.
  assert _losses(killed_dir) == _losses(straight_dir)
