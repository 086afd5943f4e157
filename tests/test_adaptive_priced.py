"""bench/adaptive_priced.py: rounds priced as their rows pay for them, and the T = 0 oracle's
data (one teacher-forced pass) reproducing the engine's greedy rounds exactly."""

import pathlib
import sys

import jax
import numpy as np
import pytest

from distillspec_jax.decoding.plain import SamplingConfig
from distillspec_jax.decoding.speculative import DraftLength, speculative_decode
from distillspec_jax.models.model import Model
from testing import TINY_TARGET, random_params

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import adaptive_priced  # noqa: E402  (bench/adaptive_priced.py)

NEW = 12


def _noisy_pair():
  """The tiny target and, as its draft, the same network with noisy weights: some of its
  tokens are accepted and some not."""
  target = Model.from_name(TINY_TARGET, vocab_size=32)
  params = random_params(target, 0)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  noisy = jax.tree.unflatten(tree, [x + 0.5 * x.std() * jax.random.normal(k, x.shape, x.dtype)
                                    for x, k in zip(leaves, keys)])
  prompts = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (6, 8), 3, 32), np.int32)
  return dict(target=target, target_params=params, draft=target, draft_params=noisy,
              prompts=prompts, max_new_tokens=NEW)


def _fixed_rounds(accepted, length: int, gamma: int) -> tuple:
  """(rounds, tokens) of one row under fixed gamma, read from its acceptance array."""
  position, rounds = 1, 0
  while position < length:
    tested = accepted[position:position + gamma]
    run = int(np.argmin(np.append(tested, False)))
    position += min(run + 1, length - position)
    rounds += 1
  return rounds, length - 1


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [2, 4])
def test_teacher_forced_acceptance_gives_the_engines_greedy_rounds(gamma):
  pair = _noisy_pair()
  arrays = adaptive_priced.greedy_acceptance(pair, len(pair["prompts"]))
  lengths = arrays["lengths"]
  tested = arrays["accepted"][np.arange(NEW)[None] < lengths[:, None]]
  assert 0.1 < tested.mean() < 0.95  # the case has both acceptances and rejections
  engine = speculative_decode(pair["target"], pair["target_params"], pair["draft"],
                              pair["draft_params"], encoder_input_tokens=pair["prompts"],
                              max_new_tokens=NEW, gamma=gamma, sampling=SamplingConfig(0.0))
  np.testing.assert_array_equal(lengths, np.asarray(engine.lengths))
  for row in range(len(lengths)):
    assert _fixed_rounds(arrays["accepted"][row], lengths[row], gamma) == (
        int(engine.target_calls[row]), int(engine.produced[row]))


def test_rounds_are_priced_as_their_rows_pay():
  """Two rows' rounds at gamma_max 3: an adaptive round proposing m < 3 tokens makes m + 1
  calls, one proposing 3 makes 3; the fixed rule makes gamma calls every round."""
  rounds = {"proposed_per_round": np.array([[1, 3, -1], [2, 2, 3]]),
            "produced": np.array([5, 7])}
  prices = adaptive_priced.Prices(draft_first=0.5, draft_step=0.25,
                                  verification=(1.0, 1.2, 1.5, 2.0), overhead=0.1)
  adaptive = adaptive_priced.price_rounds(rounds, DraftLength("confidence", 0.5), 3, prices)
  # calls: 2, 3 | 3, 3, 3; widths 2, 4 | 3, 3, 4.
  expected = [0.5 + 0.25 + 1.2, 0.5 + 0.5 + 2.0, 0.5 + 0.5 + 1.5, 0.5 + 0.5 + 1.5,
              0.5 + 0.5 + 2.0]
  assert adaptive["steps"] == pytest.approx(sum(expected) + 5 * 0.1)
  assert (adaptive["rounds"], adaptive["tokens"], adaptive["proposed"], adaptive["calls"]) == (
      5, 12, 11, 14)
  fixed = adaptive_priced.price_rounds(
      {"proposed_per_round": np.array([[3, 3, -1]]), "produced": np.array([6])},
      DraftLength(), 3, prices)
  assert fixed["steps"] == pytest.approx(2 * (0.5 + 0.5 + 2.0))  # no overhead
  assert fixed["calls"] == 6


def test_the_oracle_on_a_hand_computed_row():
  """One row of 6 tokens (the prefill makes the first); the draft's tokens are accepted at
  positions 1, 4 and 5. Prices: first call 0.5, a later call 0.25, verification of 1, 2, 3
  tokens 1, 1, 2 steps, so one proposed token costs 1.5 steps and two 2.75. At 1 both make 2
  tokens, at 3 both make 1, at 4 both make 2 (the length cuts the longer): one each time."""
  arrays = {"accepted": np.array([[False, True, False, False, True, True]]),
            "lengths": np.array([6])}
  best = adaptive_priced.oracle(arrays, 2, adaptive_priced.Prices(0.5, 0.25, (1.0, 1.0, 2.0)))
  assert (best["rounds"], best["tokens"], best["proposed"]) == (3, 5, 3)
  assert best["steps"] == pytest.approx(3 * 1.5)
  # Every token accepted, and a 3-token verification at 1.2 steps (two proposed: 1.95): at 1
  # two give 3 tokens / 1.95 > 2 / 1.5; at 4 only 2 tokens remain, so one.
  arrays["accepted"] = np.array([[False, True, True, True, True, True]])
  longer = adaptive_priced.oracle(arrays, 2, adaptive_priced.Prices(0.5, 0.25, (1.0, 1.0, 1.2)))
  assert (longer["rounds"], longer["tokens"], longer["proposed"]) == (2, 5, 3)
  assert longer["steps"] == pytest.approx(1.95 + 1.5)
