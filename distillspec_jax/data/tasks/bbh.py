"""BIG-Bench Hard (BBH) tasks from the public layout (not in TFDS).

Directory with one JSON file per subtask, as in suzgunmirac/BIG-Bench-Hard
(bbh/<subtask>.json): ``{"examples": [{"input": ..., "target": ...}, ...]}``.
Registers ``bbh_<subtask>`` (split 'test', all examples) and a mixture ``bbh``
of all subtasks (equal rates).  Prompt: zero-shot chain of thought
('Q: <input> A: Let's think step by step.'); target: the answer string.
Metric: exact match after answer extraction (text after 'the answer is',
multiple-choice options reduced to '(X)'), see metrics.bbh_exact_match.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Dict, List, Optional

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies
from distillspec_jax.data.tasks import metrics
from distillspec_jax.data.tasks import preprocessors
from distillspec_jax.data.tasks import tfds_tasks

MIXTURE_NAME = "bbh"


def subtask_name(filename: str) -> str:
  """'logical_deduction_three_objects.json' -> 'bbh_logical_deduction_three_objects'."""
  stem = os.path.splitext(os.path.basename(filename))[0]
  return "bbh_" + re.sub(r"[^\w]", "_", stem)


def read_bbh_file(path: str) -> Dict[str, List[str]]:
  """{'input': [...], 'target': [...]} from one BBH JSON file.

  Malformed JSON raises ValueError naming the file and line; a bad example
  names the file, the example index and its line.
  """
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw[: e.start].count(b"\n") + 1
    raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason}).") from None
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                     "expected {\"examples\": [{\"input\": ..., \"target\": ...}]}.") from None
  if not isinstance(obj, dict) or not isinstance(obj.get("examples"), list):
    raise ValueError(f"{path}:1: expected a JSON object with an 'examples' list "
                     "(public BBH layout).")
  # Line of each example's opening brace, for error messages.
  lines = [text[: m.start()].count("\n") + 1 for m in re.finditer(r'\{\s*"(?:input|target)"',
                                                                   text)]
  inputs, targets = [], []
  for i, ex in enumerate(obj["examples"]):
    line = lines[i] if i < len(lines) else "?"
    if not isinstance(ex, dict) or not isinstance(ex.get("input"), str) or not isinstance(
        ex.get("target"), str):
      raise ValueError(f"{path}:{line}: example {i} must be an object with string 'input' and "
                       f"'target', got {str(ex)[:80]!r}.")
    inputs.append(ex["input"])
    targets.append(ex["target"])
  return {"input": inputs, "target": targets}


def _dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None, *,
                path: str) -> tf.data.Dataset:
  del shuffle_files, seed
  if split != "test":
    raise ValueError(f"BBH has only the 'test' split, got {split!r}.")
  cols = read_bbh_file(path)
  return tf.data.Dataset.from_tensor_slices(
      {k: tf.constant(v, dtype=tf.string, shape=[len(v)]) for k, v in cols.items()})


def register_bbh_tasks(directory: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                       mixture_name: str = MIXTURE_NAME) -> List[str]:
  """Registers one task per BBH subtask file in `directory` and the mixture.

  Returns the task names followed by the mixture name.  Raises
  FileNotFoundError if the directory is missing or has no *.json files.
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(
        f"BBH directory {directory!r} does not exist. Pass the folder with one JSON file per "
        "subtask (the public BIG-Bench-Hard bbh/ folder).")
  files = sorted(f for f in os.listdir(directory) if f.endswith(".json"))
  if not files:
    raise FileNotFoundError(f"BBH directory {directory!r} has no *.json subtask files.")
  vocab = vocabularies.as_vocabulary(vocabulary)
  names = []
  for f in files:
    name = subtask_name(f)
    source = seqio.FunctionDataSource(
        dataset_fn=functools.partial(_dataset_fn, path=os.path.join(directory, f)),
        splits=("test",))
    tfds_tasks.register_task(
        name, source=source, output_features=tfds_tasks.text_features(vocab),
        preprocessors=tfds_tasks.text_task_preprocessors(preprocessors.bbh_cot),
        metric_fns=[metrics.bbh_exact_match])
    names.append(name)
  tfds_tasks.register_mixture(mixture_name, names)
  return names + [mixture_name]
