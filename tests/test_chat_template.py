"""Chat-formatted data (data/chat_template.py, data/tasks/chat_tasks.py): conversations rendered
by the tokenizer folder's own chat template as transformers renders them, tokenized as the
tokenizer encodes the text, the loss on the last reply only."""

import json
import os

import numpy as np
import pytest

import hf_fixtures
from distillspec_jax.data import batches as batches_lib
from distillspec_jax.data import chat_template as chat_lib
from distillspec_jax.data import tasks
from distillspec_jax.data.task_source import TaskSource
from distillspec_jax.data.tasks import chat_tasks

transformers = pytest.importorskip("transformers")

LENGTHS = {"inputs": 192, "targets": 32}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  tokenizer = hf_fixtures.chat_tokenizer()
  tokenizer.save_pretrained(str(root / "model"))
  plain = hf_fixtures.save_tokenizer(str(root / "plain"), "llama")  # no chat template
  hf_fixtures.write_gsm8k(root, "So {i}!\n#### {i}")
  return {"tokenizer": tokenizer, "folder": str(root / "model"), "plain": plain,
          "data_dir": hf_fixtures.write_chat(root)}


@pytest.mark.slow
def test_rendered_prompts_equal_transformers_apply_chat_template(chat, tmp_path):
  template = chat_lib.load_chat_template(chat["folder"])
  tokenizer = chat["tokenizer"]
  for conversation in hf_fixtures.CONVERSATIONS:
    for history, generation in ((conversation[:-1], True), (conversation, False)):
      expected = tokenizer.apply_chat_template(history, tokenize=False,
                                               add_generation_prompt=generation)
      assert template.render(history, add_generation_prompt=generation) == expected
  # tokenizer_config.json's "chat_template" (no chat_template.jinja) is read the same way.
  folder = hf_fixtures.save_tokenizer(str(tmp_path / "configured"), "llama")
  with open(os.path.join(folder, "tokenizer_config.json")) as f:
    config = json.load(f)
  config["chat_template"] = [{"name": "default", "template": hf_fixtures.CHAT_TEMPLATE}]
  config["eos_token"] = "<|end_of_text|>"
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  history = hf_fixtures.CONVERSATIONS[0][:-1]
  assert chat_lib.load_chat_template(folder).render(history, True) == (
      transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
          history, tokenize=False, add_generation_prompt=True))


def test_the_loss_covers_exactly_the_assistant_reply(chat):
  tokenizer = chat["tokenizer"]
  names = tasks.register_file_tasks(chat["data_dir"], vocabulary=chat["folder"],
                                    chat_template=True)
  assert names == ["chat_files", "gsm8k_files"]
  (batch,) = list(batches_lib.get_dataset("chat_files", "test", LENGTHS, batch_size=8,
                                          feature_converter="decoder"))
  examples = batches_lib.get_prompts_and_targets("chat_files", "test", LENGTHS)
  # Rows 3 and 4: the first conversation in ShareGPT and Alpaca layouts.
  conversations = list(hf_fixtures.CONVERSATIONS) + [hf_fixtures.CONVERSATIONS[0]] * 2
  assert len(batch["decoder_input_tokens"]) == len(examples) == 5
  for row, conversation in enumerate(conversations):
    prompt = tokenizer.apply_chat_template(conversation[:-1], tokenize=True,
                                           add_generation_prompt=True)["input_ids"]
    assert prompt.count(tokenizer.bos_token_id) == 1  # the template's BOS, no second one
    n = len(prompt)
    np.testing.assert_array_equal(batch["decoder_input_tokens"][row, :n], prompt)
    np.testing.assert_array_equal(examples.prompts[row, :examples.prompt_lengths[row]], prompt)
    weights = batch["decoder_loss_weights"][row]
    reply = batch["decoder_target_tokens"][row][weights == 1].tolist()
    # The positions predicting the reply, and only those: from the prompt's last token on.
    assert weights[:n - 1].sum() == 0 and weights[n - 1:n - 1 + len(reply)].all()
    assert weights.sum() == len(reply)
    content = conversation[-1]["content"]
    assert tokenizer.decode(reply) == content + "<|im_end|>"
    assert tokenizer.decode(reply, skip_special_tokens=True) == content
    assert reply[-1] == tokenizer.eos_token_id
  assert examples.target_texts[:3] == [c[-1]["content"] for c in hf_fixtures.CONVERSATIONS]


def test_a_text_task_renders_its_prompt_as_a_user_turn(chat):
  tokenizer = chat["tokenizer"]
  tasks.register_file_tasks(chat["data_dir"], vocabulary=chat["folder"], chat_template=True)
  examples = batches_lib.get_prompts_and_targets("gsm8k_files", "test", LENGTHS)
  rows = [json.loads(l) for l in open(os.path.join(chat["data_dir"], "gsm8k", "test.jsonl"))]
  assert len(examples) == len(rows)
  for i, row in enumerate(rows):
    user = "Q: " + row["question"] + " A: Let's think step by step."
    expected = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                             add_generation_prompt=True)["input_ids"]
    assert examples.prompts[i, :examples.prompt_lengths[i]].tolist() == expected
    answer = f"So {i}! #### {i}"  # gsm8k_cot joins the answer's lines
    reply = examples.targets[i, :examples.target_lengths[i]].tolist()
    assert tokenizer.decode(reply) == answer + "<|im_end|>"
    assert examples.target_texts[i] == answer  # what the metrics compare


def test_a_folder_without_a_chat_template_is_a_user_error_naming_it(chat, tmp_path):
  with pytest.raises(ValueError, match=rf"'{chat['plain']}' has no chat template .*"
                                       r"CHAT_TEMPLATE=False"):
    tasks.register_file_tasks(chat["data_dir"], vocabulary=chat["plain"], chat_template=True)
  source = TaskSource(data_dir=chat["data_dir"], vocabulary=chat["plain"], chat_template=True)
  with pytest.raises(ValueError, match=r"has no chat template"):
    source.check()
  with pytest.raises(ValueError, match=r"CHAT_TEMPLATE=True with VOCABULARY=None"):
    TaskSource(data_dir=chat["data_dir"], chat_template=True)
  with pytest.raises(TypeError, match=r"chat_template"):
    TaskSource(data_dir=chat["data_dir"], vocabulary=chat["folder"], chat_template="yes")
  from distillspec_jax.studies.pair_source import PairSource
  with pytest.raises(ValueError, match=r"CHAT_TEMPLATE=True .* set VOCABULARY"):
    PairSource(chat_template=True)
  from distillspec_jax import eval as eval_lib
  with pytest.raises(ValueError, match=r"CHAT_TEMPLATE=True with VOCABULARY=None"):
    eval_lib.EvalConfig(model_dir="m", mixture_or_task_name="chat_files",
                        target_checkpoint_path="t", draft_checkpoint_path="d",
                        data_dir=chat["data_dir"], chat_template=True)
  config = eval_lib.EvalConfig(model_dir="m", mixture_or_task_name="chat_files",
                               task_feature_lengths=LENGTHS, target_checkpoint_path="t",
                               draft_checkpoint_path="d", data_dir=chat["data_dir"],
                               vocabulary=chat["plain"], chat_template=True)
  with pytest.raises(ValueError, match=r"has no chat template"):
    config.check_inputs()


@pytest.mark.parametrize("row, message", [
    ({"text": "hi"}, r"not a conversation; expected 'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"a conversation needs an 'assistant' reply"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, r"unknown role 'robot'"),
    ({"conversations": [{"from": "human", "value": 3}]},
     r"a message's 'value' must be a string, got int")])
def test_a_bad_conversation_names_its_file_and_line(row, message):
  with pytest.raises(ValueError, match=rf"data.jsonl:7: {message}"):
    chat_tasks.conversation(row, "data.jsonl:7")


def test_layouts_give_the_same_conversation():
  system, user, reply = "Be brief.", "2+2?", "4"
  expected = [{"role": "system", "content": system}, {"role": "user", "content": user},
              {"role": "assistant", "content": reply}]
  rows = [{"messages": expected},
          {"conversations": [{"from": "system", "value": system},
                             {"from": "human", "value": user}, {"from": "gpt", "value": reply}]},
          {"system": system, "instruction": user, "output": reply},
          {"prompt": expected[:2], "completion": expected[2:]}]
  for row in rows:
    assert chat_tasks.conversation(row, "x") == expected
  assert chat_tasks.conversation({"prompt": user, "completion": reply}, "x") == expected[1:]
  # Messages after the last reply are not a target: dropped.
  assert chat_tasks.conversation({"messages": expected + [expected[1]]}, "x") == expected


def test_a_reply_ends_at_the_first_eos_and_gets_one_when_the_template_writes_none():
  plain = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}assistant: {% endif %}")
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  template = chat_lib.ChatTemplate(source="t.jinja", template=plain, eos="</s>")
  assert template.split(messages) == ("user: hi\nassistant: ", "yo\n</s>")
  ended = chat_lib.ChatTemplate(source="t.jinja", eos="</s>",
                                template=plain.replace("\n{% endfor", "</s>\n{% endfor"))
  assert ended.split(messages) == ("user: hi</s>\nassistant: ", "yo</s>")
  rewriting = chat_lib.ChatTemplate(source="t.jinja", template="{{ messages | length }}")
  with pytest.raises(ValueError, match=r"x.jsonl:2: the chat template of t.jinja renders"):
    rewriting.split(messages, "x.jsonl:2")
