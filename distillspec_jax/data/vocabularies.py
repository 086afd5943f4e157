"""SentencePiece vocabularies for distillspec_jax (seqio.SentencePieceVocabulary).

* TPU default: T5's public model, ``gs://t5-data/vocabs/cc_all.32000/sentencepiece.model``
  with 100 extra ids (as in T5X).  Loaded lazily, so naming it offline is fine
  as long as nothing tokenizes with it.
* Offline: train a small model from a task's training text::

    python -m distillspec_jax.data.train_vocabulary --task=gsm8k_files \\
        --data_dir=../shared/data --out=/tmp/gsm8k_spm.model --vocab_size=1000

  (``--task=embedded_arithmetic`` needs no data.)  Models use T5's id layout:
  pad=0, eos=1, unk=2, no bos.

Draft and target models must share one vocabulary; check it with
``check_same_vocabulary(a, b)``.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Iterable, Optional, Sequence, Union

import seqio

T5_DEFAULT_SPM_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
T5_DEFAULT_EXTRA_IDS = 100

VocabLike = Union[str, os.PathLike, seqio.Vocabulary]


def _is_remote(path: str) -> bool:
  return "://" in path


def get_vocabulary(path: Union[str, os.PathLike] = T5_DEFAULT_SPM_PATH,
                   extra_ids: Optional[int] = None) -> seqio.SentencePieceVocabulary:
  """A seqio.SentencePieceVocabulary for a SentencePiece .model file.

  Args:
    path: local or gs:// path of a SentencePiece model.  Local paths must exist
      (checked now); remote paths are only read when first used.
    extra_ids: sentinel ids appended to the vocabulary; None means 100 for the
      T5 default model (as in T5X) and 0 otherwise.
  """
  path = os.fspath(path)
  if extra_ids is None:
    extra_ids = T5_DEFAULT_EXTRA_IDS if path == T5_DEFAULT_SPM_PATH else 0
  if not _is_remote(path) and not os.path.isfile(path):
    raise FileNotFoundError(
        f"SentencePiece vocabulary file {path!r} does not exist. Pass the path "
        f"of an existing .model file: T5's {T5_DEFAULT_SPM_PATH!r} on TPU, or one "
        "trained offline with `python -m distillspec_jax.data.train_vocabulary "
        "--task=<task> --out=<file.model> --vocab_size=<n>`.")
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def as_vocabulary(vocab: Optional[VocabLike]) -> seqio.Vocabulary:
  """Vocabulary object from a Vocabulary, a path, or None (T5 default)."""
  if vocab is None:
    return get_vocabulary(T5_DEFAULT_SPM_PATH)
  if isinstance(vocab, seqio.Vocabulary):
    return vocab
  if isinstance(vocab, (str, os.PathLike)):
    return get_vocabulary(vocab)
  raise TypeError(
      f"Expected a seqio.Vocabulary or a SentencePiece model path, got {type(vocab).__name__}: "
      f"{vocab!r}")


def train_sentencepiece(texts: Iterable[str], out_path: Union[str, os.PathLike],
                        vocab_size: int = 1000, *, model_type: str = "unigram",
                        split_digits: bool = True,
                        user_defined_symbols: Sequence[str] = (),
                        character_coverage: float = 1.0,
                        max_sentence_length: int = 8192,
                        hard_vocab_limit: bool = False) -> str:
  """Trains a SentencePiece model with T5's id layout; returns the .model path.

  Deterministic for the same texts and arguments (single thread).  With
  ``hard_vocab_limit=False`` the vocabulary may come out smaller than
  `vocab_size` when the text has few distinct pieces.
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  if vocab_size < 8:
    raise ValueError(f"vocab_size={vocab_size} is too small; pass at least a few hundred.")
  out_path = os.fspath(out_path)
  texts = [t.replace("\n", " ").strip() for t in texts]
  texts = [t for t in texts if t]
  if not texts:
    raise ValueError("train_sentencepiece got no non-empty training text.")
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  model = io.BytesIO()
  kwargs = dict(
      sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
      model_type=model_type, character_coverage=character_coverage,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      split_digits=split_digits, hard_vocab_limit=hard_vocab_limit,
      max_sentence_length=max_sentence_length, num_threads=1,
      input_sentence_size=0 if len(texts) <= 200000 else 200000, shuffle_input_sentence=False,
      minloglevel=2)
  if user_defined_symbols:
    kwargs["user_defined_symbols"] = list(user_defined_symbols)
  spm.SentencePieceTrainer.train(**kwargs)
  # Write atomically so concurrent readers never see a partial file.
  fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(model.getvalue())
  os.replace(tmp, out_path)
  return out_path


def _describe(vocab: seqio.Vocabulary) -> str:
  path = getattr(vocab, "sentencepiece_model_file", None)
  return f"{type(vocab).__name__}({path!r}, extra_ids={getattr(vocab, 'extra_ids', '?')})"


def check_same_vocabulary(a: VocabLike, b: VocabLike) -> bool:
  """Raises ValueError unless `a` and `b` are the same vocabulary; returns True.

  Draft and target must tokenize identically for speculative decoding.  Same
  path and extra ids is accepted without reading the files; otherwise the
  sizes and the serialized SentencePiece models are compared.
  """
  va, vb = as_vocabulary(a), as_vocabulary(b)
  if va is vb:
    return True
  pa = getattr(va, "sentencepiece_model_file", None)
  pb = getattr(vb, "sentencepiece_model_file", None)
  if type(va) is not type(vb) and not (
      isinstance(va, seqio.SentencePieceVocabulary) and isinstance(vb, seqio.SentencePieceVocabulary)):
    raise ValueError(f"Draft and target vocabularies differ in type: {_describe(va)} vs "
                     f"{_describe(vb)}. Use the same vocabulary for both models.")
  if va.extra_ids != vb.extra_ids:
    raise ValueError(f"Draft and target vocabularies differ in extra_ids: {_describe(va)} vs "
                     f"{_describe(vb)}. Use the same vocabulary for both models.")
  if pa is not None and pa == pb:
    return True
  if va.vocab_size != vb.vocab_size:
    raise ValueError(
        f"Draft and target vocabularies differ in size: {va.vocab_size} ({_describe(va)}) vs "
        f"{vb.vocab_size} ({_describe(vb)}). Use the same vocabulary for both models.")
  sa, sb = getattr(va, "sp_model", None), getattr(vb, "sp_model", None)
  if sa != sb:
    raise ValueError(
        f"Draft and target vocabularies have the same size ({va.vocab_size}) but different "
        f"SentencePiece models: {_describe(va)} vs {_describe(vb)}. Use the same .model file.")
  return True
