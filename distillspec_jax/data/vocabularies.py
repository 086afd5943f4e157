"""Vocabularies for distillspec_jax: SentencePiece models and Hugging Face tokenizers.

`as_vocabulary(path)` takes a Hugging Face model folder (its tokenizer.json; a folder with
only a SentencePiece tokenizer.model / spiece.model gives that), a tokenizer.json (see
hf_vocabulary.py: ids, special tokens and the BOS rule exactly as transformers has them), or a
SentencePiece .model file (T5's layout: pad 0, EOS 1, decoding starts from 0).
`token_ids(vocab)` gives the models' `TokenIds` for a vocabulary.

* TPU default: T5's public model, ``gs://t5-data/vocabs/cc_all.32000/sentencepiece.model``
  with 100 extra ids (as in T5X).  Loaded lazily, so naming it offline is fine
  as long as nothing tokenizes with it.
* Offline: train a small model from a task's training text::

    python -m distillspec_jax.data.train_vocabulary --task=gsm8k_files \\
        --data_dir=../shared/data --out=/tmp/gsm8k_spm.model --vocab_size=1000

  (``--task=embedded_arithmetic`` needs no data.)  Models use T5's id layout:
  pad=0, eos=1, unk=2, no bos.

Draft and target models must share one vocabulary; check it with
``check_same_vocabulary(a, b)`` (the tokenizers are compared, not their sizes).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

from distillspec_jax.core.validation import check_path
from distillspec_jax.data import tokenizer_files
from distillspec_jax.models.model import NO_TOKEN, TokenIds

if TYPE_CHECKING:
  import seqio

T5_DEFAULT_SPM_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
T5_DEFAULT_EXTRA_IDS = 100

VocabLike = Union[str, os.PathLike, "seqio.Vocabulary"]


def _hf_vocabulary():
  from distillspec_jax.data import hf_vocabulary  # pylint: disable=g-import-not-at-top
  return hf_vocabulary


def _instance(vocab, module: str, name: str) -> bool:
  """isinstance(vocab, module.name) without importing `module`: nothing is an instance of a
  class whose module is not loaded yet."""
  loaded = sys.modules.get(module)
  return loaded is not None and isinstance(vocab, getattr(loaded, name))


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
  if not _is_remote(path):
    _check_sentencepiece(path)
  # seqio loads TensorFlow (2-3 s): only here, when a vocabulary is built, never in a process
  # that only checks paths or runs models (a worker, `--help`, a refused input).
  import seqio  # pylint: disable=g-import-not-at-top
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def _first_line(error: Exception) -> str:
  return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


def _check_sentencepiece(path: str) -> None:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  try:
    spm.SentencePieceProcessor(model_file=path)
  except Exception as e:  # pylint: disable=broad-except  (a parse error of any kind)
    raise ValueError(
        f"{path!r} is not a SentencePiece model ({_first_line(e)}). "
        "Pass a SentencePiece .model file, a Hugging Face tokenizer.json, or a model folder "
        "saved by transformers' save_pretrained.") from None


SENTENCEPIECE_IN_FOLDER = ("tokenizer.model", "spiece.model", "sentencepiece.model")


def load_vocabulary(path: Union[str, os.PathLike]) -> seqio.Vocabulary:
  """A vocabulary from a path: an HF model folder, a tokenizer.json, or a .model file."""
  path = os.fspath(path)
  if _is_remote(path):
    return get_vocabulary(path)
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, tokenizer_files.TOKENIZER_FILE)):
      return _hf_vocabulary().load_hf_vocabulary(path)
    for name in SENTENCEPIECE_IN_FOLDER:
      if os.path.isfile(os.path.join(path, name)):
        return get_vocabulary(os.path.join(path, name))
    raise FileNotFoundError(
        f"Folder {path!r} holds no tokenizer: expected tokenizer.json (a Hugging Face model "
        f"folder) or one of {list(SENTENCEPIECE_IN_FOLDER)}.")
  if path.endswith(".json"):
    return _hf_vocabulary().load_hf_vocabulary(path)
  return get_vocabulary(path)


def as_vocabulary(vocab: Optional[VocabLike]) -> seqio.Vocabulary:
  """Vocabulary object from a Vocabulary, a path (`load_vocabulary`), or None (T5 default)."""
  if vocab is None:
    return get_vocabulary(T5_DEFAULT_SPM_PATH)
  if _instance(vocab, "seqio", "Vocabulary"):
    return vocab
  if isinstance(vocab, (str, os.PathLike)):
    return load_vocabulary(vocab)
  raise TypeError(
      f"Expected a seqio.Vocabulary or a vocabulary path (model folder, tokenizer.json or "
      f"SentencePiece .model), got {type(vocab).__name__}: {vocab!r}")


def is_tokenizer(vocab: seqio.Vocabulary) -> bool:
  """Whether `vocab` is a Hugging Face tokenizer (its own special ids and BOS rule) rather
  than a vocabulary with T5's conventions."""
  return _instance(vocab, "distillspec_jax.data.hf_vocabulary", "HFTokenizerVocabulary")


def token_ids(vocab: VocabLike, rows: Optional[int] = None) -> TokenIds:
  """The models' TokenIds for `vocab`: T5's for SentencePiece vocabularies; for a tokenizer
  its EOS, as stop ids the other end-of-sequence ids its config.json / generation_config.json
  list (an instruct model's turn end: decoding stops at each), no start id (prompts begin as the tokenizer encodes them), padding marked by
  NO_TOKEN (0 is a real token), and its size (embedding rows past it are never output).

  rows: the smallest embedding row count of the models that take these ids (None: not
  known). A tokenizer with more ids is cut to `rows` (logits and sampling over the rows only)
  when every id past them is an added special token other than BOS, EOS and pad; otherwise a
  ValueError says which ids lie past the rows (`HFTokenizerVocabulary.ids_for_rows`)."""
  vocab = as_vocabulary(vocab)
  if not is_tokenizer(vocab):
    return TokenIds()
  num_tokens = int(vocab.vocab_size)
  if rows is not None:
    num_tokens = vocab.ids_for_rows(int(rows))
  _say_stop_ids(vocab)
  return TokenIds(eos_id=int(vocab.eos_id), decoder_start_id=None, pad_id=NO_TOKEN,
                  num_tokens=num_tokens, stop_ids=tuple(vocab.other_eos_ids))


def _say_stop_ids(vocab) -> None:
  """A tokenizer folder whose configs list end-of-sequence ids besides its EOS (an instruct
  model's turn end: Gemma 3 IT [1, 106], Llama 3 Instruct [128001, 128008, 128009]): every
  one stops decoding (TokenIds.stop_ids); said once a run, naming them."""
  if not vocab.other_eos_ids:
    return
  name = vocab.tokenizer.id_to_token
  ids = ", ".join(f"{i} {name(i)!r}" for i in (vocab.eos_id,) + tuple(vocab.other_eos_ids))
  _info_once(f"{vocab.folder}'s config.json / generation_config.json list several "
             f"end-of-sequence ids; each stops decoding (and ends tau's rows and the quality "
             f"texts): {ids}. EOS {vocab.eos_id} (tokenizer_config.json's eos_token, else the "
             "first id listed) is the one of training targets and padding.")


def check_examples(vocab: VocabLike, examples, num_tokens: Optional[int], task: str) -> None:
  """Refuses an evaluation example (batches.Examples of `task`) whose prompt or reference
  encodes to an id at or past `num_tokens` (a tokenizer cut to the models' rows: token_ids),
  naming the id, its token and the example; nothing to check otherwise."""
  vocab = as_vocabulary(vocab)
  if num_tokens is None or not is_tokenizer(vocab) or num_tokens >= vocab.vocab_size:
    return
  for field, texts in (("prompts", examples.prompt_texts), ("targets", examples.target_texts)):
    rows = getattr(examples, field)
    for i in range(len(rows)):
      vocab.check_encoded(rows[i], num_tokens, f"Example {i} of task {task!r} ({field[:-1]} "
                                               f"{texts[i][:200]!r})")


def pad_value(vocab: VocabLike) -> int:
  """The value right-padding token arrays of `vocab`'s ids (`token_ids(vocab).pad_id`)."""
  return token_ids(vocab).pad_id


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


def _tokenizer_difference(a, b, ia: dict, ib: dict) -> str:
  """The first difference of two tokenizers' identities (`identity()`: ia of a, ib of b):
  the definitions' (what refuses a pair) before the special ids' (what only warns)."""
  ta, tb = ia["tokenizer"], ib["tokenizer"]
  for key in sorted(set(ta) | set(tb)):
    if ta.get(key) != tb.get(key):
      sizes = f"; sizes {a.vocab_size} vs {b.vocab_size}" if key == "model" else ""
      return f"their {key!r} entries differ{sizes}"
  for key in ("bos", "eos", "prefix", "suffix"):
    if ia[key] != ib[key]:
      return f"{key}: {ia[key]} vs {ib[key]}"
  return "their definitions differ"


def _describe(vocab: seqio.Vocabulary) -> str:
  if is_tokenizer(vocab):
    return repr(vocab)
  path = getattr(vocab, "sentencepiece_model_file", None)
  return f"{type(vocab).__name__}({path!r}, extra_ids={getattr(vocab, 'extra_ids', '?')})"


@functools.lru_cache(maxsize=None)
def _info_once(message: str) -> None:
  logging.info(message)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  """A job checks its inputs more than once; a user reads each warning once."""
  logging.warning(message)


def check_same_vocabulary(a: VocabLike, b: VocabLike) -> bool:
  """Raises ValueError unless `a` and `b` are the same vocabulary; returns True.

  Draft and target must tokenize identically for speculative decoding.  Same
  path and extra ids is accepted without reading the files; otherwise the
  sizes and the serialized SentencePiece models are compared.
  """
  va, vb = as_vocabulary(a), as_vocabulary(b)
  if va is vb:
    return True
  if is_tokenizer(va) or is_tokenizer(vb):
    if not (is_tokenizer(va) and is_tokenizer(vb)):
      raise ValueError(f"Draft and target vocabularies differ in type: {_describe(va)} vs "
                       f"{_describe(vb)}. Use the same tokenizer for both models.")
    if va.tokenizer_file == vb.tokenizer_file:
      return True
    # Each identity() serialises the whole tokenizer: computed once per side.
    ia, ib = va.identity(), vb.identity()
    if ia["tokenizer"] != ib["tokenizer"]:
      raise ValueError(
          f"Draft and target tokenizers differ: {va.tokenizer_file} and {vb.tokenizer_file} "
          f"({_tokenizer_difference(va, vb, ia, ib)}). Speculative decoding and distillation "
          "compare the models token by token: give both the same tokenizer (the target's).")
    if ia != ib:
      # One token <-> id mapping with other special ids (a base model beside its instruct
      # version: EOS <|endoftext|> vs <|im_end|>): ids mean the same tokens, and the job
      # tokenizes and stops with `a`'s ids only.
      _warn_once(f"{va.tokenizer_file} and {vb.tokenizer_file} tokenize alike but differ in "
                 f"{_tokenizer_difference(va, vb, ia, ib)}; {va.tokenizer_file}'s special ids "
                 "are used.")
    return True
  pa = getattr(va, "sentencepiece_model_file", None)
  pb = getattr(vb, "sentencepiece_model_file", None)
  if type(va) is not type(vb) and not (
      _instance(va, "seqio", "SentencePieceVocabulary")
      and _instance(vb, "seqio", "SentencePieceVocabulary")):
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


def checkpoint_tokenizer(path: Optional[str]) -> Optional[str]:
  """The tokenizer a checkpoint folder carries (its tokenizer.json, as save_pretrained
  writes it), or None."""
  if not path or _is_remote(os.fspath(path)):
    return None
  path = os.fspath(path)
  folder = path if os.path.isdir(path) else os.path.dirname(path)
  candidate = os.path.join(folder, tokenizer_files.TOKENIZER_FILE)
  return candidate if os.path.isfile(candidate) else None


# What a binary's VOCABULARY may be (the fix named when it is not).
VOCABULARY_FIX = ("pass the checkpoints' tokenizer: a Hugging Face model folder (its "
                  "tokenizer.json), a tokenizer.json, or a SentencePiece .model.")


def check_vocabulary(path: Union[str, os.PathLike], name: str = "VOCABULARY",
                     checkpoints: Sequence[tuple] = ()) -> seqio.Vocabulary:
  """The vocabulary at `path`, for a binary's input `name`, loaded now (a bad file is a
  ValueError naming `name`, the path and the fix); every (macro, checkpoint path) of
  `checkpoints` that carries its own tokenizer must carry this one."""
  check_path(path, name, fix=VOCABULARY_FIX)
  try:
    vocab = as_vocabulary(path)
  except (OSError, ValueError) as error:
    raise ValueError(f"{name}={os.fspath(path)!r}: {error}") from None
  for macro, checkpoint in checkpoints:
    own = checkpoint_tokenizer(checkpoint)
    if own is None:
      continue
    try:
      check_same_vocabulary(vocab, os.path.dirname(own))
    except ValueError as error:
      raise ValueError(f"{macro}={checkpoint!r} carries another tokenizer than {name}="
                       f"{os.fspath(path)!r}: {error}") from None
  return vocab
