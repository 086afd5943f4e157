"""Metric functions against hand-computed values."""

import math

import numpy as np
import pytest

from distillspec_jax.data.tasks import metrics


def test_rouge_hand_computed():
  # target 6 unigrams, prediction 3 (all in target): P=1, R=1/2 -> F=2/3.
  # bigrams: prediction {the cat, cat sat} both in target's 5 -> P=1, R=2/5 -> F=4/7.
  # LCS = 3 -> same as ROUGE-1.
  out = metrics.rouge(["the cat sat on the mat"], ["the cat sat"])
  assert out["rouge1"] == pytest.approx(100 * 2 / 3)
  assert out["rouge2"] == pytest.approx(100 * 4 / 7)
  assert out["rougeL"] == pytest.approx(100 * 2 / 3)


def test_rouge_averages_examples():
  out = metrics.rouge(["a b", "c d"], ["a b", "x y"])
  assert out["rouge1"] == pytest.approx(50.0)


def test_bleu_hand_computed():
  # Precisions 5/6, 3/5, 2/4, 1/3; equal lengths so BP = 1.
  expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
  out = metrics.bleu(["the cat sat on a mat"], ["the cat sat on the mat"])
  assert out["bleu"] == pytest.approx(expected, abs=1e-2)
  assert metrics.bleu(["the cat sat on a mat"], ["the cat sat on a mat"])["bleu"] == (
      pytest.approx(100.0))


@pytest.mark.parametrize("text,expected", [
    ("She pays 2 * 617 = 1234 dollars. #### 1,234.", "1234"),
    ("so the total is 1,234.", "1234"),
    ("#### 18", "18"),
    ("It costs $18.00 in total", "18"),
    ("The change is -5 degrees.", "-5"),
    ("He runs 2.5 km", "2.5"),
    ("no number here", None),
    ("first 3 then #### 7 and later 9", "7"),
])
def test_extract_gsm8k_answer(text, expected):
  assert metrics.extract_gsm8k_answer(text) == expected


def test_gsm8k_accuracy():
  targets = ["2 * 617 = 1234. #### 1234", "16 - 3 = 13. #### 13", "#### 7", "#### 5"]
  predictions = ["... so she pays 1,234.", "16 - 3 = 12. #### 12", "#### 7", ""]
  assert metrics.gsm8k_accuracy(targets, predictions) == {"accuracy": pytest.approx(50.0)}


@pytest.mark.parametrize("text,expected", [
    ("(B)", "(B)"),
    ("Let's think. The shirt is blue. So the answer is (B).", "(B)"),
    ("So the answer is (B) blue.", "(B)"),
    ("the answer is True.", "True"),
    ("Reasoning...\nSo the answer is valid.\nExtra text", "valid"),
    ("no trigger\nTrue", "True"),
])
def test_extract_bbh_answer(text, expected):
  assert metrics.extract_bbh_answer(text) == expected


def test_bbh_exact_match():
  targets = ["(B)", "(A)", "True", "False"]
  predictions = ["Step by step ... So the answer is (B).", "So the answer is (C).",
                 "So the answer is True.", "So the answer is True."]
  assert metrics.bbh_exact_match(targets, predictions) == {"exact_match": pytest.approx(50.0)}


def test_log_perplexity_per_token_scores():
  out = metrics.log_perplexity(["x", "y"], [np.array([-1.0, -2.0]), np.array([-3.0])])
  assert out["log_perplexity"] == pytest.approx(2.0)
  assert out["num_tokens"] == 3


def test_log_perplexity_sequence_scores_with_token_ids():
  # Padding (0) is not a token: 3 + 1 tokens, total log-likelihood -8 -> 2 nats/token.
  out = metrics.log_perplexity([np.array([5, 6, 1, 0, 0]), np.array([1, 0])], [-6.0, -2.0])
  assert out["log_perplexity"] == pytest.approx(2.0)
  assert math.exp(out["log_perplexity"]) == pytest.approx(math.e ** 2)


def test_log_perplexity_rejects_string_target_with_scalar():
  with pytest.raises(ValueError, match="token ids"):
    metrics.log_perplexity(["some text"], [-3.0])


def test_make_log_perplexity_counts_tokens_with_vocabulary():
  class FakeVocab:
    def encode(self, s):
      return s.split()
  fn = metrics.make_log_perplexity(FakeVocab())
  # "a b c" -> 3 tokens + EOS = 4; total -8 -> 2.
  assert fn(["a b c"], [-8.0])["log_perplexity"] == pytest.approx(2.0)


def test_length_mismatch_is_an_error():
  with pytest.raises(ValueError, match="differ in length"):
    metrics.gsm8k_accuracy(["#### 1"], [])
