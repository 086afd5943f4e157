"""Tests for distillspec_jax.training.optimizers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distillspec_jax.training import optimizers


def closed_form_lr(step, base=3e-4, warmup=5000, total=300000, final=0.1):
  """Independent statement of the paper schedule (Knowl 4)."""
  if step < warmup:
    return base * step / warmup
  if step >= total:
    return final * base
  progress = (step - warmup) / (total - warmup)
  return final * base + (base - final * base) * 0.5 * (1 + math.cos(math.pi * progress))


def test_paper_constants():
  assert optimizers.PAPER_BASE_LEARNING_RATE == 3e-4
  assert optimizers.PAPER_WARMUP_STEPS == 5000
  assert optimizers.PAPER_TOTAL_STEPS == 300_000
  assert optimizers.PAPER_FINAL_FRACTION == 0.1
  assert optimizers.PAPER_BATCH_SIZE == 32


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.0),
        (2500, 1.5e-4),  # mid warm-up: half the base rate
        (5000, 3e-4),  # end of warm-up: the base rate
        (152500, 0.55 * 3e-4),  # middle of the decay: halfway between base and floor
        (300000, 3e-5),  # end: 0.1x
        (400000, 3e-5),  # after: stays at 0.1x
    ],
)
def test_paper_schedule_landmarks(step, expected):
  schedule = optimizers.learning_rate_schedule()
  np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, atol=1e-12)


def test_paper_schedule_matches_closed_form_everywhere():
  schedule = optimizers.learning_rate_schedule()
  steps = [1, 1234, 4999, 5001, 10000, 77777, 150000, 222222, 299999, 300001, 10**6]
  for step in steps:
    np.testing.assert_allclose(float(schedule(step)), closed_form_lr(step), rtol=1e-5,
                               err_msg=f"step {step}")
  # Also under jit with a traced step.
  jitted = jax.jit(schedule)
  np.testing.assert_allclose(float(jitted(jnp.asarray(77777))), closed_form_lr(77777), rtol=1e-5)


def test_custom_schedule_and_degenerate_warmup():
  schedule = optimizers.learning_rate_schedule(1.0, warmup_steps=10, total_steps=110, final_fraction=0.5)
  for step in [0, 5, 10, 35, 60, 85, 110, 200]:
    np.testing.assert_allclose(
        float(schedule(step)), closed_form_lr(step, 1.0, 10, 110, 0.5), rtol=1e-5, atol=1e-7)
  no_warmup = optimizers.learning_rate_schedule(1.0, warmup_steps=0, total_steps=100)
  np.testing.assert_allclose(float(no_warmup(0)), 1.0, rtol=1e-6)
  only_warmup = optimizers.learning_rate_schedule(1.0, warmup_steps=100, total_steps=100)
  np.testing.assert_allclose(float(only_warmup(50)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(only_warmup(100)), 0.1, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(total_steps=-5), "total_steps"),
        (dict(total_steps=0), "total_steps"),
        (dict(warmup_steps=10, total_steps=5), "must not exceed"),
        (dict(base_learning_rate=0.0), "base_learning_rate"),
        (dict(final_fraction=1.5), "final_fraction"),
    ],
)
def test_schedule_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optimizers.learning_rate_schedule(**kwargs)


def test_unknown_optimizer_raises():
  with pytest.raises(ValueError, match="'sgd'.*'adafactor'.*'adamw'"):
    optimizers.make_optimizer("sgd")


def test_bad_optimizer_arguments_raise():
  with pytest.raises(ValueError, match="learning rate"):
    optimizers.make_optimizer("adamw", -1.0)
  with pytest.raises(ValueError, match="weight_decay"):
    optimizers.make_optimizer("adamw", 1e-3, weight_decay=-0.1)


def _run_quadratic(optimizer, steps=200):
  """Minimises ||W - A||^2 + ||b - c||^2 from a fixed start; returns (first, last) loss."""
  rng = np.random.default_rng(0)
  target = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  params = {"w": jnp.ones((8, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}

  def loss_fn(p):
    return sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)

  @jax.jit
  def step(p, state):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, state = optimizer.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  state = optimizer.init(params)
  first = float(loss_fn(params))
  for _ in range(steps):
    params, state, _ = step(params, state)
  return first, float(loss_fn(params))


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("adafactor", dict()),
        ("adafactor", dict(multiply_by_parameter_scale=False)),
        ("adamw", dict()),
        ("adamw", dict(weight_decay=1e-4, clip_gradient_norm=1.0)),
    ],
)
def test_optimizer_reduces_quadratic(name, kwargs):
  schedule = optimizers.learning_rate_schedule(0.05, warmup_steps=10, total_steps=200)
  first, last = _run_quadratic(optimizers.make_optimizer(name, schedule, **kwargs))
  assert last < 0.05 * first, (first, last)


def test_default_optimizer_uses_paper_schedule():
  # With the paper schedule step 0 has lr 0, so the first update is exactly zero.
  optimizer = optimizers.make_optimizer()
  params = {"w": jnp.ones((3, 3))}
  state = optimizer.init(params)
  updates, _ = optimizer.update({"w": jnp.ones((3, 3))}, state, params)
  assert np.all(np.asarray(updates["w"]) == 0.0)
  updates, _ = optimizers.make_optimizer("adafactor", 1e-2).update(
      {"w": jnp.ones((3, 3))}, optimizers.make_optimizer("adafactor", 1e-2).init(params), params)
  assert np.all(np.asarray(updates["w"]) < 0.0)
