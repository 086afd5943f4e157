"""The one validation module: every config dataclass and binary checks its input here.

* `check_field_types(config)`: each field against its annotation (first in `__post_init__`);
* `check_int(value, name, minimum)` / `check_positive_int(value, name)`: counts;
* `check_real(value, name, minimum=...)`: a finite number above a bound;
* `check_probability(value, name, ...)`: a number in [0, 1] (ends open on request);
* `check_grid(gammas, temperatures, names)`: a speculative-decoding grid;
* `check_budget(budget_s, name)`: seconds of timing;
* `check_path(path, name, kind, fix)`: an input path that must exist before work starts;
* `check_finite(rows, where)`: a report's rows hold finite numbers only;
* `check_block_size(block_size, name, length)`: positions per block, in [1, length];
* `check_feature_lengths(lengths, name, required)`: TASK_FEATURE_LENGTHS;
* `check_distinct(values, name)`: a grid or list without repeated entries;
* `check_output_dir(path, name)`: MODEL_DIR is, or can be made, a writable directory;
* `check_decode_capacity(capacity, name, ...)`: a decoding cache holds the longest request.

Every error names the value and the fix. Nothing here coerces: "3" and True are not 3.

The type check:

`check_field_types(config)` compares every field's value with its annotation, so that a
quoted gin value (`LAMBDA1 = "0.5"`) or a bool where a number belongs fails when the config
is built, naming the field, the value and the fix, instead of being coerced later by
`float(...)` or silently taken as 1:

  * `float` fields take real numbers (Python or NumPy ints and floats), not bool or str;
  * `int` fields take integers (Python or NumPy), not bool, float or str;
  * `bool` fields take bools; `str` fields take strings; `Literal[...]` fields one of the
    listed values; `Optional[X]` also takes None;
  * fields of other types (tuples, mappings, Any) are not checked here.

Call it first in `__post_init__`; range checks follow in each class.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import os
import types
import typing
from typing import Any

import numpy as np

_KINDS = {float: "a real number (int or float)", int: "an integer", bool: "a bool (True/False)",
          str: "a string"}


@functools.lru_cache(maxsize=None)
def _field_hints(cls: type) -> dict:
  hints = typing.get_type_hints(cls)
  return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _matches(value, hint) -> bool:
  if hint is float:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
  if hint is int:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
  if hint is bool:
    return isinstance(value, (bool, np.bool_))
  if hint is str:
    return isinstance(value, str)
  if typing.get_origin(hint) is typing.Literal:
    return any(value == v and type(value) is type(v) for v in typing.get_args(hint))
  return True  # not checked here (tuples, mappings, Any, classes)


def _describe(hint) -> str:
  if typing.get_origin(hint) is typing.Literal:
    return "one of " + ", ".join(map(repr, typing.get_args(hint)))
  return _KINDS.get(hint, getattr(hint, "__name__", str(hint)))


def check_value_type(owner: str, name: str, value, hint) -> None:
  """Raises TypeError unless `value` fits the annotation `hint` (rules in the module doc);
  ValueError for a value outside a Literal's choices."""
  origin = typing.get_origin(hint)
  optional = False
  if origin is typing.Union or origin is types.UnionType:
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(options) < len(typing.get_args(hint))
    if value is None and optional:
      return
  else:
    options = [hint]
  if any(_matches(value, option) for option in options):
    return
  expected = " or ".join(_describe(o) for o in options)
  if optional:
    expected += " or None"
  choices = [c for o in options if typing.get_origin(o) is typing.Literal
             for c in typing.get_args(o)]
  if any(type(value) is type(c) for c in choices):
    # The right type, outside the fixed choices: the value is wrong.
    raise ValueError(f"{owner}.{name}={value!r} is not {expected}. Set {owner}.{name} to "
                     "one of them.")
  hint_text = ""
  if isinstance(value, str) and any(o in (int, float) for o in options):
    hint_text = " Write the number without quotes (gin: 0.5, not '0.5')."
  elif isinstance(value, (bool, np.bool_)) and any(o in (int, float) for o in options):
    hint_text = " A bool is not taken as a number here; write the number."
  raise TypeError(f"{owner}.{name}={value!r} is of type {type(value).__name__}, but it must "
                  f"be {expected}.{hint_text} Set {owner}.{name} to such a value.")


def check_field_types(config) -> None:
  """Type-checks every init field of the dataclass instance `config` against its annotation."""
  owner = type(config).__name__
  for name, hint in _field_hints(type(config)).items():
    check_value_type(owner, name, getattr(config, name), hint)


def check_int(value, name: str, minimum: int) -> int:
  """`value` as a Python int >= `minimum`, or a ValueError naming it.

  Accepts Python and NumPy integers (via `operator.index`); refuses bools, floats and
  strings, which are not counts.
  """
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} is a bool; pass an integer >= {minimum}.")
  try:
    number = operator.index(value)
  except TypeError:
    raise ValueError(f"{name}={value!r} must be an integer >= {minimum} (got "
                     f"{type(value).__name__}); pass an int.") from None
  if number < minimum:
    raise ValueError(f"{name}={number} must be an integer >= {minimum}.")
  return number


def check_positive_int(value, name: str) -> int:
  """`value` as a Python int >= 1 (a count), or a ValueError naming it (`check_int`)."""
  return check_int(value, name, 1)


def _real(value, name: str, fix: str) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name}={value!r} is not a number (got {type(value).__name__}); {fix}")
  if not math.isfinite(value):
    raise ValueError(f"{name}={value!r} is not finite; {fix}")
  return float(value)


def check_real(value, name: str, *, minimum: float = -math.inf, above: bool = False,
               fix: str = "") -> float:
  """`value` as a finite float >= `minimum` (> `minimum` when `above`), or a ValueError
  naming it, the bound and `fix`. Refuses bools and strings (no coercion)."""
  bound = f"{'>' if above else '>='} {minimum:g}"
  fix = fix or f"pass a finite number {bound}."
  number = _real(value, name, fix)
  if number < minimum or (above and number == minimum):
    raise ValueError(f"{name}={value!r} must be {bound}; {fix}")
  return number


def check_probability(value, name: str, *, zero: bool = True, one: bool = True,
                      fix: str = "") -> float:
  """`value` as a float in [0, 1] (without 0 when `zero` is False, without 1 when `one` is
  False), or a ValueError naming it, the interval and `fix`."""
  interval = ("[" if zero else "(") + "0, 1" + ("]" if one else ")")
  fix = fix or f"pass a number in {interval}."
  number = _real(value, name, fix)
  if not ((number >= 0.0 if zero else number > 0.0) and (number <= 1.0 if one else
                                                          number < 1.0)):
    raise ValueError(f"{name}={value!r} must lie in {interval}; {fix}")
  return number


def check_grid(gammas, temperatures, names: tuple = ("gammas", "temperatures")) -> None:
  """The one check of a speculative-decoding grid: `gammas` integers >= 1 and
  `temperatures` finite numbers >= 0 (0 is greedy), neither empty; errors name the whole
  grid by `names` (the config fields or gin macros that set them) and the bad entry."""
  gammas_name, temperatures_name = names
  for values, name, example in ((gammas, gammas_name, "(3, 5, 7)"),
                                (temperatures, temperatures_name, "(0.0, 1.0)")):
    if not isinstance(values, (tuple, list)):
      raise ValueError(f"{name}={values!r} is not a tuple; pass e.g. {example}.")
  if not len(gammas):
    raise ValueError(f"{gammas_name}={tuple(gammas)!r} is empty; pass at least one gamma, "
                     "e.g. (3, 5, 7).")
  for gamma in gammas:
    check_positive_int(gamma, f"{gammas_name}={tuple(gammas)!r} has a gamma: gamma")
  check_distinct(gammas, gammas_name)
  if not len(temperatures):
    raise ValueError(f"{temperatures_name}={tuple(temperatures)!r} is empty; pass e.g. "
                     "(0.0, 1.0).")
  for temperature in temperatures:
    check_real(temperature, f"{temperatures_name}={tuple(temperatures)!r} has a temperature: "
               "temperature", minimum=0.0, fix="pass temperatures >= 0 (0 is greedy).")
  check_distinct(temperatures, temperatures_name)


def check_budget(budget_s, name: str = "budget_s") -> float:
  """`budget_s` (seconds of timing) as a float >= 0, or a ValueError naming it."""
  fix = ("pass the seconds to keep timing for, a finite number >= 0 (0: exactly the minimum "
         "calls per repeat).")
  if isinstance(budget_s, (bool, np.bool_)) or not isinstance(budget_s, numbers.Real) or not (
      math.isfinite(budget_s) and budget_s >= 0):
    raise ValueError(f"{name}={budget_s!r}: {fix}")
  return float(budget_s)


PATH_KINDS = ("any", "file", "dir")


def is_remote(path: str) -> bool:
  """True for URLs (gs://, s3://, ...), which only the reading library can check."""
  return "://" in str(path)


def check_path(path, name: str, *, kind: str = "any", fix: str = "") -> str:
  """`path` as a string when it exists locally as `kind` ("any", "file" or "dir"), else a
  ValueError naming `name`, the path and `fix`. URLs (gs://...) are passed through: their
  reader checks them."""
  if kind not in PATH_KINDS:
    raise ValueError(f"kind={kind!r}; use one of {PATH_KINDS}.")
  if not isinstance(path, (str, os.PathLike)) or not str(path):
    raise ValueError(f"{name}={path!r} is not a path; {fix or 'pass a path.'}")
  path = os.fspath(path)
  if is_remote(path):
    return path
  exists = {"any": os.path.exists, "file": os.path.isfile, "dir": os.path.isdir}[kind](path)
  if not exists:
    what = {"any": "does not exist", "file": "is not a file",
            "dir": "is not a directory"}[kind]
    if kind != "any" and not os.path.exists(path):
      what = "does not exist"
    raise ValueError(f"{name}={path!r} {what}; {fix or 'pass an existing path.'}")
  return path


def check_finite(rows: list, where: str) -> None:
  """Refuses a row (a dict) with a non-finite float, also inside a list value (a diverged
  model or a broken measurement), naming `where`, the row and the key."""
  for row in rows:
    for key, value in row.items():
      values = value if isinstance(value, list) else [value]
      if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ValueError(f"{where}: the row {row} has a non-finite {key}; the model of that "
                         "row diverged or its measurement failed: rerun its stage.")


def check_block_size(block_size, name: str, length=None) -> int:
  """`block_size` (positions per block of a blocked computation) as an int in [1, length],
  or a ValueError naming it and the fix. `length=None` checks the lower bound only (a config
  built before the sequence length is known)."""
  number = check_int(block_size, name, 1)
  if length is not None and number > length:
    raise ValueError(f"{name}={number} is larger than the sequence ({length} positions); pass "
                     f"a block size in [1, {length}], 'auto' (blocks of at most a few hundred "
                     "positions), or None (no blocking).")
  return number


FEATURE_LENGTH_KEYS = ("inputs", "targets")


def check_feature_lengths(lengths, name: str = "TASK_FEATURE_LENGTHS",
                          required: tuple = ()) -> dict:
  """`lengths` ({'inputs': P, 'targets': T}: tokens per feature) as a dict, or a ValueError
  naming it and the fix: a mapping whose keys are among FEATURE_LENGTH_KEYS, holding the
  `required` ones, with integer values >= 1 (no "40", no 40.0, no 0)."""
  fix = f"pass e.g. {name}=\"{{'inputs': 40, 'targets': 44}}\"."
  if not isinstance(lengths, dict):
    raise ValueError(f"{name}={lengths!r} is not a mapping of feature to length; {fix}")
  unknown = sorted(set(lengths) - set(FEATURE_LENGTH_KEYS), key=str)
  if unknown:
    raise ValueError(f"{name}={lengths!r} has unknown feature(s) {unknown}; the features are "
                     f"{FEATURE_LENGTH_KEYS}: {fix}")
  missing = [key for key in required if key not in lengths]
  if missing:
    raise ValueError(f"{name}={lengths!r} lacks {missing}; {fix}")
  for key, value in lengths.items():
    check_positive_int(value, f"{name}[{key!r}]")
  return dict(lengths)


def check_distinct(values, name: str) -> None:
  """Refuses a grid or list with an entry given twice (it would run, and report, twice),
  naming `name`, the values and the repeated entry."""
  seen = set()
  for value in values:
    if value in seen:
      raise ValueError(f"{name}={tuple(values)!r} lists {value!r} twice; list each value once.")
    seen.add(value)


def check_output_dir(path, name: str = "MODEL_DIR") -> str:
  """`path` as a string when it is a directory, or can be made one, that this process may
  write to; else a ValueError naming `name`, the path and the fix. Creates nothing, so a
  refused run leaves no folder behind. URLs (gs://...) are passed through."""
  fix = f"pass a directory you can write to with --gin.{name}=<directory>."
  path = os.fspath(path)
  if is_remote(path):
    return path
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{name}={path!r} is a file, not a directory; {fix}")
  parent = os.path.abspath(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ValueError(f"{name}={path!r} cannot be made: {parent!r} is a file, not a directory; "
                     f"{fix}")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"{name}={path!r} is not writable ({parent!r} does not allow it); {fix}")
  return path


def check_decode_capacity(capacity: int, name: str, *, prompt: int, new_tokens: int,
                          gamma: int, or_else: str = "") -> None:
  """Refuses a decoding-cache `capacity` (the config field `name`) below what the longest
  request needs: the first slot, a decoder-only prompt of `prompt` tokens (0 for an
  encoder-decoder), `new_tokens` and the last round's gamma - 1 more. `or_else`: another way
  out, said after the size to set."""
  needed = 1 + prompt + new_tokens + gamma - 1
  if needed > capacity:
    raise ValueError(
        f"{name}={capacity} is smaller than the {needed} decoding-cache positions a request "
        f"can need (1 + the prompt's {prompt} (TASK_FEATURE_LENGTHS['inputs']) + "
        f"{new_tokens} new tokens + gamma - 1 = {gamma - 1}); set --gin.{name}={needed} or "
        f"more{or_else}, or lower the prompt length or max_new_tokens.")


def check_speculative_budget(value, name: str) -> int:
  """`value`, the decoding budget (new tokens per row) of a speculative grid, as an int >= 2,
  or a ValueError naming it and the fix. The prefill gives a row its first new token; a
  verification round needs a second one, so a budget of 1 runs no round and leaves tau and
  the acceptance rates undefined."""
  check_positive_int(value, name)
  if value < 2:
    raise ValueError(
        f"{name}={value} runs no verification round: the prefill gives the only new token, so "
        "tau and the acceptance rates are undefined; pass max_new_tokens >= 2 (one round "
        "needs a token after the prefill's).")
  return int(value)
