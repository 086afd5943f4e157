"""File-backed variants of the tasks, for users without TFDS data.

`register_file_tasks(data_dir)` registers, for each sub-folder it finds:

  task                 folder (under data_dir)   files / layout
  gsm8k_files          gsm8k/                    *.jsonl  {"question", "answer"}
  xsum_files           xsum/                     *.jsonl  {"document", "summary"}
  cnn_dailymail_files  cnndm/ or cnn_dailymail/  *.jsonl  {"article", "highlights"} (or
                                                 Spec-Bench {"turns": [...], "reference": [...]})
  wmt_en_de_files      wmt/                      aligned text, one sentence a line:
                                                 <name>.en(.txt) and <name>.de(.txt)
  lm1b_files           lm1b/                     *.txt, one sentence a line
  bbh_<subtask>, bbh   bbh/                      see tasks/bbh.py
  chat_files           chat/                     *.jsonl conversations (chat_template=True)

With chat_template=True (a Hugging Face tokenizer folder with a chat template), every task's
prompt and reference are rendered by the template as a user turn and the assistant's reply,
the loss on the reply only; see tasks/chat_tasks.py.

Splits are found by file name: a file whose name contains 'train' is train;
'validation', 'valid', 'dev' or 'val' is validation; 'test' is test.  Files that
match no split, in a folder where no file matches a split, form the 'test' split.
Pass `split_files={'train': [...], ...}` to the per-task functions to choose
files explicitly.  Formatting, features and metrics equal the TFDS tasks'.

Errors: a missing directory raises FileNotFoundError at registration; a
malformed line raises ValueError naming the file and line at first use (when
the files are read).  Files are read into memory when the dataset is built.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import seqio
import tensorflow as tf

from distillspec_jax.data import vocabularies
from distillspec_jax.data.chat_template import template_of
from distillspec_jax.data.tasks import bbh
from distillspec_jax.data.tasks import chat_tasks
from distillspec_jax.data.tasks import metrics
from distillspec_jax.data.tasks import preprocessors
from distillspec_jax.data.tasks import tfds_tasks

SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test",),
}
SplitFiles = Mapping[str, Sequence[str]]


def _require_dir(directory: str, what: str) -> str:
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(
        f"{what}: data directory {directory!r} does not exist "
        f"(absolute: {os.path.abspath(directory)!r}). Pass the folder that holds the "
        "files, e.g. register_file_tasks('../shared/data') for the sub-folders gsm8k/, "
        "xsum/, cnndm/, wmt/, lm1b/, bbh/.")
  return directory


def _split_of(filename: str) -> Optional[str]:
  base = os.path.basename(filename).lower()
  for split in ("validation", "train", "test"):  # validation first: 'val' vs others
    if any(alias in base for alias in SPLIT_ALIASES[split]):
      return split
  return None


def discover_split_files(directory: str, suffixes: Sequence[str]) -> Dict[str, List[str]]:
  """{split: sorted files} for files in `directory` ending with one of `suffixes`."""
  files = sorted(os.path.join(directory, f) for f in os.listdir(directory)
                 if f.endswith(tuple(suffixes)) and not f.startswith("."))
  out: Dict[str, List[str]] = {}
  unmatched = []
  for f in files:
    split = _split_of(f)
    if split is None:
      unmatched.append(f)
    else:
      out.setdefault(split, []).append(f)
  if unmatched and not out:
    out["test"] = unmatched
  elif unmatched:
    logging.info("Ignoring files with no split in their name: %s", unmatched)
  return out


# ---------------------------------------------------------------- readers
def read_jsonl(path: str, required_keys: Sequence[str] = ()) -> List[dict]:
  """Parses a JSONL file; a malformed line raises ValueError('<path>:<line>: ...')."""
  rows = []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8").strip()
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({e}).") from None
      if not line:
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column "
                         f"{e.colno}); expected one JSON object a line.") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got "
                         f"{type(row).__name__}.")
      missing = [k for k in required_keys if k not in row]
      if missing:
        raise ValueError(f"{path}:{lineno}: missing field(s) {missing}; the line has "
                         f"{sorted(row)}, expected {list(required_keys)}.")
      row["__line__"] = lineno
      rows.append(row)
  return rows


def read_lines(path: str) -> List[str]:
  """Lines of a UTF-8 text file (newline stripped); bad bytes name file and line."""
  out = []
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        out.append(raw.decode("utf-8").rstrip("\r\n"))
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({e}).") from None
  return out


def _string_field(row: dict, key: str, path: str) -> str:
  value = row[key]
  if not isinstance(value, str):
    raise ValueError(f"{path}:{row['__line__']}: field {key!r} must be a string, got "
                     f"{type(value).__name__}.")
  return value


def _jsonl_records(files: Sequence[str], keys: Sequence[str]) -> Dict[str, List[str]]:
  cols = {k: [] for k in keys}
  for path in files:
    for row in read_jsonl(path, keys):
      for k in keys:
        cols[k].append(_string_field(row, k, path))
  return cols


def _cnndm_records(files: Sequence[str]) -> Dict[str, List[str]]:
  cols = {"article": [], "highlights": []}
  for path in files:
    for row in read_jsonl(path):
      line = row["__line__"]
      if "article" in row and "highlights" in row:
        article = _string_field(row, "article", path)
        highlights = _string_field(row, "highlights", path)
      elif "turns" in row and "reference" in row:
        try:
          article, highlights = row["turns"][0], row["reference"][0]
          assert isinstance(article, str) and isinstance(highlights, str)
        except (AssertionError, IndexError, KeyError, TypeError):
          raise ValueError(f"{path}:{line}: 'turns' and 'reference' must be non-empty "
                           "lists of strings.") from None
        for prefix in ("Summarize: ", "summarize: "):
          if article.startswith(prefix):
            article = article[len(prefix):]
      else:
        raise ValueError(f"{path}:{line}: expected fields 'article' and 'highlights' (or "
                         f"Spec-Bench 'turns' and 'reference'); the line has {sorted(row)}.")
      cols["article"].append(article)
      cols["highlights"].append(highlights)
  return cols


def _chat_records(files: Sequence[str], template) -> Dict[str, List[str]]:
  """{"inputs": rendered prompts, "targets": rendered replies, "reference": the replies' own
  text (for metrics)}: every conversation of `files` (chat_tasks.conversation's layouts)."""
  cols = {"inputs": [], "targets": [], "reference": []}
  for path in files:
    for row in read_jsonl(path):
      where = f"{path}:{row['__line__']}"
      messages = chat_tasks.conversation(row, where)
      prompt, response = template.split(messages, where)
      cols["inputs"].append(prompt)
      cols["targets"].append(response)
      cols["reference"].append(messages[-1]["content"])
  return cols


def _lines_records(files: Sequence[str]) -> Dict[str, List[str]]:
  text = []
  for path in files:
    text.extend(l for l in read_lines(path) if l.strip())
  return {"text": text}


def _find_language_file(files: Sequence[str], lang: str) -> Optional[str]:
  for f in files:
    base = os.path.basename(f)
    if base.endswith(f".{lang}") or base.endswith(f".{lang}.txt"):
      return f
  return None


def wmt_pairs(files: Sequence[str], source_language: str, target_language: str
              ) -> List[tuple]:
  """Groups aligned files into (source file, target file) pairs by name stem."""
  def stem(f, lang):
    base = os.path.basename(f)
    for ending in (f".{lang}.txt", f".{lang}"):
      if base.endswith(ending):
        base = base[: -len(ending)]
        break
    for tag in (".src", ".ref"):  # newstest2014.de-en.src.de.txt / .ref.en.txt
      if base.endswith(tag):
        base = base[: -len(tag)]
    return base

  src = {stem(f, source_language): f for f in files
         if _find_language_file([f], source_language)}
  tgt = {stem(f, target_language): f for f in files
         if _find_language_file([f], target_language)}
  pairs = [(src[s], tgt[s]) for s in sorted(src) if s in tgt]
  if not pairs:
    raise FileNotFoundError(
        f"No aligned {source_language}/{target_language} text files among {list(files)}; "
        f"expected pairs like <name>.{source_language}.txt and <name>.{target_language}.txt.")
  return pairs


def _wmt_records(files: Sequence[str], source_language: str, target_language: str
                 ) -> Dict[str, List[str]]:
  cols = {source_language: [], target_language: []}
  for src_path, tgt_path in wmt_pairs(files, source_language, target_language):
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
      raise ValueError(f"Aligned files differ in line count: {src_path} has {len(src)} lines, "
                       f"{tgt_path} has {len(tgt)}; they must be aligned line by line.")
    for i, (s, t) in enumerate(zip(src, tgt), start=1):
      if not s.strip() and not t.strip():
        continue
      if not s.strip() or not t.strip():
        empty = src_path if not s.strip() else tgt_path
        raise ValueError(f"{empty}:{i}: empty line while the aligned file has text; the "
                         "source and reference files must be aligned line by line.")
      cols[source_language].append(s)
      cols[target_language].append(t)
  return cols


# ---------------------------------------------------------------- sources
def _records_dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None, *,
                        split_files: SplitFiles, read_fn: Callable) -> tf.data.Dataset:
  del shuffle_files, seed  # Examples are shuffled by the Task.
  if split not in split_files:
    raise ValueError(f"Split {split!r} has no files; available: {sorted(split_files)}.")
  cols = read_fn(list(split_files[split]))
  return tf.data.Dataset.from_tensor_slices(
      {k: tf.constant(v, dtype=tf.string, shape=[len(v)]) for k, v in cols.items()})


def records_source(split_files: SplitFiles, read_fn: Callable) -> seqio.FunctionDataSource:
  return seqio.FunctionDataSource(
      dataset_fn=functools.partial(_records_dataset_fn, split_files=dict(split_files),
                                   read_fn=read_fn),
      splits=tuple(split_files))


def resolve_split_files(directory: str, split_files: Optional[SplitFiles],
                         suffixes: Sequence[str], what: str) -> Dict[str, List[str]]:
  if split_files is not None:
    for split, files in split_files.items():
      for f in ([files] if isinstance(files, str) else files):
        if not os.path.isfile(f):
          raise FileNotFoundError(f"{what}: file {f!r} for split {split!r} does not exist.")
    return {k: [v] if isinstance(v, str) else list(v) for k, v in split_files.items()}
  _require_dir(directory, what)
  found = discover_split_files(directory, suffixes)
  if not found:
    raise FileNotFoundError(f"{what}: no {'/'.join(suffixes)} files in {directory!r}; "
                            "expected files named like train.jsonl / test.jsonl.")
  return found


def register_gsm8k_files(directory: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                         name: str = "gsm8k_files", split_files: Optional[SplitFiles] = None
                         ) -> seqio.Task:
  """GSM8K from JSONL {"question","answer"}: zero-shot CoT prompt -> reasoning + '#### N'."""
  files = resolve_split_files(directory, split_files, (".jsonl",), name)
  return tfds_tasks.register_task(
      name, source=records_source(
          files, functools.partial(_jsonl_records, keys=("question", "answer"))),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary)),
      preprocessors=tfds_tasks.text_task_preprocessors(preprocessors.gsm8k_cot),
      metric_fns=list(tfds_tasks.GSM8K_METRICS))


def register_xsum_files(directory: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                        name: str = "xsum_files", split_files: Optional[SplitFiles] = None
                        ) -> seqio.Task:
  """XSum from JSONL {"document","summary"}: 'summarize: <document>' -> summary."""
  files = resolve_split_files(directory, split_files, (".jsonl",), name)
  tfds_tasks.mark_inputs_truncatable(name)
  return tfds_tasks.register_task(
      name, source=records_source(
          files, functools.partial(_jsonl_records, keys=("document", "summary"))),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary)),
      preprocessors=tfds_tasks.text_task_preprocessors(
          preprocessors.summarize, article_key="document", summary_key="summary"),
      metric_fns=list(tfds_tasks.SUMMARIZATION_METRICS))


def register_cnn_dailymail_files(directory: str,
                                 vocabulary: Optional[vocabularies.VocabLike] = None,
                                 name: str = "cnn_dailymail_files",
                                 split_files: Optional[SplitFiles] = None) -> seqio.Task:
  """CNN/DM from JSONL {"article","highlights"} or Spec-Bench {"turns","reference"}."""
  files = resolve_split_files(directory, split_files, (".jsonl",), name)
  tfds_tasks.mark_inputs_truncatable(name)
  return tfds_tasks.register_task(
      name, source=records_source(files, _cnndm_records),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary)),
      preprocessors=tfds_tasks.text_task_preprocessors(
          preprocessors.summarize, article_key="article", summary_key="highlights"),
      metric_fns=list(tfds_tasks.SUMMARIZATION_METRICS))


def register_wmt_files(directory: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                       name: str = "wmt_en_de_files", source_language: str = "en",
                       target_language: str = "de",
                       split_files: Optional[SplitFiles] = None) -> seqio.Task:
  """WMT from aligned text files: 'translate English to German: <en>' -> de.

  Each split needs <stem>.<src>(.txt) and <stem>.<tgt>(.txt) files, e.g.
  newstest2014.de-en.src.de.txt + newstest2014.de-en.ref.en.txt.
  """
  files = resolve_split_files(directory, split_files,
                               tuple(f".{l}{e}" for l in (source_language, target_language)
                                     for e in ("", ".txt")), name)
  for split, fs in files.items():  # Check pairing now (names only, no reads).
    wmt_pairs(fs, source_language, target_language)
  return tfds_tasks.register_task(
      name, source=records_source(files, functools.partial(
          _wmt_records, source_language=source_language, target_language=target_language)),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary)),
      preprocessors=tfds_tasks.text_task_preprocessors(
          preprocessors.translate, source_language=source_language,
          target_language=target_language),
      metric_fns=list(tfds_tasks.TRANSLATION_METRICS))


def register_lm1b_files(directory: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                        name: str = "lm1b_files", split_files: Optional[SplitFiles] = None
                        ) -> seqio.Task:
  """LM1B from text files, one sentence a line: decoder-only, 'targets' only."""
  files = resolve_split_files(directory, split_files, (".txt",), name)
  return tfds_tasks.register_task(
      name, source=records_source(files, _lines_records),
      output_features=tfds_tasks.text_features(vocabularies.as_vocabulary(vocabulary),
                                               with_inputs=False),
      preprocessors=tfds_tasks.lm_task_preprocessors(text_key="text"),
      postprocess_fn=metrics.lm_target_token_ids,
      metric_fns=[metrics.log_perplexity])


def register_chat_files(directory: str, vocabulary: vocabularies.VocabLike,
                        name: str = chat_tasks.TASK_NAME,
                        split_files: Optional[SplitFiles] = None) -> seqio.Task:
  """Conversations from JSONL (tasks/chat_tasks.py's layouts), rendered by `vocabulary`'s chat
  template (loaded now: a folder without one is a ValueError naming it and the fix): the
  prompt through the last assistant turn's header -> that turn's reply, the loss on it."""
  vocab = vocabularies.as_vocabulary(vocabulary)
  template = template_of(vocab)
  files = resolve_split_files(directory, split_files, (".jsonl",), name)
  return tfds_tasks.register_task(
      name, source=records_source(files, functools.partial(_chat_records, template=template)),
      output_features=chat_tasks.chat_features(vocab),
      preprocessors=chat_tasks.chat_preprocessors(preprocessors.filter_empty), metric_fns=[])


_FOLDERS = (
    ("gsm8k", ("gsm8k",), register_gsm8k_files),
    ("xsum", ("xsum",), register_xsum_files),
    ("cnn_dailymail", ("cnndm", "cnn_dailymail"), register_cnn_dailymail_files),
    ("wmt", ("wmt", "wmt14", "wmt_en_de"), register_wmt_files),
    ("lm1b", ("lm1b",), register_lm1b_files),
)


def register_file_tasks(data_dir: str, vocabulary: Optional[vocabularies.VocabLike] = None,
                        include_bbh: bool = True, chat_template: bool = False) -> List[str]:
  """Registers every file-backed task whose folder exists under `data_dir`.

  Returns the registered names (e.g. ['gsm8k_files', 'xsum_files', ...]).
  Raises FileNotFoundError if `data_dir` does not exist or holds none of the
  expected folders.  Idempotent; only lists directories (files are read later).
  `chat_template`: every task's prompt and reference rendered by `vocabulary`'s chat template
  as a user turn and its reply, and the conversations of `data_dir`/chat/ as 'chat_files'
  (tasks/chat_tasks.py; a ValueError now if the vocabulary has no template).
  """
  _require_dir(data_dir, "register_file_tasks")
  vocab = vocabularies.as_vocabulary(vocabulary)
  names = []
  if chat_template:
    template = template_of(vocab)  # none: refused before any read
  for _, folders, fn in _FOLDERS:
    for folder in folders:
      path = os.path.join(data_dir, folder)
      if os.path.isdir(path):
        names.append(fn(path, vocabulary=vocab).name)
        break
  if include_bbh and os.path.isdir(os.path.join(data_dir, "bbh")):
    names.extend(bbh.register_bbh_tasks(os.path.join(data_dir, "bbh"), vocabulary=vocab))
  if chat_template:
    for name in names:  # prompts as a user turn, references as the reply (not LM tasks)
      if name in seqio.TaskRegistry.names():
        chat_tasks.render_text_task(name, template)
    if os.path.isdir(os.path.join(data_dir, chat_tasks.FOLDER)):
      names.insert(0, register_chat_files(os.path.join(data_dir, chat_tasks.FOLDER),
                                          vocab).name)
  if not names:
    raise FileNotFoundError(
        f"register_file_tasks: {data_dir!r} has none of the folders gsm8k/, xsum/, cnndm/, "
        "wmt/, lm1b/, bbh/" + (", chat/" if chat_template else "") + ". Pass the directory "
        "that contains them.")
  return names
