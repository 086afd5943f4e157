"""Imports T5X checkpoints (the public T5 1.1 ones included) into our parameter tree.

Two layouts are read:

1. T5X's own format (`t5x/checkpoints.py`, VERSION 3), used by the public checkpoints such as
   `gs://t5-data/pretrained_models/t5x/t5_1_1_small/checkpoint_1000000/`:

     checkpoint_<step>/checkpoint                         msgpack: {"version": 3, "optimizer":
                                                            {"target": {...}, "state": {...}}}
     checkpoint_<step>/target.encoder.layers_0.attention.query.kernel/   one zarr array per
     checkpoint_<step>/target.token_embedder.embedding/                  parameter (`.zarray` +
     checkpoint_<step>/state.param_states.<...>/                          gzip'd chunks)

   In the msgpack tree each large leaf is a TensorStore spec dict (`{"driver": "zarr",
   "kvstore": {"driver": "file"|"gcs", "path": "target.encoder...."}, "metadata": {...}}`) whose
   path is relative to the checkpoint directory; small leaves are stored inline. Version 0
   checkpoints have no {"version", "optimizer"} wrapper. Version 2 stored bfloat16 as uint16.

2. Orbax checkpoints written by T5X (`use_orbax`) or any orbax PyTree save holding a `target`
   (T5X) or `params` (ours) subtree; these are read with orbax itself.

Only the `target` subtree (the model parameters) is read; optimizer slots are never loaded, so
importing a large checkpoint costs one read of the parameters. The T5X tree already uses our
names (`encoder/layers_0/attention/query/kernel`, ...), so no renaming is needed.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import numpy as np

from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.interop.hf_t5 import check_param_shapes

Params = Any

T5X_CHECKPOINT_FILE = "checkpoint"
_ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "_sharding")
# Orbax's legacy aggregate msgpack marks arrays saved to TensorStore with this prefix.
_ORBAX_PLACEHOLDER = "PLACEHOLDER://"


def _is_orbax_dir(path: str) -> bool:
  return any(os.path.exists(os.path.join(path, m)) for m in _ORBAX_MARKERS)


def resolve_checkpoint_dir(path: str) -> str:
  """A checkpoint step directory from either that directory or a MODEL_DIR holding
  `checkpoint_<step>` subdirectories (the latest step is used)."""
  path = os.path.abspath(os.fspath(path))
  if os.path.isfile(path) and os.path.basename(path) == T5X_CHECKPOINT_FILE:
    return os.path.dirname(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"No T5X checkpoint at {path!r}.")
  if os.path.isfile(os.path.join(path, T5X_CHECKPOINT_FILE)) or _is_orbax_dir(path):
    return path
  steps = []
  for name in os.listdir(path):
    match = re.fullmatch(r"checkpoint_(\d+)", name)
    if match and os.path.isdir(os.path.join(path, name)):
      steps.append(int(match.group(1)))
  if steps:
    return os.path.join(path, f"checkpoint_{max(steps)}")
  raise FileNotFoundError(
      f"{path!r} is not a T5X checkpoint: expected a `checkpoint` msgpack file (plus "
      "target.* TensorStore directories), an orbax checkpoint, or checkpoint_<step> "
      "subdirectories.")


def is_t5x_checkpoint(path: str) -> bool:
  """True for a T5X step directory (msgpack `checkpoint` file) or a MODEL_DIR of them."""
  try:
    directory = resolve_checkpoint_dir(path)
  except FileNotFoundError:
    return False
  return os.path.isfile(os.path.join(directory, T5X_CHECKPOINT_FILE))


def _is_ts_spec(leaf) -> bool:
  return isinstance(leaf, dict) and "driver" in leaf and ("kvstore" in leaf or "path" in leaf)


def _local_spec(spec: dict, directory: str, name: str) -> dict:
  """The spec with its kvstore pointed at `directory` on the local file system.

  T5X writes paths relative to the checkpoint directory (absolute ones appear in old
  checkpoints and gcs ones carry a dummy bucket): the array directory's base name is what
  identifies it, so that is looked up next to the msgpack file.
  """
  spec = dict(spec)
  kvstore = dict(spec.pop("kvstore", {}) or {})
  relative = kvstore.get("path", spec.pop("path", name))
  local = os.path.join(directory, os.path.basename(os.path.normpath(relative)))
  if not os.path.exists(local):
    local = os.path.join(directory, name)
  spec["kvstore"] = {"driver": "file", "path": local}
  return spec


def _read_tensorstore(spec: dict, version: int) -> np.ndarray:
  import tensorstore as ts
  array = ts.open(spec, read=True).result().read().result()
  array = np.asarray(array)
  if version < 3 and array.dtype == np.uint16:
    # Before VERSION 3, T5X stored bfloat16 arrays bit-cast to uint16.
    import ml_dtypes
    array = array.view(ml_dtypes.bfloat16)
  return array


def _read_msgpack_tree(directory: str) -> tuple[dict, int]:
  from flax import serialization
  with open(os.path.join(directory, T5X_CHECKPOINT_FILE), "rb") as f:
    contents = serialization.msgpack_restore(f.read())
  if not isinstance(contents, dict):
    raise ValueError(f"{directory}/checkpoint is not a T5X msgpack state dict.")
  version = int(contents.get("version", 0))
  state = contents["optimizer"] if version > 0 and "optimizer" in contents else contents
  return state, version


def _materialize(tree, directory: str, prefix: str, version: int):
  """Replaces TensorStore specs / orbax placeholders with arrays, recursively."""
  if _is_ts_spec(tree):
    return _read_tensorstore(_local_spec(tree, directory, prefix), version)
  if isinstance(tree, str) and tree.startswith(_ORBAX_PLACEHOLDER):
    name = tree[len(_ORBAX_PLACEHOLDER):]
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": name}}
    return _read_tensorstore(_local_spec(spec, directory, name), version)
  if isinstance(tree, dict):
    return {k: _materialize(v, directory, f"{prefix}.{k}", version) for k, v in tree.items()}
  return np.asarray(tree)


def _restore_orbax(directory: str) -> dict:
  """Any orbax PyTree checkpoint as a nested dict of numpy arrays (no target structure)."""
  import jax
  import orbax.checkpoint as ocp
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(directory)
  metadata = getattr(metadata, "item_metadata", metadata)
  metadata = getattr(metadata, "tree", metadata)
  # Restore to host numpy: no device placement or sharding file needed for an import.
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  tree = checkpointer.restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  return jax.tree.map(np.asarray, tree)


def _find_params_subtree(tree: dict, directory: str) -> dict:
  for key in ("target", "params"):
    if isinstance(tree, dict) and key in tree:
      return tree[key]
  if isinstance(tree, dict) and "token_embedder" in tree:
    return tree
  keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
  raise ValueError(f"The checkpoint at {directory} has no `target` (T5X) or `params` subtree; "
                   f"its top-level keys are {keys}.")


def _locate(path: str) -> tuple[str, str]:
  """('msgpack' | 'orbax', the directory to read) of a T5X checkpoint path."""
  directory = resolve_checkpoint_dir(path)
  if not _is_orbax_dir(directory) and os.path.isfile(os.path.join(directory,
                                                                  T5X_CHECKPOINT_FILE)):
    return "msgpack", directory
  if not _is_orbax_dir(directory):
    # T5X's orbax mode nests the PyTree one level down (e.g. checkpoint_N/state).
    subdirs = [os.path.join(directory, d) for d in sorted(os.listdir(directory))
               if _is_orbax_dir(os.path.join(directory, d))]
    if not subdirs:
      raise FileNotFoundError(f"{directory} holds neither a T5X msgpack nor an orbax tree.")
    directory = subdirs[0]
  return "orbax", directory


def read_t5x_params(path: str) -> dict:
  """The model parameters (`target` subtree) of a T5X checkpoint, as stored (numpy)."""
  layout, directory = _locate(path)
  if layout == "orbax":
    return _find_params_subtree(_restore_orbax(directory), directory)
  state, version = _read_msgpack_tree(directory)
  target = _find_params_subtree(state, directory)
  # Only the parameters are read; optimizer slots (state.param_states.*) stay on disk.
  return _materialize(target, directory, "target", version)


def _stored_shape(leaf, directory: str, prefix: str) -> tuple:
  """A msgpack leaf's shape: the TensorStore spec's metadata, else the zarr header."""
  if _is_ts_spec(leaf) and "shape" in (leaf.get("metadata") or {}):
    return tuple(leaf["metadata"]["shape"])
  if isinstance(leaf, str) and leaf.startswith(_ORBAX_PLACEHOLDER):
    name = leaf[len(_ORBAX_PLACEHOLDER):]
    leaf = {"driver": "zarr", "kvstore": {"driver": "file", "path": name}}
  if _is_ts_spec(leaf):
    import tensorstore as ts
    return tuple(ts.open(_local_spec(leaf, directory, prefix), read=True).result().shape)
  return np.shape(leaf)


def read_t5x_shapes(path: str) -> dict:
  """The parameter shapes of a T5X checkpoint (tree of `jax.ShapeDtypeStruct`, fp32), from
  the msgpack specs / zarr headers or the orbax metadata: no array is read."""
  import jax
  layout, directory = _locate(path)
  if layout == "orbax":
    import orbax.checkpoint as ocp
    metadata = ocp.PyTreeCheckpointer().metadata(directory)
    metadata = getattr(metadata, "item_metadata", metadata)
    metadata = getattr(metadata, "tree", metadata)
    shapes = jax.tree.map(lambda x: tuple(getattr(x, "shape", ())),
                          _find_params_subtree(metadata, directory),
                          is_leaf=lambda x: hasattr(x, "shape"))
  else:
    state, _ = _read_msgpack_tree(directory)

    def walk(tree, prefix):
      if isinstance(tree, dict) and not _is_ts_spec(tree):
        return {k: walk(v, f"{prefix}.{k}") for k, v in tree.items()}
      return _stored_shape(tree, directory, prefix)

    shapes = walk(_find_params_subtree(state, directory), "target")
  return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, np.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def load_t5x(path: str, config: TransformerConfig, dtype=np.float32) -> Params:
  """Imports a T5X (or T5X-written orbax) checkpoint into our parameter tree for `config`.

  Args:
    path: a `checkpoint_<step>` directory, its `checkpoint` file, or a MODEL_DIR (latest step).
    config: the model the parameters must fit; shapes are checked and the first mismatching
      parameters are reported (path, expected shape, found shape).
    dtype: parameters are cast to this (our parameters are fp32; bf16 checkpoints widen exactly).
  Returns:
    Nested dict of numpy arrays with our (= T5X's) names.
  """
  params = read_t5x_params(path)
  params = _to_plain_dict(params, dtype)
  check_param_shapes(params, config)
  return params


def _to_plain_dict(tree, dtype) -> Any:
  if isinstance(tree, dict):
    return {k: _to_plain_dict(v, dtype) for k, v in tree.items()}
  return np.asarray(tree).astype(dtype)


def save_t5x(params: Params, directory: str, step: Optional[int] = None) -> str:
  """Writes `params` in T5X's VERSION 3 layout (msgpack + one zarr array per parameter).

  Only the `target` is written (no optimizer state): enough for T5X's `load_t5x_checkpoint` or
  our importer. Returns the checkpoint directory (`directory/checkpoint_<step>` if step given).
  """
  import tensorstore as ts
  from flax import serialization
  if step is not None:
    directory = os.path.join(directory, f"checkpoint_{step}")
  os.makedirs(directory, exist_ok=True)

  def write(tree, prefix):
    if isinstance(tree, dict):
      return {k: write(v, f"{prefix}.{k}") for k, v in tree.items()}
    array = np.asarray(tree)
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": prefix},
            "metadata": {"shape": list(array.shape), "chunks": list(array.shape) or [1],
                         "dtype": array.dtype.str if array.dtype.kind != "V" else "bfloat16",
                         "compressor": {"id": "gzip", "level": 1}}}
    local = dict(spec, kvstore={"driver": "file", "path": os.path.join(directory, prefix)})
    ts.open(local, create=True, delete_existing=True).result().write(array).result()
    return spec

  tree = {"version": 3, "optimizer": {"target": write(dict(params), "target"),
                                      "state": {"step": np.int64(step or 0)}}}
  with open(os.path.join(directory, T5X_CHECKPOINT_FILE), "wb") as f:
    f.write(serialization.msgpack_serialize(tree))
  return directory
