"""Decoding with a Hugging Face tokenizer's ids: prompts exactly as the tokenizer encodes them
(no T5 start id 0 before them, id 0 a real token), the model's own EOS, and embedding rows past
the tokenizer never output; T5's conventions unchanged where no tokenizer is given."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from distillspec_jax.data import vocabularies
from distillspec_jax.decoding import plain, speculative
from distillspec_jax.interop import importer
from distillspec_jax.models.model import NO_TOKEN, Model, TokenIds, decoder_prompt

PROMPTS = ("Betty has $100!", "How many clips did Natalia sell! 48")
TARGET_ROWS, DRAFT_ROWS = 152_064, 151_936


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(vocab, target folder, target, target params, draft, draft params): one 300-token
  Llama-3-style tokenizer, embeddings of 152,064 (target) and 151,936 (draft) rows, the
  row counts of Qwen2.5's 7B and 0.5B models, which share one tokenizer (tiny widths)."""
  root = tmp_path_factory.mktemp("pair")
  tokenizer = hf_fixtures.fast_tokenizer("llama")
  target_dir = hf_fixtures.save_model(str(root / "target"), "llama", tokenizer, vocab_size=TARGET_ROWS)
  draft_dir = hf_fixtures.save_model(str(root / "draft"), "llama", tokenizer, vocab_size=DRAFT_ROWS,
                                     seed=1, num_hidden_layers=1)
  vocab = vocabularies.as_vocabulary(target_dir)
  vocabularies.check_same_vocabulary(vocab, draft_dir)
  tokens = vocabularies.token_ids(vocab)
  tp, tc = importer.load_checkpoint(target_dir)
  dp, dc = importer.load_checkpoint(draft_dir)
  return vocab, target_dir, Model(tc, tokens), tp, Model(dc, tokens), dp


def _prompts(vocab):
  rows = [vocab.encode_prompt(p) for p in PROMPTS]
  width = max(map(len, rows))
  out = np.full((len(rows), width), NO_TOKEN, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out, rows


def test_prompts_are_used_as_the_tokenizer_encodes_them(pair):
  vocab, _, target, *_ = pair
  prompts, rows = _prompts(vocab)
  assert any(0 in r for r in rows)  # "!" is id 0: a token, not padding
  tokens, lengths = decoder_prompt(target, prompts, len(rows))
  assert lengths.tolist() == [len(r) for r in rows]
  for row, r in zip(np.asarray(tokens), rows):
    assert row[:len(r)].tolist() == r  # nothing put before the tokenizer's BOS


def test_greedy_decode_equals_transformers(pair):
  import torch
  import transformers
  vocab, target_dir, target, tp, _, _ = pair
  prompts, rows = _prompts(vocab)
  result = plain.decode(target, tp, prompt_tokens=prompts, max_new_tokens=6, max_length=64)
  hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
  for i, r in enumerate(rows):
    with torch.no_grad():
      logits = hf(torch.tensor([r])).logits[0, -1, :vocab.vocab_size]
    first = int(torch.argmax(logits))  # the tokenizer's rows only
    assert int(result.tokens[i, 0]) == first
    assert np.all(np.asarray(result.tokens)[i, :int(result.lengths[i])] < vocab.vocab_size)


@pytest.mark.slow
def test_pair_with_more_rows_than_the_tokenizer_decodes_exactly(pair):
  vocab, _, target, tp, draft, dp = pair
  assert (target.config.vocab_size, draft.config.vocab_size, target.output_size) == (
      TARGET_ROWS, DRAFT_ROWS, 300)
  prompts, _ = _prompts(vocab)
  alone = plain.decode(target, tp, prompt_tokens=prompts, max_new_tokens=8, max_length=64)
  spec = speculative.speculative_decode(target, tp, draft, dp, prompt_tokens=prompts,
                                        max_new_tokens=8, gamma=3, max_length=64)
  for i in range(len(PROMPTS)):
    n = int(alone.lengths[i])
    assert int(spec.lengths[i]) == n
    np.testing.assert_array_equal(np.asarray(spec.tokens)[i, :n], np.asarray(alone.tokens)[i, :n])
    text = vocab.decode(np.asarray(spec.tokens)[i, :n].tolist())
    assert isinstance(text, str)
  logits = target.logits(tp, {"decoder_input_tokens": jnp.asarray(prompts.clip(0))})
  assert logits.shape[-1] == vocab.vocab_size


def test_pairs_with_other_token_ids_are_refused(pair):
  _, _, target, tp, draft, dp = pair
  other = draft.with_tokens(TokenIds(eos_id=5, decoder_start_id=None, pad_id=NO_TOKEN,
                                     num_tokens=300))
  with pytest.raises(ValueError, match="token ids"):
    speculative.check_pair(target, other)
  with pytest.raises(ValueError, match="vocab_size"):  # T5 conventions: sizes must agree
    speculative.check_pair(Model(target.config), Model(draft.config))
  with pytest.raises(ValueError, match="embedding rows"):
    Model(draft.config, TokenIds(num_tokens=DRAFT_ROWS + 1))


def test_t5_conventions_are_unchanged():
  model = Model.from_name("demo_draft")
  assert model.tokens == TokenIds(eos_id=1, decoder_start_id=0, pad_id=0, num_tokens=None)
  prompts = np.array([[5, 6, 0], [7, 0, 0]], np.int32)
  tokens, lengths = decoder_prompt(Model.from_name("smoke_target").with_tokens(TokenIds()),
                                   None, 2)
  assert tokens.tolist() == [[0], [0]] and lengths.tolist() == [1, 1]
  decoder_only = Model(model.config.__class__(**{**model.config.__dict__,
                                                 "kind": "decoder_only",
                                                 "num_encoder_layers": 0}))
  tokens, lengths = decoder_prompt(decoder_only, prompts, 2)
  assert tokens.tolist() == [[0, 5, 6, 0], [0, 7, 0, 0]] and lengths.tolist() == [3, 2]


def test_on_policy_batches_keep_the_tokenizers_layout(pair):
  from distillspec_jax.distill import objectives
  _, _, target, *_ = pair
  # prompt [5, 0, 7] (0 is "!"), target [9, EOS]: inputs are the sequence, targets one ahead.
  eos = target.tokens.eos_id
  batch = {"decoder_input_tokens": np.array([[5, 0, 7, 9, 0, 0]]),
           "decoder_target_tokens": np.array([[0, 7, 9, eos, 0, 0]]),
           "decoder_loss_weights": np.array([[0, 0, 1, 1, 0, 0]])}
  prompts = objectives.prompt_tokens_from_batch(batch, target)
  assert prompts.tolist() == [[5, 0, 7, NO_TOKEN, NO_TOKEN, NO_TOKEN]]
  rebuilt = objectives.samples_to_batch(jnp.array([[9, eos, 0]]), jnp.array([2]), batch, target,
                                        prompts)
  assert rebuilt["decoder_target_tokens"].tolist() == batch["decoder_target_tokens"].tolist()
  assert rebuilt["decoder_input_tokens"][0, :4].tolist() == [5, 0, 7, 9]
  assert rebuilt["decoder_loss_weights"].tolist() == [[0, 0, 1, 1, 0, 0]]


@pytest.mark.parametrize("stop_ids, match", [
    ((5, 5), r"stop_ids=\(5, 5\).*5 twice"),
    ((1,), r"stop_ids=\(1,\).*1 is eos_id"),
    ((0,), r"stop_ids=\(0,\).*0 is the pad id"),
    ((-3,), r"stop_ids=\(-3,\).*-3 is negative"),
    ((300,), r"stop_ids=\(300,\).*300 is past num_tokens=300"),
    ((True,), r"stop_ids=\(True,\).*True is not an int"),
    (("7",), r"stop_ids=\('7',\).*'7' is not an int"),
    ([7], r"stop_ids=\[7\] must be a tuple")])
def test_bad_stop_ids_are_refused_naming_the_value(stop_ids, match):
  num_tokens = 300 if 300 in stop_ids else None
  with pytest.raises((TypeError, ValueError), match=match):
    TokenIds(stop_ids=stop_ids, num_tokens=num_tokens)


def test_stop_ids_past_the_models_rows_are_refused_and_ends_row_reads_every_stop():
  model = Model.from_name("demo_draft")
  rows = model.config.vocab_size
  with pytest.raises(ValueError, match=f"stop id {rows} .*{rows} embedding rows"):
    model.with_tokens(TokenIds(stop_ids=(rows,)))
  stopping = model.with_tokens(TokenIds(stop_ids=(7, 9)))
  assert stopping.tokens.end_ids == (1, 7, 9)
  ends = stopping.ends_row(jnp.array([[0, 1, 7, 8, 9]]))
  assert np.asarray(ends).tolist() == [[False, True, True, False, True]]
  assert np.asarray(model.ends_row(jnp.array([1, 7]))).tolist() == [True, False]
  # A JSON round trip of the checkpoint meta (lists), and older meta without the field.
  import json
  meta = json.loads(json.dumps(dataclasses.asdict(stopping.tokens)))
  assert TokenIds.from_json(meta) == stopping.tokens
  older = {k: v for k, v in meta.items() if k != "stop_ids"}
  assert TokenIds.from_json(older) == TokenIds(stop_ids=())


@pytest.mark.slow
def test_eval_texts_are_cut_at_a_stop_id(pair):
  """The quality texts (evaluation/quality.py) end at a stop id as at EOS: greedy predictions
  of a model with a stop id are the texts of the tokens before it."""
  from distillspec_jax.evaluation import quality
  vocab, _, target, tp, _, _ = pair
  prompts, _ = _prompts(vocab)
  free = plain.decode(target, tp, prompt_tokens=prompts, max_new_tokens=8, max_length=64,
                      sampling=plain.SamplingConfig(eos_id=-1))
  row = np.asarray(free.tokens)[0]
  eos = target.tokens.eos_id
  stop = int(next(t for i, t in enumerate(row)
                  if i >= 1 and t != eos and t not in row[:i] and eos not in row[:i]))
  position = int(np.flatnonzero(row == stop)[0])
  stopping = target.with_tokens(dataclasses.replace(target.tokens, stop_ids=(stop,)))
  texts = quality.greedy_predictions(stopping, tp, prompts, 8, vocab.decode)
  assert texts[0] == vocab.decode(row[:position].tolist())
