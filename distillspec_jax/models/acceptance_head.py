"""An acceptance-probability head for a draft: the chance the target accepts its next token.

A small MLP on the draft's last hidden state (the output of its final norm, the vector its
logits are read from), one logit per position:

    acceptance_logit = w2 . gelu(W1 h + b1) + b2,     h: [..., embed] -> [...]

Its parameters sit beside the network's under `acceptance_head/` in the draft's parameter
tree, with logical axis names like every other parameter:

  acceptance_head/hidden/kernel   [embed, width]   ("embed", "mlp")
  acceptance_head/hidden_bias     [width]          ("mlp",)
  acceptance_head/output/kernel   [width, 1]       ("mlp", "acceptance")
  acceptance_head/output_bias     [1]              ("acceptance",)

The head reads the hidden state through a stop-gradient: its binary cross-entropy trains the
head only, so calibrating the signal never trades away the draft's own distribution (which is
what the target accepts). distill/acceptance_signal.py defines the labels and the loss;
decoding/speculative.py reads the head's probability as the adaptive rules' confidence.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from distillspec_jax.core.validation import check_field_types, check_positive_int
from distillspec_jax.models import layers

Array = jax.Array

PARAMS_KEY = "acceptance_head"


@dataclasses.dataclass(frozen=True)
class AcceptanceHeadConfig:
  """width: the hidden layer's width, an int >= 1."""

  width: int = 64

  def __post_init__(self):
    check_field_types(self)
    check_positive_int(self.width, "AcceptanceHeadConfig.width")


def _logical_bias(axis: str):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), (axis,))


class AcceptanceHead(nn.Module):
  """[..., embed] hidden states -> [...] acceptance logits (fp32)."""

  config: AcceptanceHeadConfig

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    x = jax.lax.stop_gradient(jnp.asarray(hidden, jnp.float32))
    x = layers.DenseGeneral((self.config.width,), ("embed", "mlp"), name="hidden")(x)
    x = jax.nn.gelu(x + self.param("hidden_bias", _logical_bias("mlp"), (self.config.width,)))
    x = layers.DenseGeneral((1,), ("mlp", "acceptance"), name="output")(x)
    return (x + self.param("output_bias", _logical_bias("acceptance"), (1,)))[..., 0]


def init_boxed(config: AcceptanceHeadConfig, rng: Array, embed: int):
  """The head's boxed (logically partitioned) parameters for hidden states of width `embed`."""
  return AcceptanceHead(config).init(rng, jnp.zeros((1, 1, embed), jnp.float32))["params"]


def apply(config: AcceptanceHeadConfig, params, hidden: Array) -> Array:
  """Acceptance logits [...] of hidden states [..., embed]."""
  return AcceptanceHead(config).apply({"params": params}, hidden)
