"""A Hugging Face tokenizer folder's chat template, rendered as transformers renders it.

    template = load_chat_template("hf/Qwen2.5-0.5B-Instruct")
    template.render(messages, add_generation_prompt=True)  # apply_chat_template's text
    prompt, response = template.split(messages)  # the last assistant turn is the response

The template is the folder's `chat_template.jinja`, else tokenizer_config.json's
`chat_template` (a string, or named templates of which "default" is taken): what transformers'
AutoTokenizer loads. It is rendered with jinja2 in a sandbox with transformers' settings
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML) and the folder's special tokens (`bos_token`, `eos_token`, ...) as
variables, so the text, and the ids the tokenizer gives it, equal transformers'. Our own small
renderer on jinja2 (a core dependency) rather than transformers (the `reference` extra, with
torch): a user training on a TPU host has no transformers.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Mapping, Optional, Sequence, Tuple

from distillspec_jax.data import tokenizer_files
from distillspec_jax.data import vocabularies

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
ROLES = ("system", "user", "assistant", "tool")
Messages = Sequence[Mapping[str, str]]


def _no_template(folder: str) -> ValueError:
  return ValueError(
      f"{folder!r} has no chat template (neither {TEMPLATE_FILE} nor a 'chat_template' in "
      f"{CONFIG_FILE}), so it cannot render conversations. Pass the folder of an "
      f"instruction-tuned model as VOCABULARY (its tokenizer files carry the template), add a "
      f"{TEMPLATE_FILE} to that folder, or set CHAT_TEMPLATE=False.")


def _read_json(path: str) -> dict:
  return tokenizer_files.read_json(path, "the chat template and the special tokens")


def _token_text(token) -> Optional[str]:
  text = tokenizer_files.token_text(token)
  return text if isinstance(text, str) else None


def _configured_template(config: dict, path: str) -> Optional[str]:
  value = config.get("chat_template")
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(f"{path}: 'chat_template' holds the templates {sorted(map(str, named))} "
                     "and none named 'default'; add a chat_template.jinja to the folder.")
  raise ValueError(f"{path}: 'chat_template' must be a string or a list of named templates, "
                   f"got {type(value).__name__}.")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
  """The template compiled in jinja2's immutable sandbox (templates from the Hub are untrusted
  code), with the globals and filters chat templates use."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """Attributes:
    source: the file the template was read from (for errors).
    template: the jinja2 source.
    special_tokens: ((name, text), ...) of SPECIAL_TOKENS the folder names, template variables.
    eos: the text of the EOS token a reply ends with (decoding stops at it); None: none.
  """

  source: str
  template: str
  special_tokens: Tuple[Tuple[str, str], ...] = ()
  eos: Optional[str] = None

  def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
    """The conversation's text as the template writes it (the assistant header after it with
    `add_generation_prompt`)."""
    import jinja2  # pylint: disable=g-import-not-at-top
    try:
      return _compiled(self.template).render(
          messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
          tools=None, documents=None, **dict(self.special_tokens))
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"The chat template of {self.source} refused a conversation: {e}") from None

  def split(self, messages: Messages, where: str = "conversation") -> Tuple[str, str]:
    """(prompt, response) text of a conversation whose last message is the assistant's reply:
    the prompt is everything before it as the generation prompt renders it (the text a serving
    engine encodes), the response what the template writes after that prompt, cut after the
    first EOS token (the model stops there; EOS appended when the template writes none)."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
      raise ValueError(f"{where}: needs at least one message before a last 'assistant' one.")
    prompt = self.render(messages[:-1], add_generation_prompt=True)
    full = self.render(messages)
    if not full.startswith(prompt):
      raise ValueError(
          f"{where}: the chat template of {self.source} renders the conversation before the "
          "last response differently with and without that response (it rewrites earlier "
          "turns), so the response cannot be cut from the prompt; such templates are not "
          "supported for training.")
    response, eos = full[len(prompt):], self.eos
    if eos:
      end = response.find(eos)
      response = response + eos if end < 0 else response[:end + len(eos)]
    return prompt, response


def load_chat_template(folder: str, eos_token: Optional[str] = None) -> ChatTemplate:
  """The chat template of a Hugging Face tokenizer folder (or of the folder of a
  tokenizer.json); ValueError naming the folder and the fix when it has none. `eos_token`:
  the text of the EOS that decoding stops at (the vocabulary's, which may come from
  config.json), else tokenizer_config.json's."""
  folder = os.fspath(folder)
  if os.path.isfile(folder):
    folder = os.path.dirname(os.path.abspath(folder))
  config_path = os.path.join(folder, CONFIG_FILE)
  config = _read_json(config_path)
  template_path = os.path.join(folder, TEMPLATE_FILE)
  if os.path.isfile(template_path):
    with open(template_path, encoding="utf-8") as f:
      template, source = f.read(), template_path
  else:
    template, source = _configured_template(config, config_path), config_path
  if not template:
    raise _no_template(folder)
  legacy = os.path.join(folder, "special_tokens_map.json")  # older folders name them here
  named = {**_read_json(legacy), **config}
  specials = tuple((name, _token_text(named.get(name))) for name in SPECIAL_TOKENS
                   if _token_text(named.get(name)) is not None)
  import jinja2  # pylint: disable=g-import-not-at-top
  try:
    _compiled(template)
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"The chat template in {source} is not a valid jinja2 template ({e}); "
                     "fix it or pass another folder.") from None
  return ChatTemplate(source=source, template=template, special_tokens=specials,
                      eos=eos_token if eos_token is not None else dict(specials).get("eos_token"))


def template_of(vocabulary) -> ChatTemplate:
  """The chat template of a Hugging Face tokenizer's folder (`vocabulary`: a seqio
  Vocabulary); ValueError for other vocabularies or a folder without one."""
  if not vocabularies.is_tokenizer(vocabulary):
    raise ValueError(
        "CHAT_TEMPLATE=True renders conversations with the models' chat template, which a "
        f"{type(vocabulary).__name__} does not have: set VOCABULARY to the Hugging Face model "
        "folder (its tokenizer.json and chat template).")
  eos = vocabulary.tokenizer.id_to_token(vocabulary.eos_id)  # the id decoding stops at
  return load_chat_template(vocabulary.folder, eos_token=eos)
