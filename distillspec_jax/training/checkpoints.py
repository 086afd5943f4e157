"""Checkpoints: orbax `CheckpointManager` with periodic saves, keep-last-N and shape checks.

Layout of MODEL_DIR (one orbax step directory per save):

    MODEL_DIR/<step>/params      draft (or fine-tuned) parameters   (StandardSave)
    MODEL_DIR/<step>/opt_state   optimizer state                     (StandardSave)
    MODEL_DIR/<step>/meta        {"step", "model_config", "token_ids", ...}  (JsonSave)

Atomicity: orbax (0.12.8) writes every save into `<step>.orbax-checkpoint-tmp` (older
versions added `-<timestamp>`) and renames it to `<step>` only once all items are written
and finalized, so a crash during a save leaves the previous step directories untouched;
`latest_step()` only sees finalized steps. The next `Checkpointer` on the directory deletes
such leftover temporary directories when it opens (`remove_temporary_checkpoints`, before
the orbax manager is created: orbax's own `cleanup_tmp_directories` runs in a background
future that nothing waits for). `tests/test_checkpoints.py` checks both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from distillspec_jax.training import multihost

Params = Any
# restore_fn(path, abstract_params) -> params: a hook for importers of other formats (T5X, HF);
# the binaries pass `interop.importer.restore_any` (this layer never imports interop).
RestoreFn = Callable[[str, Params], Params]


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def shape_mismatches(expected: Params, found: Params, limit: int = 5) -> list[str]:
  """Human-readable differences between two trees of arrays/ShapeDtypeStructs/metadata.

  Returns up to `limit` lines `path: checkpoint shape (a) vs model shape (b)`, plus lines for
  parameters present in only one of the trees.
  """
  flat_expected = {_path_str(p): tuple(x.shape) for p, x in
                   jax.tree_util.tree_flatten_with_path(expected)[0]}
  flat_found = {_path_str(p): tuple(x.shape) for p, x in
                jax.tree_util.tree_flatten_with_path(found)[0]}
  lines = []
  for path in sorted(set(flat_expected) | set(flat_found)):
    a, b = flat_found.get(path), flat_expected.get(path)
    if a != b:
      if a is None:
        lines.append(f"{path}: missing from the checkpoint (model shape {b})")
      elif b is None:
        lines.append(f"{path}: in the checkpoint (shape {a}) but not in the model")
      else:
        lines.append(f"{path}: checkpoint shape {a} vs model shape {b}")
    if len(lines) >= limit:
      break
  return lines


def _raise_mismatch(where: str, lines: list[str]) -> None:
  raise ValueError(
      f"The checkpoint at {where} holds parameters of another model shape; first mismatching "
      "parameters:\n  " + "\n  ".join(lines) + "\nUse a fresh MODEL_DIR for this model (or "
      "delete the old checkpoints), or configure the model that wrote the checkpoint.")


# orbax's marker of an unfinished save (orbax.checkpoint._src.path.atomicity_types
# .TMP_DIR_SUFFIX): `<step>.orbax-checkpoint-tmp` in 0.12.8, `...-tmp-<timestamp>` before.
TMP_DIR_MARKER = ".orbax-checkpoint-tmp"


def remove_temporary_checkpoints(directory: str) -> list[str]:
  """Deletes the unfinished saves (`*.orbax-checkpoint-tmp*` directories) in `directory`.

  A process killed during a save leaves one; it is never restored (only finalized `<step>`
  directories are), so it is only wasted disk. Run when a Checkpointer opens, i.e. when no
  save of this directory is in flight (one training job per MODEL_DIR). Only process 0
  deletes. Returns the names removed.
  """
  if not multihost.is_primary() or not os.path.isdir(directory):
    return []
  removed = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if TMP_DIR_MARKER in name and os.path.isdir(path) and not os.path.islink(path):
      try:
        shutil.rmtree(path)
      except OSError as error:  # e.g. files still being written by a save of another manager
        logging.warning("Could not remove the unfinished checkpoint save %s (%s); it is "
                        "ignored (never restored) and removed by the next Checkpointer.",
                        path, error)
        continue
      removed.append(name)
  if removed:
    logging.warning("Removed %d unfinished checkpoint save(s) in %s: %s", len(removed),
                    directory, ", ".join(removed))
  return removed


@dataclasses.dataclass
class Checkpointer:
  """Periodic orbax saves to `directory` (MODEL_DIR).

  Args:
    directory: MODEL_DIR; created if absent.
    save_every: save when step % save_every == 0 (plus forced saves, e.g. the final step).
    keep: keep the last `keep` checkpoints (None = all).
    async_save: orbax async checkpointing (saves overlap training; `wait()` before exit).
  """

  directory: str
  save_every: int = 1000
  keep: Optional[int] = 3
  async_save: bool = False

  def __post_init__(self):
    if self.save_every < 1:
      raise ValueError(f"save_every={self.save_every} must be >= 1.")
    self.directory = os.path.abspath(os.fspath(self.directory))
    self.removed_temporary = remove_temporary_checkpoints(self.directory)
    multihost.barrier("checkpoint_temporaries_removed")  # process 0 removed them, then all open
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=self.save_every, max_to_keep=self.keep, create=True,
        enable_async_checkpointing=self.async_save)
    # Handlers are registered up front so that a fresh manager (a restarted job) can read
    # item metadata (shapes) before restoring anything.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"params": ocp.StandardCheckpointHandler(),
                       "opt_state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` would save without force (orbax: step % save_every == 0,
    and the first step saved by a manager with no checkpoint yet)."""
    return bool(self.manager.should_save(int(step)))

  def save(self, step: int, params: Params, opt_state: Any, meta: Optional[dict] = None,
           force: bool = False) -> bool:
    """Saves if `step` is due (or `force`); returns whether a save started. `meta` must be
    JSON: anything else is refused before the save starts (a save that failed on it halfway
    left orbax's writer threads on a closed event loop)."""
    meta = dict(meta or {}, step=int(step))
    try:
      json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as error:
      raise TypeError(f"checkpoint meta {meta!r} is not JSON ({error}): pass plain numbers, "
                      "strings, lists and dicts.") from None
    args = ocp.args.Composite(params=ocp.args.StandardSave(params),
                              opt_state=ocp.args.StandardSave(opt_state),
                              meta=ocp.args.JsonSave(meta))
    return self.manager.save(int(step), args=args, force=force)

  def params_metadata(self, step: int) -> Params:
    """Tree of the saved parameters' metadata (each leaf has `.shape`); nothing is read."""
    return self.manager.item_metadata(step)["params"]

  def check_compatible(self, step: int, abstract_params: Params) -> None:
    """Raises ValueError listing the first mismatching parameter paths and shapes."""
    lines = shape_mismatches(abstract_params, self.params_metadata(step))
    if lines:
      _raise_mismatch(os.path.join(self.directory, str(step)), lines)

  def restore(self, step: int, abstract_params: Params, abstract_opt_state: Any):
    """(params, opt_state, meta) of `step`; abstract trees carry shapes, dtypes, shardings."""
    self.check_compatible(step, abstract_params)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params),
          opt_state=ocp.args.StandardRestore(abstract_opt_state),
          meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as error:
      # Same parameter shapes but another optimiser (e.g. adamw vs adafactor state).
      raise ValueError(
          f"Cannot restore the checkpoint at {os.path.join(self.directory, str(step))}: its "
          f"optimizer state does not match this run's optimizer ({error}). Resume with the "
          "optimizer that wrote it, or start from its parameters in a fresh MODEL_DIR "
          "(INITIAL_CHECKPOINT_PATH).") from error
    return restored["params"], restored["opt_state"], dict(restored["meta"])

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def params_dir_of(path: str) -> tuple[str, str]:
  """Finds the `params` item of a checkpoint given a MODEL_DIR (latest step) or a step dir."""
  path = os.path.abspath(os.fspath(path))
  if os.path.isdir(os.path.join(path, "params")):
    return os.path.join(path, "params"), path
  if os.path.isdir(path):
    steps = [int(d) for d in os.listdir(path) if d.isdigit()
             and os.path.isdir(os.path.join(path, d, "params"))]
    if steps:
      step_dir = os.path.join(path, str(max(steps)))
      return os.path.join(step_dir, "params"), step_dir
  raise FileNotFoundError(
      f"No distillspec-jax checkpoint at {path!r}: expected a MODEL_DIR with <step>/params "
      "subdirectories or a <step> directory with a params subdirectory. For T5X or Hugging Face "
      "checkpoints pass restore_fn=distillspec_jax.interop.importer.restore_any (the train "
      "binary does).")


def restore_params(path: str, abstract_params: Params) -> Params:
  """Parameters only, from our own orbax format (INITIAL_CHECKPOINT_PATH / the target).

  Args:
    path: a MODEL_DIR (its latest step is used) or one step directory.
    abstract_params: tree of `jax.ShapeDtypeStruct`: every leaf with a `.sharding`, restored
      into those shards; else numpy arrays, whole, on every process.
  """
  params_dir, step_dir = params_dir_of(path)
  lines = shape_mismatches(abstract_params, params_metadata(params_dir))
  if lines:
    _raise_mismatch(step_dir, lines)
  if all(getattr(a, "sharding", None) is not None for a in jax.tree.leaves(abstract_params)):
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(params_dir, abstract_params)
  # No sharding asked: host arrays on every process. Left to orbax, a leaf would come back
  # on the devices it was saved from, which another process (or another topology) may lack.
  as_host = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype),
                         abstract_params)
  with ocp.PyTreeCheckpointer() as checkpointer:
    return checkpointer.restore(
        params_dir, args=ocp.args.PyTreeRestore(item=abstract_params, restore_args=as_host))


def params_metadata(params_dir: str) -> Any:
  """The tree of shapes and dtypes a `params` folder holds (nothing else is read).

  Asked of the item handler: a `params` folder is one item of a step, whose own metadata
  file lies a level up, and `StandardCheckpointer.metadata` would warn that the folder has
  none."""
  return ocp.StandardCheckpointHandler().metadata(epath.Path(params_dir))


def save_params(path: str, params: Params, meta: Optional[dict] = None) -> None:
  """Writes `params` as `<path>/params` (a step-directory layout readable by restore_params),
  and `meta` (e.g. {"model_config": ...}, JSON) as `<path>/meta` as the trainer's steps have
  it."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(os.path.abspath(path), "params"), params)
    checkpointer.wait_until_finished()
  if meta is not None:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as writer:
      writer.save(os.path.join(os.path.abspath(path), "meta"), args=ocp.args.JsonSave(meta))


def read_meta(path: str) -> Optional[dict]:
  """The `meta` item of a checkpoint (MODEL_DIR: its latest step; or a step directory), or
  None when it has none (parameters saved alone by an older version)."""
  _, step_dir = params_dir_of(path)
  if not os.path.isdir(os.path.join(step_dir, "meta")):
    return None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
    return dict(reader.restore(os.path.join(step_dir, "meta"), args=ocp.args.JsonRestore()))


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs of a tree (optionally with shardings) for orbax restores."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                       sharding=getattr(x, "sharding", None)),
                        tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                      tree, shardings)
