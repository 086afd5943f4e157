"""The wall-clock measurement (speed.py): what it returns, what it refuses, its statistics."""

import math
import os
import re
import statistics

import jax
import numpy as np
import pytest

from distillspec_jax import evaluation, speed
from distillspec_jax.decoding import SamplingConfig, prompt_inputs
from distillspec_jax.models import Model
from distillspec_jax.speculative import speculative_decode

pytestmark = pytest.mark.usefixtures("fast_compilation")  # conftest.py


@pytest.fixture(scope="module")
def pair():
  target = Model.from_name("tiny_encoder_decoder", max_decode_length=32)
  draft = Model.from_name("tiny_encoder_decoder", max_decode_length=32, num_decoder_layers=1,
                          num_encoder_layers=1)
  return (target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1)))


def _prompts(count, vocab=512, length=6, seed=0):
  rng = np.random.default_rng(seed)
  prompts = rng.integers(3, vocab, size=(count, length)).astype(np.int32)
  prompts[0, 4:] = 0  # one shorter prompt (right padding)
  return prompts


def test_measure_speed_rows_are_finite_and_match_per_prompt_decoding(pair):
  target, target_params, draft, draft_params = pair
  prompts = _prompts(3)
  out = speed.measure_speed(target, target_params, {"a": (draft, draft_params)}, prompts,
                            gammas=(2,), temperatures=(0.0,), max_new_tokens=8,
                            repeats=2, seed=3, progress=False)
  # (T = 1 rows: the main job's smoke test.)
  assert {(r["draft"], r["gamma"], r["temperature"]) for r in out["rows"]} == {("a", 2, 0.0)}
  for row in out["rows"]:
    assert len(row["speedup_repeats"]) == 2
    low, high = row["speedup_range"]
    assert low <= row["speedup"] <= high
    for key in ("speedup", "cost_model_speedup", "tokens_per_s", "plain_tokens_per_s"):
      assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["speedup"] == pytest.approx(statistics.median(row["speedup_repeats"]))
    # The decoding is timed apart from the setup; the whole time adds the setup back.
    assert row["seconds"] > row["setup_s"] > 0
  assert out["machine"]["pinned"] == sorted(os.sched_getaffinity(0))
  assert set(out["per_call_s"]) >= {"target_step", "verification_2", "a:draft_step_1",
                                    "a:draft_step_2"}
  # The loop over prompts decodes each prompt alone: its tau at T = 0 is the tau of decoding
  # the prompts one by one.
  produced = calls = 0
  for i in range(len(prompts)):
    result = speculative_decode(target, target_params, draft, draft_params, max_new_tokens=8,
                                gamma=2, sampling=SamplingConfig(0.0),
                                **prompt_inputs(target, prompts[i:i + 1]))
    produced += int(result.produced[0])
    calls += int(result.target_calls[0])
  greedy = [r for r in out["rows"] if r["temperature"] == 0.0][0]
  assert greedy["tau"] == pytest.approx(produced / calls)
  assert greedy["rounds"] == calls


@pytest.mark.parametrize("kwargs, message", [
    (dict(gammas=()), "gammas=() is empty"),
    (dict(temperatures=()), "temperatures=() is empty"),
    (dict(repeats=0), "repeats"),
    (dict(gammas=(True,)), "bool"),
])
def test_measure_speed_refuses_bad_grids(pair, kwargs, message):
  target, target_params, draft, draft_params = pair
  arguments = dict(gammas=(2,), temperatures=(0.0,), max_new_tokens=4, repeats=1)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=re.escape(message)):
    speed.measure_speed(target, target_params, {"a": (draft, draft_params)}, _prompts(2),
                        **arguments)


def test_measure_speed_refuses_no_prompts(pair):
  target, target_params, draft, draft_params = pair
  with pytest.raises(ValueError, match="No prompts"):
    speed.measure_speed(target, target_params, {"a": (draft, draft_params)},
                        np.zeros((0, 6), np.int32), gammas=(2,), temperatures=(0.0,),
                        max_new_tokens=4)


def test_ratio_stderr_against_direct_formulas():
  # Equal denominators: the ratio estimate is the mean of the per-item ratios, and its
  # standard error the usual one of a mean.
  values = np.array([2.0, 3.0, 5.0, 4.0])
  expected = np.std(values, ddof=1) / math.sqrt(len(values))
  assert evaluation.ratio_stderr(values * 3, np.full(4, 3.0)) == pytest.approx(expected)
  # Every item with the same ratio: no uncertainty left.
  assert evaluation.ratio_stderr([2.0, 4.0, 8.0], [1.0, 2.0, 4.0]) == pytest.approx(0.0)
  assert evaluation.ratio_stderr([3.0], [1.0]) == 0.0


def _affinity():
  return sorted(os.sched_getaffinity(0))


def test_run_pinned_runs_in_a_pinned_child():
  allowed = sorted(os.sched_getaffinity(0))
  assert speed.run_pinned(1, _affinity) == allowed[-1:]
  assert speed.run_pinned(0, _affinity) == allowed  # 0: in this process
  with pytest.raises(ValueError, match="cpus="):
    speed.pin_cores(len(allowed) + 1)



def test_interleaved_times_keep_each_repeats_fastest_call_from_cycles_spread_over_the_run(
    monkeypatch):
  # A scripted clock: every timed call of "a" lasts 5 s except the ones listed; "b" lasts 1 s.
  # One untimed cycle, then repeats * timed_per_turn = 6 cycles; cycle c is repeat c % 2.
  durations = {"a": [9.0, 5.0, 3.0, 5.0, 5.0, 2.0, 4.0], "b": [1.0] * 7}
  order, clock = [], [0.0]

  def timed(name):
    def call():
      order.append(name)
      clock[0] += durations[name][sum(n == name for n in order) - 1]
      return np.zeros(())
    return call

  monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
  times = speed.interleaved_times({"a": timed("a"), "b": timed("b")}, 2, timed_per_turn=3)
  assert order == ["a", "b"] * 7  # interleaved: every cycle calls each function once
  # Timed calls of "a": cycle 0..5 -> 5, 3, 5, 5, 2, 4; repeat 0 = cycles 0, 2, 4; 1 = 1, 3, 5.
  assert times["a"] == [2.0, 3.0]
  assert times["b"] == [1.0, 1.0]
