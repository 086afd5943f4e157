"""launch/ dry runs: the exact commands for a v4-32 slice and for two GPU nodes (nothing runs)."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.integration


def _dry_run(script: str, **env) -> str:
  out = subprocess.run(["bash", os.path.join(ROOT, "launch", script), "--dry_run"],
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_tpu_v4_32_dry_run_prints_the_slice_commands():
  out = _dry_run("tpu_train.sh", ACCELERATOR_TYPE="v4-32", TPU_NAME="my-v4-32",
                 MODEL_DIR="gs://bucket/run", GIN_FILE="gin/runs/paper_xsum.gin")
  lines = out.splitlines()
  assert lines[0] == "# v4-32: 4 hosts; 1. install on every host (--worker=all)"
  gcloud = [l for l in lines if l.startswith("gcloud compute tpus tpu-vm ssh my-v4-32 ")]
  assert len(gcloud) == 2 and all("--worker=all" in l for l in gcloud)
  assert ".[tpu]" in gcloud[0]  # pyproject's extra: jax[tpu]==0.10.2
  hosts = [l for l in lines if l.startswith("# host ")]
  assert [l.split(" runs: ")[0] for l in hosts] == [
      f"# host {i} of 4 (jax.process_index() = {i})" for i in range(4)]
  command = hosts[0].split(" runs: ")[1]
  assert all(l.split(" runs: ")[1] == command for l in hosts)  # the same on every host
  assert "-m distillspec_jax.main --gin_file=gin/runs/paper_xsum.gin" in command
  assert "--gin.MODEL_DIR=\"'gs://bucket/run'\"" in command
  assert "--coordinator_address" not in out  # TPU VMs: jax.distributed finds the slice


def test_gpu_dry_run_sets_the_coordinator_flags():
  out = _dry_run("gpu_multinode.sh", NODES="n0 n1", PORT="4321", MODEL_DIR="/shared/run")
  lines = out.splitlines()
  assert lines[0] == "# 2 nodes, coordinator n0:4321"
  for index, line in enumerate(lines[1:]):
    assert line.startswith(f"ssh n{index} ")
    assert (f"--coordinator_address=n0:4321\\ --process_count=2\\ --process_index={index}"
            in line), line
  assert len(lines) == 3


def test_unknown_accelerator_is_refused():
  out = subprocess.run(["bash", os.path.join(ROOT, "launch", "tpu_train.sh"), "--dry_run"],
                       env=dict(os.environ, ACCELERATOR_TYPE="v5e-16"), capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 2 and "ACCELERATOR_TYPE=v5e-16" in out.stderr
