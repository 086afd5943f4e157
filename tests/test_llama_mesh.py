"""The mesh paths for a Llama-family pair, on 8 simulated CPU devices (tests/llama_mesh_worker.py,
one subprocess for the three tests because XLA_FLAGS must be set before JAX starts): the
distillation step,
on-policy sampling, speculative decoding and its statistics on meshes (4, 2) and (2, 4) equal
one device; key/value heads fewer than the model axis are replicated, otherwise split; the
compiled programs take the rules' shardings and gather no model-sharded parameter."""

import os
import sys

import pytest

import testing

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every test's check, run once per test run in one worker process (testing.run_once): one
# interpreter start, one JAX import and one 8-device backend for all of them.
CHECKS = ("tiny_llama:step", "tiny_llama:decode", "tiny_gemma3:decode")


@pytest.fixture(scope="module")
def worker(request, tmp_path_factory) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(JAX_PLATFORMS="cpu")
  return testing.run_once(testing.run_root(request.config, tmp_path_factory),
                          "llama_mesh_worker",
                          [sys.executable, os.path.join(ROOT, "tests", "llama_mesh_worker.py"),
                           *CHECKS], env=env, cwd=ROOT, timeout=900)


def test_llama_distillation_step_on_two_meshes_equals_one_device(worker):
  out = testing.check_section(worker, "tiny_llama:step")
  assert out.count("kv layout ok") == 2
  assert out.count(" loss ") == 1 + 2  # one device, then each mesh


def test_llama_sampling_speculative_and_evaluation_on_two_meshes_equal_one_device(worker):
  out = testing.check_section(worker, "tiny_llama:decode")
  assert out.count(" tau ") == 1 + 2


def test_gemma3_sampling_and_speculative_decoding_on_two_meshes_equal_one_device(worker):
  """Gemma 3's local/global layers, q/k norms and capped logits under the mesh rules: 8 new
  tokens after 6-token prompts pass the 4-key window of the target's layer 0."""
  out = testing.check_section(worker, "tiny_gemma3:decode")
  assert out.count(" tau ") == 1 + 2
