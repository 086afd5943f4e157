"""Statistics of speculative decoding, derived in one place from per-row counts.

Every caller (the trainer's eval, the main job, the garden, the eval binary) reads them from
here. Two families, each under its own name, so that numbers compare directly with the paper
and with the serving engines (vLLM, llama.cpp, SGLang):

- tau (block efficiency) = tokens produced by verification rounds / target verification calls
  (DistillSpec, Leviathan et al.); with its standard error over rows.
- mean_acceptance_length = 1 + accepted / draft rounds (vLLM's and llama.cpp's "mean
  acceptance length") = 1 + (drafted / rounds) x draft_acceptance_rate: the mean proposal
  length times the rate, which is gamma only under the fixed draft-length rule (an adaptive
  rule proposes fewer). It equals tau except where EOS or the length limit cut a row's last
  round.
- draft_acceptance_rate = accepted / drafted (vLLM's "draft acceptance rate"); `alpha` is the
  same number under the name earlier files used.
- alpha_distillspec = accepted / (accepted + output rejections): DistillSpec's alpha, the
  per-token acceptance probability. A round tests draft tokens until the first rejection, so
  the tests run are the accepted ones and one per rejecting round; each is accepted with
  probability 1 - TVD(p, q) at its context (lossless sampling). Counted at output positions
  only (the accepted tokens that reach the output, and the rejections whose correction
  token does): a test past an accepted EOS scores a context the output never has. So this
  is the quantity `predicted_alpha` = 1 - E[TVD] along the target's outputs predicts. draft_acceptance_rate is lower: it also
  counts the draft tokens after a rejection, which are never tested. For an acceptance
  probability alpha constant over positions, tau = (1 - alpha^(gamma+1)) / (1 - alpha).
- Per position i = 1..gamma: `acceptance_by_position` (DistillSpec's, conditional: among the
  rounds whose acceptance test at position i ran at an output position, the fraction that
  accepted; the tests it counts are alpha_distillspec's, so a draft identical to the target
  at T = 0 reads 1.0 at every position, EOS and length cuts included) and
  `draft_acceptance_rate_by_position` (vLLM's per-position rate: the fraction of all rounds
  accepting position i; these sum to mean_acceptance_length - 1).

No denominator is clamped: a statistic whose denominator is 0 is None (undefined), e.g. tau
and mean_acceptance_length when no target call ran (every row's first token EOS), the rates
when nothing was drafted.

"accepted" counts the accepted draft tokens that reach the output (an accepted EOS ends the
row and the length limit cuts the last round); "accepted by the test" counts them before that
cut (speculative.py's `accepted_proposed`, behind alpha_proposed = accepted by the test /
drafted).
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
                     accepted_proposed: Optional[np.ndarray] = None,
                     output_rejections: Optional[np.ndarray] = None) -> dict:
  """The statistics of the module docstring from per-row counts (each [rows]).

  Returns tau, tau_stderr, mean_acceptance_length, draft_acceptance_rate and alpha (the
  same); with `accepted_proposed`, alpha_proposed (accepted by the test / drafted); with
  `output_rejections` (speculative.py's), alpha_distillspec (None when no test ran).
  Undefined statistics are None, never a clamped number: tau, tau_stderr and
  mean_acceptance_length when no target call ran (every row ended at its first token: EOS, or
  a budget of one new token), the acceptance rates when nothing was drafted."""
  produced, calls = np.asarray(produced, np.int64), np.asarray(target_calls, np.int64)
  accepted, drafted = np.asarray(accepted, np.int64), np.asarray(drafted, np.int64)
  rounds, proposals = int(calls.sum()), int(drafted.sum())
  rate = float(accepted.sum() / proposals) if proposals else None
  stats = {"tau": float(produced.sum() / rounds) if rounds else None,
           "tau_stderr": ratio_stderr(produced, calls) if rounds else None,
           "mean_acceptance_length": 1.0 + float(accepted.sum() / rounds) if rounds else None,
           "draft_acceptance_rate": rate, "alpha": rate}
  if accepted_proposed is not None:
    proposed = np.asarray(accepted_proposed, np.int64)
    stats["alpha_proposed"] = float(proposed.sum() / proposals) if proposals else None
  if output_rejections is not None:
    tests = accepted.sum() + np.asarray(output_rejections, np.int64).sum()
    stats["alpha_distillspec"] = float(accepted.sum() / tests) if tests else None
  return stats


def block_efficiency_stats(result) -> dict:
  """`block_statistics` of a SpeculativeResult (every field of it)."""
  return block_statistics(result.produced, result.target_calls, result.accepted,
                          result.drafted, result.accepted_proposed, result.output_rejections)


def _flat(per_round) -> np.ndarray:
  """A per-round array ([N, R], one array or a list of them), flat."""
  if isinstance(per_round, (list, tuple)):
    return np.concatenate([np.asarray(a).reshape(-1) for a in per_round])
  return np.asarray(per_round).reshape(-1)


def _round_counts(accepted_per_round, tested_per_round=None) -> tuple:
  """(accepted, tested): every round's accepted draft tokens and acceptance tests at output
  positions, flat, from `accepted_per_round` ([N, R], -1 where a row had no round; one array
  or a list of them) and `tested_per_round` (the same layout; None: accepted + 1, every
  round ending in a rejection that reaches the output)."""
  accepted = _flat(accepted_per_round)
  tested = accepted + 1 if tested_per_round is None else _flat(tested_per_round)
  if tested.shape != accepted.shape or np.any((tested < accepted) | (tested > accepted + 1)):
    raise ValueError("tested_per_round must have accepted_per_round's layout with "
                     "accepted <= tested <= accepted + 1 in every round; pass "
                     "SpeculativeResult.tested_per_round beside its accepted_per_round.")
  return accepted[accepted >= 0], tested[accepted >= 0]


def acceptance_by_position(accepted_per_round, gamma: int, *, tested_per_round=None) -> list:
  """DistillSpec's acceptance rate at each draft position 1..gamma: among the rounds whose
  acceptance test at position i ran at an output position, the fraction that accepted it.
  None where no such test ran.

  `accepted_per_round` and `tested_per_round` are SpeculativeResult's ([N, R], -1 where a row
  had no round; one array or a list of them). A round tests positions 1..tested and accepts
  1..accepted; a round cut by an accepted EOS or the length limit tests only the positions
  that reached the output, and one whose proposal ended (an adaptive rule) tests no further.
  Summed over positions the tests are alpha_distillspec's. `tested_per_round` None reads each
  round as tested up to its first rejection (fixed gamma, no cuts: hand-made counts)."""
  accepted, tested = _round_counts(accepted_per_round, tested_per_round)
  rates = []
  for position in range(1, int(gamma) + 1):
    reached = int(np.sum(tested >= position))
    rates.append(float(np.sum(accepted >= position) / reached) if reached else None)
  return rates


def draft_acceptance_rate_by_position(accepted_per_round, gamma: int) -> list:
  """vLLM's per-position acceptance rate at draft positions 1..gamma: the fraction of all
  rounds that accepted the i-th draft token (and so every one before it); the rates sum to
  mean_acceptance_length - 1. Same input as `acceptance_by_position`; None when no round ran."""
  accepted, _ = _round_counts(accepted_per_round)
  if not accepted.size:
    return [None] * int(gamma)
  return [float(np.mean(accepted >= position)) for position in range(1, int(gamma) + 1)]
