"""A Hugging Face tokenizer (a `tokenizer.json`, read by the `tokenizers` library) as a
seqio.Vocabulary.

    vocab = load_hf_vocabulary("path/to/model_folder")   # or ".../tokenizer.json"
    vocab.encode("Hi!")          # raw ids, no special tokens (seqio's contract)
    vocab.encode_prompt("Hi!")   # == transformers' tokenizer("Hi!")["input_ids"] (its BOS rule)

Special ids come from the tokenizer and the model's configs in the same folder
(tokenizer_files.py, which reads them without TensorFlow); the tokens the tokenizer adds
around a single text are `prompt_prefix` / `prompt_suffix`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence

import numpy as np
import seqio
import tensorflow as tf

from distillspec_jax.data.tokenizer_files import (CONFIG_FILES, TOKENIZER_FILE, added_around,
                                                  listed_eos_ids, load_tokenizer, special_ids)


class HFTokenizerVocabulary(seqio.Vocabulary):
  """seqio.Vocabulary over a `tokenizers.Tokenizer`; ids as transformers gives them."""

  def __init__(self, path: str):
    super().__init__(extra_ids=0)
    self.tokenizer_file = os.path.abspath(path)
    self.folder = os.path.dirname(self.tokenizer_file)
    self.tokenizer = load_tokenizer(self.tokenizer_file)
    ids = special_ids(self.tokenizer, self.folder)
    if ids["eos"] is None:
      raise ValueError(
          f"No EOS token for {self.tokenizer_file!r}: none of {list(CONFIG_FILES)} in "
          f"{self.folder!r} names one. Pass the model folder saved by save_pretrained.")
    self._bos, self._eos, self._pad = ids["bos"], ids["eos"], ids["pad"]
    # The other end-of-sequence ids the model's configs list: decoding stops at them too
    # (vocabularies.token_ids: TokenIds.stop_ids).
    self.other_eos_ids = tuple(i for i in listed_eos_ids(self.folder) if i != self._eos)
    self.prompt_prefix, self.prompt_suffix = added_around(self.tokenizer)

  # Special ids: from the files, any of BOS and pad may be absent (None).
  @property
  def bos_id(self) -> Optional[int]:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_token_id(self) -> Optional[int]:
    """The tokenizer's pad token, or None. Padding itself is marked by masks."""
    return self._pad

  @property
  def pad_id(self) -> int:
    # seqio replaces the ids after EOS with pad_id before decoding; EOS is a special token
    # that decoding skips, so the text is the same whether or not a pad token exists.
    return self._eos if self._pad is None else self._pad

  @property
  def unk_id(self) -> Optional[int]:
    return None

  @property
  def _base_vocab_size(self) -> int:
    return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

  def ids_for_rows(self, rows: int) -> int:
    """How many ids models whose embeddings have `rows` rows use: all the tokenizer's when
    `rows` holds them, else `rows` when every id at or past it is an added special token
    other than BOS, EOS and pad (text encodes to one only where it spells that token: Gemma
    3's `<image_soft_token>` at 262144 beside 262144 rows); else a ValueError saying which
    ids lie past the rows and why they cannot be cut."""
    size = self._base_vocab_size
    if rows >= size:
      return size
    added = self.tokenizer.get_added_tokens_decoder()
    roles = {}
    for name, i in (("BOS", self._bos), ("EOS", self._eos), ("pad", self._pad)):
      if i is not None:
        roles[i] = f"{roles[i]}/{name}" if i in roles else name
    past = range(rows, size)
    ordinary = [i for i in past if i not in added or not added[i].special]
    special = [i for i in past if i in roles]
    where = (f"{self.tokenizer_file!r} has {size} ids but the models only {rows} embedding "
             f"rows: ids {rows}..{size - 1} have no row")
    if ordinary:
      shown = ", ".join(f"{i} {self.tokenizer.id_to_token(i)!r}" for i in ordinary[:5])
      raise ValueError(f"{where}, and {len(ordinary)} of them are not added special tokens "
                       f"(ordinary text encodes to them): {shown}"
                       f"{', ...' if len(ordinary) > 5 else ''}; use the model trained with "
                       "that tokenizer (vocab_size >= its size) or that model's tokenizer.")
    if special:
      shown = ", ".join(f"{roles[i]} {i} {self.tokenizer.id_to_token(i)!r}" for i in special)
      raise ValueError(f"{where}, among them the tokenizer's {shown}, which every example "
                       "or decode uses; use the model trained with that tokenizer "
                       "(vocab_size >= its size) or that model's tokenizer.")
    return rows

  def check_encoded(self, ids, num_tokens: int, example: str) -> None:
    """Refuses the encoded `ids` of `example` (what it is and its text) when one lies at or
    past `num_tokens` (the ids the models use: `ids_for_rows`), naming the id and its token,
    rather than letting the models index past their embeddings."""
    ids = np.asarray(ids).reshape(-1)
    bad = ids[ids >= num_tokens]
    if bad.size:
      token = self.tokenizer.id_to_token(int(bad[0]))
      raise ValueError(f"{example} encodes to id {int(bad[0])} ({token!r}), past the "
                       f"{num_tokens} ids the models have embedding rows for: the text spells "
                       f"the special token {token!r}; remove it from the data.")

  def _encode(self, s: str) -> Sequence[int]:
    return self.tokenizer.encode(s, add_special_tokens=False).ids

  def encode_prompt(self, s: str) -> list:
    """The ids of `s` as the tokenizer encodes one text, special tokens included."""
    return list(self.tokenizer.encode(s, add_special_tokens=True).ids)

  def _decode(self, ids) -> str:
    size = self._base_vocab_size
    # Ids of embedding rows beyond the tokenizer (never sampled) have no text.
    return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < size],
                                 skip_special_tokens=True)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
    def encode(text):
      return np.asarray(self._encode(text.decode("utf-8")), np.int32)
    ids = tf.numpy_function(encode, [s], tf.int32, stateful=False)
    ids.set_shape([None])
    return ids

  def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
    def decode(row):
      return np.asarray(self._decode(row.tolist()).encode("utf-8"), dtype=object)
    if ids.shape.rank == 1:
      return tf.numpy_function(decode, [ids], tf.string, stateful=False)
    return tf.map_fn(lambda r: tf.numpy_function(decode, [r], tf.string, stateful=False),
                     ids, fn_output_signature=tf.string)

  def identity(self) -> Dict[str, Any]:
    """What makes two tokenizers tokenize alike: the tokenizer's definition (without its
    truncation/padding settings) and the special ids."""
    spec = json.loads(self.tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return {"tokenizer": spec, "bos": self._bos, "eos": self._eos,
            "prefix": self.prompt_prefix, "suffix": self.prompt_suffix}

  def __eq__(self, other):
    return isinstance(other, HFTokenizerVocabulary) and (
        self.tokenizer_file == other.tokenizer_file or self.identity() == other.identity())

  def __hash__(self):
    return hash(self.tokenizer_file)

  def __repr__(self):
    return f"HFTokenizerVocabulary({self.tokenizer_file!r}, size={self.vocab_size})"


def load_hf_vocabulary(path: str) -> HFTokenizerVocabulary:
  """An HFTokenizerVocabulary from a model folder or its tokenizer.json."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path!r} does not exist; pass a model folder with a "
                            "tokenizer.json, the tokenizer.json itself, or a SentencePiece "
                            ".model file.")
  return HFTokenizerVocabulary(path)
