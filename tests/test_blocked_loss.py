"""The blocked loss (distill/blocked.py): exact to the unblocked one, never whole logits;
bench/blocked_loss_memory.py's argument checks (its smoke run and the checks of its JSON:
test_bench_smoke.py)."""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import testing

from distillspec_jax.distill import blocked
from distillspec_jax.distill import divergences
from distillspec_jax.distill import objectives as D
from distillspec_jax.distill import teacher_cache
from distillspec_jax.models.model import Model
from distillspec_jax.studies.pipeline_config import distillation_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import blocked_loss_memory  # noqa: E402


VOCAB = 50_000
BATCH, LENGTH = 2, 7


def _model(width: int) -> Model:
  return Model.from_name("tiny_llama", vocab_size=VOCAB, emb_dim=width, num_heads=2,
                         num_kv_heads=1, head_dim=8, mlp_dim=2 * width, num_decoder_layers=1)


@pytest.fixture(scope="module")
def setup():
  target, draft = _model(16), _model(8)
  params = {"target": target.init(jax.random.PRNGKey(0)),
            "draft": draft.init(jax.random.PRNGKey(1)),
            "reference": draft.init(jax.random.PRNGKey(2))}
  tokens = jax.random.randint(jax.random.PRNGKey(3), (BATCH, LENGTH), 2, VOCAB)
  weights = jnp.asarray([[0, 1, 1, 1, 1, 0.5, 0], [0, 0, 1, 1, 1, 1, 1]], jnp.float32)
  batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": jnp.roll(tokens, -1, 1),
           "decoder_loss_weights": weights}
  return target, draft, params, batch


def _value_and_grad(objective, params, batch):
  frozen = {k: params[k] for k in objective.frozen_names}
  run = jax.jit(jax.value_and_grad(lambda p: objective.loss(p, frozen, batch), has_aux=True))
  return run(params["draft"])


def _assert_close(blocked_result, whole_result):
  (loss, metrics), grads = blocked_result
  (whole_loss, whole_metrics), whole_grads = whole_result
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-5)
  for name, value in whole_metrics.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
    assert float(jnp.linalg.norm(want)) > 0.0
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("divergence", divergences.DIVERGENCES)
def test_blocked_distillation_equals_unblocked(setup, divergence):
  """Value, metrics (TVD, predicted acceptance, AdaSPEC's selection) and gradient; blocks of 3
  do not divide the 7 positions, so the padded tail is covered too."""
  target, draft, params, batch = setup
  results = {}
  for size in (None, 3):
    config = D.DistillationConfig(divergence=divergence, top_k_fraction=0.5,
                                  loss_block_size=size)
    objective = D.DistillationObjective(target, draft, config, reference=draft)
    results[size] = _value_and_grad(objective, params, batch)
  _assert_close(results[3], results[None])


@pytest.mark.slow
def test_blocked_cross_entropy_and_teacher_cache_equal_unblocked(setup):
  target, draft, params, batch = setup
  finetune = {size: _value_and_grad(D.FinetuneObjective(draft, loss_block_size=size), params,
                                    batch) for size in (None, 2)}
  _assert_close(finetune[2], finetune[None])
  log_p = divergences.log_probs(target.logits(params["target"], batch))
  cached = dict(zip(teacher_cache.FEATURES.values(), divergences.top_k_bins(log_p, 4)))
  cached_batch = {**batch, **cached}
  config = lambda size: D.DistillationConfig(lambda1=1.0, lambda2=0.0, divergence="jsd",
                                             loss_block_size=size)
  binned = {size: _value_and_grad(teacher_cache.CachedTeacherObjective(draft, config(size)),
                                  params, cached_batch) for size in (None, 4)}
  _assert_close(binned[4], binned[None])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_encoder_decoder", "tiny_decoder_only", "tiny_llama"])
def test_projected_hidden_states_are_the_logits(name):
  """The seam every model kind offers the blocked loss: project(hidden_states) == logits."""
  model = Model.from_name(name, vocab_size=96)
  params = model.init(jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 2, 96)
  batch = {"decoder_input_tokens": tokens, "encoder_input_tokens": tokens}
  # Compiled programs (called eagerly, each operation compiles on its own for every kind).
  hidden = jax.jit(model.hidden_states)(params, batch)
  assert hidden.shape == (2, 5, model.config.emb_dim)
  project, logits = jax.jit(model.project), jax.jit(model.logits)(params, batch)
  np.testing.assert_array_equal(project(params, hidden), logits)
  np.testing.assert_array_equal(project(params, hidden[:, 1:3]), logits[:, 1:3])


def _shapes(jaxpr) -> set:
  """Every intermediate shape of a jaxpr, sub-jaxprs (scan, checkpoint, pjit) included."""
  out = set()
  for equation in jaxpr.eqns:
    out.update(tuple(v.aval.shape) for v in equation.outvars if hasattr(v.aval, "shape"))
    for param in equation.params.values():
      for sub in (param if isinstance(param, (list, tuple)) else [param]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out |= _shapes(inner)
  return out


@pytest.mark.parametrize("size", [None, 4])
def test_no_whole_logits_when_blocked(setup, size):
  """The training step's program holds [batch, block, vocab] logits, never [batch, length,
  vocab] (the unblocked program does: the check can fail)."""
  target, draft, params, batch = setup
  config = D.DistillationConfig(divergence="fkl", top_k_fraction=0.5, loss_block_size=size)
  objective = D.DistillationObjective(target, draft, config, reference=draft)
  frozen = {k: params[k] for k in objective.frozen_names}
  grad = jax.grad(lambda p: objective.loss(p, frozen, batch)[0])
  shapes = _shapes(jax.make_jaxpr(grad)(params["draft"]).jaxpr)
  assert ((BATCH, LENGTH, VOCAB) in shapes) == (size is None)
  if size is not None:
    assert (BATCH, size, VOCAB) in shapes


def test_resolve_block_size():
  assert blocked.resolve_block_size(None, 4096) is None
  assert blocked.resolve_block_size("auto", blocked.AUTO_MAX_BLOCK) is None
  assert blocked.resolve_block_size("auto", 2048) == 256
  assert blocked.resolve_block_size("auto", 300) == 150  # two equal blocks, no padding
  assert blocked.resolve_block_size(7, 7) == 7


@pytest.mark.parametrize("value,length,error,needle", [
    (0, 8, ValueError, "loss_block_size=0 must be an integer >= 1"),
    (-2, 8, ValueError, ">= 1"),
    (9, 8, ValueError, "larger than the sequence (8 positions)"),
    (2.0, 8, ValueError, "must be an integer"),
    ("big", 8, ValueError, "'auto' or None"),
])
def test_bad_block_size_is_refused(value, length, error, needle):
  with pytest.raises(error) as caught:
    blocked.resolve_block_size(value, length)
  assert needle in str(caught.value)


@pytest.mark.parametrize("value,error", [(0, ValueError), (True, TypeError), ("3", ValueError),
                                         (1.5, TypeError)])
def test_configs_refuse_a_bad_block_size_when_built(value, error):
  with pytest.raises(error, match="loss_block_size"):
    D.DistillationConfig(loss_block_size=value)
  with pytest.raises(error, match="loss_block_size"):
    D.FinetuneObjective(_model(8), loss_block_size=value)


def test_block_longer_than_the_sequence_is_refused_before_compiling(setup):
  target, draft, params, batch = setup
  objective = D.DistillationObjective(target, draft, D.DistillationConfig(loss_block_size=64))
  with pytest.raises(ValueError, match="loss_block_size=64 is larger than the sequence"):
    objective.loss(params["draft"], {"target": params["target"]}, batch)


@pytest.mark.parametrize("field,value,needle", [
    ("batch", 0, "--batch=0"), ("recipe", "kd", "--recipe='kd'"),
    ("block_sizes", "16,32", "must hold 'none'"), ("block_sizes", "none,x", "'x'")])
def test_bench_refuses_bad_arguments_before_compiling(field, value, needle):
  args = argparse.Namespace(out="unused", vocab=64, batch=1, length=8, recipe="supervised_kd",
                            block_sizes="none,4", smoke=False)
  setattr(args, field, value)
  with pytest.raises(ValueError, match=needle):
    blocked_loss_memory.run(args)


@pytest.mark.parametrize("value,error", [(0, ValueError), ("big", ValueError),
                                         (True, TypeError)])
def test_the_main_job_refuses_a_bad_block_size(tmp_path, value, error):
  with pytest.raises(error, match="loss_block_size"):
    testing.pipeline_config(tmp_path, loss_block_size=value)
  config = testing.pipeline_config(tmp_path, loss_block_size=8)
  assert distillation_config(config, "gkd").loss_block_size == 8
