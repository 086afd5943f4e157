"""One type check for the config dataclasses (TrainConfig, DistillationConfig, ...).

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
import numbers
import operator
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
  """Raises TypeError unless `value` fits the annotation `hint` (rules in the module doc)."""
  origin = typing.get_origin(hint)
  if origin is typing.Union or origin is types.UnionType:
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if value is None and len(options) < len(typing.get_args(hint)):
      return
  else:
    options = [hint]
  if any(_matches(value, option) for option in options):
    return
  expected = " or ".join(_describe(o) for o in options)
  if len(options) < len(typing.get_args(hint) or (hint,)):
    expected += " or None"
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


def check_positive_int(value, name: str) -> int:
  """`value` as a Python int >= 1, or a ValueError naming it.

  Accepts Python and NumPy integers (via `operator.index`); refuses bools, floats and
  strings, which are not counts.
  """
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} is a bool; pass an integer >= 1.")
  try:
    number = operator.index(value)
  except TypeError:
    raise ValueError(f"{name}={value!r} must be an integer >= 1 (got "
                     f"{type(value).__name__}); pass an int.") from None
  if number < 1:
    raise ValueError(f"{name}={number} must be an integer >= 1.")
  return number
