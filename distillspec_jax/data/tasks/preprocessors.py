"""Small, pure tf.data preprocessors for the distillspec_jax seqio tasks.

Every function maps a dataset of raw string features to the T5-style text
features ``inputs`` / ``targets`` (tokenization happens afterwards with
``seqio.preprocessors.tokenize``).  The prompt formats live here as constants so
the file-backed and TFDS-backed variants of a task format text identically.
"""

from __future__ import annotations

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies

SUMMARIZE_PREFIX = "summarize: "
TRANSLATE_PREFIX_TEMPLATE = "translate {source} to {target}: "
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "ro": "Romanian"}

# Zero-shot chain of thought (Kojima et al., 2022): the question, then the trigger
# phrase.  One line (T5's SentencePiece model maps newlines to spaces anyway).
COT_PREFIX = "Q: "
COT_SUFFIX = " A: Let's think step by step."

# GSM8K answers carry calculator annotations "<<16-3-4=9>>"; they are stripped.
GSM8K_CALCULATOR_REGEX = r"<<[^>]*>>"


def _strip(x: tf.Tensor) -> tf.Tensor:
  return tf.strings.strip(x)


def cot_prompt(question: tf.Tensor) -> tf.Tensor:
  """Zero-shot chain-of-thought prompt: 'Q: <question> A: Let's think step by step.'."""
  return tf.strings.join([COT_PREFIX, _strip(question), COT_SUFFIX])


@seqio.map_over_dataset
def _summarize(x, article_key, summary_key):
  return {
      "inputs": tf.strings.join([SUMMARIZE_PREFIX, _strip(x[article_key])]),
      "targets": _strip(x[summary_key]),
  }


def summarize(dataset: tf.data.Dataset, article_key: str = "document",
              summary_key: str = "summary") -> tf.data.Dataset:
  """{'document','summary'} -> {'inputs': 'summarize: <document>', 'targets': <summary>}."""
  return _summarize(dataset, article_key=article_key, summary_key=summary_key)


def translate_prefix(source_language: str, target_language: str) -> str:
  src = LANGUAGE_NAMES.get(source_language, source_language)
  tgt = LANGUAGE_NAMES.get(target_language, target_language)
  return TRANSLATE_PREFIX_TEMPLATE.format(source=src, target=tgt)


@seqio.map_over_dataset
def _translate(x, source_language, target_language):
  return {
      "inputs": tf.strings.join(
          [translate_prefix(source_language, target_language), _strip(x[source_language])]),
      "targets": _strip(x[target_language]),
  }


def translate(dataset: tf.data.Dataset, source_language: str = "en",
              target_language: str = "de") -> tf.data.Dataset:
  """{'en','de'} -> {'inputs': 'translate English to German: <en>', 'targets': <de>}."""
  return _translate(dataset, source_language=source_language,
                    target_language=target_language)


@seqio.map_over_dataset
def _gsm8k_cot(x, question_key, answer_key, strip_calculator):
  answer = x[answer_key]
  if strip_calculator:
    answer = tf.strings.regex_replace(answer, GSM8K_CALCULATOR_REGEX, "")
  answer = tf.strings.regex_replace(_strip(answer), r"\s*\n\s*", " ")
  return {"inputs": cot_prompt(x[question_key]), "targets": answer}


def gsm8k_cot(dataset: tf.data.Dataset, question_key: str = "question",
              answer_key: str = "answer", strip_calculator: bool = True) -> tf.data.Dataset:
  """GSM8K -> zero-shot CoT prompt as inputs, reasoning + '#### N' as targets.

  Calculator annotations (<<a*b=c>>) are removed and the solution lines are
  joined with single spaces.
  """
  return _gsm8k_cot(dataset, question_key=question_key, answer_key=answer_key,
                    strip_calculator=strip_calculator)


@seqio.map_over_dataset
def _bbh_cot(x):
  return {"inputs": cot_prompt(x["input"]), "targets": _strip(x["target"])}


def bbh_cot(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """BBH {'input','target'} -> zero-shot CoT prompt / the answer string as target."""
  return _bbh_cot(dataset)


@seqio.map_over_dataset
def _lm_text(x, text_key):
  return {"targets": _strip(x[text_key])}


def lm_text(dataset: tf.data.Dataset, text_key: str = "text") -> tf.data.Dataset:
  """{'text'} -> {'targets': <text>} for decoder-only language modelling."""
  return _lm_text(dataset, text_key=text_key)


def filter_empty(dataset: tf.data.Dataset, keys=("inputs", "targets")) -> tf.data.Dataset:
  """Drops examples whose text features (those present) are empty strings."""

  def keep(x):
    ok = tf.constant(True)
    for k in keys:
      if k in x:
        ok = tf.logical_and(ok, tf.strings.length(x[k]) > 0)
    return ok

  return dataset.filter(keep)


def add_special_tokens(dataset: tf.data.Dataset, output_features) -> tf.data.Dataset:
  """After tokenizing with a Hugging Face tokenizer: the prompt ('inputs', else the 'targets'
  of an LM task) gets the special tokens the tokenizer puts around a text (Llama's BOS), so
  that its ids equal `tokenizer(text)["input_ids"]`. No-op for other vocabularies."""
  key = "inputs" if "inputs" in output_features else "targets"
  vocab = output_features[key].vocabulary
  if not vocabularies.is_tokenizer(vocab) or not (vocab.prompt_prefix or vocab.prompt_suffix):
    return dataset
  prefix = tf.constant(vocab.prompt_prefix, tf.int32, shape=[len(vocab.prompt_prefix)])
  suffix = tf.constant(vocab.prompt_suffix if key == "inputs" else (), tf.int32,
                       shape=[len(vocab.prompt_suffix) if key == "inputs" else 0])

  def wrap(ex):
    ex = dict(ex)
    ex[key] = tf.concat([prefix, tf.cast(ex[key], tf.int32), suffix], axis=0)
    return ex

  return dataset.map(wrap, num_parallel_calls=tf.data.AUTOTUNE)
