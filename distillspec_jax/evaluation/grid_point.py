"""The record of one point of the decoding grid: the settings every evaluation row carries."""

from __future__ import annotations

import dataclasses

from distillspec_jax.core.records import JsonRecord
from distillspec_jax.decoding.speculative import DraftLength, Lenience


@dataclasses.dataclass(frozen=True)
class GridPoint(JsonRecord):
  """One (gamma, temperature, lenience, draft length rule) of speculative decoding.

  Attributes:
    gamma: draft tokens per round (an adaptive rule's gamma_max).
    temperature: the sampling temperature of both models.
    lenience / epsilon: speculative.Lenience's kind and epsilon (epsilon 1: lossless).
    draft_length / threshold: speculative.DraftLength's rule and threshold.
    signal: speculative.DraftLength's stop signal ("top_probability", or "acceptance_head":
      the draft's calibrated acceptance estimate), so rows of one adaptive rule on either
      signal stay apart. Rows written before the field read back as "top_probability".
  """

  gamma: int
  temperature: float
  lenience: str = "lin"
  epsilon: float = 1.0
  draft_length: str = "fixed"
  threshold: float = 0.0
  signal: str = "top_probability"

  @classmethod
  def of(cls, gamma: int, temperature: float, lenience: Lenience = Lenience(),
         draft_length: DraftLength = DraftLength()) -> "GridPoint":
    """The point of the engine's objects."""
    return cls(int(gamma), float(temperature), lenience.kind, float(lenience.epsilon),
               draft_length.rule, float(draft_length.threshold), draft_length.signal)

  @property
  def lenience_rule(self) -> Lenience:
    return Lenience(self.lenience, self.epsilon)
