"""The training loop's log: MODEL_DIR/metrics.jsonl (one JSON record per logged step) and
TensorBoard scalars, written by process 0, truncated to the restored step on a resume."""

from __future__ import annotations

import json
import logging
import os
import sys

import jax
import numpy as np

from distillspec_jax.training import multihost
from distillspec_jax.distill.objectives import SOURCES
from distillspec_jax.core.files import write_text_atomic


def _read_records(path: str) -> list:
  """The well-formed records of a metrics.jsonl (none if absent)."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
        record["step"] = int(record["step"])
      except (ValueError, KeyError, TypeError):
        continue
      records.append(record)
  return records


def truncate_metrics(path: str, last_step: int) -> list:
  """Keeps the records of `path` (metrics.jsonl) with step <= last_step; returns them.

  A job killed after its last checkpoint has logged steps that the resumed job logs again:
  those records (and a line torn by the kill) are dropped. The file is rewritten atomically
  (files.write_text_atomic), so a second kill leaves the old or the new file.
  """
  if not os.path.exists(path):
    return []
  kept, lines, dropped = [], [], 0
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
        step = int(record["step"])
      except (ValueError, KeyError, TypeError):
        dropped += 1  # a torn last line
        continue
      if step <= last_step:
        kept.append(record)
        lines.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    write_text_atomic(path, "".join(lines))
    logging.info("Resuming at step %d: dropped %d record(s) of %s past that step.", last_step,
                 dropped, path)
  return kept


def summary_writer(logdir: str, purge_step=None):
  """A tensorboardX SummaryWriter on `logdir`, loaded without torch: tensorboardX imports
  torch, where it is installed, only to accept torch tensors (a second of import per
  process); our writers pass Python floats. torch stays importable for anyone else."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter(logdir, purge_step=purge_step)


class MetricsWriter:
  """Appends records to MODEL_DIR/metrics.jsonl and scalars to TensorBoard (tensorboardX).

  `start_step`: the step training starts from (the restored checkpoint's, 0 when fresh).
  Records past it, logged by an earlier process after its last checkpoint, are dropped
  (`truncate_metrics`; kept in `self.resumed`), and TensorBoard purges its events past it.
  """

  def __init__(self, model_dir: str, tensorboard: bool = True, start_step: int = 0):
    self.path = os.path.join(model_dir, "metrics.jsonl")
    # One writer: process 0 truncates, appends and writes TensorBoard; the other processes
    # only read the kept records (after the truncation, behind a barrier).
    self.primary = multihost.is_primary()
    self.writer = None
    if not self.primary:
      multihost.barrier("metrics_truncated")
      self.resumed = [r for r in _read_records(self.path) if r["step"] <= start_step]
      return
    os.makedirs(model_dir, exist_ok=True)
    self.resumed = truncate_metrics(self.path, start_step)
    multihost.barrier("metrics_truncated")
    if tensorboard:
      self.writer = summary_writer(os.path.join(model_dir, "tensorboard"),
                                   purge_step=start_step + 1 if start_step else None)

  def write(self, record: dict) -> None:
    if not self.primary:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.writer is not None:
      for k, v in record.items():
        if isinstance(v, (int, float)) and k != "step":
          self.writer.add_scalar(k, v, record["step"])
      self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def summarize(pending: list, source_totals: np.ndarray, elapsed: float, step: int,
              learning_rate: float) -> dict:
  """Averages the per-step metrics of a logging interval into one JSON record."""
  fetched = jax.device_get(pending)
  record = {"step": int(step)}
  for key in fetched[0]:
    if key in ("source", "finite"):
      continue
    record[key] = float(np.mean([m[key] for m in fetched]))
  sources = np.asarray([int(m["source"]) for m in fetched])
  counts = np.bincount(sources, minlength=len(SOURCES))
  source_totals += counts
  record["source"] = SOURCES[int(sources[-1])]  # the last step's source
  for i, name in enumerate(SOURCES):
    record[f"source_count/{name}"] = int(counts[i])
    record[f"source_total/{name}"] = int(source_totals[i])
  tokens = float(np.sum([m.get("num_tokens", 0.0) for m in fetched]))
  record["tokens_per_s"] = tokens / max(elapsed, 1e-9)
  record["steps_per_s"] = len(fetched) / max(elapsed, 1e-9)
  record["learning_rate"] = float(learning_rate)
  return record
