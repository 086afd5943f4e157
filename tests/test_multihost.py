"""Multi-host: a real two-process run on localhost (jax.distributed, 4 CPU devices each, gloo
collectives, a (4, 2) mesh spanning both), against the single-process 8-device run; flag and
coordinator errors. A killed process: tests/test_killed_process.py.

The processes are started with the binaries' flags (`multihost.initialize_from_flags`):
tests/multihost_worker.py is one process.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from distillspec_jax.training import multihost
from compilation import xla_flags

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
STEPS = 3


def _free_port(skip: bool = True):
  """A localhost port nobody listens on; without one the test is skipped (or, skip=False,
  None is returned)."""
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("localhost", 0))
      return s.getsockname()[1]
  except OSError as error:
    if not skip:
      return None
    pytest.skip(f"cannot bind a localhost port for the coordinator ({error})")


def _env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
             PYTHONUNBUFFERED="1")
  return env


def _flags(port: int, index: int, heartbeat: int = 100) -> list:
  return [f"--coordinator_address=localhost:{port}", "--process_count=2",
          f"--process_index={index}", "--initialization_timeout=60",
          f"--heartbeat_timeout={heartbeat}"]


def _finish(procs, timeout):
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise AssertionError("a process hung past the test's time bound")
    outs.append(out)
  return outs


@pytest.mark.integration
def test_two_processes_equal_one_process(tmp_path):
  single, multi = tmp_path / "single", tmp_path / "multi"
  single.mkdir()
  multi.mkdir()
  # The reference, then the pair: run at the same time, the three processes contend for the
  # cores and the pair's collectives (gloo, polling) cost more CPU.
  procs = [subprocess.Popen([sys.executable, WORKER, str(single), str(single / "model"),
                             str(STEPS)], env=_env(8), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)]
  outs = _finish(procs, timeout=600)
  port = _free_port()
  for index in (0, 1):
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, str(multi), str(multi / "model"), str(STEPS)]
        + _flags(port, index), env=_env(4), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True))
  outs += _finish(procs[1:], timeout=600)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
    assert "WORKER_OK" in out
  reference = np.load(single / "0.npz")
  assert int(reference["process_count"]) == 1
  for index in (0, 1):
    run = np.load(multi / f"{index}.npz")
    assert int(run["process_count"]) == 2
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-6, atol=0)
    names = [k for k in reference.files if k.startswith("param:")]
    assert names and sorted(names) == sorted(k for k in run.files if k.startswith("param:"))
    for name in names:  # fp32; gloo's reduction order differs from the in-process one
      np.testing.assert_allclose(run[name], reference[name], rtol=0, atol=1e-5, err_msg=name)
  # One writer: one metrics line per logged step (log_every=1), written by process 0.
  lines = (multi / "model" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
  assert [json.loads(line)["loss"] for line in lines] == pytest.approx(
      list(reference["losses"]), rel=1e-6)
  # One checkpoint (keep 1; orbax also saves a fresh manager's first step), written by both
  # processes together.
  assert sorted(d for d in os.listdir(multi / "model") if d.isdigit()) == [str(STEPS)]
  # Each process read only its rows of each global batch of 8: 0-3 and 4-7.
  for index, (start, stop) in enumerate([(0, 4), (4, 8)]):
    rows = json.loads((multi / f"rows_{index}.json").read_text())
    assert rows == [[step, start, stop] for step in range(STEPS)]
  assert json.loads((single / "rows_0.json").read_text()) == [[s, 0, 8] for s in range(STEPS)]


@pytest.mark.slow
def test_unreachable_coordinator_names_the_address():
  port = _free_port()  # nothing listens there
  with pytest.raises(multihost.MultihostError, match=f"localhost:{port}.*within "
                     "--initialization_timeout=1 s"):
    multihost.initialize(f"localhost:{port}", 2, 1, initialization_timeout=1)


@pytest.mark.parametrize("argv, message", [
    (["--coordinator_address=localhost:1234"], "--process_count, --process_index missing"),
    (["--process_count=2", "--process_index=0"], "--coordinator_address missing"),
    (["--coordinator_address=localhost:1234", "--process_count=2", "--process_index=2"],
     r"--process_index=2 must lie in \[0, 2\)"),
    (["--coordinator_address=localhost", "--process_count=2", "--process_index=0"],
     "is not HOST:PORT"),
    (["--coordinator_address=localhost:1234", "--process_count=two", "--process_index=0"],
     "--process_count='two' is not an integer"),
    (["--process_index"], "needs a value"),
])
def test_bad_flags_are_refused(argv, message):
  with pytest.raises(multihost.MultihostError, match=message):
    multihost.initialize_from_flags(argv)


def test_flags_are_split_out_of_argv_and_single_process_is_a_no_op():
  values, rest = multihost.parse_flags(["--gin_file=a.gin", "--process_count", "2",
                                        "--gin.X=1"])
  assert values == {"process_count": "2"} and rest == ["--gin_file=a.gin", "--gin.X=1"]
  assert multihost.initialize_from_flags(["--gin_file=a.gin"]) == ["--gin_file=a.gin"]
  assert multihost.is_primary()
  multihost.barrier("single")  # nothing to wait for


def test_data_shard_of_one_process_is_the_whole_batch():
  from distillspec_jax.training import partitioning
  shard = multihost.data_shard(partitioning.make_mesh(), 8)
  assert (shard.index, shard.num_shards, shard.local_batch_size, shard.rows) == (0, 1, 8,
                                                                                  slice(0, 8))
  assert shard.shard_info().num_shards == 1
