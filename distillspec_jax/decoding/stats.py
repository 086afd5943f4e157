"""tau and alpha of speculative decoding, derived in one place from per-row counts.

tau (block efficiency) = tokens produced by verification rounds / target verification calls;
alpha = accepted draft tokens that reach the output / drafted tokens. Every caller (the
trainer's eval, the main job, the garden, the eval binary) reads them from here.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def ratio_stderr(numerators, denominators) -> float:
  """Standard error over items of the ratio estimate sum(num) / sum(den) (delta method),
  e.g. tau = sum(produced) / sum(target calls) over prompts. 0 for fewer than two items."""
  num = np.asarray(numerators, np.float64)
  den = np.asarray(denominators, np.float64)
  n = len(num)
  if n < 2 or den.sum() <= 0:
    return 0.0
  residual = num - num.sum() / den.sum() * den
  return float(np.sqrt(np.sum(residual ** 2) / (n * (n - 1))) / den.mean())


def block_statistics(produced, target_calls, accepted, drafted,
                     accepted_proposed: Optional[np.ndarray] = None) -> dict:
  """tau with its standard error over rows, and alpha, from per-row counts (each [rows]).

  `alpha_proposed` (when `accepted_proposed` is given) also counts the accepted draft tokens
  that an EOS or the length limit cut off."""
  produced, calls = np.asarray(produced, np.int64), np.asarray(target_calls, np.int64)
  accepted, drafted = np.asarray(accepted, np.int64), np.asarray(drafted, np.int64)
  stats = {"tau": float(produced.sum() / max(calls.sum(), 1)),
           "tau_stderr": ratio_stderr(produced, calls),
           "alpha": float(accepted.sum() / max(drafted.sum(), 1))}
  if accepted_proposed is not None:
    proposed = np.asarray(accepted_proposed, np.int64)
    stats["alpha_proposed"] = float(proposed.sum() / max(drafted.sum(), 1))
  return stats


def block_efficiency_stats(result) -> dict:
  """`block_statistics` of a SpeculativeResult: tau, tau_stderr, alpha and alpha_proposed."""
  return block_statistics(result.produced, result.target_calls, result.accepted,
                          result.drafted, result.accepted_proposed)


def acceptance_by_position(accepted_per_round, gamma: int) -> list:
  """Acceptance rate at each draft position 1..gamma, from `accepted_per_round` ([N, R], -1
  where a row had no round; SpeculativeResult.accepted_per_round, one array or a list of
  them): among the rounds whose first i - 1 draft tokens were accepted, the fraction that
  accepted the i-th as well. None where no round reached position i. A round that EOS or the
  length limit cut counts as accepting only the tokens that reached the output."""
  if isinstance(accepted_per_round, (list, tuple)):
    accepted = np.concatenate([np.asarray(a).reshape(-1) for a in accepted_per_round])
  else:
    accepted = np.asarray(accepted_per_round).reshape(-1)
  accepted = accepted[accepted >= 0]
  rates = []
  for position in range(1, int(gamma) + 1):
    reached = int(np.sum(accepted >= position - 1))
    rates.append(float(np.sum(accepted >= position) / reached) if reached else None)
  return rates
