"""Prompt-only tasks for cross-task transfer: drafts distilled on one task, evaluated on these.

Both format their prompts as GSM8K's zero-shot chain of thought does
('Q: <text> A: Let's think step by step.', preprocessors.cot_prompt), so that a draft
distilled on GSM8K sees the prompt style it was trained with and only the content changes
(the paper's GSM8K -> BBH setting). Metric: ROUGE against the reference (a quality check;
these tasks are for tau, alpha and speed).

  task         folder (under data_dir)   files
  mbpp_files   mbpp/                     *.jsonl {"text", "code"}: the problem -> the code
  alpaca_files alpaca/                   *.json, a list of {"instruction", "input", "output"}:
                                         the instruction (and its input) -> the output
The mixture 'gsm8k_transfer' holds both. Every file is in the 'test' split (file_tasks.discover_split_files rules apply).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Dict, List, Optional, Sequence

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies
from distillspec_jax.data.tasks import file_tasks, metrics
from distillspec_jax.data.tasks import preprocessors as preprocessors_lib
from distillspec_jax.data.tasks import tfds_tasks


@seqio.map_over_dataset
def _cot(x):
  return {"inputs": preprocessors_lib.cot_prompt(x["question"]),
          "targets": tf.strings.strip(x["answer"])}


def cot_question_answer(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """{'question', 'answer'} -> GSM8K-style zero-shot CoT prompt / the answer."""
  return _cot(dataset)


def _mbpp_records(files: Sequence[str]) -> Dict[str, List[str]]:
  cols = {"question": [], "answer": []}
  for path in files:
    for row in file_tasks.read_jsonl(path, ("text", "code")):
      cols["question"].append(str(row["text"]))
      cols["answer"].append(str(row["code"]).replace("\r\n", "\n"))
  return cols


def _alpaca_records(files: Sequence[str]) -> Dict[str, List[str]]:
  cols = {"question": [], "answer": []}
  for path in files:
    with open(path, encoding="utf-8") as f:
      try:
        records = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg}); expected a list of "
                         "{\"instruction\", \"input\", \"output\"} objects.") from None
    if not isinstance(records, list):
      raise ValueError(f"{path}: expected a JSON list of Alpaca records.")
    for i, r in enumerate(records):
      if not isinstance(r, dict) or not {"instruction", "output"} <= set(r):
        raise ValueError(f"{path}: record {i} needs 'instruction' and 'output', got "
                         f"{str(r)[:80]!r}.")
      question = r["instruction"] + (" " + r["input"] if r.get("input") else "")
      cols["question"].append(question)
      cols["answer"].append(r["output"])
  return cols


def _register(name: str, directory: str, suffixes, read_fn, vocabulary) -> seqio.Task:
  files = file_tasks.discover_split_files(directory, suffixes)
  if not files:
    raise FileNotFoundError(f"{name}: no {'/'.join(suffixes)} files in {directory!r}.")
  return tfds_tasks.register_task(
      name, source=file_tasks.records_source(files, read_fn),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary)),
      preprocessors=tfds_tasks.text_task_preprocessors(cot_question_answer),
      metric_fns=[functools.partial(metrics.rouge, score_keys=("rouge1", "rougeL"))])


MIXTURE_NAME = "gsm8k_transfer"


def register_prompt_tasks(data_dir: str,
                          vocabulary: Optional[vocabularies.VocabLike] = None) -> List[str]:
  """Registers mbpp_files and alpaca_files for the folders `data_dir` has, and their mixture
  'gsm8k_transfer'; returns the names."""
  names = []
  for name, folder, suffixes, read_fn in (("mbpp_files", "mbpp", (".jsonl",), _mbpp_records),
                                          ("alpaca_files", "alpaca", (".json",),
                                           _alpaca_records)):
    path = os.path.join(data_dir, folder)
    if os.path.isdir(path):
      names.append(_register(name, path, suffixes, read_fn, vocabulary).name)
  if names:
    tfds_tasks.register_mixture(MIXTURE_NAME, names)
    names.append(MIXTURE_NAME)
  return names


def check_bbh_dir(bbh_dir: str) -> None:
  """Refuses a BBH_DIR that is not the public layout's bbh/ folder, naming the fix."""
  fix = ("point BBH_DIR at the bbh/ folder of a checkout of the public BIG-Bench-Hard "
         "repository (github.com/suzgunmirac/BIG-Bench-Hard), which holds one JSON file per "
         "subtask: {\"examples\": [{\"input\": ..., \"target\": ...}]}")
  if not os.path.isdir(bbh_dir):
    raise ValueError(f"BBH_DIR={bbh_dir!r} is not a directory; {fix}.")
  files = [f for f in os.listdir(bbh_dir) if f.endswith(".json")]
  if not files:
    inner = os.path.join(bbh_dir, "bbh")
    hint = (f" (it has a bbh/ folder: pass BBH_DIR={inner!r})" if os.path.isdir(inner)
            else "")
    raise ValueError(f"BBH_DIR={bbh_dir!r} holds no BBH files (*.json){hint}; {fix}.")
