"""Offline top-k teacher-logit cache for recipes whose training sequences are fixed data.

SupervisedKD (lambda1 = 1), and SeqKD trained on target samples stored as fixed data, train
on sequences that do not depend on the draft, so the target's distribution at every token can
be computed once and read back every epoch instead of running the target each step:

    write_cache(target, target_params, arrays, cache_dir, k=32, task=..., lengths=...)
    cache = open_cache(cache_dir, target=target, target_params=params, arrays=arrays, k=32,
                       task=..., lengths=...)            # refuses a cache of another setup
    data = InMemoryData({**arrays, **cache.arrays}, batch_size)   # rows stay aligned
    trainer.train(config, CachedTeacherObjective(draft, distillation_config), data, ...)

Per token the cache keeps the target's k most probable ids (uint16 when the vocabulary fits,
else int32), their log-probabilities (float32) and the log of the remaining (tail) mass
(float32): k * (4 + id bytes) + 4 bytes per stored position. Distillation then compares the
(k + 1)-bin distributions (`divergences.binned_token_divergence`): a lower bound of the full
divergence by data processing, equal to it at k = vocabulary size.

Layout of `cache_dir` (every file written to a temporary name, then renamed):
  shard-00000.{log_probs,ids,tail}.npy   rows [start, stop) of the training arrays:
                                         [rows, length, k], [rows, length, k], [rows, length]
  shard-00000.json                       written after its three arrays: the cache identity's
                                         hash and the rows (a shard without it is redone)
  manifest.json                          written last: identity, shards, storage cost
A cache without manifest.json is incomplete and is never read; `write_cache` finishes it,
reusing the shards whose json matches, so a writer killed at any point can simply be rerun.

Library code: no gin (the pipeline's PipelineConfig.teacher_cache_k is the switch).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.validation import check_positive_int
from distillspec_jax.distill import blocked
from distillspec_jax.distill import divergences
from distillspec_jax.distill.objectives import (FIXED, DistillationConfig, split_dropout,
                                                training_features)
from distillspec_jax.core.files import read_json, write_json_atomic
from distillspec_jax.models.model import Model

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ARRAYS = ("log_probs", "ids", "tail")
# Batch keys the cached objective reads (none ends in `_tokens`, the trainer's id check).
FEATURES = {"log_probs": "teacher_top_log_probs", "ids": "teacher_top_ids",
            "tail": "teacher_tail_log_prob"}
INPUT_KEYS = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
              "decoder_loss_weights")


def check_k(k, vocab_size: int) -> int:
  """k as an int in [1, vocab_size], or a ValueError naming it and the fix."""
  k = check_positive_int(k, "teacher_cache_k")
  if k > vocab_size:
    raise ValueError(f"teacher_cache_k={k} exceeds the vocabulary size {vocab_size}; pass "
                     f"1 <= k <= {vocab_size} (k = {vocab_size} keeps the full distribution).")
  return k


def id_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def _array_dtypes(vocab_size: int) -> dict:
  """The stored dtype of each cached array (ARRAYS), as written and as read."""
  return {"log_probs": np.float32, "ids": id_dtype(vocab_size), "tail": np.float32}


def bytes_per_token(k: int, vocab_size: int) -> int:
  """Storage per cached position: k log-probs (fp32), k ids, one tail log-mass (fp32)."""
  return k * (4 + id_dtype(vocab_size).itemsize) + 4


# --- identity: what a cache was written for -----------------------------------------------------


def target_fingerprint(model: Model, params) -> dict:
  """Parameter shapes and a SHA-256 of the parameter bytes (tree order), plus the config.

  Hashing reads every parameter once (seconds for the demo, minutes for T5-XXL): the price of
  refusing a cache written by another checkpoint of the same shapes.
  """
  digest = hashlib.sha256()
  shapes = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)
    value = _host_value(leaf)
    shapes[name] = list(value.shape)
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(value).tobytes())
  return {"param_shapes": shapes, "param_sha256": digest.hexdigest(),
          "model_config": json.loads(json.dumps(dataclasses.asdict(model.config), default=str))}


def _host_value(leaf) -> np.ndarray:
  """One parameter whole on this host. A leaf spread over several processes' devices is
  gathered alone (a collective every process makes in the same tree order): the host holds
  one parameter at a time, never the whole model."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(jax.device_get(leaf))


def data_fingerprint(arrays: Mapping[str, np.ndarray]) -> dict:
  """Rows and a SHA-256 of the input features: the cache is row-aligned with these arrays."""
  digest = hashlib.sha256()
  for key in INPUT_KEYS:
    if key in arrays:
      digest.update(key.encode())
      digest.update(np.ascontiguousarray(np.asarray(arrays[key])).tobytes())
  return {"num_examples": int(len(arrays["decoder_input_tokens"])),
          "sha256": digest.hexdigest()}


def cache_identity(target: Model, target_params, arrays, *, k: int, task: str,
                   lengths: Mapping[str, int], temperature: float = 1.0) -> dict:
  vocab_size = target.config.vocab_size
  return {"format": FORMAT_VERSION, "k": check_k(k, vocab_size), "vocab_size": vocab_size,
          "task": str(task), "lengths": {str(n): int(v) for n, v in dict(lengths).items()},
          "temperature": float(temperature), "target": target_fingerprint(target, target_params),
          "data": data_fingerprint(arrays)}


def _identity_hash(identity: dict) -> str:
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


# --- writing -------------------------------------------------------------------------------------


def bins_fn(model: Model, k: int, temperature: float) -> Callable:
  """The cache's one target program, jitted: (params, batch of T5X features [rows, length])
  -> the top-k bins of the log-probabilities at `temperature` (divergences.top_k_bins), from
  logits a block of positions at a time (blocked.py's "auto" blocks)."""
  def bins(params, batch):
    def per_position(index, hidden):
      del index
      log_p = divergences.log_probs(model.project(params, hidden), temperature=temperature)
      return divergences.top_k_bins(log_p, k)
    hidden = model.hidden_states(params, batch)
    size = blocked.resolve_block_size(blocked.AUTO, hidden.shape[1])
    return blocked.map_position_blocks(per_position, hidden, size)
  return jax.jit(bins)


def _save_npy_atomic(path: str, value: np.ndarray) -> None:
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    np.save(f, value)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _shard_path(cache_dir: str, index: int, what: str) -> str:
  suffix = "json" if what == "meta" else f"{what}.npy"
  return os.path.join(cache_dir, f"shard-{index:05d}.{suffix}")


def _shard_done(cache_dir: str, index: int, meta: dict) -> bool:
  path = _shard_path(cache_dir, index, "meta")
  if not os.path.exists(path) or not all(
      os.path.exists(_shard_path(cache_dir, index, a)) for a in ARRAYS):
    return False
  try:
    return read_json(path) == meta
  except ValueError:  # a torn json cannot be: it is renamed into place; be safe anyway
    return False


def write_cache(target: Model, target_params, arrays: Mapping[str, np.ndarray], cache_dir: str,
                *, k: int, task: str, lengths: Mapping[str, int], temperature: float = 1.0,
                batch_size: int = 64, shard_examples: int = 4096, progress: bool = True,
                on_shard: Optional[Callable[[int], None]] = None,
                place: Optional[Callable[[dict], dict]] = None,
                gather: Optional[Callable[[Any], Any]] = None, writer: bool = True) -> dict:
  """Runs the target once over `arrays` (the training split) and writes the cache.

  Args:
    target, target_params: the frozen target.
    arrays: the training split's features, [examples, length] each (train.npz).
    cache_dir: output folder (created); an existing complete cache of the same identity is
      kept as it is; one of another identity is replaced (its manifest is removed first).
    k: ids kept per token, 1 <= k <= vocabulary size.
    task, lengths: recorded and checked on reading.
    temperature: the target temperature T_p the log-probabilities are taken at.
    batch_size, shard_examples: examples per target call and per shard file.
    on_shard: called with the shard index after each shard is complete (tests).
    place: puts each batch of T5X features ([batch_size, length] each) where the target's
      program reads it (e.g. rows split over a mesh's 'data' axis); None: as NumPy arrays.
    gather: the program's outputs -> host arrays of every row (None: jax.device_get); with
      several processes, a gather across them (every process calls it: a collective).
    writer: whether this process writes the files. With several processes every one runs
      the target over every batch (the program spans their devices) and only one writes;
      all read the same folder (a file system every process sees, as for the job's stages).

  Returns:
    the manifest (also in cache_dir/manifest.json), with "reused_shards" for this call.
  """
  batch_size = check_positive_int(batch_size, "batch_size")
  shard_examples = check_positive_int(shard_examples, "shard_examples")
  identity = cache_identity(target, target_params, arrays, k=k, task=task, lengths=lengths,
                            temperature=temperature)
  manifest_path = os.path.join(cache_dir, MANIFEST)
  complete = _complete_manifest(manifest_path, identity)
  if complete is not None:
    return dict(complete, reused_shards=len(complete["shards"]))
  if writer:
    os.makedirs(cache_dir, exist_ok=True)
    if os.path.exists(manifest_path):
      os.remove(manifest_path)  # first: from here on the folder reads as incomplete
    for stale in glob.glob(os.path.join(cache_dir, "*.tmp-*")):
      os.remove(stale)  # a killed writer's torn temporaries
  key = _identity_hash(identity)
  num = identity["data"]["num_examples"]
  features = {n: np.asarray(arrays[n]) for n in INPUT_KEYS if n in arrays}
  bins = bins_fn(target, identity["k"], float(temperature))

  def run(batch):  # [batch_size, length] host features -> host bins of every row
    batch = training_features(batch, target)
    out = bins(target_params, place(batch) if place else batch)
    return (gather or jax.device_get)(out)

  shards, reused = [], 0
  from tqdm.auto import tqdm  # only the writer needs it
  bar = tqdm(total=num, desc=f"teacher cache (k={identity['k']})", unit="example",
             dynamic_ncols=True, disable=not (progress and writer))
  for index, start in enumerate(range(0, num, shard_examples)):
    stop = min(start + shard_examples, num)
    meta = {"identity_sha256": key, "rows": [start, stop]}
    shards.append({"index": index, "rows": [start, stop]})
    if _shard_done(cache_dir, index, meta):
      reused += 1
      bar.update(stop - start)
    else:
      parts = _run_shard(run, features, start, stop, batch_size, bar)
      if writer:
        dtypes = _array_dtypes(identity["vocab_size"])
        for name in ARRAYS:
          _save_npy_atomic(_shard_path(cache_dir, index, name), parts[name].astype(dtypes[name]))
        write_json_atomic(_shard_path(cache_dir, index, "meta"), meta)  # the shard is complete
      if on_shard is not None:
        on_shard(index)
  bar.close()
  positions = int(np.prod(np.asarray(arrays["decoder_input_tokens"]).shape))
  manifest = {"identity": identity, "shards": shards,
              "bytes_per_token": bytes_per_token(identity["k"], identity["vocab_size"]),
              "stored_positions": positions,
              "total_bytes": positions * bytes_per_token(identity["k"], identity["vocab_size"])}
  if writer:
    write_json_atomic(manifest_path, manifest)  # last: the cache is complete
  return dict(manifest, reused_shards=reused)


def _complete_manifest(path: str, identity: dict) -> Optional[dict]:
  """The manifest at `path` if it is there and was written for `identity`, else None (also
  when another process's writer removes it meanwhile)."""
  try:
    manifest = read_json(path)
  except (FileNotFoundError, ValueError):
    return None
  return manifest if manifest.get("identity") == identity else None


def _run_shard(run: Callable, features: dict, start: int, stop: int, batch_size: int,
               bar) -> dict:
  """The target's bins for rows [start, stop): {array name: [stop - start, ...]}."""
  parts = {a: [] for a in ARRAYS}
  for lo in range(start, stop, batch_size):
    hi = min(lo + batch_size, stop)
    # Pad the last batch to batch_size rows: one compiled shape for the whole split.
    batch = {n: np.pad(v[lo:hi], [(0, batch_size - (hi - lo))] + [(0, 0)] * (v.ndim - 1))
             for n, v in features.items()}
    for name, value in zip(ARRAYS, run(batch)):
      parts[name].append(np.asarray(value)[:hi - lo])
    bar.update(hi - lo)
  return {name: np.concatenate(value) for name, value in parts.items()}


# --- reading -------------------------------------------------------------------------------------


class ShardedRows:
  """Rows of one cached array across its shard files (memory-mapped): `rows[indices]`."""

  def __init__(self, paths: list, starts: list, shape: tuple, dtype):
    self._arrays = [np.load(p, mmap_mode="r") for p in paths]
    self._starts = np.asarray(starts)
    self.shape, self.dtype = tuple(shape), np.dtype(dtype)

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, indices) -> np.ndarray:
    indices = np.asarray(indices)
    shard = np.searchsorted(self._starts, indices, side="right") - 1
    out = np.empty((len(indices),) + self.shape[1:], self.dtype)
    for s in np.unique(shard):
      where = shard == s
      out[where] = self._arrays[s][indices[where] - self._starts[s]]
    return out


def _mismatch(what: str, cached, expected, cache_dir: str, fix: str) -> ValueError:
  return ValueError(f"The teacher cache in {cache_dir!r} was written for {what}={cached!r}, "
                    f"but this run has {what}={expected!r}. {fix}")


@dataclasses.dataclass(frozen=True)
class TeacherCache:
  manifest: dict
  arrays: dict  # FEATURES name -> ShardedRows, [examples, length, k] / [examples, length]

  @property
  def k(self) -> int:
    return int(self.manifest["identity"]["k"])


def open_cache(cache_dir: str, *, target: Model, target_params, arrays, k: int, task: str,
               lengths: Mapping[str, int], temperature: float = 1.0,
               write_command: str = "run the teacher_cache stage") -> TeacherCache:
  """The complete cache in `cache_dir` if it was written for exactly this setup.

  Raises ValueError, naming the value and the fix, for a missing folder, an incomplete cache
  (no manifest: writing was interrupted), or one written for another target (parameter
  shapes or bytes), vocabulary, task, k, lengths, temperature or training split.
  """
  rewrite = f"Delete the folder and {write_command} again for this setup."
  if not cache_dir or not os.path.isdir(cache_dir):
    raise ValueError(f"teacher cache directory {cache_dir!r} does not exist; {write_command} "
                     "first (it runs the target once over the training split).")
  manifest_path = os.path.join(cache_dir, MANIFEST)
  if not os.path.exists(manifest_path):
    raise ValueError(f"{cache_dir!r} holds no complete teacher cache (no {MANIFEST}: writing "
                     f"was interrupted or never finished); {write_command} to finish it.")
  manifest = read_json(manifest_path)
  cached = manifest["identity"]
  vocab_size = target.config.vocab_size
  k = check_k(k, vocab_size)
  if cached.get("format") != FORMAT_VERSION:
    raise _mismatch("format", cached.get("format"), FORMAT_VERSION, cache_dir, rewrite)
  if cached["vocab_size"] != vocab_size:
    raise _mismatch("vocab_size", cached["vocab_size"], vocab_size, cache_dir, rewrite)
  for name, expected in (("task", str(task)), ("k", k), ("temperature", float(temperature)),
                         ("lengths", {str(n): int(v) for n, v in dict(lengths).items()})):
    if cached[name] != expected:
      raise _mismatch(name, cached[name], expected, cache_dir, rewrite)
  fingerprint = target_fingerprint(target, target_params)
  if cached["target"]["param_shapes"] != fingerprint["param_shapes"]:
    names = [n for n in fingerprint["param_shapes"]
             if cached["target"]["param_shapes"].get(n) != fingerprint["param_shapes"][n]]
    first = names[0] if names else next(iter(cached["target"]["param_shapes"]), "?")
    raise ValueError(
        f"The teacher cache in {cache_dir!r} was written by another target model: parameter "
        f"{first} has shape {cached['target']['param_shapes'].get(first)} there and "
        f"{fingerprint['param_shapes'].get(first)} here (cached model_config "
        f"{cached['target']['model_config']}). {rewrite}")
  if cached["target"]["param_sha256"] != fingerprint["param_sha256"]:
    raise _mismatch("target parameters (sha256)", cached["target"]["param_sha256"][:16],
                    fingerprint["param_sha256"][:16], cache_dir,
                    "Another checkpoint of the same shapes wrote it (e.g. the target was "
                    "retrained). " + rewrite)
  data = data_fingerprint(arrays)
  if cached["data"] != data:
    raise _mismatch("training split", cached["data"], data, cache_dir,
                    "The cache is row-aligned with the training arrays it was written from. "
                    + rewrite)
  num, length = data["num_examples"], np.asarray(arrays["decoder_input_tokens"]).shape[1]
  starts = [s["rows"][0] for s in manifest["shards"]]
  shapes = {"log_probs": (num, length, k), "ids": (num, length, k), "tail": (num, length)}
  dtypes = _array_dtypes(vocab_size)
  out = {}
  for name in ARRAYS:
    paths = [_shard_path(cache_dir, s["index"], name) for s in manifest["shards"]]
    out[FEATURES[name]] = ShardedRows(paths, starts, shapes[name], dtypes[name])
  return TeacherCache(manifest=manifest, arrays=out)


# --- distillation from the cache ------------------------------------------------------------------


def check_fixed_data(config: DistillationConfig) -> None:
  """The cache holds the target on the fixed training sequences only: refuse sampling."""
  if config.lambda1 >= 1.0 and config.top_k_fraction is None:
    return
  if config.top_k_fraction is not None:
    raise ValueError(f"top_k_fraction={config.top_k_fraction!r} (AdaSPEC token selection) "
                     "with the teacher cache: selection needs the target's full logits; turn "
                     "the cache off (teacher_cache_k=None) for AdaSPEC.")
  if config.lambda2 > 0.0:
    raise ValueError(
        f"lambda1={config.lambda1!r}, lambda2={config.lambda2!r}: this recipe samples from "
        "the draft (on-policy), whose sequences change every step and are not in the teacher "
        "cache. Use the cache with fixed-data recipes only (SupervisedKD, lambda1 = 1), or "
        "turn it off (teacher_cache_k=None).")
  raise ValueError(
      f"lambda1={config.lambda1!r}, lambda2={config.lambda2!r}: this recipe samples from the "
      "target every step, and those samples are not in the teacher cache. For SeqKD with "
      "fixed target samples, store the samples as the training data and set lambda1 = 1; "
      "otherwise turn the cache off (teacher_cache_k=None).")


@dataclasses.dataclass(frozen=True)
class CachedTeacherObjective:
  """DistillSpec on fixed data with the target read from a cache (no target in the step).

  The batch carries `teacher_top_log_probs` / `teacher_top_ids` [b, L, k] and
  `teacher_tail_log_prob` [b, L] next to the T5X features; the loss is the binned divergence.
  """

  draft: Model
  config: DistillationConfig = DistillationConfig(lambda1=1.0, lambda2=0.0)
  name = "distill"
  frozen_names = ()

  def __post_init__(self):
    check_fixed_data(self.config)
    if self.draft.acceptance_head is not None or self.config.acceptance_weight > 0.0:
      raise ValueError(
          "The teacher cache does not train an acceptance head (its labels need the target's "
          "full distribution at each position, the cache holds its top k); train a draft with "
          "a head with the target in the step (teacher_cache_k=None), or leave the head out "
          f"(acceptance_weight={self.config.acceptance_weight!r}).")

  @property
  def model(self) -> Model:
    return self.draft

  def make_batch(self, params, frozen, batch, rng):
    missing = [n for n in FEATURES.values() if n not in batch]
    if missing:
      raise ValueError(f"The batch has no {missing}: pass the training arrays merged with "
                       "open_cache(...).arrays (teacher_cache.py).")
    out = training_features(batch, self.draft)
    out.update({n: jnp.asarray(batch[n]) for n in FEATURES.values()})
    return out, jnp.int32(FIXED)

  def loss(self, params, frozen, batch, dropout_rng=None):
    """Scalar binned divergence and metrics (divergence, binned tvd, num_tokens, ...).

    The draft's logits exist a block of positions at a time (`config.loss_block_size`)."""
    c = self.config
    weights = batch["decoder_loss_weights"]
    hidden_rng, block_rng = split_dropout(dropout_rng)
    inputs = {"draft": self.draft.hidden_states(params, batch, dropout_rng=hidden_rng),
              "cached": tuple(batch[n] for n in ("teacher_top_log_probs", "teacher_top_ids",
                                                 "teacher_tail_log_prob"))}

    def per_position(index, block):
      draft_logits = self.draft.project(params, block["draft"], dropout_rng=block_rng(index))
      # The binned TVD is <= the full one, so 1 - it over-states the acceptance for k < vocab
      # (and block-acceptance weights read from it over-state each position's reach).
      return {"divergence": divergences.binned_token_divergence(
                  c.divergence, *block["cached"], draft_logits,
                  draft_temperature=c.draft_temperature, beta=c.beta, lk_s=c.lk_s,
                  lk_eta=c.lk_eta),
              "tvd": divergences.binned_token_divergence(
                  "tvd", *block["cached"], jax.lax.stop_gradient(draft_logits),
                  draft_temperature=c.draft_temperature)}

    size = blocked.resolve_block_size(c.loss_block_size, weights.shape[1],
                                      "DistillationConfig.loss_block_size")
    values = blocked.map_position_blocks(per_position, inputs, size)
    divergence = jnp.mean(divergences.masked_sequence_mean(values["divergence"], weights))
    per_token, metrics = c.weighted(values["divergence"], 1.0 - values["tvd"], weights)
    loss = jnp.mean(divergences.masked_sequence_mean(per_token, weights))
    tvd = jnp.mean(divergences.masked_sequence_mean(values["tvd"], weights))
    return loss, {**metrics, "divergence": divergence, "loss": loss, "tvd": tvd,
                  "predicted_acceptance": 1.0 - tvd, "num_tokens": jnp.sum(weights)}


def with_cache(arrays: Mapping[str, Any], cache: TeacherCache) -> dict:
  """The training arrays plus the cache's row-aligned arrays (for an indexed data source)."""
  return {**dict(arrays), **cache.arrays}
