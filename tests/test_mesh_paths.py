"""Every compiled path under the mesh, on 8 simulated CPU devices (tests/mesh_worker.py, in a
subprocess because XLA_FLAGS must be set before JAX starts): the distillation step, on-policy
sampling, speculative decoding and its evaluation statistics on meshes (4, 2) and (2, 4)
equal one device; parameter shardings inside the compiled programs are the rules'; no program
all-gathers a model-sharded parameter; the optimizer state is sharded like the draft and the
frozen target has none; checkpoints restore across meshes. Plus the rule checks."""

import os
import sys

import pytest
import testing

from distillspec_jax.training import partitioning

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The integration tests' checks, run once per test run in one worker process
# (testing.run_once): one interpreter start, one JAX import and one 8-device backend.
CHECKS = ("step", "decode", "checkpoint")


@pytest.fixture(scope="module")
def worker(request, tmp_path_factory) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(JAX_PLATFORMS="cpu")
  return testing.run_once(testing.run_root(request.config, tmp_path_factory), "mesh_worker",
                          [sys.executable, os.path.join(ROOT, "tests", "mesh_worker.py"),
                           *CHECKS], env=env, cwd=ROOT, timeout=900)


@pytest.mark.integration
def test_distillation_step_on_two_meshes_equals_one_device(worker):
  out = testing.check_section(worker, "step")
  assert out.count(" loss ") == 1 + 2  # one device, then each mesh


@pytest.mark.integration
def test_sampling_speculative_and_evaluation_on_two_meshes_equal_one_device(worker):
  out = testing.check_section(worker, "decode")
  assert out.count(" tau ") == 1 + 2


@pytest.mark.integration
def test_checkpoint_saved_under_one_mesh_restores_under_others(worker):
  out = testing.check_section(worker, "checkpoint")
  assert out.count("restored under") == 3
  assert "batch of 6 refused: batch_size=6 is not divisible by the data-parallel mesh size 4" in out
  assert "mesh of 3 x 2 refused: Mesh data=3 x model=2 = 6 does not match the 8" in out


def test_rule_naming_an_unknown_mesh_axis_is_refused():
  _, model = testing.tiny_pair(vocab_size=64)
  rules = partitioning.LOGICAL_AXIS_RULES + (("extra", "tensor"),)
  with pytest.raises(ValueError, match="names mesh axis 'tensor'.*its axes: \\('data', "
                     "'model'\\)"):
    partitioning.param_shardings(model, partitioning.make_mesh(), rules)


def test_logical_name_without_a_rule_is_refused():
  _, model = testing.tiny_pair(vocab_size=64)
  rules = tuple(r for r in partitioning.LOGICAL_AXIS_RULES if r[0] != "mlp")
  with pytest.raises(ValueError, match="No logical-axis rule for \\['mlp'\\]"):
    partitioning.param_shardings(model, partitioning.make_mesh(), rules)


def test_optimizer_state_follows_the_parameters():
  import jax
  from distillspec_jax.training import trainer
  _, model = testing.tiny_pair(vocab_size=64)
  mesh = partitioning.make_mesh()
  shardings = partitioning.param_shardings(model, mesh)
  for name in ("adamw", "adafactor"):
    optimizer = trainer.OptimizerSpec(name, 1e-3, 0, 10, 0.1).make()
    shapes = jax.eval_shape(optimizer.init, model.param_shapes())
    out = partitioning.optimizer_state_shardings(shapes, model.param_shapes(), shardings, mesh)
    assert jax.tree.structure(out) == jax.tree.structure(shapes)
    assert all(s.mesh == mesh for s in jax.tree.leaves(out))
