"""Optimiser and learning-rate schedule of DistillSpec (Zhou et al., ICLR 2024).

Paper recipe (Knowl 4): Adafactor, base learning rate 3e-4, 5,000 linear warm-up
steps starting from 0, then cosine decay to 0.1x the base rate, reached at step
300,000 (the schedule stays at 0.1x afterwards); batch size 32.

The batch size is not the optimiser's business; it is exported with the other
paper defaults so configs can refer to one place.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import jax.numpy as jnp
import optax

PAPER_BASE_LEARNING_RATE = 3e-4
PAPER_WARMUP_STEPS = 5_000
PAPER_TOTAL_STEPS = 300_000
PAPER_FINAL_FRACTION = 0.1
PAPER_BATCH_SIZE = 32

OPTIMIZERS = ("adafactor", "adamw")


def learning_rate_schedule(
    base_learning_rate: float = PAPER_BASE_LEARNING_RATE,
    warmup_steps: int = PAPER_WARMUP_STEPS,
    total_steps: int = PAPER_TOTAL_STEPS,
    final_fraction: float = PAPER_FINAL_FRACTION,
) -> optax.Schedule:
  """Linear warm-up from 0 followed by cosine decay to a floor.

    lr(s) = base * s / warmup                                      s < warmup
    lr(s) = base * (f + (1 - f) * 0.5 * (1 + cos(pi * u)))          otherwise,
            u = clip((s - warmup) / (total - warmup), 0, 1)

  so lr(warmup) = base, lr(total) = f * base, and lr(s) = f * base for all
  s >= total.

  Args:
    base_learning_rate: peak learning rate (> 0).
    warmup_steps: length of the linear warm-up (>= 0).
    total_steps: step at which the cosine reaches the floor (> 0, >= warmup).
    final_fraction: floor as a fraction of the base rate, in [0, 1].

  Returns:
    optax schedule mapping a (scalar, possibly traced) step to a float32 rate.
  """
  if not base_learning_rate > 0:
    raise ValueError(f"base_learning_rate must be > 0; got {base_learning_rate!r}.")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0; got {warmup_steps!r}.")
  if total_steps <= 0:
    raise ValueError(f"total_steps must be > 0; got {total_steps!r}.")
  if warmup_steps > total_steps:
    raise ValueError(
        f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})."
    )
  if not 0.0 <= final_fraction <= 1.0:
    raise ValueError(f"final_fraction must lie in [0, 1]; got {final_fraction!r}.")

  # max(., 1) only guards the degenerate warmup == 0 / warmup == total cases,
  # where the guarded branch is never selected.
  warmup_denominator = float(max(warmup_steps, 1))
  decay_denominator = float(max(total_steps - warmup_steps, 1))

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warmup_lr = base_learning_rate * step / warmup_denominator
    progress = jnp.clip((step - warmup_steps) / decay_denominator, 0.0, 1.0)
    # Explicit so that a zero-length decay (warmup == total) still ends at the floor.
    progress = jnp.where(step >= total_steps, 1.0, progress)
    cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
    decay_lr = base_learning_rate * (final_fraction + (1.0 - final_fraction) * cosine)
    return jnp.where(step < warmup_steps, warmup_lr, decay_lr)

  return schedule


def _paper_schedule() -> optax.Schedule:
  # Separate name because make_optimizer's argument shadows learning_rate_schedule.
  return learning_rate_schedule()


def make_optimizer(
    name: str = "adafactor",
    learning_rate_schedule: Optional[Union[float, optax.Schedule]] = None,
    *,
    multiply_by_parameter_scale: bool = True,
    weight_decay: float = 0.0,
    clip_gradient_norm: Optional[float] = None,
) -> optax.GradientTransformation:
  """Builds the draft model's optimiser.

  Args:
    name: "adafactor" (paper) or "adamw" (tiny CPU demos, where Adafactor's
      parameter-relative steps converge slowly from small initialisations).
    learning_rate_schedule: a float or optax schedule; None = the paper schedule
      ``learning_rate_schedule()`` with its defaults.
    multiply_by_parameter_scale: Adafactor only.  Default True, as in T5X's
      Adafactor, which the paper's (T5X-based) recipe is built on: the update
      is scaled by max(RMS(param), 1e-3), so 3e-4 is a *relative* step.  Set
      False for an absolute step size.
    weight_decay: decoupled weight decay (AdamW's ``weight_decay``; Adafactor's
      ``weight_decay_rate``).  0 = none, as in the paper.
    clip_gradient_norm: optional global-norm clipping applied before the
      optimiser (Adafactor also clips its own update RMS at 1.0, as T5X does).

  Returns:
    optax.GradientTransformation.
  """
  if name not in OPTIMIZERS:
    raise ValueError(
        f"Unknown optimizer {name!r}; valid names are {', '.join(map(repr, OPTIMIZERS))}."
    )
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0; got {weight_decay!r}.")
  if clip_gradient_norm is not None and not clip_gradient_norm > 0:
    raise ValueError(f"clip_gradient_norm must be > 0 or None; got {clip_gradient_norm!r}.")

  schedule = learning_rate_schedule
  if schedule is None:
    schedule = _paper_schedule()
  elif isinstance(schedule, numbers.Real) and not schedule > 0:
    raise ValueError(f"learning rate must be > 0; got {schedule!r}.")

  if name == "adafactor":
    # optax's other defaults equal T5X's Adafactor: decay_rate 0.8, no momentum,
    # factored second moments for dims >= 128, update clipping threshold 1.0.
    optimizer = optax.adafactor(
        learning_rate=schedule,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        weight_decay_rate=weight_decay or None,
    )
  else:
    optimizer = optax.adamw(learning_rate=schedule, weight_decay=weight_decay)

  if clip_gradient_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(clip_gradient_norm), optimizer)
  return optimizer
