"""The embedded arithmetic task: determinism, correctness, lengths, batches."""

import re

import numpy as np
import pytest

from distillspec_jax.data import batches as batches_lib
from distillspec_jax.data.tasks import embedded
from distillspec_jax.data.tasks import metrics

_WORDS = {"plus": "+", "minus": "-", "times": "*", "over": "/"}
_STEP_FORMS = (re.compile(r"^(?P<a>\d+) (?P<op>[-+*/]) (?P<b>\d+) = (?P<r>\d+)\.$"),
               re.compile(r"^(?P<a>\d+) (?P<op>plus|minus|times|over) (?P<b>\d+) is (?P<r>\d+)\.$"),
               re.compile(r"^(?P<r>\d+) = (?P<a>\d+) (?P<op>[-+*/]) (?P<b>\d+)\.$"))


def _parse_step(step):
  for form in _STEP_FORMS:
    m = form.match(step)
    if m:
      op = _WORDS.get(m.group("op"), m.group("op"))
      return int(m.group("a")), op, int(m.group("b")), int(m.group("r"))
  return None


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return embedded.embedded_vocabulary(str(tmp_path_factory.mktemp("embvocab")), build=True)


@pytest.fixture(scope="module")
def task_name(vocab):
  embedded.register_embedded_task("embedded_arithmetic_test", vocabulary=vocab)
  return "embedded_arithmetic_test"


def test_deterministic_for_a_seed():
  a = embedded.generate_examples("train", 200, seed=0)
  embedded._generate_cached.cache_clear()  # Really regenerate.
  b = embedded.generate_examples("train", 200, seed=0)
  c = embedded.generate_examples("train", 200, seed=1)
  assert a == b
  assert a != c
  # A prefix of a longer request is the same examples.
  assert embedded.generate_examples("train", 50, seed=0) == a[:50]


def test_splits_are_disjoint():
  train = {e["inputs"] for e in embedded.generate_examples("train", 20000)}
  val = {e["inputs"] for e in embedded.generate_examples("validation", 500)}
  test = {e["inputs"] for e in embedded.generate_examples("test", 500)}
  assert not train & val and not train & test and not val & test
  assert len(test) > 450  # Mostly distinct problems.


def _check_solution(ex):
  """Re-derives the solution from the question text (independent of the generator)."""
  q, t = ex["inputs"], ex["targets"]
  start = int(re.search(r"(?:has|starts with|owns) (\d+) ", q).group(1))
  *steps, final = t.split(". ")
  steps = [s + "." for s in steps]
  assert final.startswith("#### ")
  cur = start
  sentences = q.split(". ")[1:]
  assert len(sentences) == len(steps) + 1 and sentences[-1].startswith("How many")
  for sentence, step in zip(sentences, steps):
    parsed = _parse_step(step)
    assert parsed, step
    a, op, b, r = parsed
    assert a == cur
    if "more" in sentence:
      expected = cur + int(re.search(r"(\d+) more", sentence).group(1))
      assert op == "+"
    elif "half" in sentence:
      expected, _ = divmod(cur, 2)
      assert op == "/" and cur % 2 == 0
    elif "doubles" in sentence:
      expected = cur * 2
      assert op == "*"
    elif "triples" in sentence:
      expected = cur * 3
      assert op == "*"
    else:
      expected = cur - int(re.search(r"(\d+)", sentence).group(1))
      assert op == "-"
    assert r == expected, (q, t)
    assert 0 <= r <= 99
    cur = r
  assert final == f"#### {cur}" and ex["answer"] == str(cur)


def test_solutions_are_correct_and_small():
  exs = embedded.generate_examples("train", 2000)
  for ex in exs:
    _check_solution(ex)
  n_steps = [len(ex["targets"].split(". ")) - 1 for ex in exs]
  assert set(n_steps) == {2, 3}
  # Every solution-step form occurs, in roughly equal shares.
  steps = [s for ex in exs for s in ex["targets"].split(". ")[:-1]]
  shares = [sum(form.match(s + ".") is not None for s in steps) / len(steps)
            for form in _STEP_FORMS]
  assert all(0.25 < share < 0.42 for share in shares), shares
  # Templated phrasing has a few variations.
  assert len({re.sub(r"\d+", "N", ex["inputs"]) for ex in exs}) > 100


def test_token_lengths_fit_short_sequences(vocab):
  assert vocab.vocab_size == embedded.DEFAULT_VOCAB_SIZE
  for ex in embedded.generate_examples("validation", 1000):
    assert len(vocab.encode(ex["inputs"])) + 1 <= embedded.DEFAULT_SEQUENCE_LENGTHS["inputs"]
    assert len(vocab.encode(ex["targets"])) + 1 <= embedded.DEFAULT_SEQUENCE_LENGTHS["targets"]
  # Digits are single pieces, so every number is spelled digit by digit.
  ids = vocab.encode("12 + 7 = 19. #### 19")
  pieces = [vocab.tokenizer.id_to_piece(i) for i in ids]
  assert [p for p in pieces if any(c.isdigit() for c in p)] == ["1", "2", "7", "1", "9", "1", "9"]
  assert "####" in pieces


@pytest.mark.slow
def test_batches_and_seeded_shuffle(task_name):
  lengths = embedded.DEFAULT_SEQUENCE_LENGTHS
  first = [next(batches_lib.get_dataset(task_name, "train", lengths, batch_size=8, shuffle=True,
                                 seed=3, num_epochs=None)) for _ in range(2)]
  assert set(first[0]) == {"encoder_input_tokens", "decoder_input_tokens",
                           "decoder_target_tokens", "decoder_loss_weights"}
  for k, v in first[0].items():
    assert v.shape == (8, lengths["inputs"] if k.startswith("encoder") else lengths["targets"])
    assert v.dtype == np.int32
    np.testing.assert_array_equal(v, first[1][k])  # Same seed, same batch.


def test_metric_on_references_and_wrong_answers(task_name):
  got = batches_lib.get_prompts_and_targets(task_name, "test", embedded.DEFAULT_SEQUENCE_LENGTHS,
                                     num_examples=20)
  refs = got.target_texts
  assert batches_lib.compute_metrics(task_name, refs, refs) == {"accuracy": pytest.approx(100.0)}
  wrong = [re.sub(r"#### (\d+)", lambda m: f"#### {int(m.group(1)) + 1}", r) for r in refs]
  assert metrics.gsm8k_accuracy(refs, wrong)["accuracy"] == 0.0


def test_prefix_lm_batches(task_name, vocab):
  lengths = embedded.DEFAULT_SEQUENCE_LENGTHS
  batch = next(batches_lib.get_dataset(task_name, "validation", lengths, batch_size=4,
                                feature_converter="decoder"))
  total = lengths["inputs"] + lengths["targets"]
  assert batch["decoder_target_tokens"].shape == (4, total)
  ex = embedded.generate_examples("validation", 1)[0]
  row = batch["decoder_target_tokens"][0]
  n_in = len(vocab.encode(ex["inputs"])) + 1
  # Prefix (inputs + EOS) is causal-attention "1" and carries no loss.
  assert batch["decoder_causal_attention"][0, :n_in].all()
  assert not batch["decoder_loss_weights"][0, :n_in].any()
  assert vocab.decode(row[:n_in].tolist()) == ex["inputs"]
  n_tgt = int(batch["decoder_loss_weights"][0].sum())
  assert vocab.decode(row[n_in:n_in + n_tgt].tolist()) == ex["targets"]
