"""The main job from a user's own pretrained pair: where the pair and its tokenizer come from.

    PipelineConfig(..., target_model=None, draft_model=None,
                   target_checkpoint_path="hf/Llama-3.1-8B", draft_checkpoint_path="hf/Llama-3.2-1B",
                   pair=PairSource(vocabulary="hf/Llama-3.1-8B"))

With a checkpoint given, its model comes from the checkpoint (an HF config.json, our stored
configuration); a preset named beside it is checked against it before any work. The target is
loaded, not trained, unless `finetune_target`; the raw draft is the draft checkpoint, unless
`finetune_draft`. With a vocabulary given, the vocab stage trains none: the task is tokenized
with it, exactly as the tokenizer encodes text, and both models take its special ids.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from distillspec_jax.core.validation import check_field_types
from distillspec_jax.data import vocabularies
from distillspec_jax.data.chat_template import template_of
from distillspec_jax.interop import importer
from distillspec_jax.models.config import TransformerConfig, model_config
from distillspec_jax.models.model import TokenIds


@dataclasses.dataclass(frozen=True)
class PairSource:
  """Attributes:
    vocabulary: VOCABULARY, the models' tokenizer: a Hugging Face model folder, its
      tokenizer.json, or a SentencePiece .model (T5's conventions); None: the task's own
      vocabulary (or the one the vocab stage trains).
    finetune_target: FINETUNE_TARGET, fine-tune TARGET_CHECKPOINT_PATH for target_steps
      (False: the target stage loads it as it is).
    finetune_draft: FINETUNE_DRAFT, fine-tune DRAFT_CHECKPOINT_PATH for draft_steps into the
      raw draft (False: the raw draft is that model).
    chat_template: CHAT_TEMPLATE, also DATA_DIR/chat/'s conversations as the task
      `chat_files`, rendered by VOCABULARY's chat template with the loss on the last reply
      (data/tasks/chat_tasks.py); needs VOCABULARY and DATA_DIR.
  """

  vocabulary: Optional[str] = None
  finetune_target: bool = False
  finetune_draft: bool = False
  chat_template: bool = False

  def __post_init__(self):
    check_field_types(self)
    if self.chat_template and self.vocabulary is None:
      raise ValueError("CHAT_TEMPLATE=True renders conversations with the tokenizer folder's "
                       "chat template: set VOCABULARY to that folder (the target's), or "
                       "CHAT_TEMPLATE=False.")

  def finetunes(self, role: str) -> bool:
    return self.finetune_target if role == "target" else self.finetune_draft

  @property
  def tokens(self) -> TokenIds:
    """The models' special ids: the vocabulary's (T5's without one)."""
    return self.tokens_for(None)

  def tokens_for(self, rows: Optional[int]) -> TokenIds:
    """The special ids of models whose smallest embedding has `rows` rows (None: unknown): a
    tokenizer with more ids is cut to them (vocabularies.token_ids)."""
    return TokenIds() if self.vocabulary is None else _token_ids(self.vocabulary, rows)


@functools.lru_cache(maxsize=8)
def _token_ids(path: str, rows: Optional[int] = None) -> TokenIds:
  return vocabularies.token_ids(path, rows)


@functools.lru_cache(maxsize=16)
def opened(path: str) -> importer.OpenedCheckpoint:
  """The checkpoint at `path`, opened once per process (importer.open_checkpoint)."""
  return importer.open_checkpoint(path)


def role_config(path: Optional[str], preset: Optional[str], vocab_size: Optional[int],
                overrides: dict, macro: str) -> TransformerConfig:
  """A role's model: the preset's (with the vocabulary's rows) when one is named, else the
  checkpoint's own configuration; the job's run settings (`overrides`) on top."""
  if preset is not None:
    kwargs = dict(overrides, **({} if vocab_size is None else {"vocab_size": vocab_size}))
    return model_config(preset, **kwargs)
  role = macro.split("_")[0].lower()
  config = importer.stored_config(opened(path), path, macro, f"PipelineConfig.{role}_model")
  return config.replace(**overrides)


def _opened(macro: str, path: str) -> importer.OpenedCheckpoint:
  """`opened(path)`, its errors (a config.json this network does not compute, ...) naming
  `macro` and the path."""
  try:
    return opened(path)
  except ValueError as error:
    raise ValueError(f"{macro}={path!r}: {error}") from None


def check_pair_inputs(pair: PairSource, roles: dict, train_vocabulary: bool) -> None:
  """Before any work: the vocabulary loads, every checkpoint that carries a tokenizer carries
  the one of the job (and both the same), CHAT_TEMPLATE has a template to render with, and a
  preset named beside a checkpoint describes it (shapes, RoPE, norm epsilon:
  importer.check_checkpoint). `roles`: {role: (macro, path, preset)}."""
  if pair.vocabulary is not None and train_vocabulary:
    raise ValueError(f"VOCABULARY={pair.vocabulary!r} and TRAIN_VOCABULARY=True: the job "
                     "either uses the given tokenizer or trains one; set one of them.")
  given = [(macro, path) for macro, path, _ in roles.values() if path is not None]
  if pair.vocabulary is not None:
    vocab = vocabularies.check_vocabulary(pair.vocabulary, "VOCABULARY", given)
    importer.check_checkpoint_tokenizers(given, vocab)
    if pair.chat_template:
      template_of(vocab)
  else:
    carried = [(macro, path, _opened(macro, path).tokenizer) for macro, path in given
               if _opened(macro, path).tokenizer is not None]
    for macro, path, tokenizer in carried[1:]:
      try:
        vocabularies.check_same_vocabulary(carried[0][2], tokenizer)
      except ValueError as error:
        raise ValueError(f"{carried[0][0]}={carried[0][1]!r} and {macro}={path!r} carry "
                         f"different tokenizers: {error}") from None
    importer.check_checkpoint_tokenizers(given)
  for role, (macro, path, preset) in roles.items():
    if path is None:
      if preset is None:
        raise ValueError(f"The {role} has neither a preset nor a checkpoint; name one "
                         f"(PipelineConfig.{role}_model or {macro}).")
      continue
    if preset is None:
      importer.check_own_checkpoint(path, macro, f"PipelineConfig.{role}_model",
                                    None if pair.vocabulary is None else vocab)
      continue
    stored = _opened(macro, path).config
    if stored is None:
      continue
    try:
      importer.check_checkpoint(path, model_config(preset, vocab_size=stored.vocab_size))
    except ValueError as error:
      raise ValueError(f"{macro}={path!r} does not hold the {role} preset {preset!r}: "
                       f"{error}") from None
