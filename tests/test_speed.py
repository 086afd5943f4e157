"""The wall-clock measurement (speed.py): what it returns, what it refuses, its statistics."""

import math
import os
import re
import statistics
import time

import jax
import numpy as np
import pytest

from distillspec_jax.decoding import stats
from distillspec_jax.evaluation.grid_point import GridPoint
from distillspec_jax.evaluation import pinning
from distillspec_jax.evaluation import speed
from distillspec_jax.decoding.plain import SamplingConfig, prompt_inputs
from distillspec_jax.models.model import Model
from distillspec_jax.decoding.speculative import Lenience, speculative_decode


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


@pytest.mark.slow
def test_measure_speed_rows_are_finite_and_match_per_prompt_decoding(pair):
  target, target_params, draft, draft_params = pair
  prompts = _prompts(3)
  plan = speed.TimingPlan(gammas=(2, 3), temperatures=(0.0,), max_new_tokens=8, repeats=2,
                          seed=3, timed_per_turn=1, budget_s=2.0)
  out = speed.measure_speed(target, target_params, {"a": (draft, draft_params)}, prompts,
                            plan, progress=False).to_json()
  # How many calls the budget adds depends on the host's speed (a busy one may give only the
  # minimum); the rule itself is tested on a fake clock below
  # (test_interleaved_times_keep_calling_in_whole_rounds_within_the_budget).
  assert out["protocol"]["budget_s"] == 2.0 and out["protocol"]["timed_per_repeat"] >= 1
  # (T = 1 rows: the main job's smoke test.)
  assert {(r["draft"], r["gamma"], r["temperature"]) for r in out["rows"]} == {
      ("a", 2, 0.0), ("a", 3, 0.0)}
  for row in out["rows"]:
    assert len(row["speedup_repeats"]) == 2
    low, high = row["speedup_range"]
    assert low <= row["speedup"] <= high
    for key in ("speedup", "cost_model_speedup", "tokens_per_s", "plain_tokens_per_s"):
      assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["speedup"] == pytest.approx(statistics.median(row["speedup_repeats"]))
    # The decoding is timed apart from the setup; the whole time adds the setup back.
    assert row["seconds"] > row["setup_s"] > 0
    # Decode phase, end to end and typical, each a median inside its [min, max] over repeats.
    for name in ("speedup", "end_to_end_speedup", "typical_speedup",
                 "typical_end_to_end_speedup"):
      low, high = row[f"{name}_range"]
      assert 0 < low <= row[name] <= high, name
      assert row[f"{name}_spread"] == pytest.approx((high - low) / row[name])
    for name in ("speedup", "end_to_end_speedup"):
      low, high = row[f"{name}_prompt_interval"]
      assert 0 < low <= high
    assert row["speedup_unreliable"] == (
        max(row["speedup_spread"], row["end_to_end_speedup_spread"]) > speed.SPREAD_LIMIT)
    assert row["call_overhead_s"] >= 0
  assert out["machine"]["pinned"] == sorted(os.sched_getaffinity(0))
  assert set(out["per_call_s"]) >= {"target_step", "verification_2", "verification_3",
                                    "a:draft_step_1",
                                    "a:draft_step_2", "stamp"}
  # The whole call holds its windows: what is left is the call's fixed cost, reported apart.
  assert out["plain"]["0.0"]["call_overhead_s"] >= 0
  assert set(out["interference"]) == {"target_step", "verification_3"}
  # Every window's fastest call is near its fastest: some share is quiet, none above 1.
  assert set(out["quiet_timeline"]) == {"plain", "verification_3"}
  for shares in out["quiet_timeline"].values():
    assert len(shares) == min(10, 2 * out["protocol"]["timed_per_repeat"])
    assert max(shares) > 0 and all(0 <= share <= 1 for share in shares)
  assert all(value >= 0 for value in out["interference"].values())
  assert 0 < out["per_call_s"]["stamp"] < out["plain"]["0.0"]["decode_seconds"] / len(prompts)
  # The loop over prompts decodes each prompt alone: its tau at T = 0 is the tau of decoding
  # the prompts one by one, at every gamma (the second gamma's rounds start from the first
  # gamma's compiled start, resized).
  for gamma in (2, 3):
    produced = calls = tokens = 0
    for i in range(len(prompts)):
      result = speculative_decode(target, target_params, draft, draft_params, max_new_tokens=8,
                                  gamma=gamma, sampling=SamplingConfig(0.0),
                                  **prompt_inputs(target, prompts[i:i + 1]))
      produced += int(result.produced[0])
      calls += int(result.target_calls[0])
      tokens += int(result.lengths[0])
    greedy = [r for r in out["rows"] if r["gamma"] == gamma][0]
    assert greedy["timed_tau"] == pytest.approx(produced / calls)
    assert (greedy["rounds"], greedy["tokens"]) == (calls, tokens)


@pytest.mark.slow
def test_a_lenience_grid_is_timed_in_one_measurement_with_lossless_rules_shared(pair):
  target, target_params, draft, draft_params = pair
  prompts = _prompts(2)
  lossy = Lenience("lin", 0.3)
  grid = (Lenience("lin", 1.0), Lenience("sq", 1.0), lossy)
  plan = speed.TimingPlan(gammas=(2,), temperatures=(1.0,), max_new_tokens=8, repeats=2,
                          seed=5, timed_per_turn=1, leniences=grid)
  log = []
  measured = speed.measure_speed(target, target_params, {"a": (draft, draft_params)},
                                 prompts, plan, windows_log=log, progress=False)
  out = measured.to_json()
  assert [(r["lenience"], r["epsilon"]) for r in out["rows"]] == [
      ("lin", 1.0), ("sq", 1.0), ("lin", 0.3)]
  # Every kind at epsilon 1 is the same (lossless) rule: timed once, reported for each.
  timed = {key for key, _, _ in log if key[0] == "a"}
  assert timed == {("a", 2, 1.0, Lenience()), ("a", 2, 1.0, lossy)}
  lin, sq, eps = out["rows"]
  assert {k: v for k, v in lin.items() if k != "lenience"} == {
      k: v for k, v in sq.items() if k != "lenience"}
  # The lossy row is the lossy rule's decoding: prompt i alone with key fold_in(seed, i).
  produced = calls = tokens = 0
  for i in range(len(prompts)):
    result = speculative_decode(target, target_params, draft, draft_params, max_new_tokens=8,
                                gamma=2, sampling=SamplingConfig(1.0), lenience=lossy,
                                rng=jax.random.fold_in(jax.random.PRNGKey(5), i),
                                **prompt_inputs(target, prompts[i:i + 1]))
    produced += int(result.produced[0])
    calls += int(result.target_calls[0])
    tokens += int(result.lengths[0])
  assert (eps["timed_tau"], eps["rounds"], eps["tokens"]) == (
      pytest.approx(produced / calls), calls, tokens)
  # An evaluation row finds its timing by its grid point; the JSON form reads back the same.
  speedups = measured.row("a", GridPoint.of(2, 1.0, lossy)).figures.speedups
  assert speedups.speedup == eps["speedup"] and speedups.speedup_range == eps["speedup_range"]
  assert speed.SpeedMeasurement.from_json(out) == measured
  with pytest.raises(KeyError, match="no row"):
    measured.row("a", GridPoint.of(2, 1.0, Lenience("exp", 0.5)))


@pytest.mark.parametrize("leniences, message", [
    ((), "leniences=() is empty"),
    (("lin",), "leniences has 'lin'"),
    ((Lenience("sq", 0.5),), "Lenience('sq', epsilon=0.5) at temperature 0"),
])
def test_a_timing_plan_refuses_bad_leniences(leniences, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    speed.TimingPlan(gammas=(2,), temperatures=(0.0,), max_new_tokens=4, leniences=leniences)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gammas=()), "gammas=() is empty"),
    (dict(temperatures=()), "temperatures=() is empty"),
    (dict(repeats=0), "repeats"),
    (dict(gammas=(True,)), "bool"),
    (dict(budget_s=-1.0), "budget_s=-1.0"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_a_timing_plan_refuses_bad_grids(kwargs, message):
  arguments = dict(gammas=(2,), temperatures=(0.0,), max_new_tokens=4, repeats=1)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=re.escape(message)):
    speed.TimingPlan(**arguments)


def test_measure_speed_refuses_no_prompts(pair):
  target, target_params, draft, draft_params = pair
  with pytest.raises(ValueError, match="No prompts"):
    speed.measure_speed(target, target_params, {"a": (draft, draft_params)},
                        np.zeros((0, 6), np.int32),
                        speed.TimingPlan(gammas=(2,), temperatures=(0.0,), max_new_tokens=4))


def test_quiet_timeline_shares_of_windows_near_their_fastest():
  # Four calls of two windows: the first two at the floor, the last two twice as slow.
  floor = np.array([1.0, 2.0])
  log = [(("plain", 0.0), c % 2, floor * (1 if c < 2 else 2)) for c in range(4)]
  log.append((("other",), 0, np.array([9.0])))  # other functions' calls are not counted
  assert speed.quiet_timeline(log, ("plain", 0.0), parts=2) == [1.0, 0.0]
  assert speed.quiet_timeline(log, ("plain", 0.0), parts=4) == [1.0, 1.0, 0.0, 0.0]
  # 1.02 x the floor counts as quiet at within=0.03, not at 0.01.
  log[3] = (("plain", 0.0), 1, floor * 1.02)
  assert speed.quiet_timeline(log, ("plain", 0.0), parts=2) == [1.0, 0.5]
  assert speed.quiet_timeline(log, ("plain", 0.0), parts=2, within=0.01) == [1.0, 0.0]
  with pytest.raises(ValueError, match="parts=5"):
    speed.quiet_timeline(log, ("plain", 0.0), parts=5)


def test_ratio_stderr_against_direct_formulas():
  # Equal denominators: the ratio estimate is the mean of the per-item ratios, and its
  # standard error the usual one of a mean.
  values = np.array([2.0, 3.0, 5.0, 4.0])
  expected = np.std(values, ddof=1) / math.sqrt(len(values))
  assert stats.ratio_stderr(values * 3, np.full(4, 3.0)) == pytest.approx(expected)
  # Every item with the same ratio: no uncertainty left.
  assert stats.ratio_stderr([2.0, 4.0, 8.0], [1.0, 2.0, 4.0]) == pytest.approx(0.0)
  assert stats.ratio_stderr([3.0], [1.0]) == 0.0


def _affinity():
  return sorted(os.sched_getaffinity(0))


@pytest.mark.integration
def test_run_pinned_runs_in_a_pinned_child():
  allowed = sorted(os.sched_getaffinity(0))
  assert pinning.run_pinned(1, _affinity) == allowed[-1:]
  assert pinning.run_pinned(0, _affinity) == allowed  # 0: in this process
  with pytest.raises(ValueError, match="cpus="):
    pinning.pin_cores(len(allowed) + 1)


def _read_after_release(folder):
  # Says it reached the gate, waits there, then reads what the parent wrote before releasing.
  open(os.path.join(folder, "ready"), "w").close()
  pinning.wait_for_release()
  with open(os.path.join(folder, "message")) as f:
    return f.read(), sorted(os.sched_getaffinity(0))


@pytest.mark.integration
def test_start_pinned_child_waits_for_release(tmp_path):
  allowed = sorted(os.sched_getaffinity(0))
  with pinning.start_pinned(1, _read_after_release, str(tmp_path)) as run:
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
      assert time.monotonic() < deadline, "the pinned child never started"
      time.sleep(0.05)
    time.sleep(0.5)  # a child that did not wait would read the message now, before it exists
    (tmp_path / "message").write_text("timed alone")
    assert run.result() == ("timed alone", allowed[-1:])
  # cpus=0: in this process, when the result is asked for (nothing waits).
  (tmp_path / "message").write_text("inline")
  assert pinning.start_pinned(0, _read_after_release, str(tmp_path)).result() == (
      "inline", allowed)
  # Leaving the block before result() stops the child instead of waiting for it.
  with pytest.raises(RuntimeError, match="left early"):
    with pinning.start_pinned(1, pinning.wait_for_release):
      raise RuntimeError("left early")


def test_interleaved_times_keep_each_windows_fastest_time_per_repeat(monkeypatch):
  # Scripted calls of "a", each two windows (seconds); the host sees 0.5 s more per call.
  # One untimed call, then repeats * timed_per_turn = 6 cycles; cycle c is repeat c % 2.
  windows = {"a": [(9, 9), (5, 1), (3, 4), (2, 6), (5, 5), (4, 3), (6, 2)],
             "b": [(1,)] * 7}
  order, clock = [], [0.0]

  def timed(name):
    def call():
      order.append(name)
      durations = windows[name][sum(n == name for n in order) - 1]
      clock[0] += sum(durations) + 0.5
      # The clock wraps: the third call of "a" starts a microsecond before the wrap.
      start = (1 << 31) - 1 if len(order) == 5 else 1000
      stamps = start + np.cumsum([0, *durations]) * 1_000_000
      return None, (stamps % (1 << 31)).astype(np.int32)
    return call

  monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
  timed_calls = speed.interleaved_times({"a": timed("a"), "b": timed("b")}, 2,
                                        timed_per_turn=3)
  times, calls, typical, rounds = (timed_calls.windows, timed_calls.calls,
                                   timed_calls.typical, timed_calls.calls_per_repeat)
  assert rounds == 3  # no budget: exactly timed_per_turn calls per repeat
  assert order == ["a", "b"] * 7  # interleaved: every cycle calls each function once
  # Repeat 0 = cycles 0, 2, 4: windows (5, 1), (2, 6), (4, 3) -> 2 + 1, from different calls;
  # repeat 1 = cycles 1, 3, 5: (3, 4), (5, 5), (6, 2) -> 3 + 2.
  assert times["a"] == pytest.approx([3.0, 5.0])
  assert calls["a"] == pytest.approx([6.5, 7.5])  # the fastest whole call, as the host saw it
  assert times["b"] == pytest.approx([1.0, 1.0])
  assert typical["a"] == pytest.approx(7.5)  # the median of the timed calls' sums 6, 7, 8, 10, 7, 8


def test_interleaved_times_keep_calling_in_whole_rounds_within_the_budget(monkeypatch):
  # Each call of "a" advances the fake clock 1 s (one 1-s window), and ever faster windows
  # from the fourth call on. 2 repeats, 1 call each at least, a 5-s budget: a round (2 s)
  # starts only if it would end within 5 s of the first timed cycle: rounds 2 (ends at 4 s)
  # and not 3 (6 s).
  clock, count = [0.0], [0]

  def call():
    count[0] += 1
    clock[0] += 1.0
    window = 1.0 if count[0] < 4 else 1.0 / count[0]
    return None, np.array([0, int(window * 1_000_000)], np.int32)

  monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
  timed_calls = speed.interleaved_times({"a": call}, 2, timed_per_turn=1, budget_s=5.0)
  times, rounds, log = timed_calls.windows, timed_calls.calls_per_repeat, timed_calls.log
  assert count[0] == 1 + 4 and rounds == 2  # one untimed call, then 2 rounds of 2
  # Repeat 0 = calls 2, 4 (windows 1, 1/4); repeat 1 = calls 3, 5 (1, 1/5).
  assert times["a"] == pytest.approx([1 / 4, 1 / 5], abs=1e-5)
  # The log holds every timed call in order; its first calls give the shorter measurement.
  assert [(key, repeat) for key, repeat, _ in log] == [("a", 0), ("a", 1)] * 2
  assert speed.repeat_times(log, 2) == times
  assert speed.repeat_times(log, 2, calls=1)["a"] == pytest.approx([1.0, 1.0], abs=1e-5)
  # With a budget of 6 s the third round fits (ends at 6 s).
  rounds = speed.interleaved_times({"a": call}, 2, timed_per_turn=1,
                                   budget_s=6.0).calls_per_repeat
  assert rounds == 3
  # The minimum rounds run even when the budget is spent.
  rounds = speed.interleaved_times({"a": call}, 2, timed_per_turn=4,
                                   budget_s=1.0).calls_per_repeat
  assert rounds == 4
  for bad in (-1.0, float("nan"), "60"):
    with pytest.raises(ValueError, match="budget_s="):
      speed.interleaved_times({"a": call}, 2, budget_s=bad)


def test_a_key_called_more_often_per_cycle_gets_every_call_in_its_repeat(monkeypatch):
  # "p" (the plain decoding) twice per cycle, "s" once; each call is one window whose length
  # is the call's number (1, 2, 3, ...), except that "p"'s calls get faster as they go.
  monkeypatch.setattr(speed.time, "perf_counter", lambda: 0.0)
  made = []

  def timed(name):
    def call():
      made.append(name)
      seconds = 10.0 / len(made) if name == "p" else float(len(made))
      return None, np.array([0, int(seconds * 1_000_000)], np.int32)
    return call

  order = speed.cycle_order({"p": None, "s": None, "t": None, "u": None}, ["p"], 2)
  assert order == ["p", "s", "p", "t", "u"]  # spread over the cycle: before each half
  timed_calls = speed.interleaved_times({"p": timed("p"), "s": timed("s")}, 2,
                                        timed_per_turn=2, order=["p", "s", "p"])
  times, rounds, log = timed_calls.windows, timed_calls.calls_per_repeat, timed_calls.log
  assert rounds == 2
  # One untimed cycle (calls 1-2; warm-up calls each function once), then 4 cycles of 3.
  assert made == ["p", "s"] + ["p", "s", "p"] * 4
  # Repeat 0 = cycles 0 and 2: "p" calls 3, 5, 9, 11 -> fastest 10 / 11; "s" calls 4, 10.
  assert times["p"] == pytest.approx([10 / 11, 10 / 14], rel=1e-5)
  assert times["s"] == pytest.approx([4.0, 7.0])
  # Counted in cycles: the first cycle of repeat 0 holds "p" calls 3 and 5.
  first = speed.repeat_times(log, 2, calls=1, calls_per_cycle={"p": 2})
  assert first["p"] == pytest.approx([10 / 5, 10 / 8], rel=1e-5)
  assert speed.repeat_times(log, 2, calls=1)["p"] == pytest.approx([10 / 3, 10 / 6], rel=1e-5)
  with pytest.raises(ValueError, match="order must call every function"):
    speed.interleaved_times({"p": timed("p"), "s": timed("s")}, 2, order=["p", "x"])


def test_stamped_scan_times_each_item_in_its_own_window():
  # Items that sleep on the host for 40, 0 and 20 ms: each sleep lands in its own window (a
  # sleep lasts at least its time; work moved across a stamp would leave a window short).
  def sleep(x):
    return jax.pure_callback(lambda v: (time.sleep(float(v) / 1000), v)[1],
                             jax.ShapeDtypeStruct((), np.float32), x)

  run = jax.jit(lambda xs: speed._stamped_scan(lambda n, x: (n + 1, sleep(x)), 0, xs, 3))
  count, results, stamps = run(np.array([40.0, 0.0, 20.0], np.float32))
  assert int(count) == 3  # the state is carried from item to item
  seconds = speed.window_seconds(stamps)
  assert list(np.asarray(results)) == [40.0, 0.0, 20.0]
  assert seconds.shape == (3,)
  assert seconds[0] >= 0.0399 and seconds[2] >= 0.0199


def test_typical_times_fastest_windows_and_the_prompt_bootstrap():
  log = [("a", 0, np.array([1.0, 2.0])), ("a", 1, np.array([3.0, 1.0])),
         ("a", 0, np.array([2.0, 4.0])), ("a", 0, np.array([0.5, 9.0]))]
  # Repeat 0's calls sum to 3, 6 and 9.5: the median call is 6; repeat 1's only call is 4.
  assert speed.repeat_typical_times(log, 2) == {"a": [6.0, 4.0]}
  np.testing.assert_array_equal(speed.prompt_fastest(log)["a"], [0.5, 1.0])
  # Every prompt 2x as fast: every resample reads 2x.
  tokens = np.array([10, 20, 30])
  assert speed.prompt_interval(tokens, [1.0, 2.0, 3.0], tokens, [2.0, 4.0, 6.0]) == [
      pytest.approx(2.0), pytest.approx(2.0)]
  # Prompts that gain differently: the interval spans the pooled figure, reproducibly.
  spec, plain = [1.0, 4.0, 3.0, 1.5], [2.0, 4.0, 9.0, 2.0]
  low, high = speed.prompt_interval([10] * 4, spec, [10] * 4, plain)
  assert low < sum(plain) / sum(spec) < high
  assert speed.prompt_interval([10] * 4, spec, [10] * 4, plain) == [low, high]


def test_compared_speedups_decode_end_to_end_typical_and_the_spread_flag():
  plain = {"decode": [4.0, 4.0], "setup": [2.0, 2.0], "typical_decode": [5.0, 6.0],
           "typical_setup": [3.0, 2.0], "prompt_tokens": np.array([5, 5]),
           "prompt_decode": np.array([2.0, 2.0]), "prompt_setup": np.array([1.0, 1.0])}
  spec = {"decode": [2.0, 2.5], "setup": [2.0, 2.5], "typical_decode": [4.0, 3.0],
          "typical_setup": [2.0, 2.0], "prompt_tokens": np.array([5, 5]),
          "prompt_decode": np.array([1.0, 1.0]), "prompt_setup": np.array([1.0, 1.0])}
  out = speed.compared_speedups(10, spec, 10, plain)
  assert out.speedup_repeats == [2.0, 1.6]
  assert out.speedup_range == [1.6, 2.0] and out.speedup == pytest.approx(1.8)
  assert out.end_to_end_speedup_range == pytest.approx([6 / 5, 6 / 4])
  assert out.typical_speedup_range == pytest.approx([5 / 4, 6 / 3])
  assert out.typical_end_to_end_speedup_range == pytest.approx([8 / 6, 8 / 5])
  assert out.speedup_prompt_interval == [pytest.approx(2.0)] * 2
  assert out.end_to_end_speedup_prompt_interval == [pytest.approx(1.5)] * 2
  assert out.speedup_spread == pytest.approx(0.4 / 1.8) and out.speedup_unreliable
  steady = dict(spec, decode=[2.0, 2.1], setup=[2.0, 2.0])
  assert not speed.compared_speedups(10, steady, 10, plain).speedup_unreliable


@pytest.mark.slow
def test_an_adaptive_draft_length_is_timed_beside_the_fixed_gammas(pair):
  from distillspec_jax.decoding.speculative import DraftLength
  target, target_params, draft, draft_params = pair
  rule = DraftLength("confidence", 0.05)
  plan = speed.TimingPlan(gammas=(3,), temperatures=(0.0,), max_new_tokens=8, repeats=2,
                          timed_per_turn=1, draft_lengths=(DraftLength(), rule))
  out = speed.measure_speed(target, target_params, {"a": (draft, draft_params)}, _prompts(2),
                            plan, progress=False)
  fixed, adaptive = (row.to_json() for row in out.rows)
  assert (fixed["draft_length"], adaptive["draft_length"]) == ("fixed", "confidence")
  assert adaptive["threshold"] == 0.05 and adaptive["cost_model_speedup"] is None
  assert fixed["drafted"] == 3 * fixed["rounds"]
  assert adaptive["rounds"] <= adaptive["drafted"] <= 3 * adaptive["rounds"]
  low, high = adaptive["end_to_end_speedup_range"]
  assert 0 < low <= adaptive["end_to_end_speedup"] <= high
  # The eval binary's row at the fixed rule's point is the fixed rule's.
  assert out.row("a", GridPoint.of(3, 0.0)).figures.speedups.speedup == fixed["speedup"]
  with pytest.raises(ValueError, match="draft_lengths has 'confidence'"):
    speed.TimingPlan(gammas=(3,), temperatures=(0.0,), max_new_tokens=8,
                     draft_lengths=("confidence",))


def test_a_timed_configuration_with_no_verification_round_has_no_tau_or_cost_model(
    monkeypatch):
  """Every timed prompt's first token EOS: no target call, so the cost model predicted 0
  seconds (tokens / 0 raised ZeroDivisionError) and timed_tau read 0.0 (a clamped
  denominator); both are None."""
  from distillspec_jax.decoding.speculative import Lenience
  monkeypatch.setattr(speed, "_decoder_times", lambda *a: {"decode": [1.0], "setup": [0.1]})
  monkeypatch.setattr(speed, "compared_speedups", lambda *a: None)
  monkeypatch.setattr(speed, "_call_overhead", lambda *a: 0.0)
  zero = [0, 0]
  key = speed.speculative_key("d", 3, 0.0, Lenience())
  runs = {key: {"lengths": [1, 1], "target_calls": zero, "produced": zero, "drafted": zero,
                "draft_calls": zero}}
  timing = {"windows": {("setup_speculative", 0.0, "d"): [0.1]}}
  cost = {"d:draft_step_1": 1e-3, "d:draft_step_2": 1e-3, "verification_3": 2e-3}
  plain = speed.PlainSpeed(
      tokens=2, seconds=1.0, seconds_range=[1.0, 1.0], decode_seconds=1.0,
      typical_decode_seconds=1.0, tokens_per_s=2.0, setup_s=0.1,
      cost_model_decode_seconds=1e-3, call_overhead_s=0.0)
  [row] = speed._speculative_rows(runs, timing, cost, {None: ["d"]}, 0.0, plain, gammas=(3,),
                                  leniences=(Lenience(),))
  assert row.figures.timed_tau is None and row.rounds == 0
  assert row.figures.cost_model_speedup is None
  assert row.figures.cost_model_end_to_end_speedup is None
