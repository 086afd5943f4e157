"""Bridge from seqio tasks to the JAX side: NumPy batches with T5X feature names.

    from distillspec_jax.data import batches as batches_lib
    it = batches_lib.get_dataset("embedded_arithmetic", "train", {"inputs": 48, "targets": 48},
                          batch_size=32, shuffle=True, seed=0, num_epochs=None)
    batch = next(it)   # encoder_input_tokens, decoder_input_tokens,
                       # decoder_target_tokens, decoder_loss_weights: int32 [32, L]

feature_converter:
  'enc_dec'  seqio.EncDecFeatureConverter; needs lengths for 'inputs' and 'targets'.
  'decoder'  seqio.DecoderFeatureConverter: with 'inputs' and 'targets' lengths a
             prefix LM (inputs+targets concatenated into decoder_* features of length
             inputs+targets, plus decoder_causal_attention; loss on targets only);
             with only 'targets' (e.g. lm1b) a plain LM.
Both default to pack=False (fixed [batch, length] shapes, one example a row).

TensorFlow runs only here (the input pipeline); callers get NumPy arrays.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from distillspec_jax.data import tasks
from distillspec_jax.data import vocabularies

FEATURE_CONVERTERS = ("enc_dec", "decoder")


def _registered_names() -> List[str]:
  tasks.ensure_default_tasks()
  return sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))


def get_task(task_name: str) -> Union[seqio.Task, seqio.Mixture]:
  """The registered seqio Task or Mixture; ValueError with close names if unknown."""
  if not isinstance(task_name, str):
    raise TypeError(f"task_name must be a string, got {type(task_name).__name__}: {task_name!r}")
  tasks.ensure_default_tasks()
  if task_name in seqio.MixtureRegistry.names():
    return seqio.MixtureRegistry.get(task_name)
  if task_name in seqio.TaskRegistry.names():
    return seqio.TaskRegistry.get(task_name)
  names = _registered_names()
  close = difflib.get_close_matches(task_name, names, n=5, cutoff=0.5)
  hint = ""
  if task_name.endswith("_files") or task_name.startswith("bbh"):
    hint = (" File-backed and BBH tasks exist only after "
            "distillspec_jax.data.tasks.register_file_tasks(data_dir) (or register_bbh_tasks(dir)).")
  if task_name == "chat_files":
    hint += (" chat_files exists with CHAT_TEMPLATE=True (register_file_tasks(data_dir, "
             "vocabulary, chat_template=True)) and a DATA_DIR holding chat/*.jsonl.")
  raise ValueError(
      f"Task {task_name!r} is not registered."
      + (f" Did you mean {close}?" if close else "")
      + f" Registered: {names}." + hint)


def get_vocabulary(task_name: str) -> seqio.Vocabulary:
  """The vocabulary of a task's 'targets' feature (draft and target must share it)."""
  task = get_task(task_name)
  return task.output_features["targets"].vocabulary


def _subtasks(task) -> List[seqio.Task]:
  return list(seqio.get_subtasks(task))


def check_records(task_name: str) -> None:
  """Reads every split of each function-backed source of the task once (a file task's JSONL
  or text records, checked as they are read; nothing tokenized), so that a malformed line
  (a GSM8K row without "answer", misaligned WMT files) is refused before a job writes
  anything. TFDS sources are read only where a job reads them."""
  for task in _subtasks(get_task(task_name)):
    if isinstance(task.source, seqio.FunctionDataSource):
      for split in task.source.splits:
        task.source.get_dataset(split=split, shuffle=False)


def _check_split(task, split: str) -> None:
  for t in _subtasks(task):
    if split not in t.splits:
      raise ValueError(f"Task {t.name!r} has no split {split!r}; available splits: "
                       f"{sorted(t.splits)}.")


def _check_lengths(task, sequence_lengths: Mapping[str, int], feature_converter: str) -> None:
  if not isinstance(sequence_lengths, Mapping) or not sequence_lengths:
    raise ValueError(f"sequence_lengths must be a dict like {{'inputs': 512, 'targets': 128}}, "
                     f"got {sequence_lengths!r}.")
  for k, v in sequence_lengths.items():
    if not isinstance(v, (int, np.integer)) or v <= 0:
      raise ValueError(f"sequence_lengths[{k!r}]={v!r} must be a positive int.")
  features = set(task.output_features)
  if feature_converter == "enc_dec" and "inputs" not in features:
    raise ValueError(
        f"Task {task.name!r} is decoder-only (features {sorted(features)}); pass "
        "feature_converter='decoder' with sequence_lengths={'targets': N}.")
  unknown = set(sequence_lengths) - features
  if unknown:
    raise ValueError(f"sequence_lengths has {sorted(unknown)} but task {task.name!r} has only "
                     f"the features {sorted(features)}.")
  if feature_converter == "enc_dec":
    missing = {"inputs", "targets"} - set(sequence_lengths)
    if missing:
      raise ValueError(f"feature_converter='enc_dec' needs lengths for 'inputs' and 'targets'; "
                       f"missing {sorted(missing)} in {dict(sequence_lengths)}.")
  else:
    if "targets" not in sequence_lengths:
      raise ValueError(f"feature_converter='decoder' needs sequence_lengths['targets']; got "
                       f"{dict(sequence_lengths)}.")
    if "inputs" in features and "inputs" not in sequence_lengths:
      raise ValueError(
          f"Task {task.name!r} has 'inputs' (prompts); for decoder-only use pass lengths for "
          "both 'inputs' and 'targets' (a prefix LM), e.g. {'inputs': 48, 'targets': 48}.")


def _make_converter(feature_converter, pack: bool) -> seqio.FeatureConverter:
  if isinstance(feature_converter, seqio.FeatureConverter):
    return feature_converter
  if feature_converter == "enc_dec":
    return seqio.EncDecFeatureConverter(pack=pack)
  if feature_converter in ("decoder", "lm", "prefix_lm"):
    return seqio.DecoderFeatureConverter(pack=pack)
  raise ValueError(f"feature_converter={feature_converter!r} is not one of "
                   f"{FEATURE_CONVERTERS} (or a seqio.FeatureConverter instance).")


def _untrimmed_examples(task: seqio.Task, split: str, num: int, shuffle: bool = False,
                        seed: Optional[int] = None) -> tf.data.Dataset:
  ds = task.get_dataset(sequence_length=None, split=split, shuffle=shuffle, seed=seed,
                        trim_output_features=False, num_epochs=1)
  return ds.take(num) if num is not None and num >= 0 else ds


def check_prompt_lengths(task_name: str, split: str, sequence_lengths: Mapping[str, int],
                         num_examples: int = 64, max_truncated_fraction: float = 0.5) -> None:
  """Raises ValueError if sequence_lengths['inputs'] is too small for the prompts.

  Looks at the first `num_examples` prompts ('inputs', with EOS).  Error when
  more than `max_truncated_fraction` of them are longer than the length; for
  document tasks (summarization, where truncating the article is the norm) only
  when more than that fraction would lose over half of their tokens.
  """
  if "inputs" not in sequence_lengths:
    return
  length = int(sequence_lengths["inputs"])
  for task in _subtasks(get_task(task_name)):
    lens = [int(len(ex["inputs"])) for ex in
            tfds.as_numpy(_untrimmed_examples(task, split, num_examples))]
    if not lens:
      continue
    lens = np.asarray(lens)
    too_long = int((lens > length).sum())
    lenient = task.name in tasks.tfds_tasks.TRUNCATABLE_INPUT_TASKS
    bad = int((lens > 2 * length).sum()) if lenient else too_long
    if bad / len(lens) > max_truncated_fraction:
      what = "would lose over half of their tokens" if lenient else "are longer"
      raise ValueError(
          f"sequence_lengths['inputs']={length} is too small for task {task.name!r} "
          f"(split {split!r}): {bad} of the first {len(lens)} prompts {what} "
          f"(longest {lens.max()} tokens incl. EOS, median {int(np.median(lens))}). Pass "
          f"sequence_lengths['inputs'] >= {int(np.percentile(lens, 95))} (95th percentile), or "
          f"{lens.max()} to keep every prompt whole.")
    if too_long:
      logging.warning("Task %s: %d of %d sampled prompts exceed %d tokens and are truncated.",
                      task.name, too_long, len(lens), length)


def _check_tokenizer_converter(task_name: str, kind: str, pack: bool) -> None:
  if kind == "enc_dec":
    raise ValueError(
        f"Task {task_name!r} uses a Hugging Face tokenizer, which has no decoder start token; "
        "encoder-decoder batches need T5's conventions: pass the folder's SentencePiece "
        "spiece.model as the vocabulary, or feature_converter='decoder'.")
  if pack:
    raise ValueError(f"Task {task_name!r} uses a Hugging Face tokenizer: packed batches are "
                     "not supported with it; pass pack=False.")


def tokenizer_features(ex: Mapping[str, tf.Tensor], width: int) -> Dict[str, tf.Tensor]:
  """A decoder-only training example as a tokenizer's model reads it, from a task example's
  'inputs' (the prompt, as the tokenizer encodes it) and 'targets' (ending in EOS).

  The sequence is prompt + targets; `decoder_input_tokens` is the sequence and
  `decoder_target_tokens` the same one ahead (no start id: seqio's converter would put T5's
  0, a real token here, first), each `[width]` (= inputs + targets lengths - 1), zero-filled
  after the sequence. `decoder_loss_weights` marks the targets by position, so a target id 0
  still counts (seqio reads id 0 as padding); `decoder_causal_attention` marks the prompt.
  An LM task (no 'inputs') predicts every token after the first.
  """
  targets = tf.cast(ex["targets"], tf.int32)
  prompt = tf.cast(ex["inputs"], tf.int32) if "inputs" in ex else targets[:0]
  sequence = tf.concat([prompt, targets], axis=0)[:width + 1]
  n = tf.shape(sequence)[0]
  first = tf.maximum(tf.shape(prompt)[0], 1)  # the first predicted token's position
  positions = tf.range(width)
  pad = [[0, width + 1 - n]]
  padded = tf.pad(sequence, pad)
  return {
      "decoder_input_tokens": padded[:-1], "decoder_target_tokens": padded[1:],
      "decoder_loss_weights": tf.cast((positions >= first - 1) & (positions < n - 1), tf.int32),
      "decoder_causal_attention": tf.cast(positions < first, tf.int32)}


def get_tf_dataset(task_name: str, split: str, sequence_lengths: Mapping[str, int],
                   batch_size: int, feature_converter: Any = "enc_dec", shuffle: bool = False,
                   seed: Optional[int] = None, num_epochs: Optional[int] = 1,
                   pack: bool = False, drop_remainder: bool = False,
                   max_truncated_fraction: Optional[float] = 0.5,
                   shard_info: Optional[seqio.ShardInfo] = None) -> tf.data.Dataset:
  """Like get_dataset, but returns the batched tf.data.Dataset."""
  task = get_task(task_name)
  if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
    raise ValueError(f"batch_size={batch_size!r} must be a positive int.")
  kind = feature_converter if isinstance(feature_converter, str) else (
      "enc_dec" if isinstance(feature_converter, seqio.EncDecFeatureConverter) else "decoder")
  converter = _make_converter(feature_converter, pack)
  for t in _subtasks(task):
    _check_lengths(t, sequence_lengths, "enc_dec" if kind == "enc_dec" else "decoder")
  _check_split(task, split)
  if max_truncated_fraction is not None:
    check_prompt_lengths(task_name, split, sequence_lengths,
                         max_truncated_fraction=max_truncated_fraction)
  if vocabularies.is_tokenizer(get_vocabulary(task_name)):
    _check_tokenizer_converter(task_name, kind, pack)
    width = sum(int(v) for v in sequence_lengths.values()) - 1
    ds = task.get_dataset(sequence_length=dict(sequence_lengths), split=split, shuffle=shuffle,
                          seed=seed, num_epochs=num_epochs, shard_info=shard_info)
    ds = ds.map(functools.partial(tokenizer_features, width=width),
                num_parallel_calls=tf.data.AUTOTUNE)
  else:
    ds = seqio.get_dataset(task_name, task_feature_lengths=dict(sequence_lengths),
                           feature_converter=converter, dataset_split=split, shuffle=shuffle,
                           num_epochs=num_epochs, seed=seed, shard_info=shard_info,
                           verbose=False)
  ds = ds.batch(int(batch_size), drop_remainder=drop_remainder)
  return ds.prefetch(tf.data.AUTOTUNE)


def get_dataset(task_name: str, split: str, sequence_lengths: Mapping[str, int],
                batch_size: int, feature_converter: Any = "enc_dec", shuffle: bool = False,
                seed: Optional[int] = None, num_epochs: Optional[int] = 1, pack: bool = False,
                drop_remainder: bool = False, max_truncated_fraction: Optional[float] = 0.5,
                shard_info: Optional[seqio.ShardInfo] = None
                ) -> Iterator[Dict[str, np.ndarray]]:
  """Iterator of batches (dicts of int32 NumPy arrays) with T5X feature names.

  Args:
    task_name: registered task or mixture, e.g. 'embedded_arithmetic'.
    split: 'train', 'validation' or 'test' (what the task has).
    sequence_lengths: task feature lengths, e.g. {'inputs': 48, 'targets': 48};
      {'targets': N} for LM tasks.
    batch_size: examples per batch.
    feature_converter: 'enc_dec' (encoder_input_tokens, decoder_input_tokens,
      decoder_target_tokens, decoder_loss_weights), 'decoder' (decoder_* of
      length inputs+targets, + decoder_causal_attention for a prefix LM), or a
      seqio.FeatureConverter.
    shuffle, seed: example shuffling (seeded: reproducible order).
    num_epochs: passes over the data; None repeats forever (training).
    pack: pack several examples a row (seqio packing; adds segment ids/positions).
    drop_remainder: drop the last partial batch (fixed shapes for jit).
    max_truncated_fraction: error if more than this fraction of sampled prompts
      would be truncated (None disables the check).
  """
  ds = get_tf_dataset(task_name, split, sequence_lengths, batch_size,
                      feature_converter=feature_converter, shuffle=shuffle, seed=seed,
                      num_epochs=num_epochs, pack=pack, drop_remainder=drop_remainder,
                      max_truncated_fraction=max_truncated_fraction, shard_info=shard_info)
  return iter(tfds.as_numpy(ds))


def _pad(rows: Sequence[np.ndarray], width: int, value: int = 0) -> np.ndarray:
  out = np.full((len(rows), width), value, dtype=np.int32)
  for i, r in enumerate(rows):
    out[i, : len(r)] = r[:width]
  return out


@dataclasses.dataclass(frozen=True)
class RowSelection:
  """The positions of a split's examples one process reads: position i (0-based, in the
  split's order) when `start <= i % period < stop` (its rows of every evaluation batch of
  `period` rows), or when `i < leading` (the first prompts, e.g. the timed ones)."""

  period: int
  start: int
  stop: int
  leading: int = 0

  def __post_init__(self):
    if not 0 <= self.start < self.stop <= self.period:
      raise ValueError(f"RowSelection rows [{self.start}, {self.stop}) of period {self.period}: "
                       "need 0 <= start < stop <= period.")

  def keeps(self, position):
    """Whether the example at `position` (an int64 tensor) is read."""
    offset = position % self.period
    return tf.logical_or(tf.logical_and(offset >= self.start, offset < self.stop),
                         position < self.leading)


def _selected_examples(task: seqio.Task, split: str, num: int,
                       rows: RowSelection) -> tuple:
  """(the preprocessed examples at the positions `rows` keeps among the split's first `num`
  (all: num < 0), those positions). Selected from the source's records, before any
  preprocessor runs, so that the others are never tokenized (seqio's own sharding picks its
  shard at the source the same way)."""
  source = task.source.get_dataset(split=split, shuffle=False)
  source = source.take(num) if num >= 0 else source
  kept = source.enumerate().filter(lambda i, _: rows.keeps(i))
  positions = [int(i) for i in tfds.as_numpy(kept.map(lambda i, _: i))]
  ds = kept.map(lambda _, ex: ex)
  ds = task.preprocess_postcache(task.preprocess_precache(ds), sequence_length=None)
  return ds, positions


@dataclasses.dataclass(frozen=True, eq=False)
class Examples:
  """The examples of a split, tokenized for decoding evaluation (`get_prompts_and_targets`).

  Attributes:
    prompts: [N, P] int32, the task's 'inputs' tokens (ending in EOS, exactly as the models
      see them in training), padded with `pad`; prompt_lengths: [N] int32.
    targets: [N, T] int32, the reference 'targets' tokens (ending in EOS), padded with `pad`;
      target_lengths: [N] int32.
    prompt_texts / target_texts: the raw strings, N each (for metrics).
    positions: [N] int64, the split positions read, ascending (a RowSelection's read; None:
      the first N). complete: whether each selected position gave exactly one row.
    local: [N] bool, the rows whose tokens this process read (evaluation/examples.py; None:
      all of them); the others are all `pad`.
    pad: the value right-padding `prompts` and `targets` (vocabularies.pad_value: T5's pad 0,
      NO_TOKEN for a Hugging Face tokenizer, whose 0 is a real token; the models' pad_id).
  """

  prompts: np.ndarray
  prompt_lengths: np.ndarray
  targets: np.ndarray
  target_lengths: np.ndarray
  prompt_texts: list
  target_texts: list
  positions: Optional[np.ndarray] = None
  complete: bool = True
  local: Optional[np.ndarray] = None
  pad: int = 0

  def __len__(self) -> int:
    return len(self.prompts)


def get_prompts_and_targets(task_name: str, split: str,
                            sequence_lengths: Optional[Mapping[str, int]] = None,
                            num_examples: Optional[int] = None, shuffle: bool = False,
                            seed: Optional[int] = None, on_long_prompt: str = "error",
                            lm_prompt_length: Optional[int] = None,
                            rows: Optional[RowSelection] = None) -> Examples:
  """Prompts and references, tokenized, for decoding evaluation: the split's Examples.

  Longer references are cut to T-1 tokens + EOS. Prompts and targets are right-padded with
  `vocabularies.pad_value(vocab)` (0 for T5, NO_TOKEN = -1 for a Hugging Face tokenizer,
  whose id 0 is a real token); prompts are the task's 'inputs' tokens exactly as the models
  see them in training. P and T come from sequence_lengths ('inputs', 'targets') or are the longest
  lengths present.  A prompt longer than P raises ValueError naming the example,
  its length and P (on_long_prompt='error'); 'truncate' keeps its first P-1
  tokens + EOS, 'skip' drops it.  For LM tasks (no 'inputs') the first
  `lm_prompt_length` target tokens form the prompt.

  `rows` (a RowSelection): only the examples at the positions it keeps are read and
  tokenized (no shuffling); the Examples then have `positions` (the split positions read)
  and `complete` (False when a preprocessor, 'skip' or an empty LM target dropped one, so
  rows no longer match positions).
  It may hold no rows; P and T then come from sequence_lengths (else 0).
  """
  if on_long_prompt not in ("error", "truncate", "skip"):
    raise ValueError(f"on_long_prompt={on_long_prompt!r}; pass 'error', 'truncate' or 'skip'.")
  task = get_task(task_name)
  if isinstance(task, seqio.Mixture):
    raise ValueError(f"{task_name!r} is a mixture; call get_prompts_and_targets per task: "
                     f"{[t.name for t in task.tasks]}.")
  _check_split(task, split)
  has_inputs = "inputs" in task.output_features
  if not has_inputs and not lm_prompt_length:
    raise ValueError(f"Task {task_name!r} has no 'inputs'; pass lm_prompt_length=K to use the "
                     "first K target tokens as the prompt.")
  sequence_lengths = dict(sequence_lengths or {})
  max_p, max_t = sequence_lengths.get("inputs"), sequence_lengths.get("targets")
  eos = task.output_features["targets"].vocabulary.eos_id
  pad = vocabularies.pad_value(task.output_features["targets"].vocabulary)
  prompt_eos = task.output_features["inputs"].add_eos if has_inputs else True
  num = -1 if num_examples is None else num_examples
  if rows is None:
    ds = _untrimmed_examples(task, split, num, shuffle=shuffle, seed=seed)
    positions = None
  elif shuffle:
    raise ValueError("get_prompts_and_targets: rows= reads examples by their position in the "
                     "split, which needs shuffle=False.")
  else:
    ds, positions = _selected_examples(task, split, num, rows)
  prompts, targets, p_texts, t_texts = [], [], [], []
  read = 0  # examples the preprocessors gave
  for ex in tfds.as_numpy(ds):
    # The example's position in the split, for errors (a preprocessor that drops or adds
    # examples shifts it; "complete" then says so).
    i = read if positions is None else positions[min(read, len(positions) - 1)]
    read += 1
    tgt = np.asarray(ex["targets"], dtype=np.int32)
    t_text = ex.get("targets_pretokenized", b"")
    t_text = t_text.decode("utf-8") if isinstance(t_text, bytes) else str(t_text)
    if has_inputs:
      prm = np.asarray(ex["inputs"], dtype=np.int32)
      p_text = ex.get("inputs_pretokenized", b"")
      p_text = p_text.decode("utf-8") if isinstance(p_text, bytes) else str(p_text)
    else:
      prm, tgt = tgt[:lm_prompt_length], tgt[lm_prompt_length:]
      vocab = task.output_features["targets"].vocabulary
      p_text, t_text = vocab.decode(prm.tolist()), vocab.decode(tgt.tolist())
      if len(tgt) == 0:
        continue
    if max_p is not None and len(prm) > max_p:
      if on_long_prompt == "error":
        raise ValueError(
            f"Prompt {i} of task {task_name!r} (split {split!r}) has {len(prm)} tokens but "
            f"sequence_lengths['inputs']={max_p}. Pass sequence_lengths['inputs'] >= "
            f"{len(prm)}, or on_long_prompt='truncate' / 'skip'.")
      if on_long_prompt == "skip":
        continue
      if not has_inputs:
        prm = prm[-max_p:]
      else:  # the prompt's start and, with T5's conventions, its EOS
        prm = np.concatenate([prm[: max_p - 1], [eos]]) if prompt_eos else prm[:max_p]
    if max_t is not None and len(tgt) > max_t:
      tgt = np.concatenate([tgt[: max_t - 1], [eos]])
    prompts.append(prm)
    targets.append(tgt)
    p_texts.append(p_text)
    t_texts.append(t_text)
  if not prompts and rows is None:
    raise ValueError(f"No examples left for task {task_name!r} split {split!r} "
                     f"(num_examples={num_examples}, on_long_prompt={on_long_prompt!r}).")
  p_width = max_p if max_p is not None else max((len(p) for p in prompts), default=0)
  t_width = max_t if max_t is not None else max((len(t) for t in targets), default=0)
  selection = {} if positions is None else dict(
      positions=np.asarray(positions, np.int64),
      complete=read == len(positions) == len(prompts))
  return Examples(prompts=_pad(prompts, p_width, pad),
                  prompt_lengths=np.asarray([len(p) for p in prompts], dtype=np.int32),
                  targets=_pad(targets, t_width, pad),
                  target_lengths=np.asarray([len(t) for t in targets], dtype=np.int32),
                  prompt_texts=p_texts, target_texts=t_texts, pad=int(pad), **selection)


def compute_metrics(task_name: str, targets: Sequence[str], predictions: Sequence[str]
                    ) -> Dict[str, float]:
  """Runs a task's (targets, predictions) metric functions on decoded strings."""
  task = get_task(task_name)
  out: Dict[str, float] = {}
  for fn in task.predict_metric_fns:
    out.update(fn(list(targets), list(predictions)))
  return out
