"""JSON form of the frozen dataclasses that carry results across modules (rows, summaries).

A record's field names are its JSON keys: one name per quantity, declared once, beside the
field. The writers (report.json, metrics.json, eval.json, a bench script's --out) call
`to_json`; the readers call `from_json`; nothing else spells the keys.

A field declared with `flattened(RecordType)` holds a nested record whose keys are spliced
into the parent's JSON object (so a row reads flat: `speedup`, `tau`, ... side by side); a
nested record of None writes each of its keys as null and reads back as None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

_FLATTEN = "flatten"


def flattened(record_type: type, **kwargs) -> Any:
  """A dataclass field holding a `record_type` (or None) spliced flat into the parent's JSON."""
  return dataclasses.field(metadata={_FLATTEN: record_type}, **kwargs)


def _plain(value):
  """`value` as JSON: tuples as lists, NumPy scalars and arrays as Python numbers and lists."""
  if isinstance(value, JsonRecord):
    return value.to_json()
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value


class JsonRecord:
  """Mixin of a frozen dataclass: `to_json` / `from_json` / `json_keys` by its fields."""

  def to_json(self) -> dict:
    """{key: value} in field order, nested `flattened` records spliced in."""
    out = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      nested = field.metadata.get(_FLATTEN)
      if nested is None:
        out[field.name] = _plain(value)
      elif value is None:
        out.update(dict.fromkeys(nested.json_keys()))
      else:
        out.update(value.to_json())
    return out

  @classmethod
  def json_keys(cls) -> tuple:
    """Every key `to_json` writes, in order."""
    keys = []
    for field in dataclasses.fields(cls):
      nested = field.metadata.get(_FLATTEN)
      keys += list(nested.json_keys()) if nested else [field.name]
    return tuple(keys)

  @classmethod
  def from_json(cls, data: Mapping):
    """The record of a `to_json` object. A key the object lacks takes the field's default (a
    field without one raises KeyError naming it); keys of other records are ignored."""
    values = {}
    for field in dataclasses.fields(cls):
      nested = field.metadata.get(_FLATTEN)
      if nested is not None:
        keys = nested.json_keys()
        present = any(data.get(key) is not None for key in keys)
        values[field.name] = nested.from_json(data) if present else None
      elif field.name in data:
        values[field.name] = data[field.name]
      elif (field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING):
        raise KeyError(f"{cls.__name__} needs {field.name!r}, which the JSON object lacks "
                       f"(it has {sorted(data)}).")
    return cls(**values)
