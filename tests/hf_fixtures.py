"""Hugging Face model folders built offline for the tests: a byte-level BPE tokenizer trained
with `tokenizers` on a few fixture sentences, saved by transformers' save_pretrained with tiny
random Llama-3-style (llama3 RoPE scaling, BOS added by the tokenizer, no pad token) or Qwen2
(no BOS, pad = EOS) configs. Everything is deterministic and takes well under a second."""

from __future__ import annotations

import contextlib
import os

import numpy as np

SENTENCES = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "Betty is saving money for a new wallet which costs $100! Betty has only half of the money.",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages a year?",
    "The answer is 72! #### 72",
)

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(vocab_size: int = 300, specials=LLAMA3_SPECIALS, bos=None,
                    sentences=SENTENCES):
  """A byte-level BPE `tokenizers.Tokenizer` whose special tokens come after the learnt ones
  (as in Llama-3 and Qwen2: id 0 is "!", a real token); with `bos`, a post-processor that
  puts it first."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(sentences), trainer)
  tok.add_special_tokens(list(specials))
  if bos is not None:
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return tok


def fast_tokenizer(kind: str = "llama", vocab_size: int = 300, sentences=SENTENCES):
  """A transformers PreTrainedTokenizerFast in the style of `kind` ("llama" or "qwen2")."""
  from transformers import PreTrainedTokenizerFast
  if kind == "llama":
    tok = train_tokenizer(vocab_size, LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                          sentences=sentences)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")
  tok = train_tokenizer(vocab_size, QWEN2_SPECIALS, sentences=sentences)
  return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 pad_token="<|endoftext|>")


def model_config(kind: str, tokenizer, vocab_size=None, max_positions: int = 4096, **sizes):
  """A tiny transformers config of `kind` ("llama", "qwen2" or "qwen3") with the tokenizer's
  special ids."""
  import transformers
  common = dict(vocab_size=vocab_size or len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
  common.update(sizes)
  if kind == "llama":
    return transformers.LlamaConfig(
        rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        **common)
  if kind == "qwen3":
    return transformers.Qwen3Config(rope_theta=1000000.0, rms_norm_eps=1e-6,
                                    **dict(dict(head_dim=8), **common))
  return transformers.Qwen2Config(rope_theta=1000000.0, rms_norm_eps=1e-6, **common)


def save_model(directory: str, kind: str = "llama", tokenizer=None, vocab_size=None,
               seed: int = 0, **sizes) -> str:
  """Saves a tiny random model of `kind` with its tokenizer under `directory`; returns it."""
  import torch
  import transformers
  tokenizer = tokenizer or fast_tokenizer(kind)
  config = model_config(kind, tokenizer, vocab_size, **sizes)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  os.makedirs(directory, exist_ok=True)
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return directory


def save_tokenizer(directory: str, kind: str = "llama", **kwargs) -> str:
  """Saves only the tokenizer files (and a config.json-free folder) under `directory`."""
  os.makedirs(directory, exist_ok=True)
  fast_tokenizer(kind, **kwargs).save_pretrained(directory)
  return directory


# Rows of different lengths: [0] + prompt, right-padded with 0 (the RoPE families' logit
# comparisons against transformers).
TOKENS = np.array([[0, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                   [0, 3, 4, 40, 0, 0, 0, 0, 0, 0],
                   [0, 90, 17, 25, 33, 61, 2, 0, 0, 0]], np.int32)
LENGTHS = np.array([10, 4, 7])


def hf_logits(torch, model, tokens=TOKENS, lengths=LENGTHS):
  """A transformers causal LM's logits [batch, length, vocab] of right-padded `tokens`."""
  mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()


def check_real_positions(ours, ref, lengths=LENGTHS, atol=1e-4):
  """`ours` equals `ref` at every row's first `lengths` positions (padding not compared)."""
  assert np.abs(ref).max() > 1.0  # not a degenerate comparison
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(ours[row, :n], ref[row, :n], atol=atol, rtol=1e-4)


def check_cached_decoding(model, params, ref, tokens=TOKENS, lengths=LENGTHS, prefix: int = 3):
  """Through the decoding cache: rows prefilled with their first `prefix` tokens (or fewer, to
  their own lengths), then one token per row per call; each row's logits equal `ref`'s at its
  real positions (a finished row repeats a filler token, not compared)."""
  import jax
  import jax.numpy as jnp
  cache = model.init_cache(params, tokens.shape[0], model.config.max_decode_length)
  split = np.minimum(lengths, prefix)
  last, cache = jax.jit(model.prefill)(params, cache, jnp.asarray(tokens[:, :prefix]),
                                       jnp.asarray(split))
  np.testing.assert_allclose(last, ref[np.arange(tokens.shape[0]), split - 1], atol=1e-4,
                             rtol=1e-4)
  extend = jax.jit(model.extend)
  for step in range(prefix, tokens.shape[1]):
    column = np.where(step < lengths, tokens[:, step], 7)
    logits, cache = extend(params, cache, jnp.asarray(column[:, None]))
    live = step < lengths
    np.testing.assert_allclose(np.asarray(logits)[live, 0], ref[live, step], atol=1e-4,
                               rtol=1e-4)


# Questions the tokenizer was not trained on (four more prompts for the 8-prompt checks).
MORE_QUESTIONS = (
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?",
    "Tina makes $18.00 an hour! How much does she make in 10 hours?",
    "Mark has a garden with flowers of three colors. How many flowers are there?",
    "Julie is reading a 120-page book. Yesterday, she read 12 pages. How many are left?",
)


def write_gsm8k(root, answer: str, questions=SENTENCES[:4]) -> str:
  """`<root>/data/gsm8k/{train,test}.jsonl` of GSM8K-style rows, `questions` (default the
  first four SENTENCES) with `answer.format(i=...)` as answers; returns the gsm8k folder."""
  import json
  data = os.path.join(str(root), "data", "gsm8k")
  os.makedirs(data)
  rows = [{"question": q, "answer": answer.format(i=i)} for i, q in enumerate(questions)]
  for split in ("train", "test"):
    with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return data


# A chat tokenizer: Llama-3's BOS rule (added by the tokenizer, written by the template) with
# Qwen-style turn markers, EOS = the end of a turn (as in instruction-tuned Llama-3 and Qwen2).
CHAT_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "  {%- set system_message = messages[0]['content'] | trim -%}\n"
    "  {%- set messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "  {%- set system_message = 'You answer math questions.' -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>system\\n' + system_message + eos_token + '\\n' -}}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] not in ['user', 'assistant'] -%}\n"
    "    {{- raise_exception('Only user and assistant turns follow the system message.') -}}\n"
    "  {%- endif -%}\n"
    "  {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + eos_token"
    " + '\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n")

# Three conversations: one with a system message, one multi-turn, one plain.
CONVERSATIONS = (
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": SENTENCES[0]},
     {"role": "assistant", "content": "She sold 72 clips! #### 72"}],
    [{"role": "user", "content": SENTENCES[1]},
     {"role": "assistant", "content": "Per minute?"},
     {"role": "user", "content": "Yes, 50 minutes at $12 an hour."},
     {"role": "assistant", "content": "12 / 60 * 50 = 10. #### 10"}],
    [{"role": "user", "content": SENTENCES[3]},
     {"role": "assistant", "content": "3 * 2 * 2 * 52 = 624 #### 624"}],
)


def chat_tokenizer(template: str = CHAT_TEMPLATE):
  """A PreTrainedTokenizerFast with a chat template (None: without one)."""
  from transformers import PreTrainedTokenizerFast
  tok = train_tokenizer(300, CHAT_SPECIALS, bos="<|begin_of_text|>")
  return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                 eos_token="<|im_end|>", pad_token="<|end_of_text|>",
                                 chat_template=template)


def write_chat(root) -> str:
  """`<root>/data/chat/{train,test}.jsonl`: CONVERSATIONS as 'messages' rows, the first also
  in ShareGPT and Alpaca layouts; returns the data folder."""
  import json
  data = os.path.join(str(root), "data", "chat")
  os.makedirs(data)
  share = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"],
                                                                                m["role"]),
                              "value": m["content"]} for m in CONVERSATIONS[0]]}
  alpaca = {"system": "You are terse.", "instruction": SENTENCES[0],
            "output": CONVERSATIONS[0][-1]["content"]}
  rows = [{"messages": list(c)} for c in CONVERSATIONS] + [share, alpaca]
  for split in ("train", "test"):
    with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return os.path.dirname(data)
@contextlib.contextmanager
def one_torch_thread():
  """torch on one thread inside the block: tiny models decode token by token many times
  faster than with a thread pool on a busy host (restored after)."""
  import torch
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)


def save_near_copy(directory: str, source: str, noise: float, seed: int = 1) -> str:
  """Saves the model of HF folder `source` with Gaussian noise of `noise` times each tensor's
  spread added to every weight (and its tokenizer) under `directory`: a draft that agrees
  with `source` on some greedy tokens and not on others (random models of other seeds agree
  on none, which makes tau 1 and any tau comparison vacuous)."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(source)
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for weight in model.parameters():
      weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
  model.save_pretrained(directory)
  transformers.AutoTokenizer.from_pretrained(source).save_pretrained(directory)
  return directory


def save_with_eos_for(directory: str, source: str, token: int) -> str:
  """Saves the model of HF folder `source` (and its tokenizer) with its EOS output row set to
  1.05 x `token`'s: wherever `token` is the greedy choice with a positive logit, EOS is,
  so outputs end early (EOS cuts in speculative rounds)."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(source)
  eos = model.config.eos_token_id
  with torch.no_grad():
    weight = model.get_output_embeddings().weight
    weight[eos] = 1.05 * weight[token]
  model.save_pretrained(directory)
  transformers.AutoTokenizer.from_pretrained(source).save_pretrained(directory)
  return directory


def greedy_speculative(target, draft, prompt_ids, *, gamma: int, max_new_tokens: int,
                       eos_id: int, num_tokens: int) -> dict:
  """Greedy speculative decoding of one prompt written out with transformers models (no
  cache, nothing shared with distillspec_jax), counted as decoding/speculative.py counts:

  the first token is the target's argmax after the prompt (its prefill call), counted in
  neither `produced` nor `target_calls`; then each round the draft proposes `gamma` tokens
  greedily, the target scores context + proposal in one call (`target_calls` += 1), the
  round keeps the longest prefix of proposals equal to the target's argmax plus the target's
  next token, cut after the first EOS and at `max_new_tokens` in all (`produced` += the
  tokens kept). Argmaxes over the first `num_tokens` logits (the tokenizer's size: rows past
  it are never output). Returns {"tokens", "produced", "target_calls", "length_cut" (the last
  round lost tokens to max_new_tokens)}; tau over prompts = sum(produced) / sum(target_calls).""" 
  import torch

  def argmaxes(model, ids):
    with torch.no_grad():
      logits = model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0]
    return logits[:, :num_tokens].argmax(-1).tolist()

  prompt = list(prompt_ids)
  out = [argmaxes(target, prompt)[-1]]
  produced = calls = 0
  cut = False
  while out[-1] != eos_id and len(out) < max_new_tokens:
    proposal = []
    for _ in range(gamma):
      proposal.append(argmaxes(draft, prompt + out + proposal)[-1])
    scored = argmaxes(target, prompt + out + proposal)[len(prompt) + len(out) - 1:]
    n = 0
    while n < gamma and proposal[n] == scored[n]:
      n += 1
    kept = proposal[:n] + [scored[n]]
    if eos_id in kept:
      kept = kept[:kept.index(eos_id) + 1]
    cut = len(kept) > max_new_tokens - len(out)
    kept = kept[:max_new_tokens - len(out)]
    out += kept
    produced += len(kept)
    calls += 1
  return {"tokens": out, "produced": produced, "target_calls": calls, "length_cut": cut}
