"""seqio tasks: TFDS-backed (mock data), file-backed, BBH, errors, shared batches_lib."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import seqio
import tensorflow_datasets as tfds

from distillspec_jax.data import batches as batches_lib
from distillspec_jax.data import vocabularies
from distillspec_jax.data import tasks
from distillspec_jax.data.tasks import embedded

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO_ROOT / ".." / "shared" / "data").resolve()
COT = " A: Let's think step by step."

_TEXT = [
    "summarize: translate English to German: Q: A: Let's think step by step.",
    "The quick brown fox jumps over the lazy dog. Der schnelle braune Fuchs springt.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "How many clips did Natalia sell altogether in April and May? #### 72 (A) (B) (C)",
    "abcdefghij jihgfedcba aceg bdfhj Options: True False valid invalid",
    "Zwei Anlagen so nah beieinander: Absicht oder Schildbürgerstreich? Äpfel Öl Übung ß",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 .,;:!?'\"()[]$%&-+*/=#",
]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  texts = _TEXT * 20 + [e["inputs"] + " " + e["targets"]
                        for e in embedded.generate_examples("train", 300)]
  path = vocabularies.train_sentencepiece(texts, tmp_path_factory.mktemp("v") / "t.model",
                                          vocab_size=300, model_type="bpe")
  return vocabularies.get_vocabulary(path)


@pytest.fixture(scope="module")
def tfds_names(vocab):
  return tasks.register_tfds_tasks(vocabulary=vocab, suffix="_t")


def _dec(vocab, row):
  return vocab.decode([int(t) for t in row if t > 1])


# ------------------------------------------------------------------ TFDS
@pytest.mark.integration
def test_default_tasks_registered_on_demand_not_on_import():
  code = ("import seqio\nfrom distillspec_jax.data import batches, tasks\n"
          "assert 'xsum' not in seqio.TaskRegistry.names()\n"
          "batches.get_task('embedded_arithmetic')\nassert 'xsum' in seqio.TaskRegistry.names()")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  tasks.ensure_default_tasks()
  for name in tasks.TFDS_TASK_NAMES + (tasks.EMBEDDED_TASK_NAME,):
    assert name in seqio.TaskRegistry.names()
  assert (seqio.TaskRegistry.get("xsum").output_features["targets"].vocabulary
          .sentencepiece_model_file == vocabularies.T5_DEFAULT_SPM_PATH)


@pytest.mark.parametrize("name,prefix,suffix", [
    ("xsum_t", "summarize: ", ""),
    ("cnn_dailymail_t", "summarize: ", ""),
    ("gsm8k_t", "Q: ", COT),
    ("wmt14_en_de_t", "translate English to German: ", ""),
])
def test_tfds_enc_dec_tasks_under_mock_data(vocab, tfds_names, name, prefix, suffix):
  lengths = {"inputs": 64, "targets": 32}
  with tfds.testing.mock_data(num_examples=5):
    batch = next(batches_lib.get_dataset(name, "train", lengths, batch_size=3))
  assert set(batch) == {"encoder_input_tokens", "decoder_input_tokens",
                        "decoder_target_tokens", "decoder_loss_weights"}
  assert batch["encoder_input_tokens"].shape == (3, 64)
  for k in ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights"):
    assert batch[k].shape == (3, 32) and batch[k].dtype == np.int32
  for i in range(3):
    text = _dec(vocab, batch["encoder_input_tokens"][i])
    assert text.startswith(prefix.strip()) and text.endswith(suffix)
    assert len(text) > len(prefix + suffix)  # The mock text itself is there.
    tgt = batch["decoder_target_tokens"][i]
    n = int((tgt > 0).sum())
    assert tgt[n - 1] == vocab.eos_id  # Targets end with EOS.
    np.testing.assert_array_equal(batch["decoder_loss_weights"][i], (tgt > 0).astype(np.int32))
    np.testing.assert_array_equal(batch["decoder_input_tokens"][i, 1:n], tgt[: n - 1])
    assert batch["decoder_input_tokens"][i, 0] == 0


def test_tfds_lm1b_decoder_only_under_mock_data(vocab, tfds_names):
  with tfds.testing.mock_data(num_examples=4):
    batch = next(batches_lib.get_dataset("lm1b_t", "train", {"targets": 24}, batch_size=2,
                                  feature_converter="decoder"))
  assert set(batch) == {"decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights"}
  assert batch["decoder_target_tokens"].shape == (2, 24)
  assert (batch["decoder_target_tokens"][:, 0] > 1).all()  # Text starts right away.
  with pytest.raises(ValueError, match="decoder-only"):
    batches_lib.get_dataset("lm1b_t", "train", {"inputs": 8, "targets": 24}, batch_size=2)


@pytest.mark.slow
def test_tfds_gsm8k_as_prefix_lm(vocab, tfds_names):
  with tfds.testing.mock_data(num_examples=4):
    batch = next(batches_lib.get_dataset("gsm8k_t", "test", {"inputs": 64, "targets": 32},
                                  batch_size=2, feature_converter="decoder"))
  assert batch["decoder_target_tokens"].shape == (2, 96)
  causal = batch["decoder_causal_attention"][0]
  # seqio marks the inputs (with EOS) plus one position: decoder inputs are shifted by one.
  n_in = int(causal.sum()) - 1
  assert _dec(vocab, batch["decoder_target_tokens"][0, :n_in]).startswith("Q:")
  assert not batch["decoder_loss_weights"][0, :n_in].any()
  assert batch["decoder_loss_weights"][0, n_in:].any()


# ------------------------------------------------------------------ files
def _write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


@pytest.fixture()
def data_dir(tmp_path):
  d = tmp_path / "data"
  _write_jsonl(d / "gsm8k" / "train.jsonl", [
      {"question": "Natalia sold 48 clips in April.", "answer":
       "She sold 48 / 2 = <<48/2=24>>24 in May.\nIn all 48 + 24 = <<48+24=72>>72.\n#### 72"},
      {"question": "How many clips?", "answer": "#### 5"}])
  _write_jsonl(d / "gsm8k" / "test.jsonl", [{"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"}])
  _write_jsonl(d / "xsum" / "validation.jsonl", [
      {"document": "The quick brown fox jumps.", "summary": "A fox jumps.", "id": "1"}])
  _write_jsonl(d / "cnndm" / "test.jsonl", [
      {"article": "The lazy dog sleeps.", "highlights": "Dog sleeps."}])
  _write_jsonl(d / "cnndm" / "other_format.jsonl", [  # Ignored: a split file exists.
      {"turns": ["Summarize: x"], "reference": ["y"]}])
  (d / "wmt").mkdir()
  (d / "wmt" / "newstest2014.de-en.ref.en.txt").write_text("The quick fox.\nTwo lights.\n")
  (d / "wmt" / "newstest2014.de-en.src.de.txt").write_text("Der schnelle Fuchs.\nZwei Ampeln.\n")
  (d / "lm1b").mkdir()
  (d / "lm1b" / "train.txt").write_text("The quick brown fox .\n\nThe lazy dog .\n")
  (d / "lm1b" / "heldout.dev.txt").write_text("Two lights .\n")
  (d / "bbh").mkdir()
  (d / "bbh" / "boolean_expressions.json").write_text(json.dumps(
      {"examples": [{"input": "True and False is", "target": "False"},
                    {"input": "not False is", "target": "True"}]}, indent=1))
  (d / "bbh" / "date_understanding.json").write_text(json.dumps(
      {"examples": [{"input": "Which date? Options:\n(A) today\n(B) tomorrow",
                     "target": "(B)"}]}, indent=1))
  return d


@pytest.mark.slow
def test_register_file_tasks_and_read(vocab, data_dir):
  names = tasks.register_file_tasks(str(data_dir), vocabulary=vocab)
  assert names == ["gsm8k_files", "xsum_files", "cnn_dailymail_files", "wmt_en_de_files",
                   "lm1b_files", "bbh_boolean_expressions", "bbh_date_understanding", "bbh"]
  got = batches_lib.get_prompts_and_targets("gsm8k_files", "train", {"inputs": 64, "targets": 64})
  assert got.prompt_texts == ["Q: Natalia sold 48 clips in April." + COT,
                                 "Q: How many clips?" + COT]
  assert got.target_texts[0] == "She sold 48 / 2 = 24 in May. In all 48 + 24 = 72. #### 72"
  assert _dec(vocab, got.prompts[0]) == got.prompt_texts[0]
  assert got.prompts[0, got.prompt_lengths[0] - 1] == vocab.eos_id
  assert _dec(vocab, got.targets[0]) == got.target_texts[0]
  assert got.prompts.shape == (2, 64) and got.targets.shape == (2, 64)

  xs = batches_lib.get_prompts_and_targets("xsum_files", "validation")
  assert xs.prompt_texts == ["summarize: The quick brown fox jumps."]
  assert xs.target_texts == ["A fox jumps."]
  cn = batches_lib.get_prompts_and_targets("cnn_dailymail_files", "test")
  assert cn.prompt_texts == ["summarize: The lazy dog sleeps."]
  wmt = batches_lib.get_prompts_and_targets("wmt_en_de_files", "test")
  assert wmt.prompt_texts == ["translate English to German: The quick fox.",
                                 "translate English to German: Two lights."]
  assert wmt.target_texts == ["Der schnelle Fuchs.", "Zwei Ampeln."]

  batch = next(batches_lib.get_dataset("lm1b_files", "train", {"targets": 16}, batch_size=4,
                                feature_converter="decoder"))
  assert batch["decoder_target_tokens"].shape == (2, 16)  # Blank line skipped.
  assert _dec(vocab, batch["decoder_target_tokens"][1]) == "The lazy dog ."
  lm = batches_lib.get_prompts_and_targets("lm1b_files", "validation", lm_prompt_length=2)
  assert lm.prompt_lengths.tolist() == [2]

  enc = next(batches_lib.get_dataset("wmt_en_de_files", "test", {"inputs": 32, "targets": 16},
                              batch_size=2))
  assert enc["encoder_input_tokens"].shape == (2, 32)


def test_cnndm_specbench_layout(vocab, tmp_path):
  _write_jsonl(tmp_path / "cnndm" / "specbench_cnndm_80.jsonl", [
      {"question_id": 1, "turns": ["Summarize: The lazy dog sleeps."],
       "reference": ["Dog sleeps."]}])
  tasks.register_cnn_dailymail_files(str(tmp_path / "cnndm"), vocabulary=vocab, name="cnn_sb")
  got = batches_lib.get_prompts_and_targets("cnn_sb", "test")  # No split in the name -> test.
  assert got.prompt_texts == ["summarize: The lazy dog sleeps."]
  assert got.target_texts == ["Dog sleeps."]


@pytest.mark.slow
def test_bbh_tasks_and_mixture(vocab, data_dir):
  names = tasks.register_bbh_tasks(str(data_dir / "bbh"), vocabulary=vocab)
  assert names == ["bbh_boolean_expressions", "bbh_date_understanding", "bbh"]
  got = batches_lib.get_prompts_and_targets("bbh_date_understanding", "test")
  assert got.prompt_texts == ["Q: Which date? Options:\n(A) today\n(B) tomorrow" + COT]
  assert got.target_texts == ["(B)"]
  assert batches_lib.compute_metrics("bbh_date_understanding", ["(B)"], ["So the answer is (B)."]) == {
      "exact_match": 100.0}
  batches = list(batches_lib.get_dataset("bbh", "test", {"inputs": 64, "targets": 8}, batch_size=4))
  assert len(batches) == 1 and batches[0]["encoder_input_tokens"].shape == (3, 64)  # One epoch.
  prompts = sorted(_dec(vocab, r) for r in batches[0]["encoder_input_tokens"])
  assert prompts == sorted(["Q: True and False is" + COT, "Q: not False is" + COT,
                            vocab.decode(vocab.encode(got.prompt_texts[0]))])
  batch = next(batches_lib.get_dataset("bbh", "test", {"inputs": 64, "targets": 8}, batch_size=4,
                                shuffle=True, seed=0, num_epochs=None))
  assert batch["encoder_input_tokens"].shape == (4, 64)


# ------------------------------------------------------------------ errors
def test_malformed_jsonl_line_names_file_and_line(vocab, tmp_path):
  path = tmp_path / "gsm8k" / "train.jsonl"
  _write_jsonl(path, [{"question": "a", "answer": "#### 1"}, "{not json", ])
  tasks.register_gsm8k_files(str(tmp_path / "gsm8k"), vocabulary=vocab, name="bad_gsm8k")
  with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON"):
    batches_lib.get_prompts_and_targets("bad_gsm8k", "train")
  _write_jsonl(path, [{"question": "a", "answer": "#### 1"}, {"question": "b"}])
  with pytest.raises(ValueError, match=rf"{path}:2: missing field\(s\) \['answer'\]"):
    batches_lib.get_prompts_and_targets("bad_gsm8k", "train")


def test_malformed_bbh_file_names_file_and_line(vocab, tmp_path):
  (tmp_path / "bbh").mkdir()
  bad = tmp_path / "bbh" / "navigate.json"
  bad.write_text('{"examples": [\n {"input": "a", "target": "b"},\n {"input": "c" "target"}\n]}')
  tasks.register_bbh_tasks(str(tmp_path / "bbh"), vocabulary=vocab, mixture_name="bbh_bad")
  with pytest.raises(ValueError, match=rf"{bad}:3: malformed JSON"):
    batches_lib.get_prompts_and_targets("bbh_navigate", "test")
  bad.write_text('{"examples": [\n {"input": "a", "target": "b"},\n {"input": "c"}\n]}')
  with pytest.raises(ValueError, match=rf"{bad}:3: example 1"):
    batches_lib.get_prompts_and_targets("bbh_navigate", "test")


def test_malformed_text_and_missing_fields(vocab, tmp_path):
  lm = tmp_path / "lm1b"
  lm.mkdir()
  (lm / "train.txt").write_bytes(b"fine line\nbad \xff byte\n")
  tasks.register_lm1b_files(str(lm), vocabulary=vocab, name="bad_lm1b")
  with pytest.raises(ValueError, match=rf"{lm / 'train.txt'}:2: not valid UTF-8"):
    next(batches_lib.get_dataset("bad_lm1b", "train", {"targets": 8}, batch_size=1,
                          feature_converter="decoder"))
  path = tmp_path / "xsum" / "test.jsonl"
  _write_jsonl(path, [{"document": "d", "summary": "s"}, {"document": "d", "summary": 3}])
  tasks.register_xsum_files(str(tmp_path / "xsum"), vocabulary=vocab, name="bad_xsum")
  with pytest.raises(ValueError, match=rf"{path}:2: field 'summary' must be a string"):
    batches_lib.get_prompts_and_targets("bad_xsum", "test")


def test_misaligned_wmt_files(vocab, tmp_path):
  d = tmp_path / "wmt"
  d.mkdir()
  (d / "test.en").write_text("a\nb\n")
  (d / "test.de").write_text("x\n")
  tasks.register_wmt_files(str(d), vocabulary=vocab, name="bad_wmt")
  with pytest.raises(ValueError, match=r"line count.*test\.en has 2 lines"):
    batches_lib.get_prompts_and_targets("bad_wmt", "test")


def test_missing_data_directory(tmp_path):
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    tasks.register_file_tasks(str(missing))
  with pytest.raises(FileNotFoundError, match=str(missing)):
    tasks.register_gsm8k_files(str(missing))
  with pytest.raises(FileNotFoundError, match=str(missing)):
    tasks.register_bbh_tasks(str(missing))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="none of the folders"):
    tasks.register_file_tasks(str(tmp_path / "empty"))


def test_unknown_task_name():
  with pytest.raises(ValueError) as e:
    batches_lib.get_dataset("gsm8kk", "train", {"inputs": 8, "targets": 8}, batch_size=1)
  assert "'gsm8kk' is not registered" in str(e.value) and "'gsm8k'" in str(e.value)
  with pytest.raises(ValueError, match="register_file_tasks"):
    batches_lib.get_task("xsum_filez_files")


def test_unknown_split_and_bad_lengths(vocab, tfds_names):
  with pytest.raises(ValueError, match=r"no split 'validation'.*\['test', 'train'\]"):
    batches_lib.get_dataset("gsm8k_t", "validation", {"inputs": 8, "targets": 8}, batch_size=1)
  with pytest.raises(ValueError, match="positive int"):
    batches_lib.get_dataset("gsm8k_t", "train", {"inputs": 0, "targets": 8}, batch_size=1)
  with pytest.raises(ValueError, match="needs lengths for 'inputs' and 'targets'"):
    batches_lib.get_dataset("gsm8k_t", "train", {"targets": 8}, batch_size=1)
  with pytest.raises(ValueError, match="feature_converter='nope'"):
    batches_lib.get_dataset("gsm8k_t", "train", {"inputs": 8, "targets": 8}, batch_size=1,
                     feature_converter="nope")


def test_sequence_length_too_small_for_prompts(vocab, data_dir):
  tasks.register_gsm8k_files(str(data_dir / "gsm8k"), vocabulary=vocab)
  needed = len(vocab.encode("Q: Natalia sold 48 clips in April." + COT)) + 1
  with pytest.raises(ValueError) as e:
    batches_lib.get_dataset("gsm8k_files", "train", {"inputs": 4, "targets": 64}, batch_size=1)
  msg = str(e.value)
  assert "sequence_lengths['inputs']=4 is too small" in msg and str(needed) in msg
  with pytest.raises(ValueError) as e:
    batches_lib.get_prompts_and_targets("gsm8k_files", "train", {"inputs": 10, "targets": 64})
  assert "Prompt 0 of task 'gsm8k_files'" in str(e.value)
  assert f"has {needed} tokens but sequence_lengths['inputs']=10" in str(e.value)
  cut = batches_lib.get_prompts_and_targets("gsm8k_files", "train", {"inputs": 10, "targets": 64},
                                     on_long_prompt="truncate")
  assert cut.prompt_lengths.max() == 10 and cut.prompts[0, 9] == vocab.eos_id


def test_registration_is_idempotent(vocab, data_dir):
  for _ in range(2):
    tasks.register_file_tasks(str(data_dir), vocabulary=vocab)
    tasks.register_tfds_tasks(vocabulary=vocab, suffix="_t")
    embedded.register_embedded_task("embedded_arithmetic_idem", vocabulary=vocab)


# ------------------------------------------------------------------ shared data
@pytest.mark.skipif(not SHARED_DATA.is_dir(),
                    reason=f"no shared data folder at {SHARED_DATA} (../shared/data)")
def test_shared_data_through_file_tasks(vocab):
  names = tasks.register_file_tasks(str(SHARED_DATA), vocabulary=vocab)
  for n in ("gsm8k_files", "xsum_files", "wmt_en_de_files", "lm1b_files"):
    assert n in names
  with open(SHARED_DATA / "gsm8k" / "test.jsonl") as f:
    first = json.loads(f.readline())
  got = batches_lib.get_prompts_and_targets("gsm8k_files", "test", num_examples=3)
  assert got.prompt_texts[0] == "Q: " + first["question"].strip() + COT
  assert got.target_texts[0].endswith("#### " + first["answer"].split("####")[-1].strip())
  assert "<<" not in got.target_texts[0]

  with open(SHARED_DATA / "xsum" / "test_1000.jsonl") as f:
    first = json.loads(f.readline())
  xs = batches_lib.get_prompts_and_targets("xsum_files", "test", num_examples=2,
                                    on_long_prompt="truncate", sequence_lengths={"inputs": 512})
  assert xs.target_texts[0] == first["summary"].strip()
  assert xs.prompt_texts[0].startswith("summarize: " + first["document"].strip()[:50])

  en = (SHARED_DATA / "wmt" / "newstest2014.de-en.ref.en.txt").read_text().split("\n")[0]
  de = (SHARED_DATA / "wmt" / "newstest2014.de-en.src.de.txt").read_text().split("\n")[0]
  wmt = batches_lib.get_prompts_and_targets("wmt_en_de_files", "test", num_examples=2)
  assert wmt.prompt_texts[0] == "translate English to German: " + en.strip()
  assert wmt.target_texts[0] == de.strip()

  line = (SHARED_DATA / "lm1b" / "heldout_shards10-11.dev.txt").read_text().split("\n")[0]
  batch = next(batches_lib.get_dataset("lm1b_files", "validation", {"targets": 256}, batch_size=2,
                                feature_converter="decoder"))
  assert batch["decoder_target_tokens"].shape == (2, 256)
  assert _dec(vocab, batch["decoder_target_tokens"][0]) == vocab.decode(vocab.encode(line.strip()))


def test_document_tasks_allow_moderate_truncation(vocab, tmp_path):
  doc = "The quick brown fox jumps over the lazy dog near the river bank today."
  _write_jsonl(tmp_path / "xsum" / "train.jsonl", [{"document": doc, "summary": "Fox."}] * 4)
  tasks.register_xsum_files(str(tmp_path / "xsum"), vocabulary=vocab, name="xsum_long")
  n = len(vocab.encode("summarize: " + doc)) + 1
  # Every document is cut, but keeps more than half: normal for summarization.
  length = n // 2 + 2
  batch = next(batches_lib.get_dataset("xsum_long", "train", {"inputs": length, "targets": 8},
                                batch_size=4))
  assert batch["encoder_input_tokens"].shape == (4, length)
  assert (batch["encoder_input_tokens"] > 0).all()
  with pytest.raises(ValueError, match="would lose over half of their tokens"):
    batches_lib.get_dataset("xsum_long", "train", {"inputs": n // 2 - 1, "targets": 8}, batch_size=4)
