"""How well a draft's confidence signals predict the target's acceptance: reliability and ECE.

Two signals per position of a teacher-forced batch, both read before the draft's next token
is drawn, as the adaptive draft-length rules read them (decoding/speculative.py):
  top_probability: the draft's top probability at the temperature (at 1 when greedy);
  acceptance_head: the acceptance head's probability (drafts built with one).
The outcome is the acceptance the target gives there (distill/acceptance_signal.py): greedy,
1 when the argmaxes agree; sampled, sum_v min(p_v, q_v), the expected acceptance (a soft
outcome, so a bin's accuracy is its mean acceptance probability).

Expected calibration error over equal-width bins of the signal:
  ECE = sum_b (n_b / n) |mean outcome in b - mean signal in b|.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from distillspec_jax.core.validation import check_positive_int
from distillspec_jax.decoding.speculative import top_probability
from distillspec_jax.distill.acceptance_signal import acceptance_labels
from distillspec_jax.distill.objectives import training_features
from distillspec_jax.models.model import Model

SIGNALS = ("top_probability", "acceptance_head")


@dataclasses.dataclass(frozen=True)
class Reliability:
  """A signal's reliability table: per bin b of [0, 1] in `bins` equal parts,
  count[b] positions, confidence[b] their mean signal and accuracy[b] their mean outcome
  (NaN for an empty bin); ece the expected calibration error, positions the total."""

  ece: float
  count: tuple
  confidence: tuple
  accuracy: tuple
  positions: int

  def as_dict(self) -> dict:
    nan_to_none = lambda xs: [None if np.isnan(x) else float(x) for x in xs]
    return dict(ece=self.ece, positions=self.positions, count=list(self.count),
                confidence=nan_to_none(self.confidence), accuracy=nan_to_none(self.accuracy))


def reliability(signal, outcome, weights=None, bins: int = 10) -> Reliability:
  """The reliability table of `signal` against `outcome` (same shape, both in [0, 1]) over the
  positions whose weight is > 0 (all when None)."""
  bins = check_positive_int(bins, "bins")
  signal = np.asarray(signal, np.float64).ravel()
  outcome = np.asarray(outcome, np.float64).ravel()
  if signal.shape != outcome.shape:
    raise ValueError(f"signal has {signal.size} positions but outcome {outcome.size}.")
  keep = np.ones_like(signal, bool) if weights is None else np.asarray(weights).ravel() > 0
  signal, outcome = signal[keep], outcome[keep]
  bad = ~np.isfinite(signal) | (signal < 0) | (signal > 1)
  if bad.any():
    raise ValueError(f"signal holds {int(bad.sum())} values outside [0, 1] "
                     f"(first: {signal[bad][0]!r}); pass probabilities.")
  if signal.size == 0:
    raise ValueError("No positions to calibrate (every weight is 0).")
  index = np.minimum((signal * bins).astype(int), bins - 1)
  count = np.bincount(index, minlength=bins)
  with np.errstate(invalid="ignore", divide="ignore"):
    confidence = np.bincount(index, signal, bins) / count
    accuracy = np.bincount(index, outcome, bins) / count
  gaps = np.where(count > 0, np.abs(accuracy - confidence), 0.0)
  ece = float(np.sum(count * gaps) / signal.size)
  return Reliability(ece=ece, count=tuple(int(c) for c in count),
                     confidence=tuple(confidence), accuracy=tuple(accuracy),
                     positions=int(signal.size))


def raw_signals(target: Model, target_params, draft: Model, draft_params, batch: dict,
                *, temperature: float) -> dict:
  """{"signals": {name: [b, L]}, "outcome": [b, L], "weights": [b, L]} of a teacher-forced
  `batch` (T5X features), outcomes at `temperature`; the head's signal only for a draft
  with one. Callers pool several batches before `reliability`."""
  features = training_features(batch, draft)
  target_logits = target.logits(target_params, features)
  if draft.acceptance_head is None:
    draft_logits, head = draft.logits(draft_params, features), None
  else:
    draft_logits, head = draft.logits_with_acceptance(draft_params, features)
  signals = {"top_probability": top_probability(draft_logits, temperature)}
  if head is not None:
    signals["acceptance_head"] = jax.nn.sigmoid(head)
  return jax.device_get({"signals": signals,
                         "outcome": acceptance_labels(target_logits, draft_logits, temperature),
                         "weights": features["decoder_loss_weights"]})


def signal_calibration(target: Model, target_params, draft: Model, draft_params, batch: dict,
                       *, temperature: float, bins: int = 10) -> dict:
  """{signal name: Reliability} at the loss-weighted positions of a teacher-forced `batch`
  (T5X features), outcomes at `temperature`; the head's row only for a draft with one."""
  raw = raw_signals(target, target_params, draft, draft_params, batch, temperature=temperature)
  return {name: reliability(value, raw["outcome"], raw["weights"], bins)
          for name, value in raw["signals"].items()}


def pooled_calibration(target: Model, target_params, draft: Model, draft_params, batches,
                       *, temperature: float, bins: int = 10) -> dict:
  """{signal name: Reliability} pooled over the loss-weighted positions of every teacher-forced
  batch in `batches` (an iterable of T5X feature dicts), outcomes at `temperature`."""
  pooled = []
  for batch in batches:
    pooled.append(raw_signals(target, target_params, draft, draft_params, batch,
                              temperature=temperature))
  if not pooled:
    raise ValueError("No batches to calibrate on; pass at least one.")
  joined = lambda get: np.concatenate([np.ravel(get(raw)) for raw in pooled])
  outcome, weights = joined(lambda r: r["outcome"]), joined(lambda r: r["weights"])
  return {name: reliability(joined(lambda r, n=name: r["signals"][n]), outcome, weights, bins)
          for name in pooled[0]["signals"]}


def reliability_of_json(data: dict) -> Reliability:
  """The Reliability of its `as_dict` (None bins read back as NaN)."""
  nan = lambda xs: tuple(float("nan") if x is None else float(x) for x in xs)
  return Reliability(ece=float(data["ece"]), count=tuple(int(c) for c in data["count"]),
                     confidence=nan(data["confidence"]), accuracy=nan(data["accuracy"]),
                     positions=int(data["positions"]))


def write_reliability_diagram(path: str, tables: dict, title: Optional[str] = None) -> None:
  """A PNG at `path`: each signal's mean outcome against its mean signal per bin (the
  diagonal is perfect calibration), its ECE in the legend; below, the positions per bin."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  figure, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1]})
  top.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
  for name, table in tables.items():
    bins = len(table.count)
    centres = (np.arange(bins) + 0.5) / bins
    filled = np.asarray(table.count) > 0
    top.plot(np.asarray(table.confidence)[filled], np.asarray(table.accuracy)[filled],
             marker="o", label=f"{name} (ECE {table.ece:.3f})")
    bottom.bar(centres, table.count, width=1.0 / bins, alpha=0.5, label=name)
  top.set_ylabel("acceptance (mean per bin)")
  top.set_xlim(0, 1)
  top.set_ylim(0, 1)
  top.legend(loc="upper left", fontsize=8)
  if title:
    top.set_title(title, fontsize=9)
  bottom.set_xlabel("signal (mean per bin)")
  bottom.set_ylabel("positions")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
