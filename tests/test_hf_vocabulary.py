"""Hugging Face tokenizers as vocabularies: ids, special tokens and batches exactly as the
tokenizer gives them; mismatches and bad files refused with the value named."""

import json
import os

import pytest

import hf_fixtures
from distillspec_jax.data import batches, vocabularies
from distillspec_jax.data.tasks import file_tasks
from distillspec_jax.models.model import NO_TOKEN, TokenIds

TEXT = "Betty has $100! How many clips? 72"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  out = {kind: hf_fixtures.save_tokenizer(str(root / kind), kind) for kind in ("llama", "qwen2")}
  # GSM8K-style JSONL with a "!" (id 0 in these tokenizers) in a question.
  out["data"] = hf_fixtures.write_gsm8k(root, "She has {i} left!\n#### {i}")
  return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ids_and_special_tokens_are_the_tokenizers(folders, kind):
  from transformers import AutoTokenizer
  reference = AutoTokenizer.from_pretrained(folders[kind])
  for path in (folders[kind], os.path.join(folders[kind], "tokenizer.json")):
    vocab = vocabularies.as_vocabulary(path)
    assert vocab.encode_prompt(TEXT) == reference(TEXT)["input_ids"]
    assert list(vocab.encode(TEXT)) == reference(TEXT, add_special_tokens=False)["input_ids"]
    assert vocab.decode(vocab.encode(TEXT)) == TEXT
    assert (vocab.bos_id, vocab.eos_id, vocab.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert vocab.vocab_size == len(reference)
  assert 0 in vocab.encode("!")  # id 0 is a real token here, never padding
  assert vocabularies.token_ids(vocab) == TokenIds(
      eos_id=reference.eos_token_id, decoder_start_id=None, pad_id=NO_TOKEN,
      num_tokens=len(reference))


def test_sentencepiece_keeps_t5_conventions(tmp_path):
  path = vocabularies.train_sentencepiece(hf_fixtures.SENTENCES * 20, tmp_path / "a.model",
                                          vocab_size=100)
  assert vocabularies.token_ids(path) == TokenIds()  # pad 0, EOS 1, decoding starts from 0
  vocab = vocabularies.as_vocabulary(path)
  assert not vocabularies.is_tokenizer(vocab)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_task_prompts_and_batches_are_the_tokenizers_ids(folders, kind):
  from transformers import AutoTokenizer
  reference = AutoTokenizer.from_pretrained(folders[kind])
  name = f"gsm8k_files_{kind}"
  file_tasks.register_gsm8k_files(folders["data"], vocabulary=folders[kind], name=name)
  examples = batches.get_prompts_and_targets(name, "test", {"inputs": 160, "targets": 48})
  eos = reference.eos_token_id
  sequences = []
  for row, length, text, target, t_length, t_text in zip(
      examples.prompts, examples.prompt_lengths, examples.prompt_texts,
      examples.targets, examples.target_lengths, examples.target_texts):
    ids = reference(text)["input_ids"]
    assert row[:length].tolist() == ids  # no EOS after the prompt, BOS as the tokenizer puts it
    assert (row[length:] == NO_TOKEN).all()
    expected = reference(t_text, add_special_tokens=False)["input_ids"] + [eos]
    assert target[:t_length].tolist() == expected
    sequences.append(ids + expected)
  assert any(0 in s for s in sequences)  # a "!" made it through as id 0
  batch = next(batches.get_dataset(name, "test", {"inputs": 160, "targets": 48}, batch_size=4,
                                   feature_converter="decoder"))
  for i, sequence in enumerate(sequences):
    n = len(sequence)
    # Inputs are the sequence itself (no T5 start id 0 before it); targets one ahead.
    assert batch["decoder_input_tokens"][i, :n - 1].tolist() == sequence[:-1]
    assert batch["decoder_target_tokens"][i, :n - 1].tolist() == sequence[1:]
    weights = batch["decoder_loss_weights"][i]
    prompt = n - len(examples.targets[i][:examples.target_lengths[i]])
    assert (weights[:prompt - 1] == 0).all() and (weights[prompt - 1:n - 1] == 1).all()
    assert (weights[n - 1:] == 0).all()


def test_encoder_decoder_batches_refuse_a_tokenizer(folders):
  file_tasks.register_gsm8k_files(folders["data"], vocabulary=folders["llama"], name="g_ed")
  with pytest.raises(ValueError, match="no decoder start token"):
    batches.get_dataset("g_ed", "test", {"inputs": 160, "targets": 48}, batch_size=2)


def test_one_tokenizer_at_two_paths_is_the_same_vocabulary(folders, tmp_path):
  copy = hf_fixtures.save_tokenizer(str(tmp_path / "copy"), "llama")
  assert vocabularies.check_same_vocabulary(folders["llama"], copy)
  assert vocabularies.check_same_vocabulary(
      folders["llama"], os.path.join(folders["llama"], "tokenizer.json"))


def test_a_base_and_an_instruct_tokenizer_are_one_vocabulary(folders, tmp_path):
  """One tokenizer.json with another EOS in tokenizer_config.json (a base model beside its
  instruct version): the ids mean the same tokens, so the pair is accepted, and the first
  vocabulary's EOS is the one used; another token mapping is still refused (below)."""
  instruct = hf_fixtures.save_tokenizer(str(tmp_path / "instruct"), "llama")
  config_file = os.path.join(instruct, "tokenizer_config.json")
  with open(config_file) as f:
    config = json.load(f)
  base = vocabularies.as_vocabulary(folders["llama"])
  other_eos = next(token for token, index in sorted(base.tokenizer.get_vocab().items(),
                                                    key=lambda item: item[1])
                   if index != base.eos_id and index > 3)
  config["eos_token"] = other_eos
  with open(config_file, "w") as f:
    json.dump(config, f)
  changed = vocabularies.as_vocabulary(instruct)
  assert changed.eos_id != base.eos_id and changed != base
  assert vocabularies.check_same_vocabulary(base, changed)
  assert vocabularies.check_same_vocabulary(folders["llama"], instruct)


def test_two_tokenizers_of_one_size_are_refused(folders, tmp_path):
  other = hf_fixtures.save_tokenizer(
      str(tmp_path / "other"), "llama",
      sentences=[s[::-1] for s in hf_fixtures.SENTENCES])
  a, b = vocabularies.as_vocabulary(folders["llama"]), vocabularies.as_vocabulary(other)
  assert a.vocab_size == b.vocab_size
  with pytest.raises(ValueError, match="tokenizers differ") as e:
    vocabularies.check_same_vocabulary(a, b)
  assert other in str(e.value)
  with pytest.raises(ValueError, match="differ"):
    vocabularies.check_same_vocabulary(folders["llama"], folders["qwen2"])


def test_bad_tokenizer_files_are_named(tmp_path):
  not_json = tmp_path / "tokenizer.json"
  not_json.write_bytes(b"\x08\x96\x01 not a tokenizer")
  with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json") as e:
    vocabularies.as_vocabulary(str(not_json))
  assert str(not_json) in str(e.value)
  (tmp_path / "j").mkdir()
  wrong_json = tmp_path / "j" / "tokenizer.json"
  wrong_json.write_text('{"hello": 1}')
  with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
    vocabularies.as_vocabulary(str(tmp_path / "j"))
  not_spm = tmp_path / "x.model"
  not_spm.write_text('{"model": {}}')
  with pytest.raises(ValueError, match="is not a SentencePiece model") as e:
    vocabularies.as_vocabulary(str(not_spm))
  assert str(not_spm) in str(e.value)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
    vocabularies.as_vocabulary(str(tmp_path / "empty"))


def test_ids_past_the_tokenizer_decode_to_nothing(folders):
  vocab = vocabularies.as_vocabulary(folders["qwen2"])
  ids = list(vocab.encode(TEXT))
  assert vocab.decode(ids + [vocab.vocab_size + 3]) == TEXT


def test_ids_past_the_rows_are_cut_only_when_they_are_unused_special_tokens(tmp_path):
  """Gemma 3's layout: a special token added past the models' embedding rows. The ids are cut
  to the rows (train binary: TaskSource.tokens_for) when every id past them is an added
  special token other than BOS, EOS and pad; rows that leave out BOS or EOS are refused naming
  them (before: token_ids took no rows, the vocabulary's size was the models' output width)."""
  from distillspec_jax.data.task_source import TaskSource
  tokenizer = hf_fixtures.fast_tokenizer("llama")  # ... 298 BOS, 299 EOS (no pad)
  tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
  folder = str(tmp_path / "tok")
  tokenizer.save_pretrained(folder)
  assert vocabularies.token_ids(folder, rows=300).num_tokens == 300
  assert vocabularies.token_ids(folder, rows=301).num_tokens == 301
  assert TaskSource(vocabulary=folder).tokens_for(300) == TokenIds(
      eos_id=299, decoder_start_id=None, pad_id=NO_TOKEN, num_tokens=300)
  with pytest.raises(ValueError, match=r"VOCABULARY='.*tok' does not fit the models: .*has 301 "
                                       r"ids but the models only 298 embedding rows: ids "
                                       r"298..300 have no row, among them the tokenizer's BOS "
                                       r"298 '<\|begin_of_text\|>', EOS 299 '<\|end_of_text\|>'"):
    TaskSource(vocabulary=folder).tokens_for(298)


def test_several_end_of_sequence_ids_all_stop_decoding(tmp_path, caplog):
  """An instruct model's generation_config.json lists several EOS ids (Gemma 3 IT: [1, 106]
  beside tokenizer_config's <eos>): every one stops decoding. tokenizer_config.json's
  eos_token stays the EOS (padding, targets); the others are TokenIds.stop_ids, and the job
  says once which ids stop (before: decoding stopped at the one EOS only)."""
  import logging
  tokenizer = hf_fixtures.fast_tokenizer("qwen2")  # EOS <|endoftext|> 297, <|im_end|> 299
  folder = str(tmp_path / "instruct")
  tokenizer.save_pretrained(folder)
  with open(os.path.join(folder, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [299, 297]}, f)
  with caplog.at_level(logging.INFO):
    tokens = vocabularies.token_ids(folder)
    vocabularies.token_ids(folder)
  assert (tokens.eos_id, tokens.stop_ids, tokens.end_ids) == (297, (299,), (297, 299))
  said = [r.getMessage() for r in caplog.records if "stops decoding" in r.getMessage()]
  assert len(said) == 1, caplog.text
  assert "297 '<|endoftext|>'" in said[0] and "299 '<|im_end|>'" in said[0], said[0]
  # tokenizer_config.json's eos_token names the EOS; the others still stop.
  with open(os.path.join(folder, "tokenizer_config.json")) as f:
    config = json.load(f)
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(dict(config, eos_token="<|im_end|>"), f)
  tokens = vocabularies.token_ids(folder)
  assert (tokens.eos_id, tokens.stop_ids) == (299, (297,))
  # One EOS listed: no stop ids.
  base = vocabularies.token_ids(hf_fixtures.save_tokenizer(str(tmp_path / "base"), "qwen2"))
  assert base.stop_ids == ()
