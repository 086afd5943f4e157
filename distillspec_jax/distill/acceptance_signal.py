"""The acceptance head's training signal: what the target would accept, and a cross-entropy.

At each position of a teacher-forced batch (the data source's positions: fixed data, draft
or target samples alike) the head predicts, before the draft's next token is drawn, the
probability that the target accepts it:

  greedy (temperature 0): 1 when the draft's argmax equals the target's, else 0 (a hard
    label; greedy verification accepts exactly the target's argmax). A NaN in either
    model's logits at a position makes its label NaN (as the sampled label's sum does).
  sampled (temperature T > 0): alpha = sum_v min(p_v, q_v) at temperature T, a soft label:
    the expectation over the draft's token y ~ q of min(1, p(y) / q(y)), the acceptance
    probability of speculative sampling (Leviathan et al. 2023). The soft label is the
    expected outcome itself, so the cross-entropy has the same minimiser as one on sampled
    0/1 outcomes with less variance.

Labels carry no gradient: the head (models/acceptance_head.py) learns to predict them, and
reads the draft's hidden state through a stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillspec_jax.decoding.plain import probabilities

Array = jax.Array


def acceptance_labels(target_logits: Array, draft_logits: Array, temperature: float) -> Array:
  """[b, L] labels in [0, 1] from logits [b, L, V] (see the module docstring)."""
  target_logits = jax.lax.stop_gradient(target_logits)
  draft_logits = jax.lax.stop_gradient(draft_logits)
  if temperature == 0.0:
    agree = (jnp.argmax(target_logits, -1) == jnp.argmax(draft_logits, -1)).astype(jnp.float32)
    # argmax of a row holding NaN is an index: keep the NaN instead of a 0/1 label.
    bad = jnp.isnan(target_logits).any(-1) | jnp.isnan(draft_logits).any(-1)
    return jnp.where(bad, jnp.nan, agree)
  p = probabilities(target_logits, temperature)
  q = probabilities(draft_logits, temperature)
  return jnp.sum(jnp.minimum(p, q), axis=-1)


def binary_cross_entropy(logits: Array, labels: Array) -> Array:
  """Elementwise -[y log s(x) + (1 - y) log(1 - s(x))] for soft labels y in [0, 1], computed
  as softplus(x) - y x (finite for every finite x)."""
  return jax.nn.softplus(logits) - labels * logits


def acceptance_loss(head_logits: Array, labels: Array, weights: Array) -> tuple:
  """(mean cross-entropy over the weighted positions, metrics): head_logits, labels,
  weights [b, L]; metrics hold the loss, the mean predicted and the mean label."""
  total = jnp.maximum(jnp.sum(weights), 1.0)
  mean = lambda x: jnp.sum(x * weights) / total
  loss = mean(binary_cross_entropy(head_logits, labels))
  return loss, {"acceptance_bce": loss,
                "acceptance_predicted": mean(jax.nn.sigmoid(jax.lax.stop_gradient(head_logits))),
                "acceptance_label": mean(labels)}
