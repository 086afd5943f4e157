"""Conversation data rendered with the models' own chat template (the `chat_files` task,
file_tasks.register_chat_files, and CHAT_TEMPLATE's rendering of the other text tasks).

`chat_files` reads `*.jsonl` conversations (splits found by file name, as for the other
file-backed tasks), one a line, in any of the layouts TRL's SFTTrainer takes:

  {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
  {"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}     (ShareGPT)
  {"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}
                                                                               (Alpaca)
  {"prompt": [messages] | str, "completion": [messages] | str}           (prompt-completion)

Each conversation is rendered by VOCABULARY's chat template (data/chat_template.py): 'inputs'
is the text up to its last assistant turn, with the generation prompt (what a serving engine
encodes), 'targets' that turn's reply through the first EOS token; earlier assistant turns are
context. Messages after the last assistant turn are dropped. Both are tokenized as the
tokenizer encodes the rendered text, no special tokens added (the template writes them), so
the loss (on 'targets' only: batches.tokenizer_features) covers the response alone.
'targets_pretokenized' is the reply's own text (metrics compare it with decoded predictions).

`render_text_task(name, template)` does the same for a registered text task (gsm8k_files,
...): its formatted prompt is one user turn, its reference the assistant's reply.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import numpy as np
import seqio
import tensorflow as tf

from distillspec_jax.data import chat_template as chat_lib
from distillspec_jax.data.tasks import preprocessors
from distillspec_jax.data.tasks import tfds_tasks

TASK_NAME = "chat_files"
FOLDER = "chat"
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
                  "tool": "tool", "function": "tool"}
LAYOUTS = ("'messages' (a list of {role, content}), ShareGPT 'conversations' ({from, value}), "
           "Alpaca 'instruction' and 'output', or 'prompt' and 'completion'")


def _message(item, role_key: str, content_key: str, roles: dict, where: str) -> dict:
  if not isinstance(item, dict) or role_key not in item or content_key not in item:
    raise ValueError(f"{where}: each message must be an object with {role_key!r} and "
                     f"{content_key!r}, got {item!r:.120}.")
  role, content = item[role_key], item[content_key]
  if role not in roles:
    raise ValueError(f"{where}: unknown role {role!r}; expected one of {sorted(roles)}.")
  if not isinstance(content, str):
    raise ValueError(f"{where}: a message's {content_key!r} must be a string, got "
                     f"{type(content).__name__}.")
  return {"role": roles[role], "content": content}


def _messages(value, where: str, role_key: str = "role", content_key: str = "content",
              roles: Optional[dict] = None) -> List[dict]:
  if not isinstance(value, list):
    raise ValueError(f"{where}: expected a list of messages, got {type(value).__name__}.")
  roles = roles or {r: r for r in chat_lib.ROLES}
  return [_message(item, role_key, content_key, roles, where) for item in value]


def _turns(value, role: str, where: str) -> List[dict]:
  """A prompt or completion: a plain string (one message of `role`) or a list of messages."""
  return [{"role": role, "content": value}] if isinstance(value, str) else _messages(value, where)


def conversation(row: dict, where: str) -> List[dict]:
  """A JSONL row in one of LAYOUTS as [{"role", "content"}, ...], through its last assistant
  turn; ValueError naming `where` (file:line) otherwise."""
  if "messages" in row:
    messages = _messages(row["messages"], where)
  elif "conversations" in row:
    messages = _messages(row["conversations"], where, "from", "value", SHAREGPT_ROLES)
  elif "instruction" in row and "output" in row:
    fields = {k: row.get(k) or "" for k in ("system", "instruction", "input", "output")}
    if not all(isinstance(v, str) for v in fields.values()):
      raise ValueError(f"{where}: Alpaca fields must be strings.")
    user = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
    messages = ([{"role": "system", "content": fields["system"]}] if fields["system"] else [])
    messages += [{"role": "user", "content": user},
                 {"role": "assistant", "content": fields["output"]}]
  elif "prompt" in row and "completion" in row:
    messages = (_turns(row["prompt"], "user", where)
                + _turns(row["completion"], "assistant", where))
  else:
    raise ValueError(f"{where}: not a conversation; expected {LAYOUTS}. The line has "
                     f"{sorted(k for k in row if k != '__line__')}.")
  last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
  if last < 1:
    raise ValueError(f"{where}: a conversation needs an 'assistant' reply after at least one "
                     "other message; it is the training target.")
  return messages[:last + 1]


def render_turn(dataset: tf.data.Dataset, template: chat_lib.ChatTemplate
                ) -> tf.data.Dataset:
  """A text task's formatted {"inputs", "targets"} as one user turn and the assistant's reply,
  rendered by `template` (the reply's own text kept as "reference")."""
  def render(prompt, reply):
    messages = [{"role": "user", "content": prompt.decode("utf-8")},
                {"role": "assistant", "content": reply.decode("utf-8")}]
    text, response = template.split(messages, f"the example {prompt[:60]!r}")
    return (np.asarray(text.encode("utf-8"), dtype=object),
            np.asarray(response.encode("utf-8"), dtype=object))

  def apply(ex):
    text, response = tf.numpy_function(render, [ex["inputs"], ex["targets"]],
                                       (tf.string, tf.string), stateful=False)
    text.set_shape([])
    response.set_shape([])
    return {"inputs": text, "targets": response, "reference": ex["targets"]}

  return dataset.map(apply, num_parallel_calls=tf.data.AUTOTUNE)


@seqio.map_over_dataset
def _keep_texts(ex):
  """The rendered prompt and the reply's own text as the *_pretokenized features (inference
  lines, metrics: predictions decode without the template's special tokens)."""
  return {"inputs": ex["inputs"], "targets": ex["targets"],
          "inputs_pretokenized": ex["inputs"], "targets_pretokenized": ex["reference"]}


def chat_preprocessors(*rendering) -> list:
  """[rendering..., keep the texts, tokenize (no special tokens, no EOS: the template writes
  them)]."""
  return [*rendering, _keep_texts,
          functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False)]


def render_text_task(name: str, template: chat_lib.ChatTemplate) -> bool:
  """Re-registers the registered text task `name` (a prompt and a reference: its first
  preprocessor formats them, tfds_tasks.text_task_preprocessors) so that they are rendered as
  one chat turn and its reply; False (unchanged) for a task without prompts (an LM task)."""
  task = seqio.TaskRegistry.get(name)
  if "inputs" not in task.output_features:
    return False
  vocab = task.output_features["targets"].vocabulary
  tfds_tasks.register_task(
      name, source=task.source, output_features=chat_features(vocab),
      preprocessors=chat_preprocessors(task.preprocessors[0], preprocessors.filter_empty,
                                       functools.partial(render_turn, template=template)),
      postprocess_fn=task.postprocessor, metric_fns=list(task.metric_fns))
  return True


def chat_features(vocabulary: seqio.Vocabulary) -> dict:
  """'inputs' and 'targets' with no EOS added: the template writes the turns' ends."""
  return {"inputs": seqio.Feature(vocabulary=vocabulary, add_eos=False),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=False)}
