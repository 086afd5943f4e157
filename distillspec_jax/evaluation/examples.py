"""The evaluation examples of one process: with several processes, each reads its rows only.

  examples, place = read_examples("xsum", "test", {"inputs": 1024, "targets": 64},
                                  num_examples=1000, mesh=mesh, batch_size=32)

Every evaluation batch of `batch_size` rows is split over the mesh's 'data' axis
(placement.BatchPlacement); a process hands the decoders only the rows its devices hold. So
each process reads and tokenizes only the examples at those positions of the split
(batches.RowSelection: rows [start, stop) of every `batch_size`; process 0 also the first
`leading`, which it times alone), picked from the source's records before any preprocessor
runs. What every process needs of every row is small and is gathered
(`multihost.all_gather_objects`): the texts (metrics and inference lines are computed from
every row's), the token lengths (the arrays' widths) and the positions. The token arrays
keep their global shape [N, ...]; a row another process holds is padding there (the reader's
pad value, never a real token) and is never sent to a device (`BatchPlacement.put` takes
this process's rows).

Rows must match the split's positions one to one. When a preprocessor or the reading drops
or adds an example on some process (`complete` False there), or when the batch is "all
prompts" and the split holds fewer than `num_examples`, every process reads the whole split
instead, as with one process.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Mapping, Optional

import jax
import numpy as np

from distillspec_jax.evaluation.placement import BatchPlacement
from distillspec_jax.training import multihost

if TYPE_CHECKING:
  from distillspec_jax.data import batches

# What every process needs of every row (gathered); the tokens stay where they were read.
SHARED_FIELDS = ("positions", "prompt_lengths", "target_lengths", "prompt_texts",
                 "target_texts")


def read_examples(task: str, split: str, sequence_lengths: Optional[Mapping[str, int]], *,
                  num_examples: int, mesh=None, batch_size: Optional[int] = None,
                  leading: int = 0, **reading) -> tuple:
  """(examples, placement) of this process's evaluation of `task`.

  examples: batches.Examples over all N rows, with `local` [N]: the rows whose tokens this
    process read (the others are all padding). placement: the BatchPlacement of every batch
    (`batch_size` rows; None = all N in one batch), or None without a mesh.
  `reading`: more keyword arguments of batches.get_prompts_and_targets (on_long_prompt,
  lm_prompt_length).
  """
  from distillspec_jax.data import batches  # pylint: disable=g-import-not-at-top  (seqio, TF)
  period = batch_size or num_examples
  place = None if mesh is None else BatchPlacement(mesh, period)
  if place is not None and jax.process_count() > 1 and place.split:
    rows = place.rows
    selection = batches.RowSelection(period, rows.start, rows.stop,
                                  leading if multihost.is_primary() else 0)
    mine = batches.get_prompts_and_targets(task, split, sequence_lengths,
                                        num_examples=num_examples, rows=selection, **reading)
    parts = multihost.all_gather_objects(
        {"complete": mine.complete, **{k: getattr(mine, k) for k in SHARED_FIELDS}})
    examples = assemble(parts, mine, sequence_lengths)
    # No row at all: the whole read below raises the reader's own error for that.
    if examples is not None and len(examples) and (
        batch_size or len(examples) == num_examples):
      return examples, place
    logging.warning("Evaluation of %s/%s: the rows do not match the split's positions one to "
                    "one (or fewer than %d examples); every process reads the whole split.",
                    task, split, num_examples)
  examples = batches.get_prompts_and_targets(task, split, sequence_lengths,
                                             num_examples=num_examples, **reading)
  examples = dataclasses.replace(examples, local=np.ones(len(examples), bool))
  if mesh is not None:
    place = BatchPlacement(mesh, batch_size or len(examples))
  return examples, place


def assemble(parts: list, mine: batches.Examples,
             sequence_lengths: Optional[Mapping[str, int]]) -> Optional[batches.Examples]:
  """All rows' examples from every process's shared fields (`parts`, in process order, each
  with SHARED_FIELDS and "complete") and this process's own read (`mine`), or None when a
  process's rows do not match its positions (a part not complete)."""
  from distillspec_jax.data import batches  # pylint: disable=g-import-not-at-top
  if not all(part["complete"] for part in parts):
    return None
  shared = {}
  for part in parts:
    for row, position in enumerate(part["positions"]):
      shared.setdefault(int(position), {k: part[k][row] for k in SHARED_FIELDS[1:]})
  count = len(shared)
  if sorted(shared) != list(range(count)):
    raise ValueError(f"The processes read the positions {sorted(shared)[:20]}..., not 0..."
                     f"{count - 1}: their row selections must cover every row of a batch.")
  rows = [shared[i] for i in range(count)]
  lengths = dict(sequence_lengths or {})
  prompt_lengths = np.asarray([r["prompt_lengths"] for r in rows], np.int32)
  target_lengths = np.asarray([r["target_lengths"] for r in rows], np.int32)
  widths = {"prompts": lengths.get("inputs", int(prompt_lengths.max(initial=0))),
            "targets": lengths.get("targets", int(target_lengths.max(initial=0)))}
  local = np.zeros(count, bool)
  local[mine.positions] = True
  tokens = {}
  for key, width in widths.items():
    # The reader's padding, never 0 (a real token of a Hugging Face tokenizer): past a row's
    # own tokens and on the rows another process holds.
    array = np.full((count, width), mine.pad, np.int32)
    own = np.asarray(getattr(mine, key))[:, :width]
    array[mine.positions, :own.shape[1]] = own
    tokens[key] = array
  return batches.Examples(prompt_lengths=prompt_lengths, target_lengths=target_lengths,
                          prompt_texts=[r["prompt_texts"] for r in rows],
                          target_texts=[r["target_texts"] for r in rows], local=local,
                          pad=mine.pad, **tokens)
