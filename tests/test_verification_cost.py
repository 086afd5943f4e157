"""bench/verification_cost.py: the perfect-draft ceiling from per-call costs, and bad input."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import verification_cost  # noqa: E402


def test_ceiling_is_tokens_per_round_over_the_round_cost_in_steps():
  # Step 100; a 4-token verification 180 (gamma 3), a 6-token one 300 (gamma 5); draft
  # calls 10 (one token) and 15 (two tokens).
  ceiling = verification_cost.perfect_draft_ceiling(
      100.0, {4: 180.0, 6: 300.0}, draft_one_s=10.0, draft_two_s=15.0)
  assert set(ceiling) == {3, 5}
  assert ceiling[3] == pytest.approx(4 * 100 / (180 + 15 + 2 * 10))
  assert ceiling[5] == pytest.approx(6 * 100 / (300 + 15 + 4 * 10))
  # A verification that costs as much as its tokens' steps never pays, whatever the draft.
  assert verification_cost.perfect_draft_ceiling(1.0, {3: 3.0}, 0.1, 0.2)[2] < 1.0


def test_summary_is_median_and_range_over_turns():
  summary = verification_cost.summarise({"a": [3.0, 1.0, 2.0, 10.0, 2.5]})
  assert summary["a"] == {"median_s": 2.5, "range_s": [1.0, 10.0]}


@pytest.mark.parametrize("field,value", [("max_width", 1), ("turns", 0)])
def test_bad_arguments_name_the_value(field, value):
  args = argparse.Namespace(max_width=4, turns=2, target_model="demo_target",
                            draft_model="demo_draft", input_length=8, call_seconds=0.01)
  setattr(args, field, value)
  with pytest.raises(ValueError, match=f"--{field}={value}"):
    verification_cost.run(args)
