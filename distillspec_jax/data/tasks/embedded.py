"""Embedded task: procedurally generated multi-step arithmetic word problems.

Needs no download; it is the default task of the demo.  In the spirit of GSM8K:

  inputs : "Mia has 12 shells. She buys 7 more. Then she doubles them. How many shells does Mia have?"
  targets: "12 + 7 = 19. 19 times 2 is 38. #### 38"   (each step in one of three forms)

Design for a fast CPU demo: short sequences (< 48 tokens each with the embedded
vocabulary), small numbers (operands 1-20, every intermediate result < 100),
2-3 steps, templated phrasing with a few variations.  Most target tokens are
predictable (copied operands, operators, '=', '.', '####' and the repeated final
answer); the results of the arithmetic are the tokens only a stronger model
gets right, which makes drafting meaningful.

Determinism: examples come from `random.Random(f"{seed}:{split}")`; a split is
the same list for the same seed, whatever else runs.  Splits are disjoint: each
question text hashes (SHA-1) to one of 100 buckets; test owns buckets 0-1,
validation 2-3, train 4-99, and generation rejects questions of other buckets.

The vocabulary is a SentencePiece BPE model (256 pieces, digits split into single
characters) trained on generated text; `embedded_vocabulary()` returns it lazily
and builds the file (a few seconds) on first use if it does not exist.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from typing import Dict, List, Optional, Tuple

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies
from distillspec_jax.data.tasks import metrics
from distillspec_jax.data.tasks import tfds_tasks

TASK_NAME = "embedded_arithmetic"
GENERATOR_VERSION = 2
DEFAULT_SEED = 0
DEFAULT_NUM_EXAMPLES = {"train": 50000, "validation": 1000, "test": 1000}
DEFAULT_VOCAB_SIZE = 256
# Sequence lengths that fit every example with the embedded vocabulary.
DEFAULT_SEQUENCE_LENGTHS = {"inputs": 48, "targets": 48}

_NAMES = (("Tom", "He", "he"), ("Sam", "He", "he"), ("Ben", "He", "he"), ("Max", "He", "he"),
          ("Leo", "He", "he"), ("Ann", "She", "she"), ("Mia", "She", "she"),
          ("Zoe", "She", "she"), ("Lily", "She", "she"), ("Emma", "She", "she"))
_ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs", "balls", "shells",
          "stamps", "cookies")
_START = ("{name} has {a} {items}.", "{name} starts with {a} {items}.",
          "{name} owns {a} {items}.")
_ADD = ("{P} buys {b} more.", "{P} finds {b} more.", "{P} gets {b} more.")
_SUB = ("{P} gives away {b}.", "{P} loses {b}.", "{P} sells {b}.")
_MUL = {2: ("Then {p} doubles them.", "{P} doubles them."),
        3: ("Then {p} triples them.", "{P} triples them.")}
_DIV = ("{P} gives half of them away.", "Then {p} gives half away.")
_QUESTION = ("How many {items} does {name} have?", "How many {items} does {name} have now?")

# Each solution step is written in one of three equally likely forms of the same length, so
# the data has several right answers and each trained model has its own preferences among
# them: what a draft must learn from its target, not from the data (the DistillSpec setting).
_OPERATOR_WORDS = {"+": "plus", "-": "minus", "*": "times", "/": "over"}
_STEP_FORMS = ("{x} {op} {y} = {z}.", "{x} {word} {y} is {z}.", "{z} = {x} {op} {y}.")

_SPLIT_BUCKETS = {"test": range(0, 2), "validation": range(2, 4), "train": range(4, 100)}
MAX_VALUE = 99


def _bucket(question: str) -> int:
  return int(hashlib.sha1(question.encode("utf-8")).hexdigest()[:8], 16) % 100


def _make_problem(rng: random.Random) -> Tuple[str, str, int]:
  name, he_cap, he = rng.choice(_NAMES)
  items = rng.choice(_ITEMS)
  a = rng.randint(2, 20)
  sentences = [rng.choice(_START).format(name=name, a=a, items=items)]
  steps = []
  cur = a
  num_steps = rng.choice((2, 3))
  for _ in range(num_steps):
    ops = ["add"] if cur < MAX_VALUE else []
    if cur >= 3:
      ops.append("sub")
    if cur * 2 <= MAX_VALUE:
      ops.append("mul")
    if cur % 2 == 0 and cur >= 4:
      ops.append("div")
    op = rng.choice(ops)
    if op == "add":
      b = rng.randint(1, min(15, MAX_VALUE - cur))
      text, new, op_symbol = rng.choice(_ADD), cur + b, "+"
    elif op == "sub":
      b = rng.randint(1, min(15, cur - 1))
      text, new, op_symbol = rng.choice(_SUB), cur - b, "-"
    elif op == "mul":
      k = 3 if cur * 3 <= MAX_VALUE and rng.random() < 0.4 else 2
      b = k
      text, new, op_symbol = rng.choice(_MUL[k]), cur * k, "*"
    else:
      b = 2
      text, new, op_symbol = rng.choice(_DIV), cur // 2, "/"
    sentences.append(text.format(P=he_cap, p=he, b=b))
    steps.append(rng.choice(_STEP_FORMS).format(x=cur, y=b, z=new, op=op_symbol,
                                                word=_OPERATOR_WORDS[op_symbol]))
    cur = new
  sentences.append(rng.choice(_QUESTION).format(items=items, name=name))
  question = " ".join(sentences)
  answer = " ".join(steps) + f" #### {cur}"
  return question, answer, cur


def generate_examples(split: str = "train", num_examples: Optional[int] = None,
                      seed: int = DEFAULT_SEED) -> List[Dict[str, str]]:
  """The `num_examples` first examples of `split` for `seed`, as dicts.

  Each dict has 'inputs' (question), 'targets' (step-by-step solution ending in
  '#### N') and 'answer' (N as a string).  Deterministic for (split, seed).
  """
  if split not in _SPLIT_BUCKETS:
    raise ValueError(f"Unknown split {split!r} for {TASK_NAME}; pass one of "
                     f"{sorted(_SPLIT_BUCKETS)}.")
  if num_examples is None:
    num_examples = DEFAULT_NUM_EXAMPLES[split]
  return list(_generate_cached(split, int(num_examples), int(seed)))


@functools.lru_cache(maxsize=16)
def _generate_cached(split: str, num_examples: int, seed: int) -> Tuple[Dict[str, str], ...]:
  rng = random.Random(f"distillspec-embedded-v{GENERATOR_VERSION}:{seed}:{split}")
  buckets = _SPLIT_BUCKETS[split]
  out = []
  while len(out) < num_examples:
    question, answer, value = _make_problem(rng)
    if _bucket(question) in buckets:
      out.append({"inputs": question, "targets": answer, "answer": str(value)})
  return tuple(out)


# ------------------------------------------------------------------ vocabulary
def default_cache_dir() -> str:
  """$DISTILLSPEC_CACHE_DIR, else ~/.cache/distillspec_jax."""
  return os.environ.get("DISTILLSPEC_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "distillspec_jax"))


def embedded_vocabulary_path(directory: Optional[str] = None,
                             vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
  directory = directory or default_cache_dir()
  return os.path.join(directory,
                      f"embedded_arithmetic_v{GENERATOR_VERSION}_bpe{vocab_size}.model")


def build_embedded_vocabulary(directory: Optional[str] = None,
                              vocab_size: int = DEFAULT_VOCAB_SIZE,
                              num_texts: int = 20000, overwrite: bool = False) -> str:
  """Trains the embedded task's SentencePiece model into `directory`; returns its path.

  Cached: an existing file is reused unless `overwrite`.  Trained on generated
  train-split text (seed 0): BPE (unigram stops at ~95 pieces on this
  repetitive text), digits split into single pieces, '####' one piece.
  """

  path = embedded_vocabulary_path(directory, vocab_size)
  if os.path.exists(path) and not overwrite:
    return path
  texts = []
  for ex in generate_examples("train", num_texts, seed=DEFAULT_SEED):
    texts.append(ex["inputs"])
    texts.append(ex["targets"])
  return vocabularies.train_sentencepiece(texts, path, vocab_size=vocab_size,
                                          model_type="bpe", split_digits=True,
                                          user_defined_symbols=["####"])


class EmbeddedVocabulary(seqio.SentencePieceVocabulary):
  """SentencePieceVocabulary that builds the embedded model file on first use."""

  def __init__(self, directory: Optional[str] = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    self._directory = directory
    self._target_vocab_size = vocab_size
    super().__init__(embedded_vocabulary_path(directory, vocab_size), extra_ids=0)

  def _model_context(self):
    if self._model is None and not os.path.exists(self._sentencepiece_model_file):
      build_embedded_vocabulary(self._directory, self._target_vocab_size)
    return super()._model_context()


def embedded_vocabulary(directory: Optional[str] = None,
                        vocab_size: int = DEFAULT_VOCAB_SIZE,
                        build: bool = False) -> seqio.SentencePieceVocabulary:
  """The embedded task's vocabulary (lazy; `build=True` trains the file now)."""
  if build:
    build_embedded_vocabulary(directory, vocab_size)
  return EmbeddedVocabulary(directory, vocab_size)


# ------------------------------------------------------------------ task
def _dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None, *,
                generator_seed: int, num_examples: Dict[str, int]) -> tf.data.Dataset:
  del shuffle_files, seed  # Examples are shuffled by the Task; order is fixed here.
  exs = generate_examples(split, num_examples[split], seed=generator_seed)
  return tf.data.Dataset.from_tensor_slices({
      "inputs": [e["inputs"] for e in exs],
      "targets": [e["targets"] for e in exs],
  })


def register_embedded_task(name: str = TASK_NAME,
                           vocabulary: Optional[seqio.Vocabulary] = None,
                           seed: int = DEFAULT_SEED,
                           num_examples: Optional[Dict[str, int]] = None) -> seqio.Task:
  """Registers the embedded arithmetic task (idempotent); returns it.

  Output features 'inputs' and 'targets' (targets end with EOS).  Enc-dec: use
  EncDecFeatureConverter; decoder-only: DecoderFeatureConverter(pack=False) with
  sequence lengths for both 'inputs' and 'targets' gives a prefix LM
  (inputs+targets concatenated, loss on the targets).  Metric: accuracy of
  the number after '####'.  Nothing is generated or read until first use.
  """
  vocabulary = vocabulary if vocabulary is not None else embedded_vocabulary()
  sizes = dict(DEFAULT_NUM_EXAMPLES)
  sizes.update(num_examples or {})
  source = seqio.FunctionDataSource(
      dataset_fn=functools.partial(_dataset_fn, generator_seed=seed, num_examples=sizes),
      splits=tuple(sizes), num_input_examples=sizes)
  return tfds_tasks.register_task(
      name, source=source,
      output_features=tfds_tasks.text_features(vocabulary),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      metric_fns=[metrics.gsm8k_accuracy])
