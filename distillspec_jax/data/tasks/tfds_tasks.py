"""TFDS-backed seqio tasks (what a TPU user has) and shared registration helpers.

Tasks (registered on `import distillspec_jax.data.tasks` with T5's public vocabulary,
which is only read when something tokenizes):

  name            TFDS dataset                  format
  xsum            xsum:1.1.0                    'summarize: <document>' -> summary
  cnn_dailymail   cnn_dailymail:3.4.0           'summarize: <article>' -> highlights
  gsm8k           gsm8k:1.0.0                   'Q: <question> A: Let's think step by step.'
                                                -> reasoning + '#### N' (calculator notes removed)
  wmt14_en_de     wmt14_translate/de-en:1.0.0   'translate English to German: <en>' -> de
  lm1b            lm1b:1.1.0                    targets only (decoder-only LM)

Enc-dec tasks have 'inputs' and 'targets' (EOS appended); lm1b has 'targets'
only.  The gsm8k task also works decoder-only as a prefix LM: use
seqio.DecoderFeatureConverter(pack=False) with lengths for 'inputs' and
'targets' (`distillspec_jax.data.batches.get_dataset(..., feature_converter='decoder')`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies
from distillspec_jax.data.tasks import metrics
from distillspec_jax.data.tasks import preprocessors

TFDS_TASK_NAMES = ("xsum", "cnn_dailymail", "gsm8k", "wmt14_en_de", "lm1b")


# ------------------------------------------------------------ shared helpers
def text_features(vocabulary: seqio.Vocabulary, with_inputs: bool = True) -> dict:
  """Output features: 'inputs' if `with_inputs`, and 'targets' (EOS). The inputs end in EOS
  with T5's conventions; with a Hugging Face tokenizer they are encoded as the tokenizer
  encodes a text (`preprocessors.add_special_tokens`), with no EOS after the prompt."""
  feats = {"targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)}
  if with_inputs:
    feats["inputs"] = seqio.Feature(vocabulary=vocabulary,
                                    add_eos=not vocabularies.is_tokenizer(vocabulary))
  return feats


def register_task(name: str, **task_kwargs) -> seqio.Task:
  """seqio.TaskRegistry.add that replaces an existing task of the same name."""
  seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(name, **task_kwargs)


def register_mixture(name: str, tasks: Sequence[str], default_rate: float = 1.0,
                     stop_on_empty_dataset: bool = False) -> seqio.Mixture:
  """seqio.MixtureRegistry.add that replaces an existing mixture of the same name.

  With stop_on_empty_dataset=False (unlike seqio's default) one epoch of the
  mixture yields every example of every task, not only until the first ends.
  """
  seqio.MixtureRegistry.remove(name)
  sample_fn = functools.partial(tf.data.Dataset.sample_from_datasets,
                                stop_on_empty_dataset=stop_on_empty_dataset)
  return seqio.MixtureRegistry.add(name, list(tasks), default_rate=default_rate,
                                   sample_fn=sample_fn)


def text_task_preprocessors(format_fn: Callable, **kwargs) -> list:
  """[format (with kwargs), drop empty, tokenize, a tokenizer's special tokens, append EOS
  after trimming]."""
  return [functools.partial(format_fn, **kwargs) if kwargs else format_fn,
          preprocessors.filter_empty, seqio.preprocessors.tokenize,
          preprocessors.add_special_tokens,
          seqio.preprocessors.append_eos_after_trim]


def lm_task_preprocessors(text_key: str = "text") -> list:
  """[text -> targets, drop empty, tokenize, a tokenizer's special tokens, append EOS after
  trimming]."""
  return [functools.partial(preprocessors.lm_text, text_key=text_key),
          functools.partial(preprocessors.filter_empty, keys=("targets",)),
          seqio.preprocessors.tokenize, preprocessors.add_special_tokens,
          seqio.preprocessors.append_eos_after_trim]


# Tasks whose inputs are documents that T5-style setups routinely truncate
# (summarization).  data.check_prompt_lengths is lenient with them.
TRUNCATABLE_INPUT_TASKS = set()


def mark_inputs_truncatable(name: str) -> None:
  """Declares that truncating this task's inputs is normal (long documents)."""
  TRUNCATABLE_INPUT_TASKS.add(name)


SUMMARIZATION_METRICS = (metrics.rouge,)
TRANSLATION_METRICS = (metrics.bleu,)
GSM8K_METRICS = (metrics.gsm8k_accuracy,)


# ------------------------------------------------------------ TFDS tasks
class TfdsSource(seqio.TfdsDataSource):
  """TfdsDataSource whose size lookup tolerates missing split metadata.

  seqio asks for the split size to decide on in-memory caching; under
  tfds.testing.mock_data (and for some partially prepared datasets) the split
  info is empty, which would raise KeyError.  Unknown size -> None.
  """

  def num_input_examples(self, split: str):
    try:
      return super().num_input_examples(split)
    except (KeyError, ValueError):
      return None


def register_tfds_tasks(vocabulary: Optional[vocabularies.VocabLike] = None,
                        tfds_data_dir: Optional[str] = None,
                        suffix: str = "") -> list:
  """Registers xsum, cnn_dailymail, gsm8k, wmt14_en_de and lm1b; returns the names.

  Args:
    vocabulary: seqio.Vocabulary or SentencePiece path; default T5's public
      model (gs://t5-data/vocabs/cc_all.32000/sentencepiece.model, 100 extra ids).
    tfds_data_dir: TFDS data directory (None: TFDS default / $TFDS_DATA_DIR).
    suffix: appended to each task name (to register variants side by side).
  Idempotent and cheap: nothing is read until a dataset is requested.
  """
  vocab = vocabularies.as_vocabulary(vocabulary)
  feats = text_features(vocab)

  def source(name, splits):
    return TfdsSource(tfds_name=name, tfds_data_dir=tfds_data_dir, splits=splits)

  three = ("train", "validation", "test")
  names = []
  register_task(f"xsum{suffix}", source=source("xsum:1.1.0", three), output_features=feats,
                preprocessors=text_task_preprocessors(
                    preprocessors.summarize, article_key="document", summary_key="summary"),
                metric_fns=list(SUMMARIZATION_METRICS))
  names.append(f"xsum{suffix}")
  mark_inputs_truncatable(f"xsum{suffix}")
  register_task(f"cnn_dailymail{suffix}", source=source("cnn_dailymail:3.4.0", three),
                output_features=feats,
                preprocessors=text_task_preprocessors(
                    preprocessors.summarize, article_key="article", summary_key="highlights"),
                metric_fns=list(SUMMARIZATION_METRICS))
  names.append(f"cnn_dailymail{suffix}")
  mark_inputs_truncatable(f"cnn_dailymail{suffix}")
  register_task(f"gsm8k{suffix}", source=source("gsm8k:1.0.0", ("train", "test")),
                output_features=feats,
                preprocessors=text_task_preprocessors(preprocessors.gsm8k_cot),
                metric_fns=list(GSM8K_METRICS))
  names.append(f"gsm8k{suffix}")
  register_task(f"wmt14_en_de{suffix}", source=source("wmt14_translate/de-en:1.0.0", three),
                output_features=feats,
                preprocessors=text_task_preprocessors(preprocessors.translate, source_language="en",
                                                      target_language="de"),
                metric_fns=list(TRANSLATION_METRICS))
  names.append(f"wmt14_en_de{suffix}")
  register_task(f"lm1b{suffix}", source=source("lm1b:1.1.0", ("train", "test")),
                output_features=text_features(vocab, with_inputs=False),
                preprocessors=lm_task_preprocessors(text_key="text"),
                postprocess_fn=metrics.lm_target_token_ids,
                metric_fns=[metrics.log_perplexity])
  names.append(f"lm1b{suffix}")
  return names

