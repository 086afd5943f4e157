"""SentencePiece vocabularies: training, loading, sharing checks, CLI."""

import os

import pytest

from distillspec_jax.data import train_vocabulary, vocabularies
from distillspec_jax.data.tasks import embedded

_WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly "
          "judge boxing matches and many people read books about history science and art").split()


def _texts(n=400, shift=0):
  out = []
  for i in range(n):
    words = [_WORDS[(i * 7 + j * 3 + shift) % len(_WORDS)] for j in range(8)]
    out.append(" ".join(words) + f" {i * 13 % 1000}.")
  return out


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
  return vocabularies.train_sentencepiece(
      _texts(), tmp_path_factory.mktemp("spm") / "a.model", vocab_size=120, model_type="bpe")


def test_trained_model_has_t5_id_layout_and_round_trips(model_a):
  assert os.path.isfile(model_a)
  vocab = vocabularies.get_vocabulary(model_a)
  assert vocab.pad_id == 0 and vocab.eos_id == 1 and vocab.unk_id == 2
  assert vocab.extra_ids == 0
  assert 100 <= vocab.vocab_size <= 120
  text = "the lazy dog reads 42 books."
  assert vocab.decode(vocab.encode(text)) == text
  # split_digits: every piece holding a digit is exactly one digit (maybe after '▁').
  pieces = [vocab.tokenizer.id_to_piece(i) for i in vocab.encode("seven 1234 and 56")]
  for p in pieces:
    digits = [c for c in p if c.isdigit()]
    assert len(digits) <= 1 and (not digits or p.lstrip("\u2581") == digits[0]), pieces


def test_training_is_deterministic(tmp_path):
  a = vocabularies.train_sentencepiece(_texts(), tmp_path / "x.model", vocab_size=120,
                                       model_type="bpe")
  b = vocabularies.train_sentencepiece(_texts(), tmp_path / "y.model", vocab_size=120,
                                       model_type="bpe")
  assert open(a, "rb").read() == open(b, "rb").read()


def test_missing_vocabulary_file_is_a_clear_error(tmp_path):
  missing = tmp_path / "nope.model"
  with pytest.raises(FileNotFoundError) as e:
    vocabularies.get_vocabulary(missing)
  assert str(missing) in str(e.value)
  assert "python -m distillspec_jax.data.train_vocabulary" in str(e.value)


def test_t5_default_path_is_lazy_and_has_extra_ids():
  vocab = vocabularies.get_vocabulary()  # Offline: must not read gs://.
  assert vocab.sentencepiece_model_file == vocabularies.T5_DEFAULT_SPM_PATH
  assert vocab.extra_ids == 100
  # Same path on both sides: accepted without reading the file.
  assert vocabularies.check_same_vocabulary(vocab, vocabularies.T5_DEFAULT_SPM_PATH)


def test_check_same_vocabulary(model_a, tmp_path):
  copy = tmp_path / "copy.model"
  copy.write_bytes(open(model_a, "rb").read())
  assert vocabularies.check_same_vocabulary(model_a, str(copy))  # Same bytes, other path.
  other_size = vocabularies.train_sentencepiece(_texts(), tmp_path / "b.model", vocab_size=90,
                                                model_type="bpe")
  with pytest.raises(ValueError, match="differ in size"):
    vocabularies.check_same_vocabulary(model_a, other_size)
  same_size_other_model = vocabularies.train_sentencepiece(
      [t.upper() for t in _texts()], tmp_path / "c.model", vocab_size=120, model_type="bpe",
      hard_vocab_limit=True)
  with pytest.raises(ValueError, match="different SentencePiece models"):
    vocabularies.check_same_vocabulary(vocabularies.get_vocabulary(model_a),
                                       vocabularies.get_vocabulary(same_size_other_model))
  with pytest.raises(ValueError, match="extra_ids"):
    vocabularies.check_same_vocabulary(vocabularies.get_vocabulary(model_a, extra_ids=0),
                                       vocabularies.get_vocabulary(model_a, extra_ids=10))


def test_cli_trains_from_a_task(tmp_path, capsys):
  out = tmp_path / "emb.model"
  rc = train_vocabulary.main(["--task=embedded_arithmetic", f"--out={out}", "--vocab_size=150",
                          "--max_examples=500", "--model_type=bpe"])
  assert rc == 0 and out.is_file()
  vocab = vocabularies.get_vocabulary(out)
  assert vocab.vocab_size == 150
  ex = embedded.generate_examples("train", 3)[0]
  assert vocab.decode(vocab.encode(ex["targets"])) == ex["targets"]
  assert "150 pieces" in capsys.readouterr().out


def test_cli_with_data_dir_for_file_tasks(tmp_path):
  d = tmp_path / "data" / "gsm8k"
  d.mkdir(parents=True)
  import json
  with open(d / "train.jsonl", "w") as f:
    for i in range(50):
      f.write(json.dumps({"question": f"Tom has {i} apples and buys {i + 2}. How many?",
                          "answer": f"{i} + {i + 2} = <<{i}+{i+2}={2*i+2}>>{2 * i + 2}\n#### "
                                    f"{2 * i + 2}"}) + "\n")
  out = tmp_path / "g.model"
  rc = train_vocabulary.main(["--task=gsm8k_files", f"--data_dir={tmp_path / 'data'}",
                          f"--out={out}", "--vocab_size=80"])
  assert rc == 0 and out.is_file()
  vocab = vocabularies.get_vocabulary(out)
  # Trained on the formatted text: the CoT prompt words are in the vocabulary's reach.
  text = "Q: Tom has 3 apples. A: Let's think step by step."
  assert vocab.decode(vocab.encode(text)) == text


def test_embedded_vocabulary_is_cached_and_lazy(tmp_path):
  vocab = embedded.embedded_vocabulary(str(tmp_path))
  path = embedded.embedded_vocabulary_path(str(tmp_path))
  assert not os.path.exists(path)  # Lazy: nothing built yet.
  assert vocab.vocab_size == embedded.DEFAULT_VOCAB_SIZE  # First use builds it.
  assert os.path.exists(path)
  mtime = os.path.getmtime(path)
  assert embedded.build_embedded_vocabulary(str(tmp_path)) == path
  assert os.path.getmtime(path) == mtime  # Cached, not rebuilt.
