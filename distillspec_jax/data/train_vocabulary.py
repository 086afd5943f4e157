"""Train a SentencePiece vocabulary on a seqio task's training text (library and CLI).

    python -m distillspec_jax.data.train_vocabulary --task=gsm8k_files \\
        --data_dir=../shared/data --out=/tmp/gsm8k_spm.model --vocab_size=1000

(``--task=embedded_arithmetic`` needs no data.) Models use T5's id layout: pad=0, eos=1,
unk=2, no bos.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence, Union

import seqio
import tensorflow_datasets as tfds

from distillspec_jax.data import batches
from distillspec_jax.data import tasks
from distillspec_jax.data import vocabularies


def task_texts(task_name: str, split: str = "train",
               max_examples: Optional[int] = 50000) -> list:
  """Raw 'inputs'/'targets' strings of a registered seqio task (before tokenizing).

  Runs the task's source and its text preprocessors, skipping the tokenizing
  steps, so the task's own vocabulary is never loaded.
  """

  task = batches.get_task(task_name)
  skip = {seqio.preprocessors.tokenize, seqio.preprocessors.tokenize_and_append_eos,
          seqio.preprocessors.append_eos, seqio.preprocessors.append_eos_after_trim,
          tasks.preprocessors.add_special_tokens}
  ds = task.source.get_dataset(split=split, shuffle=False)
  for p in task.preprocessors:
    if p in skip or getattr(p, "func", None) in skip:
      continue
    ds = p(ds)
  if max_examples:
    ds = ds.take(max_examples)
  texts = []
  for ex in tfds.as_numpy(ds):
    for key in ("inputs", "targets"):
      if key in ex:
        v = ex[key]
        texts.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
  return texts


def train_vocabulary_for_task(task_name: str, out_path: Union[str, os.PathLike],
                              vocab_size: int = 1000, split: str = "train",
                              max_examples: Optional[int] = 50000, **kwargs) -> str:
  """Trains a SentencePiece model on a task's training text; returns its path."""
  texts = task_texts(task_name, split=split, max_examples=max_examples)
  return vocabularies.train_sentencepiece(texts, out_path, vocab_size=vocab_size, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m distillspec_jax.data.train_vocabulary",
      description="Train a SentencePiece vocabulary on a seqio task's training text.")
  parser.add_argument("--task", required=True,
                      help="registered task name, e.g. embedded_arithmetic, gsm8k_files")
  parser.add_argument("--out", required=True, help="output .model path")
  parser.add_argument("--vocab_size", type=int, default=1000)
  parser.add_argument("--split", default="train")
  parser.add_argument("--data_dir", default=None,
                      help="directory for file-backed tasks (registers *_files and bbh tasks)")
  parser.add_argument("--max_examples", type=int, default=50000)
  parser.add_argument("--model_type", default="unigram", choices=["unigram", "bpe"])
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO)
  if args.data_dir:
    tasks.register_file_tasks(args.data_dir)
  path = train_vocabulary_for_task(args.task, args.out, vocab_size=args.vocab_size,
                                   split=args.split, max_examples=args.max_examples,
                                   model_type=args.model_type)
  vocab = vocabularies.get_vocabulary(path)
  print(f"Wrote {path} ({vocab.vocab_size} pieces) from task {args.task!r} split {args.split!r}.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
