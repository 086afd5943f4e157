"""A model configuration as JSON and back, generically: any frozen config dataclass of the
models layer (every kind) round-trips through `config_to_json` / `config_from_json`.

    {"class": "TransformerConfig", "fields": {"kind": "llama", "rope_theta": 500000.0, ...}}

Tuples come back as tuples and nested dataclasses as dataclasses (from the field types); a
field the class does not have is refused, naming it (a checkpoint from a newer version), and
a field missing from the JSON keeps its default (a checkpoint from an older version).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from distillspec_jax.models.config import TransformerConfig

# The config classes a checkpoint may name; a new kind's class is added here.
CONFIG_CLASSES = {cls.__name__: cls for cls in (TransformerConfig,)}


def _plain(value: Any) -> Any:
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  return value


def config_to_json(config) -> dict:
  """{"class", "fields"} of a config dataclass (JSON-ready)."""
  if not dataclasses.is_dataclass(config):
    raise TypeError(f"Expected a config dataclass, got {type(config).__name__}.")
  return {"class": type(config).__name__, "fields": _plain(config)}


def _typed(value: Any, hint: Any) -> Any:
  origin = typing.get_origin(hint)
  if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
    return _build(hint, value, hint.__name__)
  if (origin is tuple or hint is tuple) and isinstance(value, list):
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    return tuple(_typed(v, args[0]) if len(args) == 1 else v for v in value)
  if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
    for arg in typing.get_args(hint):
      if arg is not type(None) and value is not None:
        return _typed(value, arg)
  return value


def _build(cls, fields: Mapping[str, Any], where: str):
  hints = typing.get_type_hints(cls)
  known = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"{where}: fields {unknown} are not {cls.__name__} fields; the checkpoint "
                     "was written by another version of distillspec-jax.")
  return cls(**{k: _typed(v, hints.get(k, Any)) for k, v in fields.items()})


def config_from_json(value: Mapping[str, Any], where: str = "the stored model configuration"):
  """The config dataclass of `config_to_json`'s output (or of a bare TransformerConfig field
  dict, as older checkpoints' meta holds)."""
  if "class" in value and "fields" in value:
    name = value["class"]
    if name not in CONFIG_CLASSES:
      raise ValueError(f"{where}: model configuration class {name!r} is unknown; known: "
                       f"{sorted(CONFIG_CLASSES)}.")
    return _build(CONFIG_CLASSES[name], value["fields"], where)
  return _build(TransformerConfig, value, where)
