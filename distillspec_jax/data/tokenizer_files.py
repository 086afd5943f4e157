"""A Hugging Face model folder's tokenizer files, read without seqio or TensorFlow: the
tokenizer.json (by the `tokenizers` library) and the special tokens its configs name.

Special ids come from the tokenizer and the model's configs in the same folder, never from
constants: EOS from tokenizer_config.json's `eos_token`, else config.json's or
generation_config.json's `eos_token_id`; BOS and pad likewise, and either may be absent (a
Llama-3 tokenizer has no pad token, a Qwen2 one no BOS). The tokens the tokenizer adds around
a single text (its post-processor: Llama's BOS) are `added_around`'s.

hf_vocabulary.py wraps them as a seqio.Vocabulary; this module is what a process that only
looks at a folder (the binaries' checks, the importers, the chat template) needs, so it does
not pay TensorFlow's import.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "config.json", "generation_config.json")


def read_json(path: str, purpose: str = "the tokenizer's special tokens") -> Dict[str, Any]:
  """A tokenizer folder's JSON file as a dict ({} when absent or not an object); ValueError
  naming the file and what it is read for when it is not JSON."""
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not a JSON file ({e}); it is read for {purpose}, so fix or "
                     "remove it.") from None
  return value if isinstance(value, dict) else {}


def token_text(token: Any) -> Any:
  """A special token as tokenizer_config.json writes it (a string, or an AddedToken dict
  whose 'content' is the string): the string; anything else as it is."""
  return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(path: str):
  """A `tokenizers.Tokenizer` from a tokenizer.json; ValueError naming the file otherwise."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  try:
    with open(path, encoding="utf-8") as f:
      json.load(f)
    return tokenizers.Tokenizer.from_file(path)
  except (UnicodeDecodeError, json.JSONDecodeError, Exception) as e:  # pylint: disable=broad-except
    reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    raise ValueError(
        f"{path!r} is not a Hugging Face tokenizer.json ({reason}). Pass a model folder saved "
        "by transformers' save_pretrained, its tokenizer.json, or a SentencePiece .model "
        "file.") from None


def _token_id(tokenizer, token: Any, where: str) -> Optional[int]:
  """The id of a special token as tokenizer_config.json writes it (a string or an
  AddedToken dict); None when absent."""
  token = token_text(token)
  if token is None:
    return None
  if not isinstance(token, str):
    raise ValueError(f"{where}: expected a token string, got {token!r}.")
  found = tokenizer.token_to_id(token)
  if found is None:
    raise ValueError(f"{where}: special token {token!r} is not in the tokenizer's vocabulary; "
                     "the folder's tokenizer files do not belong together.")
  return int(found)


def _config_id(value: Any) -> Optional[int]:
  """An id from config.json / generation_config.json: an int, or the first of a list."""
  if isinstance(value, list):
    value = value[0] if value else None
  return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def special_ids(tokenizer, folder: str) -> Dict[str, Optional[int]]:
  """{"bos", "eos", "pad"} ids: tokenizer_config.json's tokens first, then config.json's and
  generation_config.json's `*_token_id` (None where no file names one)."""
  configs = {name: read_json(os.path.join(folder, name)) for name in CONFIG_FILES}
  out = {}
  for key in ("bos", "eos", "pad"):
    where = os.path.join(folder, "tokenizer_config.json") + f" {key}_token"
    found = _token_id(tokenizer, configs["tokenizer_config.json"].get(f"{key}_token"), where)
    for name in CONFIG_FILES[1:]:
      if found is None:
        found = _config_id(configs[name].get(f"{key}_token_id"))
    out[key] = found
  return out


def listed_eos_ids(folder: str) -> Tuple[int, ...]:
  """Every end-of-sequence id config.json and generation_config.json list (an instruct
  model's several: Gemma 3 IT's [1, 106], Llama 3 Instruct's [128001, 128008, 128009]), in
  order, each once. `special_ids`' EOS is the one of targets and padding; decoding stops at
  every one (vocabularies.token_ids: TokenIds.stop_ids)."""
  out = []
  for name in CONFIG_FILES[1:]:
    value = read_json(os.path.join(folder, name)).get("eos_token_id")
    for item in value if isinstance(value, list) else [value]:
      if isinstance(item, int) and not isinstance(item, bool) and item not in out:
        out.append(int(item))
  return tuple(out)


def added_around(tokenizer) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
  """(prefix, suffix): the ids the tokenizer's post-processor puts around one text."""
  sample = "a b"
  raw = tokenizer.encode(sample, add_special_tokens=False).ids
  full = tokenizer.encode(sample, add_special_tokens=True).ids
  for start in range(len(full) - len(raw) + 1):
    if full[start:start + len(raw)] == raw:
      return tuple(full[:start]), tuple(full[start + len(raw):])
  raise ValueError("The tokenizer's post-processor changes the text's own ids; such a "
                   "tokenizer is not supported.")
