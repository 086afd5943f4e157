"""bench/timing_budget.py's recomputation: each row's speedups from each repeat's first k
calls of a recorded measurement, and the spreads and deviations it prints."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import timing_budget  # noqa: E402

from distillspec_jax.decoding.speculative import Lenience  # noqa: E402


def test_speedups_and_summary_from_each_repeats_first_calls():
  # Two repeats, three rounds. Plain decoding: two windows, 2 s each at best. The draft's
  # decoding: 1 s per window at best, but repeat 1 meets it only on its third call.
  plain = [np.array([2.0, 2.0])] * 6
  spec = [np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([1.5, 1.0]),
          np.array([1.5, 1.5]), np.array([1.2, 1.0]), np.array([1.0, 1.0])]
  log = []
  for cycle in range(6):
    repeat = cycle % 2
    log.append((("plain", 0.0), repeat, plain[cycle]))
    log.append((("a", 3, 0.0, Lenience()), repeat, spec[cycle]))
  result = {"protocol": {"repeats": 2, "timed_per_repeat": 3, "plain_calls_per_cycle": 1},
            "rows": [{"draft": "a", "gamma": 3, "temperature": 0.0, "lenience": "lin",
                       "epsilon": 1.0, "tokens": 10}],
            "plain": {"0.0": {"tokens": 10}}}
  # Equal tokens: a repeat's speedup is plain time / speculative time.
  assert timing_budget.speedups(log, result, 1)[("a", 3, 0.0)] == pytest.approx([2.0, 1.0])
  assert timing_budget.speedups(log, result, 3)[("a", 3, 0.0)] == pytest.approx([2.0, 2.0])
  one, three = timing_budget.summarise(log, result, [1, 3])
  assert one["max_spread"] == pytest.approx(1.0 / 1.5)  # (2 - 1) / median 1.5
  assert one["rows_spread_over_10_percent"] == 1
  assert one["max_deviation_from_all_calls"] == pytest.approx(0.25)  # 1.5 against 2
  assert three["max_spread"] == 0 and three["max_deviation_from_all_calls"] == 0
  assert three["speedups"] == {"a/gamma3/T0": pytest.approx(2.0)}


def test_pooled_speedups_reach_windows_no_single_repeat_reached():
  floor = np.array([1.0, 2.0])
  log = [(("plain", 0.0), c % 2, floor * (1 if c < 2 else 2)) for c in range(4)]
  # The draft's fastest first window is in repeat 0, its fastest second one in repeat 1:
  # only all calls together reach both.
  spec = [np.array([2.0, 2.0]), np.array([3.0, 1.0]), np.array([1.0, 3.0]),
          np.array([2.0, 1.0])]
  log += [(("a", 3, 0.0, Lenience()), c % 2, spec[c]) for c in range(4)]
  result = {"protocol": {"repeats": 2, "timed_per_repeat": 2, "plain_calls_per_cycle": 1},
            "rows": [{"draft": "a", "gamma": 3, "temperature": 0.0, "lenience": "lin",
                      "epsilon": 1.0, "tokens": 10}],
            "plain": {"0.0": {"tokens": 10}}}
  assert timing_budget.speedups(log, result, 2)[("a", 3, 0.0)] == pytest.approx([1.0, 1.0])
  assert timing_budget.pooled_speedups(log, result) == {("a", 3, 0.0): pytest.approx(1.5)}


def test_one_plain_call_per_cycle_keeps_the_first_of_each_cycles_plain_calls():
  # Two repeats, plain decoding 2 calls per cycle: cycle c's plain calls are 2c and 2c + 1.
  log = []
  for cycle in range(4):
    repeat = cycle % 2
    log += [(("plain", 0.0), repeat, np.array([10.0 + 2 * cycle])),
            (("a", 3, 0.0, Lenience()), repeat, np.array([1.0])),
            (("plain", 0.0), repeat, np.array([11.0 + 2 * cycle]))]
  kept = timing_budget.one_plain_call_per_cycle(
      log, {"protocol": {"plain_calls_per_cycle": 2}})
  assert [float(w[0]) for k, _, w in kept if k[0] == "plain"] == [10.0, 12.0, 14.0, 16.0]
  assert sum(k[0] == "a" for k, _, _ in kept) == 4
  counts = timing_budget.spread_counts({"x": [1.0, 1.05, 1.2], "y": [1.0, 1.0, 1.0]})
  assert counts["rows_spread_within_10_percent"] == 1
  assert counts["median_spread"] == pytest.approx((0.2 / 1.05) / 2)
