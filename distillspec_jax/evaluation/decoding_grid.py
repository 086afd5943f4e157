"""The speculative-decoding grid an evaluation sweeps: one frozen config, shared by the eval
binary (`EvalConfig.grid`) and the main job (`PipelineConfig.grid`), checked when it is made.

gin (the binaries register it): `EvalConfig.grid = @DecodingGrid()`,
`DecodingGrid.gammas = %GAMMAS`, `DecodingGrid.draft_length = @DraftLength()`,
`DraftLength.rule = %DRAFT_LENGTH_RULE`.
"""

from __future__ import annotations

import dataclasses

from distillspec_jax.core.validation import check_distinct, check_field_types, check_grid
from distillspec_jax.decoding.speculative import DraftLength, Lenience


@dataclasses.dataclass(frozen=True)
class DecodingGrid:
  """Every (temperature, gamma, lenience) point an evaluation decodes, and the draft-length
  rule of all of them.

  Attributes:
    gammas: draft tokens per round (gamma_max of an adaptive draft length), integers >= 1.
    temperatures: sampling temperatures, >= 0 (0 is greedy).
    lenience_kinds / epsilons: the lenience grid, every kind at every epsilon
      (speculative.Lenience; epsilon 1 is lossless; a lossy one needs temperatures > 0).
    draft_length: how many draft tokens a row proposes per round (speculative.DraftLength:
      'fixed' gamma, or an adaptive rule up to gamma).
  """

  gammas: tuple = (3, 5, 7)
  temperatures: tuple = (0.0, 1.0)
  lenience_kinds: tuple = ("lin",)
  epsilons: tuple = (1.0,)
  draft_length: DraftLength = DraftLength()

  def __post_init__(self):
    check_field_types(self)
    check_grid(self.gammas, self.temperatures,
               names=("DecodingGrid.gammas", "DecodingGrid.temperatures"))
    for name, example in (("lenience_kinds", "('lin',)"),
                          ("epsilons", "(1.0,) for lossless decoding")):
      values = getattr(self, name)
      if not isinstance(values, (tuple, list)) or not values:
        raise ValueError(f"DecodingGrid.{name}={values!r} must be a non-empty tuple; pass "
                         f"e.g. {example}.")
    for name, values, make in (("lenience_kinds", self.lenience_kinds, Lenience),
                               ("epsilons", self.epsilons, lambda e: Lenience("lin", e))):
      for value in values:
        try:
          make(value)
        except (TypeError, ValueError) as error:
          raise ValueError(f"DecodingGrid.{name} has {value!r}: {error}") from None
      check_distinct(values, f"DecodingGrid.{name}")
    for lenience in self.leniences:  # a lossy lenience at T = 0 has no meaning: refused
      for temperature in self.temperatures:
        try:
          lenience.check_temperature(temperature)
        except ValueError as error:
          raise ValueError(f"DecodingGrid.epsilons={tuple(self.epsilons)} with "
                           f"DecodingGrid.temperatures={tuple(self.temperatures)}: "
                           f"{error}") from None
    if not isinstance(self.draft_length, DraftLength):
      raise TypeError(f"DecodingGrid.draft_length={self.draft_length!r} must be a "
                      "DraftLength (gin: DecodingGrid.draft_length = @DraftLength()).")
    self.draft_length.check_gamma_max(max(self.gammas))

  @property
  def leniences(self) -> list:
    """Every kind at every epsilon, as the engine's Lenience objects."""
    return [Lenience(kind, epsilon) for kind in self.lenience_kinds
            for epsilon in self.epsilons]
