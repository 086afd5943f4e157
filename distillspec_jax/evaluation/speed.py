"""Wall-clock speed of speculative decoding against plain target decoding.

One measurement protocol, used by the main job's evaluation and by `bench/`:

- Batch 1, as in the paper: every prompt is decoded alone. All prompts of one measurement run
  in one compiled device loop over the prompts, so dispatch and the call's fixed costs are
  paid once per measurement; they are reported apart (`call_overhead_s`). Each decoder is two
  such loops: the setup (every prompt's encoders and prefill, timed and reported as
  `setup_s`) and the decoding from the setup's states, made once and passed in; `speedup`
  compares the decoding loops, `end_to_end_speedup` adds the setup back.
- One window per prompt: the loop reads the host clock between prompts (`_stamped_scan`), so
  a call of N prompts gives N windows of a few milliseconds each.
- Compiled once, timed warm, interleaved: after one untimed call of every function, timed
  cycles each call every function once (plain decoding `plain_calls_per_cycle` times, spread
  over the cycle, since it is the denominator of every row; every speculative configuration
  (draft, gamma, temperature and lenience: a lossy trade-off is timed in the same cycles);
  both setups; every per-call cost), `repeats * timed_per_turn` cycles in all; cycle c
  belongs to repeat c % repeats. A repeat's time of a function is the sum over its windows
  of each window's fastest time among the repeat's calls. Interference only ever adds time:
  on the shared 2-core VMs this project runs on, other tenants slow a pinned core by
  10-200% in bursts of milliseconds and in slow periods of seconds, compute-bound calls (a
  verification) more than memory-bound ones (a step) (docs/speed.md). A window of one
  prompt is far more often free of it than a call of all prompts, and the fastest of a
  window's times spread over the measurement is the machine's own cost.
- The speedup of a repeat is the ratio of tokens per second against plain decoding in the
  same repeat (fair at T > 0, where the two decoders' samples differ in length); we report
  its median, [min, max] and spread over repeats, for the decoding phase (`speedup`), end
  to end (`end_to_end_speedup`, the setup added back), and both again from each repeat's
  median call instead of its fastest windows (`typical_speedup`,
  `typical_end_to_end_speedup`); a bootstrap over the prompts gives each figure's
  prompt-level interval; a row whose decode or end-to-end spread exceeds SPREAD_LIMIT (10%)
  is flagged `speedup_unreliable` (`compared_speedups`, a `Speedups` record).
- The cost-model speedup predicts both times from per-call costs measured in the same cycles
  and windows: plain = (tokens - 1) target steps per prompt (exactly the calls plain
  decoding makes after its setup); speculative = per round one first draft call (2 tokens
  for a draft model; gamma + 1 positions for a draft head, which rewrites the accepted
  positions with the target's features) and gamma - 1 one-token draft calls and one
  (gamma + 1)-token verification. Model
  calls are timed in jitted loops fed the previous call's outputs (see `_repeated_extend`).
- Reported apart: `plain[T].call_overhead_s`, the fastest whole call less its windows
  (dispatch and the call's own fixed work: paid once per call of N prompts, outside every
  window); `per_call_s["stamp"]`, the clock read each window holds (a loop over the prompts
  that does nothing; it is in both decoders' windows, once per prompt); `interference`, how
  much slower a typical call was than its fastest windows (median over all timed calls / the
  cost, less 1): the host's contention during the measurement; `quiet_timeline`, {"plain"
  (the first temperature's plain decoding), "verification_<max gamma>"}: `quiet_timeline` of
  each over (at most) ten tenths of the timing.
- Pinning (`pinning.py`): the process is restricted to some cores before JAX creates its
  thread pools, or the measurement runs in a fresh process pinned that way (the training
  stages of the main job keep every core).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from distillspec_jax.core.records import JsonRecord, flattened
from distillspec_jax.core.validation import check_budget, check_grid, check_positive_int
from distillspec_jax.decoding.plain import (SamplingConfig, cache_capacity, decode_start, decode_steps, prompt_inputs)
from distillspec_jax.models.head import Head
from distillspec_jax.models.model import Model
from distillspec_jax.evaluation.grid_point import GridPoint
from distillspec_jax.evaluation.pinning import machine_info
from distillspec_jax.decoding.speculative import (DraftLength, Lenience, speculative_rounds,
                                                  speculative_start, start_state_for_gamma)


_CLOCK_ORIGIN_NS = time.perf_counter_ns()
_CLOCK_WRAP = 1 << 31


def _clock_us(dependency) -> np.ndarray:
  del dependency
  return np.int32(((time.perf_counter_ns() - _CLOCK_ORIGIN_NS) // 1000) % _CLOCK_WRAP)


def _stamp(dependency):
  """The host clock (int32 microseconds, wrapping every 35 minutes) read once `dependency`
  (a scalar) is computed."""
  return io_callback(_clock_us, jax.ShapeDtypeStruct((), jnp.int32), dependency)


def _done(result) -> jax.Array:
  """A float32 scalar that exists only once every leaf of `result` is computed."""
  return sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in jax.tree.leaves(result))


def _stamped_scan(step: Callable, init, xs, length: int):
  """lax.scan of `step(state, x) -> (state, result)` over `xs` (leading axis `length`; None
  for no inputs) that reads the host clock between items: returns (final state, results,
  stamps [length + 1]); window i = stamps[i + 1] - stamps[i] is item i's time.

  The barrier makes each item's work wait for its start stamp, and each stamp takes the
  previous item's state and result as an argument, so no work moves across a stamp. A window
  holds its item's work and one clock read (`measure_speed`'s `per_call_s["stamp"]`).
  """
  def body(carry, x):
    state, previous = carry
    start = _stamp(previous)
    start, state, x = jax.lax.optimization_barrier((start, state, x))
    state, result = step(state, x)
    return (state, _done((state, result))), (result, start)

  (state, last), (results, starts) = jax.lax.scan(body, (init, jnp.float32(0)), xs,
                                                  length=length)
  return state, results, jnp.concatenate([starts, _stamp(last)[None]])


def window_seconds(stamps) -> np.ndarray:
  """Seconds of each window between consecutive `stamps` (from `_stamped_scan`)."""
  return np.diff(np.asarray(stamps, np.int64)) % _CLOCK_WRAP * 1e-6


def repeat_times(windows_log: Sequence[tuple], repeats: int,
                 calls: Optional[int] = None,
                 calls_per_cycle: Optional[Mapping[object, int]] = None) -> dict:
  """key -> [repeat r's time]: the sum over a function's windows of each window's fastest
  time among repeat r's timed calls of its first `calls` cycles (None: all), from
  `windows_log` entries (key, repeat, window seconds [W]) in the order they were timed.
  `calls_per_cycle`: key -> its calls per cycle where that is not 1 (`interleaved_times`'s
  `order`)."""
  calls_per_cycle = calls_per_cycle or {}
  best, seen = {}, {}
  for key, repeat, windows in windows_log:
    count = seen.setdefault(key, [0] * repeats)
    if calls is not None and count[repeat] >= calls * calls_per_cycle.get(key, 1):
      continue
    count[repeat] += 1
    per_repeat = best.setdefault(key, [None] * repeats)
    previous = per_repeat[repeat]
    per_repeat[repeat] = windows if previous is None else np.minimum(previous, windows)
  return {key: [float(np.sum(w)) for w in per_repeat] for key, per_repeat in best.items()}


def repeat_typical_times(windows_log: Sequence[tuple], repeats: int) -> dict:
  """key -> [repeat r's typical time]: the median over repeat r's timed calls of a call's
  windows' sum (what a call costs on the host as it was, where `repeat_times` takes each
  window's fastest), from `windows_log` entries (key, repeat, window seconds [W])."""
  sums = {}
  for key, repeat, windows in windows_log:
    sums.setdefault(key, [[] for _ in range(repeats)])[repeat].append(float(np.sum(windows)))
  return {key: [statistics.median(calls) if calls else math.nan for calls in per_repeat]
          for key, per_repeat in sums.items()}


def prompt_fastest(windows_log: Sequence[tuple]) -> dict:
  """key -> [W]: each window's (prompt's) fastest time over every timed call of the key."""
  fastest = {}
  for key, _, windows in windows_log:
    fastest[key] = windows if key not in fastest else np.minimum(fastest[key], windows)
  return fastest


def prompt_interval(tokens, seconds, plain_tokens, plain_seconds, *, resamples: int = 2000,
                    level: float = 0.95, seed: int = 0) -> list:
  """[low, high]: the central `level` interval of the speedup (sum tokens / sum seconds over
  plain's) over bootstrap resamples of the prompts, each resample taking the same prompts
  for both decoders. Arguments are per prompt, [N] each. It says how much the figure owes
  to which prompts were timed; the range over repeats says how much it owes to the host."""
  arrays = [np.asarray(a, np.float64) for a in (tokens, seconds, plain_tokens, plain_seconds)]
  count = len(arrays[0])
  picks = np.random.default_rng(seed).integers(0, count, (resamples, count))
  spec_rate, plain_rate = (arrays[i][picks].sum(1) / arrays[i + 1][picks].sum(1)
                           for i in (0, 2))
  low, high = np.quantile(spec_rate / plain_rate, [(1 - level) / 2, (1 + level) / 2])
  return [float(low), float(high)]


def quiet_timeline(windows_log: Sequence[tuple], key, parts: int = 10,
                   within: float = 0.03) -> list:
  """When the host was quiet for function `key`: in each of `parts` consecutive groups of its
  timed calls in `windows_log` (entries (key, repeat, window seconds [W])), the share of
  (call, window) pairs within `within` of that window's fastest time over all calls. The
  repeats' minima come from these moments; on a shared host they come in stretches of tens
  of seconds between minutes of contention (docs/speed.md)."""
  windows = np.array([w for k, _, w in windows_log if k == key])
  check_positive_int(parts, "parts")
  if len(windows) < parts:
    raise ValueError(f"{key} has {len(windows)} timed calls; a timeline of parts={parts} "
                     "needs at least as many.")
  near = windows <= (1 + within) * windows.min(axis=0)
  return [float(group.mean()) for group in np.array_split(near, parts)]


@dataclasses.dataclass(frozen=True)
class InterleavedTimes:
  """`interleaved_times`' result, key -> per function.

  Attributes:
    windows: key -> [repeat r's time]: the sum over the function's W windows of each
      window's fastest time among repeat r's calls.
    calls: key -> [repeat r's fastest whole call], as the host saw it (dispatch and the
      call's fixed costs included).
    typical: key -> the median over all timed calls of a call's windows' sum (what a single
      call costs on the host as it was).
    calls_per_repeat: how many cycles each repeat got (a key `order` holds k times got k
      calls in each).
    log: (key, repeat, window seconds [W]) of every timed call, in order.
  """

  windows: dict
  calls: dict
  typical: dict
  calls_per_repeat: int
  log: list


def interleaved_times(functions: Mapping[object, Callable], repeats: int,
                      timed_per_turn: int = 5, progress: Optional[Callable] = None,
                      budget_s: float = 0.0,
                      order: Optional[Sequence] = None) -> InterleavedTimes:
  """The InterleavedTimes of `functions` (key -> callable returning (result, stamps
  [W + 1]), e.g. a `_stamped_scan` over W prompts).

  After one untimed cycle (compiled code and weights warm), timed cycles each call the
  functions in `order` (below; default every function once); cycle c belongs to repeat
  c % repeats, so every repeat's calls are
  spread over the whole measurement. Cycles run in rounds of `repeats` (one more call for
  every repeat): at least `timed_per_turn` rounds, then more while, at the pace so far, the
  next round would end within `budget_s` seconds of the first timed cycle (0: exactly
  `timed_per_turn`). Why the
  fastest, and why per window: on a shared VM the host's interference comes and goes within
  milliseconds and in slow periods of seconds to minutes; it only ever adds time, and a
  window of a few milliseconds (one prompt) is far more often free of it than a call of a
  hundred, and more calls make it likelier that every window met a quiet moment
  (docs/speed.md). `progress(seconds since the first timed cycle)` is called after each
  cycle. The result's `log` holds every timed call's windows (`repeat_times` turns it into
  `windows`, also for fewer calls). `order`: the keys one
  cycle calls, in order (default: each function once); a key may come more than once, and
  every call of it counts toward its repeat's fastest windows.
  """
  check_positive_int(timed_per_turn, "timed_per_turn")
  check_budget(budget_s)
  order = list(functions) if order is None else list(order)
  if set(order) != set(functions):
    raise ValueError(f"order must call every function: it misses "
                     f"{sorted(map(str, set(functions) - set(order)))} and has unknown "
                     f"{sorted(map(str, set(order) - set(functions)))}.")
  for fn in functions.values():
    jax.block_until_ready(fn())
  log = []
  calls = {key: [math.inf] * repeats for key in functions}
  first = time.perf_counter()
  rounds = 0
  # After the minimum, a round starts only if it should end within the budget at the pace
  # so far: the timing never runs a round past `budget_s` (the main job plans on it).
  while rounds < timed_per_turn or budget_s > 0 and (
      (time.perf_counter() - first) * (rounds + 1) / rounds <= budget_s):
    for repeat in range(repeats):
      for key in order:
        start = time.perf_counter()
        _, stamps = jax.block_until_ready(functions[key]())
        calls[key][repeat] = min(calls[key][repeat], time.perf_counter() - start)
        log.append((key, repeat, window_seconds(stamps)))
      if progress is not None:
        progress(time.perf_counter() - first)
    rounds += 1
  typical = {key: statistics.median(float(np.sum(w)) for k, _, w in log if k == key)
             for key in functions}
  return InterleavedTimes(repeat_times(log, repeats), calls, typical, rounds, log)


def cycle_order(functions: Mapping, often: Sequence, times: int) -> list:
  """The keys of one timing cycle: every key of `functions` once, except the keys in `often`,
  which come `times` times each, before each of `times` equal parts of the others (so their
  calls are spread evenly over the cycle)."""
  others = [key for key in functions if key not in often]
  order = []
  for part in range(times):
    order += list(often) + others[part * len(others) // times:(part + 1) * len(others) // times]
  return order


@functools.partial(jax.jit, static_argnames=("model", "width", "steps", "windows"))
def _repeated_extend(model, params, cache, tokens, passes, *, width, steps, windows):
  """`windows` x `passes` x `steps` calls of `model.extend` on `width` tokens per row, each
  pass filling the cache from its start, each window of `passes` passes timed apart. Returns
  (the last call's tokens [batch, width], stamps [windows + 1]).

  Each call is fed the argmax of the previous call's logits, as in decoding: with inputs that
  do not depend on the previous call XLA hoists the embedding lookup and the first layer's
  projections out of the loop, and with only part of the logits used it drops the rest as
  dead code; either way a call would be timed cheaper than it is.
  """
  start_positions = cache.positions

  def one_pass(pass_index, carry):
    def body(step, carry):
      cache, tokens = carry
      logits, cache = model.extend(params, cache, tokens)
      return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    cache, tokens = carry
    return jax.lax.fori_loop(0, steps, body, (cache.replace(positions=start_positions), tokens))

  window = lambda carry, _: (jax.lax.fori_loop(0, passes, one_pass, carry), None)
  (_, tokens), _, stamps = _stamped_scan(window, (cache, tokens), None, windows)
  return tokens, stamps


@functools.partial(jax.jit, static_argnames=("model", "batch", "capacity"))
def _empty_cache(model, params, batch, capacity, encoder_inputs):
  # One program: run eagerly, the encoder compiles each of its operations on its own.
  return model.init_cache(params, batch, capacity, encoder_inputs)


def per_call_function(model: Model, params, inputs: dict, batch: int, width: int,
                      duration: float, capacity: Optional[int] = None, windows: int = 4):
  """(callable making `calls` extends of `width` tokens per row, returning (tokens, stamps)
  with `windows` windows, calls), for per-call costs.

  The callable runs about `duration` seconds; a window is a whole number of passes over the
  cache (at least one). `capacity`: cache slots (default the model's max_decode_length); one
  pass fills them.
  """
  encoder_inputs = inputs.get("encoder_input_tokens")
  capacity = capacity or model.config.max_decode_length
  steps = max(1, capacity // width)
  cache = _empty_cache(model, params, batch, capacity, encoder_inputs)
  tokens = jnp.full((batch, width), 5, jnp.int32)
  run = functools.partial(_repeated_extend, model, params, cache, tokens, width=width,
                          steps=steps, windows=windows)
  return _calibrated(run, steps * windows, duration)


def _calibrated(run: Callable, calls_per_pass: int, duration: float) -> tuple:
  """(run with the passes that make it last about `duration` seconds, model calls it makes):
  `run(passes)` is compiled first (passes is traced, so once)."""
  jax.block_until_ready(run(1))
  start = time.perf_counter()
  jax.block_until_ready(run(1))
  passes = max(1, round(duration / (time.perf_counter() - start)))
  return functools.partial(run, passes), calls_per_pass * passes


@functools.partial(jax.jit, static_argnames=("head", "width", "steps", "windows",
                                             "from_target"))
def _repeated_head_extend(head, params, cache, tokens, inputs, passes, *, width, steps,
                          windows, from_target):
  """`_repeated_extend` for a draft head (models/head.py): calls of `head.extend` on `width`
  positions per row, each fed the argmax of the previous call's logits and its own output as
  the next call's input (tiled over the feature layers where the call reads target features
  [batch, width, n * embed]), so nothing is hoisted out of the loop."""
  start_positions = cache.positions
  layers = inputs.shape[-1] // head.config.width

  def one_pass(pass_index, carry):
    def body(step, carry):
      cache, tokens, inputs = carry
      logits, out, cache = head.extend(params, cache, tokens, inputs, from_target=from_target)
      tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return cache, tokens, jnp.tile(out, (1, 1, layers)).astype(inputs.dtype)

    cache, tokens, inputs = carry
    return jax.lax.fori_loop(0, steps, body,
                             (cache.replace(positions=start_positions), tokens, inputs))

  window = lambda carry, _: (jax.lax.fori_loop(0, passes, one_pass, carry), None)
  (_, tokens, _), _, stamps = _stamped_scan(window, (cache, tokens, inputs), None, windows)
  return tokens, stamps


@functools.partial(jax.jit, static_argnames=("target", "head", "batch", "capacity"))
def _empty_head_cache(target, target_params, head, params, batch, capacity, encoder_inputs):
  encoded = mask = None
  if head.is_encoder_decoder:
    encoded, mask = target.encode(target_params, encoder_inputs), encoder_inputs > 0
  return head.init_cache(params, batch, capacity, encoded, mask)


def head_call_function(target: Model, target_params, head: Head, params, inputs: dict,
                       width: int, duration: float, capacity: Optional[int] = None,
                       windows: int = 4):
  """`per_call_function` of a draft head at batch 1: calls of `width` positions, reading the
  target's features (`width` > 1: a round's first call, which writes the accepted positions
  and drafts the first token) or its own output (`width` 1: every later draft step)."""
  capacity = capacity or target.config.max_decode_length
  steps = max(1, capacity // width)
  cache = _empty_head_cache(target, target_params, head, params, 1, capacity,
                            inputs.get("encoder_input_tokens"))
  tokens = jnp.full((1, width), 5, jnp.int32)
  from_target = width > 1
  features = head.config.width * (len(head.feature_layers) if from_target else 1)
  inputs = jnp.full((1, width, features), 0.1, head.config.layer_config.activation_dtype)
  run = functools.partial(_repeated_head_extend, head, params, cache, tokens, inputs,
                          width=width, steps=steps, windows=windows, from_target=from_target)
  return _calibrated(run, steps * windows, duration)


def first_call_width(draft, gamma: int) -> int:
  """Positions of a round's first draft call: 2 for a draft model ([previous, pending]),
  gamma + 1 for a head (the accepted positions rewritten with the target's features, in one
  fixed-width call; decoding/head_draft.py)."""
  return gamma + 1 if isinstance(draft, Head) else 2


def _map_prompts(run_one: Callable) -> Callable:
  """jit(params, per-prompt inputs (leading axis N), rng) -> (per-prompt results, stamps
  [N + 1]), each prompt alone (batch 1) in one `_stamped_scan`; prompt i uses
  fold_in(rng, i)."""

  def run(model_params, inputs, rng):
    count = jax.tree.leaves(inputs)[0].shape[0]
    one = lambda state, args: (state, run_one(model_params, args[1],
                                              jax.random.fold_in(rng, args[0])))
    _, results, stamps = _stamped_scan(one, None, (jnp.arange(count), inputs), count)
    return results, stamps

  return jax.jit(run)


def _plain_decoder(target: Model, max_new_tokens: int, sampling: SamplingConfig):
  """(start, steps): start(params, prompts [N, P], rng) -> per-prompt states after the
  encoder and the prefill; steps(params, states, rng) -> {"lengths": [N]} from them. Both
  decode each prompt alone; together they are `decoding.decode` of each prompt."""
  capacity = cache_capacity(target, None)

  def start_one(params, prompt, rng):
    del rng
    return decode_start(target, params["target"], max_length=capacity,
                        **prompt_inputs(target, prompt[None]))

  def steps_one(params, state, rng):
    logits, cache = state
    result = decode_steps(target, params["target"], logits, cache, rng,
                          max_new_tokens=max_new_tokens, sampling=sampling)
    return {"lengths": result.lengths[0]}

  return _map_prompts(start_one), _map_prompts(steps_one)


def _speculative_decoder(target: Model, draft: Model, max_new_tokens: int, gamma: int,
                         sampling: SamplingConfig, lenience: Lenience,
                         draft_length: DraftLength = DraftLength()):
  """(start, rounds) of speculative decoding, as `_plain_decoder`'s (start, steps)."""
  capacity = cache_capacity(target, None)

  def start_one(params, prompt, rng):
    inputs = prompt_inputs(target, prompt[None])
    return speculative_start(target, params["target"], draft, params["draft"],
                             inputs.get("encoder_input_tokens"), inputs.get("prompt_tokens"),
                             rng, max_new_tokens=max_new_tokens, gamma=gamma,
                             sampling=sampling, max_length=capacity)

  def rounds_one(params, state, rng):
    del rng  # the state holds the prompt's key
    result = speculative_rounds(target, params["target"], draft, params["draft"], state,
                                max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                                lenience=lenience, draft_length=draft_length)
    return {"lengths": result.lengths[0], "target_calls": result.target_calls[0],
            "produced": result.produced[0], "drafted": result.drafted[0],
            "draft_calls": result.draft_calls[0]}

  return _map_prompts(start_one), _map_prompts(rounds_one)


def paired_speedups(tokens: int, seconds: Sequence[float], plain_tokens: int,
                    plain_seconds: Sequence[float]) -> list:
  """Each repeat's speedup: its tokens per second over plain decoding's in the same repeat."""
  return [(tokens / s) / (plain_tokens / p) for s, p in zip(seconds, plain_seconds)]


def _spread(values: Sequence[float]) -> float:
  """(max - min) / median."""
  return (max(values) - min(values)) / statistics.median(values)


# A speed row whose decode-phase or end-to-end spread over repeats exceeds this is flagged
# `speedup_unreliable`: its repeats disagree by more than the differences the rows are read for.
SPREAD_LIMIT = 0.10


@dataclasses.dataclass(frozen=True)
class Speedups(JsonRecord):
  """One speculative configuration's speedups over plain decoding (`compared_speedups`).

  Each figure is the median over repeats of the repeat's tokens per second over plain
  decoding's, with its [min, max] (`_range`) and (max - min) / median (`_spread`):
    speedup: the decoding phase (each prompt's fastest window among a repeat's calls).
    end_to_end_speedup: the setup (encoders, prefill) added back: what a request sees.
    typical_speedup / typical_end_to_end_speedup: the same two from each repeat's median
      call instead of its fastest windows (the host as it was).
    speedup_repeats: each repeat's decoding-phase speedup.
    speedup_prompt_interval / end_to_end_speedup_prompt_interval: 95% bootstrap intervals
      over the timed prompts (`prompt_interval`).
    speedup_unreliable: the decoding-phase or end-to-end spread exceeds SPREAD_LIMIT.
  """

  speedup: float
  speedup_range: list
  speedup_spread: float
  speedup_repeats: list
  end_to_end_speedup: float
  end_to_end_speedup_range: list
  end_to_end_speedup_spread: float
  typical_speedup: float
  typical_speedup_range: list
  typical_speedup_spread: float
  typical_end_to_end_speedup: float
  typical_end_to_end_speedup_range: list
  typical_end_to_end_speedup_spread: float
  speedup_prompt_interval: list
  end_to_end_speedup_prompt_interval: list
  speedup_unreliable: bool


@dataclasses.dataclass(frozen=True)
class SpeedFigures(JsonRecord):
  """What an evaluation row reports of its timing: the measured speedups and the rest.

  Attributes:
    speedups: the measured Speedups.
    cost_model_speedup / cost_model_end_to_end_speedup: both figures predicted from per-call
      costs timed in the same cycles (None for an adaptive draft length rule, and where no
      target call ran).
    tokens_per_s / plain_tokens_per_s: decoding-phase rates, speculative and plain.
    setup_s: the speculative setup's median seconds (all timed prompts).
    call_overhead_s: the fastest whole call less its windows (dispatch, fixed work).
    timed_tau: tau over the timed prompts (an evaluation's `tau` is over all its prompts);
      None when no target call ran (and then no cost model either).
  """

  speedups: Speedups = flattened(Speedups)
  cost_model_speedup: Optional[float] = None
  cost_model_end_to_end_speedup: Optional[float] = None
  tokens_per_s: float = 0.0
  plain_tokens_per_s: float = 0.0
  setup_s: float = 0.0
  call_overhead_s: float = 0.0
  timed_tau: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class SpeedRow(JsonRecord):
  """One timed speculative configuration of `measure_speed`.

  Attributes:
    draft: the draft's name (a key of measure_speed's `drafts`).
    point: the grid point timed (GridPoint: gamma, temperature, lenience, draft length).
    figures: its SpeedFigures.
    drafted / draft_calls / rounds / tokens: totals over the timed prompts (draft tokens
      proposed, draft model calls, verification rounds, tokens produced).
    seconds: median over repeats of the decoding plus the setup.
  """

  draft: str
  point: GridPoint = flattened(GridPoint)
  figures: SpeedFigures = flattened(SpeedFigures)
  drafted: int = 0
  draft_calls: int = 0
  rounds: int = 0
  tokens: int = 0
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class PlainSpeed(JsonRecord):
  """Plain target decoding's timing at one temperature (`measure_speed`'s `plain`).

  Attributes:
    tokens: tokens produced over the timed prompts.
    seconds / seconds_range: median and [min, max] over repeats of decoding plus setup.
    decode_seconds / typical_decode_seconds: the decoding phase, from each repeat's fastest
      windows and from its median call.
    tokens_per_s: decoding-phase rate.
    setup_s: the setup's median seconds (encoder and prefill of every prompt).
    cost_model_decode_seconds: (tokens - 1) target steps per prompt at the timed step cost.
    call_overhead_s: the fastest whole call less its windows.
  """

  tokens: int
  seconds: float
  seconds_range: list
  decode_seconds: float
  typical_decode_seconds: float
  tokens_per_s: float
  setup_s: float
  cost_model_decode_seconds: float
  call_overhead_s: float


@dataclasses.dataclass(frozen=True)
class SpeedProtocol(JsonRecord):
  """How a measurement was timed (the report's measurement sentence reads it).

  Attributes:
    num_prompts: prompts timed, each alone. repeats: timing repeats. timed_per_repeat: cycles
    each repeat got. plain_calls_per_cycle: calls of each plain decoding per cycle.
    budget_s: seconds of timing asked for (0: exactly the minimum). max_new_tokens: the
    decoding budget.
  """

  num_prompts: int
  repeats: int
  timed_per_repeat: int
  plain_calls_per_cycle: int
  budget_s: float
  max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class SpeedMeasurement(JsonRecord):
  """`measure_speed`'s result.

  Attributes:
    rows: one SpeedRow per timed speculative configuration.
    plain: str(temperature) -> PlainSpeed.
    per_call_s: per-call costs: "target_step", "verification_<gamma>",
      "<draft>:draft_step_<w>" (per draft call of w positions: 1, and a round's first call's
      width, 2 or gamma + 1 for a head) and "stamp" (per prompt).
    interference: {"target_step", "verification_<max gamma>"}: a typical call's time over
      its fastest windows, less 1.
    quiet_timeline: {"plain", "verification_<max gamma>"}: `quiet_timeline` of each.
    machine: pinning.machine_info().
    protocol: the SpeedProtocol.
  """

  rows: tuple
  plain: dict
  per_call_s: dict
  interference: dict
  quiet_timeline: dict
  machine: dict
  protocol: SpeedProtocol

  def row(self, draft: str, point: GridPoint) -> SpeedRow:
    """The row of `draft` at `point`, or a KeyError naming them."""
    for row in self.rows:
      if row.draft == draft and row.point == point:
        return row
    raise KeyError(f"The timing has no row for draft {draft!r} at {point}.")

  @classmethod
  def from_json(cls, data) -> "SpeedMeasurement":
    return cls(rows=tuple(SpeedRow.from_json(r) for r in data["rows"]),
               plain={t: PlainSpeed.from_json(p) for t, p in data["plain"].items()},
               per_call_s=data["per_call_s"], interference=data["interference"],
               quiet_timeline=data["quiet_timeline"], machine=data["machine"],
               protocol=SpeedProtocol.from_json(data["protocol"]))


def _summary(per_repeat: Sequence[float]) -> tuple:
  """(median, [min, max], spread) of per-repeat values."""
  return statistics.median(per_repeat), [min(per_repeat), max(per_repeat)], _spread(per_repeat)


def compared_speedups(tokens: int, spec: dict, plain_tokens: int, plain: dict) -> Speedups:
  """The Speedups of one speculative configuration against plain decoding, from per-repeat
  seconds "decode", "setup", "typical_decode", "typical_setup" and per prompt
  "prompt_tokens", "prompt_decode", "prompt_setup" ([N] each) of `spec` and `plain`
  (`_decoder_times`)."""
  def per_repeat(kind):
    ratio = lambda s, p: paired_speedups(tokens, s, plain_tokens, p)
    if kind.endswith("end_to_end"):
      prefix = "typical_" if kind.startswith("typical") else ""
      total = lambda d: [a + b for a, b in zip(d[prefix + "decode"], d[prefix + "setup"])]
      return ratio(total(spec), total(plain))
    phase = "typical_decode" if kind.startswith("typical") else "decode"
    return ratio(spec[phase], plain[phase])

  repeats = per_repeat("decode")
  decode, end_to_end = _summary(repeats), _summary(per_repeat("end_to_end"))
  typical, typical_end_to_end = _summary(per_repeat("typical")), _summary(
      per_repeat("typical_end_to_end"))
  prompt = lambda d, total: d["prompt_decode"] + (d["prompt_setup"] if total else 0.0)
  decode_interval, end_to_end_interval = (prompt_interval(
      spec["prompt_tokens"], prompt(spec, total), plain["prompt_tokens"], prompt(plain, total))
      for total in (False, True))
  return Speedups(*decode[:3], repeats, *end_to_end, *typical, *typical_end_to_end,
                  decode_interval, end_to_end_interval,
                  bool(max(decode[2], end_to_end[2]) > SPREAD_LIMIT))


def timed_lenience(lenience: Lenience) -> Lenience:
  """The rule timed for `lenience`: every kind at epsilon 1 is lossless sampling, one rule."""
  return Lenience() if lenience.epsilon == 1.0 else lenience


def _distinct(values, cls: type, name: str, fields: str, example: str) -> tuple:
  """`values` (one `cls` or several) as a tuple of distinct `cls`, or a ValueError naming it."""
  values = (values,) if isinstance(values, cls) else tuple(values)
  kind = f"speculative.{cls.__name__}"
  if not values:
    raise ValueError(f"{name}=() is empty; pass at least one {kind}, e.g. {example}.")
  for value in values:
    if not isinstance(value, cls):
      raise ValueError(f"{name} has {value!r}; pass {kind}({fields}) values.")
  return tuple(dict.fromkeys(values))


def check_leniences(leniences, temperatures=()) -> tuple:
  """`leniences` as a tuple of distinct speculative.Lenience, or a ValueError naming it (and
  a lossy one at temperature 0 in `temperatures`: `Lenience.check_temperature`)."""
  leniences = _distinct(leniences, Lenience, "leniences", "kind, epsilon",
                        "(Lenience(),) for lossless decoding")
  for temperature in temperatures:
    for lenience in leniences:
      lenience.check_temperature(temperature)
  return leniences


def check_draft_lengths(draft_lengths) -> tuple:
  """`draft_lengths` as a tuple of distinct speculative.DraftLength, or a ValueError naming
  it."""
  return _distinct(draft_lengths, DraftLength, "draft_lengths", "rule, threshold",
                   "(DraftLength(),) for gamma draft tokens every round")


def _drafts_by_model(drafts: Mapping[str, tuple]) -> dict:
  """draft Model -> the names of the drafts that use it (they share compiled code)."""
  model_of = {}
  for name, (draft, _) in drafts.items():
    model_of.setdefault(draft, []).append(name)
  return model_of


def _per_call_functions(target: Model, target_params, drafts: Mapping[str, tuple],
                        model_of: dict, prompts, gammas: Sequence[int]) -> tuple:
  """(name -> timed callable, name -> model calls it makes) of the per-call costs:
  "target_step", "verification_<gamma>" and "<draft>:draft_step_<w>" (one per draft Model
  or Head, named after its first draft) for w = 1 and each round's first call's width
  (`first_call_width`: 2, or gamma + 1 for a head). Temperature-independent."""
  one_prompt = {k: v[:1] for k, v in prompt_inputs(target, prompts).items()}
  capacity = target.config.max_decode_length
  per_call, extends = {}, {}
  per_call["target_step"], extends["target_step"] = per_call_function(
      target, target_params, one_prompt, 1, 1, 0.03, capacity)
  for gamma in gammas:
    per_call[f"verification_{gamma}"], extends[f"verification_{gamma}"] = per_call_function(
        target, target_params, one_prompt, 1, gamma + 1, 0.03, capacity)
  for draft, names in model_of.items():
    params = drafts[names[0]][1]
    for width in sorted({1} | {first_call_width(draft, gamma) for gamma in gammas}):
      key = f"{names[0]}:draft_step_{width}"
      if isinstance(draft, Head):
        per_call[key], extends[key] = head_call_function(
            target, target_params, draft, params, one_prompt, width, 0.03, capacity)
      else:
        per_call[key], extends[key] = per_call_function(draft, params, one_prompt, 1, width,
                                                        0.03, capacity)
  return per_call, extends


def timed_rules(gamma: int, gammas: Sequence[int], draft_lengths: Sequence[DraftLength],
                draft=None) -> list:
  """The draft length rules timed at `gamma`: the fixed rule at every gamma, an adaptive rule
  at the largest only (its gamma_max); with `draft`, only the rules it can run (a rule on the
  acceptance head's signal skips drafts without a head: `DraftLength.runs_on`)."""
  return [rule for rule in draft_lengths if (not rule.adaptive or gamma == max(gammas))
          and (draft is None or rule.runs_on(draft))]


def speculative_key(name: str, gamma: int, temperature, lenience: Lenience,
                    draft_length: DraftLength = DraftLength()) -> tuple:
  """The timing key of a speculative configuration: (name, gamma, temperature, timed
  lenience), with the DraftLength appended for an adaptive rule."""
  key = (name, gamma, temperature, timed_lenience(lenience))
  return key + (draft_length,) if draft_length.adaptive else key


def _speculative_functions(target: Model, target_params, draft: Model, names: list,
                           drafts: Mapping[str, tuple], prompts, rng, temperature, *,
                           gammas: Sequence[int], sampling: SamplingConfig,
                           leniences: Sequence[Lenience], max_new_tokens: int,
                           draft_lengths: Sequence[DraftLength] = (DraftLength(),)) -> tuple:
  """(functions, runs) of the drafts `names` (all of Model `draft`) at one temperature: their
  setup ("setup_speculative", temperature, names[0]) and every `speculative_key`'s rounds,
  timed on states made once; runs: each rounds call's results."""
  functions, runs = {}, {}
  first_states = {}  # draft name -> the start's states at gammas[0]
  for gamma in gammas:
    # Compiled once per draft Model (drafts of one Model differ in parameters only); the
    # setup does not depend on the rules (the first's is used), the rounds do.
    decoders = {(lenience, rule): _speculative_decoder(target, draft, max_new_tokens, gamma,
                                                       sampling, lenience, rule)
                for lenience in leniences
                for rule in timed_rules(gamma, gammas, draft_lengths, draft)}
    if not decoders:
      continue
    for name in names:
      params = {"target": target_params, "draft": drafts[name][1]}
      if name not in first_states:
        start = next(iter(decoders.values()))[0]
        first_states[name] = jax.block_until_ready(start(params, prompts, rng))[0]
        if name == names[0]:
          functions[("setup_speculative", temperature, name)] = functools.partial(
              start, params, prompts, rng)
      states = jax.block_until_ready(start_state_for_gamma(
          first_states[name], gamma=gamma, max_new_tokens=max_new_tokens))
      for (lenience, rule), (_, rounds) in decoders.items():
        key = speculative_key(name, gamma, temperature, lenience, rule)
        runs[key] = jax.device_get(rounds(params, states, rng)[0])
        functions[key] = functools.partial(rounds, params, states, rng)
  return functions, runs


def _decoding_functions(target: Model, target_params, drafts: Mapping[str, tuple],
                        model_of: dict, prompts, rng, *, gammas: Sequence[int],
                        temperatures: Sequence[float], leniences: Sequence[Lenience],
                        max_new_tokens: int, eos: dict,
                        draft_lengths: Sequence[DraftLength] = (DraftLength(),)) -> tuple:
  """(functions, runs): key -> timed callable and key -> its results, of every decoder.

  Each decoder is (start, steps): the encoders and the prefill of every prompt ("setup"),
  timed alone, and the decoding from their states, timed alone on states made once.
  Compiling is most of `measure_speed`'s time (on one pinned core, before timing can start),
  so the setups are compiled once where their programs would be the same: the plain start
  ignores the sampling rule, and a speculative start depends on gamma only through its
  output buffer's width (`start_state_for_gamma`).
  """
  functions, runs = {}, {}
  plain_start = None
  for temperature in temperatures:
    sampling = SamplingConfig(float(temperature), **eos)
    start, steps = _plain_decoder(target, max_new_tokens, sampling)
    if plain_start is None:
      plain_start = start
    start = plain_start
    params = {"target": target_params}
    states, _ = jax.block_until_ready(start(params, prompts, rng))
    key = ("plain", temperature)
    runs[key] = jax.device_get(steps(params, states, rng)[0])
    functions[key] = functools.partial(steps, params, states, rng)
    functions[("setup_plain", temperature)] = functools.partial(start, params, prompts, rng)
    for draft, names in model_of.items():
      more_functions, more_runs = _speculative_functions(
          target, target_params, draft, names, drafts, prompts, rng, temperature,
          gammas=gammas, sampling=sampling, leniences=leniences,
          max_new_tokens=max_new_tokens, draft_lengths=draft_lengths)
      functions.update(more_functions)
      runs.update(more_runs)
  return functions, runs


def _timed_cycles(functions: dict, repeats: int, *, timed_per_turn: int, budget_s: float,
                  order: list, progress: bool) -> InterleavedTimes:
  """`interleaved_times` of `functions` in cycles of `order`, with a progress bar."""
  from tqdm.auto import tqdm
  minimum = repeats * timed_per_turn
  with tqdm(total=minimum, desc="speed (timing cycles)", disable=not progress,
            dynamic_ncols=True) as bar:
    def advance(elapsed):
      # With a budget the cycles' count is known only as they go: the total is the whole
      # rounds of `repeats` that fit in the budget at the rate so far, or the minimum.
      bar.update(1)
      if budget_s > 0:
        expected = math.floor(bar.n * budget_s / max(elapsed, 1e-9) / repeats) * repeats
        bar.total = max(minimum, expected, bar.n)
        bar.refresh()

    return interleaved_times(functions, repeats, timed_per_turn=timed_per_turn,
                             progress=advance, budget_s=budget_s, order=order)


def _per_call_costs(times: dict, typical: dict, extends: dict, num_prompts: int,
                    largest: str) -> tuple:
  """(per_call_s, interference): each per-call function's median time per model call (and
  "stamp": per prompt), and how much the host slowed a typical call of "target_step" and
  `largest` (median call over the fastest windows, less 1)."""
  cost = {name: statistics.median(times[("per_call", name)]) / extends[name]
          for name in extends}
  cost["stamp"] = statistics.median(times[("stamp",)]) / num_prompts
  interference = {
      name: typical[("per_call", name)] / statistics.median(times[("per_call", name)]) - 1
      for name in ("target_step", largest)}
  return cost, interference


def _decoder_times(runs: dict, timing: dict, key, setup_key) -> dict:
  """`compared_speedups`' seconds of one decoder: its decoding function `key` and its setup
  `setup_key`, from `timing` ({"windows", "typical", "fastest"}: `repeat_times`,
  `repeat_typical_times`, `prompt_fastest` of the measurement)."""
  windows, typical, fastest = timing["windows"], timing["typical"], timing["fastest"]
  return {"decode": windows[key], "setup": windows[setup_key],
          "typical_decode": typical[key], "typical_setup": typical[setup_key],
          "prompt_tokens": np.asarray(runs[key]["lengths"]), "prompt_decode": fastest[key],
          "prompt_setup": fastest[setup_key]}


def _call_overhead(timing: dict, key) -> float:
  """Median over repeats of the fastest whole call of `key` less its windows' sum: dispatch
  and the call's fixed work, paid once per call of all prompts, outside every window."""
  return statistics.median(c - w for c, w in zip(timing["calls"][key], timing["windows"][key]))


def _plain_summary(runs: dict, timing: dict, cost: dict, temperature) -> PlainSpeed:
  """`measure_speed`'s plain[T]: plain decoding's tokens, times and cost model at T."""
  key = ("plain", temperature)
  lengths = np.asarray(runs[key]["lengths"])
  tokens = int(lengths.sum())
  times = _decoder_times(runs, timing, key, ("setup_plain", temperature))
  decode, setup = times["decode"], times["setup"]
  total = [d + u for d, u in zip(decode, setup)]
  return PlainSpeed(
      tokens=tokens, seconds=statistics.median(total), seconds_range=[min(total), max(total)],
      decode_seconds=statistics.median(decode),
      typical_decode_seconds=statistics.median(times["typical_decode"]),
      tokens_per_s=tokens / statistics.median(decode),
      setup_s=statistics.median(setup),
      # L new tokens take L - 1 target steps after the setup (plain.decode_steps).
      cost_model_decode_seconds=float(np.sum(lengths - 1)) * cost["target_step"],
      call_overhead_s=_call_overhead(timing, key))


def _speculative_rows(runs: dict, timing: dict, cost: dict, model_of: dict, temperature,
                      plain: PlainSpeed, *, gammas: Sequence[int],
                      leniences: Sequence[Lenience],
                      draft_lengths: Sequence[DraftLength] = (DraftLength(),)) -> list:
  """`measure_speed`'s SpeedRows at one temperature, against `plain` (its `_plain_summary`).

  An adaptive DraftLength's rows have no cost model (None): its verifications have widths
  the per-call costs do not time."""
  plain_times = _decoder_times(runs, timing, ("plain", temperature),
                               ("setup_plain", temperature))
  plain_tokens, predicted_plain = plain.tokens, plain.cost_model_decode_seconds
  rows = []
  for draft, names in model_of.items():
    draft_one = cost[f"{names[0]}:draft_step_1"]
    setup_key = ("setup_speculative", temperature, names[0])
    setup_spec = statistics.median(timing["windows"][setup_key])
    for name, gamma, lenience, rule in itertools.product(names, gammas, leniences,
                                                         draft_lengths):
      if rule not in timed_rules(gamma, gammas, draft_lengths, draft):
        continue
      key = speculative_key(name, gamma, temperature, lenience, rule)
      result = runs[key]
      tokens = int(np.sum(result["lengths"]))
      rounds = int(np.sum(result["target_calls"]))
      times = _decoder_times(runs, timing, key, setup_key)
      spec_decode = times["decode"]
      first = cost[f"{names[0]}:draft_step_{first_call_width(draft, gamma)}"]
      predicted = rounds * (first + (gamma - 1) * draft_one + cost[f"verification_{gamma}"])
      # No cost model for an adaptive rule, nor without a round (it predicts 0 seconds).
      model = lambda value: None if rule.adaptive or not rounds else value()
      figures = SpeedFigures(
          speedups=compared_speedups(tokens, times, plain_tokens, plain_times),
          cost_model_speedup=model(
              lambda: (tokens / predicted) / (plain_tokens / predicted_plain)),
          cost_model_end_to_end_speedup=model(lambda: (tokens / (setup_spec + predicted)) / (
              plain_tokens / (plain.setup_s + predicted_plain))),
          tokens_per_s=tokens / statistics.median(spec_decode),
          plain_tokens_per_s=plain_tokens / statistics.median(plain_times["decode"]),
          setup_s=setup_spec, call_overhead_s=_call_overhead(timing, key),
          timed_tau=float(np.sum(result["produced"])) / rounds if rounds else None)
      rows.append(SpeedRow(
          draft=name, point=GridPoint.of(gamma, temperature, lenience, rule), figures=figures,
          drafted=int(np.sum(result["drafted"])),
          draft_calls=int(np.sum(result["draft_calls"])), rounds=rounds, tokens=tokens,
          seconds=statistics.median([d + u for d, u in zip(spec_decode, times["setup"])])))
  return rows


@dataclasses.dataclass(frozen=True)
class TimingPlan:
  """What `measure_speed` times and how, checked when made.

  Attributes:
    gammas / temperatures: the grid; every draft is timed at every (gamma, temperature).
    max_new_tokens: the decoding budget of every decoder.
    leniences: the acceptance rules to time (speculative.Lenience); every one is timed in the
      same interleaved cycles, against the same plain decoding, so a lossy trade-off's
      speedups share their machine. Lossless rules (epsilon 1: every kind is the same rule)
      are timed once.
    draft_lengths: the draft length rules to time (speculative.DraftLength) in the same
      cycles: the fixed rule at every gamma, an adaptive one at the largest gamma (its
      gamma_max).
    eos_id: None = the sampling default (EOS and the model's stop ids stop a row); -1
      disables them (fixed lengths).
    seed: prompt i of every decoder samples with fold_in(PRNGKey(seed), i).
    repeats: timing repeats (>= 1); medians and ranges are over them.
    timed_per_turn: timed calls of each function per repeat, at least; a repeat's time sums
      each window's fastest (`interleaved_times`).
    budget_s: seconds of timing: after `timed_per_turn` calls per repeat, every repeat gets
      one more call at a time while the next round would end within this many seconds of
      timing (0: no more calls). The number each repeat got is `timed_per_repeat`.
    plain_calls_per_cycle: calls of each plain decoding per cycle, spread evenly over it.
      Plain decoding is the denominator of every row at its temperature, so its noise is in
      all of their ratios: for a ratio whose denominator n rows share, about sqrt(n x the
      numerator's cost / the denominator's) denominator calls per numerator call give the
      smallest variance per second of timing; 3 for the demo's grid (9 rows per
      temperature, a speculative call about 0.8x a plain one).
  """

  gammas: tuple
  temperatures: tuple
  max_new_tokens: int
  leniences: tuple = (Lenience(),)
  draft_lengths: tuple = (DraftLength(),)
  eos_id: Optional[int] = None
  seed: int = 0
  repeats: int = 7
  timed_per_turn: int = 6
  budget_s: float = 0.0
  plain_calls_per_cycle: int = 3

  def __post_init__(self):
    check_grid(self.gammas, self.temperatures)
    check_positive_int(self.repeats, "speed repeats (timing turns)")
    check_positive_int(self.timed_per_turn, "timed_per_turn")
    check_positive_int(self.plain_calls_per_cycle, "plain_calls_per_cycle")
    check_positive_int(self.max_new_tokens, "max_new_tokens")
    # Normalised: tuples of the engine's objects, each rule once.
    object.__setattr__(self, "gammas", tuple(self.gammas))
    object.__setattr__(self, "temperatures", tuple(self.temperatures))
    object.__setattr__(self, "leniences", check_leniences(self.leniences,
                                                                self.temperatures))
    object.__setattr__(self, "draft_lengths", check_draft_lengths(self.draft_lengths))
    object.__setattr__(self, "budget_s", check_budget(self.budget_s))


def measure_speed(target: Model, target_params, drafts: Mapping[str, tuple], prompts,
                  plan: TimingPlan, *, before_timing: Optional[Callable] = None,
                  windows_log: Optional[list] = None,
                  progress: bool = True) -> SpeedMeasurement:
  """Measured and cost-model speedups of every (draft, gamma, temperature) of `plan` over
  plain decoding.

  Args:
    drafts: name -> (draft Model or Head, its params); drafts of one Model (or Head) share
      compiled code.
    prompts: [N, P] right-padded prompts (encoder inputs of an encoder-decoder), each decoded
      alone.
    plan: the TimingPlan: the grid, the budget and the timing's settings.
    before_timing: called once everything is compiled and warm, just before the timed
      cycles (e.g. `wait_for_release`, so that the caller's other work is done by then).
    windows_log: if given, gets (key, repeat, window seconds) of every timed call, in order;
      keys are ("plain", T), (draft, gamma, T, timed Lenience), ("setup_plain", T),
      ("setup_speculative", T, draft), ("per_call", name) and ("stamp",).
  Returns:
    A SpeedMeasurement: a SpeedRow per timed configuration, plain decoding's PlainSpeed per
    temperature, the per-call costs, `interference`, `quiet_timeline`, the machine and the
    SpeedProtocol (`timed_per_repeat`: cycles each repeat got, one call of each function
    per cycle, `plain_calls_per_cycle` of each plain decoding).

    `speedup` compares the decoding loops only (the setup is a fixed cost per prompt that
    speculative decoding cannot shorten; timed apart, its noise stays out of the ratio);
    `end_to_end_speedup` adds each repeat's setup back: what a request sees, less the
    dispatch of a call (`call_overhead_s`, per call of all prompts; bench/latency.py times
    single requests with it). The typical_ ones take each repeat's median call instead of
    its fastest windows. The fixed costs, `interference` and `quiet_timeline`: see the
    module docstring.
  """
  if len(prompts) < 1:
    raise ValueError("No prompts to time: pass at least one speed prompt.")
  gammas, temperatures, repeats = plan.gammas, plan.temperatures, plan.repeats
  leniences, draft_lengths = plan.leniences, plan.draft_lengths
  max_new_tokens, budget_s = plan.max_new_tokens, plan.budget_s
  timed_per_turn, plain_calls_per_cycle = plan.timed_per_turn, plan.plain_calls_per_cycle
  eos_id, seed = plan.eos_id, plan.seed
  timed_leniences = list(dict.fromkeys(timed_lenience(lenience) for lenience in leniences))
  prompts = jnp.asarray(np.asarray(prompts), jnp.int32)
  num_prompts = int(prompts.shape[0])
  model_of = _drafts_by_model(drafts)
  rng = jax.random.PRNGKey(seed)

  per_call, extends = _per_call_functions(target, target_params, drafts, model_of, prompts,
                                          gammas)
  functions, runs = _decoding_functions(
      target, target_params, drafts, model_of, prompts, rng, gammas=gammas,
      temperatures=temperatures, leniences=timed_leniences, max_new_tokens=max_new_tokens,
      eos={} if eos_id is None else {"eos_id": eos_id}, draft_lengths=draft_lengths)
  for name, fn in per_call.items():
    functions[("per_call", name)] = fn
  # The clock read each window holds: windows of a loop over the prompts that does nothing.
  functions[("stamp",)] = functools.partial(
      _map_prompts(lambda params, prompt, rng: jnp.sum(prompt)), None, prompts, rng)
  for fn in functions.values():  # compiles what the runs above did not
    jax.block_until_ready(fn())
  if before_timing is not None:
    before_timing()

  timed = _timed_cycles(
      functions, repeats, timed_per_turn=timed_per_turn, budget_s=budget_s,
      order=cycle_order(functions, [("plain", t) for t in temperatures],
                        plain_calls_per_cycle), progress=progress)
  log = timed.log
  if windows_log is not None:
    windows_log.extend(log)
  largest = f"verification_{max(gammas)}"
  parts = min(10, repeats * timed.calls_per_repeat)
  timeline = {"plain": quiet_timeline(log, ("plain", temperatures[0]), parts),
              largest: quiet_timeline(log, ("per_call", largest), parts)}
  cost, interference = _per_call_costs(timed.windows, timed.typical, extends, num_prompts,
                                       largest)
  timing = {"windows": timed.windows, "calls": timed.calls, "fastest": prompt_fastest(log),
            "typical": repeat_typical_times(log, repeats)}

  plain_info, rows = {}, []
  for temperature in temperatures:
    plain = _plain_summary(runs, timing, cost, temperature)
    plain_info[str(float(temperature))] = plain
    rows += _speculative_rows(runs, timing, cost, model_of, temperature, plain, gammas=gammas,
                              leniences=leniences, draft_lengths=draft_lengths)
  protocol = SpeedProtocol(num_prompts=num_prompts, repeats=int(repeats),
                           timed_per_repeat=int(timed.calls_per_repeat),
                           plain_calls_per_cycle=int(plain_calls_per_cycle),
                           budget_s=float(budget_s), max_new_tokens=int(max_new_tokens))
  return SpeedMeasurement(rows=tuple(rows), plain=plain_info, per_call_s=cost,
                          interference=interference, quiet_timeline=timeline,
                          machine=machine_info(), protocol=protocol)
