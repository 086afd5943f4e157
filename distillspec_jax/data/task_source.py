"""Where a binary's task data and tokenizer come from (DATA_DIR, VOCABULARY): one small
config the train binary takes (gin: `run.data = @TaskSource()`).

    source = TaskSource(data_dir="../shared/data", vocabulary="hf/Llama-3.2-1B")
    source.check()             # paths and the tokenizer, before any work (ValueError naming them)
    source.register()          # the file-backed tasks (gsm8k_files, ...) with that vocabulary
                               # (and chat_files, with chat_template=True)
    model.with_tokens(source.tokens)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from distillspec_jax.core.validation import check_field_types, check_path
from distillspec_jax.data import vocabularies
from distillspec_jax.models.model import TokenIds


@dataclasses.dataclass(frozen=True)
class TaskSource:
  """Attributes:
    data_dir: DATA_DIR, the folder of the file-backed tasks (gsm8k/, xsum/, ...); None: only
      the registered (TFDS, embedded) tasks.
    vocabulary: VOCABULARY, the models' tokenizer: a Hugging Face model folder, its
      tokenizer.json, or a SentencePiece .model; None: each task's own.
    chat_template: CHAT_TEMPLATE, also DATA_DIR/chat/'s conversations as the task
      `chat_files`, rendered by VOCABULARY's chat template with the loss on the last reply
      (data/tasks/chat_tasks.py).
  """

  data_dir: Optional[str] = None
  vocabulary: Optional[str] = None
  chat_template: bool = False

  def __post_init__(self):
    check_field_types(self)
    if self.chat_template and (self.vocabulary is None or self.data_dir is None):
      raise ValueError(
          f"CHAT_TEMPLATE=True with VOCABULARY={self.vocabulary!r} and DATA_DIR="
          f"{self.data_dir!r}: conversations (DATA_DIR/chat/*.jsonl) are rendered by the "
          "tokenizer folder's chat template; set both, or CHAT_TEMPLATE=False.")

  def check(self, checkpoints: Sequence[tuple] = ()) -> None:
    """Refuses a missing DATA_DIR, a VOCABULARY that is not a tokenizer, and a checkpoint of
    `checkpoints` ((macro, path) pairs) that carries another tokenizer, and CHAT_TEMPLATE
    without a tokenizer folder that has a chat template."""
    if self.data_dir is not None:
      check_path(self.data_dir, "DATA_DIR", kind="dir",
                 fix="pass the folder holding gsm8k/, xsum/, ... (e.g. ../shared/data).")
    if self.vocabulary is not None:
      check_path(self.vocabulary, "VOCABULARY", kind="any",
                 fix="pass a Hugging Face model folder, its tokenizer.json or a SentencePiece "
                     ".model.")
      vocab = vocabularies.check_vocabulary(self.vocabulary, "VOCABULARY", checkpoints)
    if self.chat_template:
      from distillspec_jax.data.chat_template import template_of  # pylint: disable=g-import-not-at-top
      template_of(vocab)

  def register(self) -> None:
    """Registers DATA_DIR's file-backed tasks with VOCABULARY (nothing without DATA_DIR)."""
    from distillspec_jax.data import tasks  # pylint: disable=g-import-not-at-top
    if self.data_dir is not None:
      tasks.register_file_tasks(self.data_dir, vocabulary=self.vocabulary,
                                chat_template=self.chat_template)

  @property
  def tokens(self) -> TokenIds:
    """The models' special ids: VOCABULARY's, T5's without one."""
    return self.tokens_for(None)

  def tokens_for(self, rows: Optional[int]) -> TokenIds:
    """The special ids of models whose smallest embedding has `rows` rows (None: unknown): a
    tokenizer with more ids is cut to them (vocabularies.token_ids: a ValueError naming the
    ids past the rows when they cannot be cut)."""
    if self.vocabulary is None:
      return TokenIds()
    try:
      return vocabularies.token_ids(self.vocabulary, rows)
    except ValueError as error:
      raise ValueError(f"VOCABULARY={self.vocabulary!r} does not fit the models: {error}"
                       ) from None
