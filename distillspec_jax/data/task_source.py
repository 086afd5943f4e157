"""Where a binary's task data and tokenizer come from (DATA_DIR, VOCABULARY): one small
config the train binary takes (gin: `run.data = @TaskSource()`).

    source = TaskSource(data_dir="../shared/data", vocabulary="hf/Llama-3.2-1B")
    source.check()             # paths and the tokenizer, before any work (ValueError naming them)
    source.register()          # the file-backed tasks (gsm8k_files, ...) with that vocabulary
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
  """

  data_dir: Optional[str] = None
  vocabulary: Optional[str] = None

  def __post_init__(self):
    check_field_types(self)

  def check(self, checkpoints: Sequence[tuple] = ()) -> None:
    """Refuses a missing DATA_DIR, a VOCABULARY that is not a tokenizer, and a checkpoint of
    `checkpoints` ((macro, path) pairs) that carries another tokenizer."""
    if self.data_dir is not None:
      check_path(self.data_dir, "DATA_DIR", kind="dir",
                 fix="pass the folder holding gsm8k/, xsum/, ... (e.g. ../shared/data).")
    if self.vocabulary is not None:
      check_path(self.vocabulary, "VOCABULARY", kind="any",
                 fix="pass a Hugging Face model folder, its tokenizer.json or a SentencePiece "
                     ".model.")
      vocabularies.check_vocabulary(self.vocabulary, "VOCABULARY", checkpoints)

  def register(self) -> None:
    """Registers DATA_DIR's file-backed tasks with VOCABULARY (nothing without DATA_DIR)."""
    from distillspec_jax.data import tasks  # pylint: disable=g-import-not-at-top
    if self.data_dir is not None:
      tasks.register_file_tasks(self.data_dir, vocabulary=self.vocabulary)

  @property
  def tokens(self) -> TokenIds:
    """The models' special ids: VOCABULARY's, T5's without one."""
    return TokenIds() if self.vocabulary is None else vocabularies.token_ids(self.vocabulary)
