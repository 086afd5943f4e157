"""The mesh paths for a Llama-family pair, on 8 simulated CPU devices (tests/llama_mesh_worker.py,
in a subprocess because XLA_FLAGS must be set before JAX starts): the distillation step,
on-policy sampling, speculative decoding and its statistics on meshes (4, 2) and (2, 4) equal
one device; key/value heads fewer than the model axis are replicated, otherwise split; the
compiled programs take the rules' shardings and gather no model-sharded parameter."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(check: str, preset: str = "tiny_llama") -> str:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "llama_mesh_worker.py"),
                        check, preset], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
  assert "CHECK_OK" in out.stdout
  return out.stdout


def test_llama_distillation_step_on_two_meshes_equals_one_device():
  out = _run("step")
  assert out.count("kv layout ok") == 2
  assert out.count(" loss ") == 1 + 2  # one device, then each mesh


def test_llama_sampling_speculative_and_evaluation_on_two_meshes_equal_one_device():
  out = _run("decode")
  assert out.count(" tau ") == 1 + 2


@pytest.mark.integration
def test_gemma3_sampling_and_speculative_decoding_on_two_meshes_equal_one_device():
  """Gemma 3's local/global layers, q/k norms and capped logits under the mesh rules: 8 new
  tokens after 6-token prompts pass the 4-key window of the target's layer 0."""
  out = _run("decode", "tiny_gemma3")
  assert out.count(" tau ") == 1 + 2
