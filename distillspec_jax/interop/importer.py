"""The one importer: checkpoints in our orbax format, T5X or Hugging Face, detected by layout.

    params, config = load_checkpoint(path)                 # config from config.json / shapes
    params, config = load_checkpoint(path, config=preset)  # every shape checked against it

Formats:
  hf    Hugging Face T5 1.1: a directory with config.json + model.safetensors (or a sharded
        index), or a single .safetensors file (then a config is needed). Pickles are refused.
  t5x   T5X checkpoint: a checkpoint_<step> directory (msgpack + TensorStore) or a MODEL_DIR of
        them, or an orbax checkpoint written by T5X.
  ours  Our orbax format (`training.checkpoints`): `<path>/params`, or a MODEL_DIR of
        `<step>/params`.

`restore_any(path, abstract_params)` is the trainer's `restore_fn` for INITIAL_CHECKPOINT_PATH
and the target: the binaries pass it, so every path that names a checkpoint accepts all three.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np

from distillspec_jax.interop import hf_t5
from distillspec_jax.interop import t5x as t5x_checkpoints
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints

Params = Any
FORMATS = ("hf", "t5x", "ours")


# --- our format (delegates to distillspec_jax.training.checkpoints) ----------------------------------


def save_ours(params: Params, path: str) -> None:
  """Writes `params` in our orbax format; `checkpoints.restore_params(path, ...)` reads it."""
  checkpoints.save_params(path, jax.tree.map(np.asarray, params))


def _ours_params_dir(path: str) -> Optional[str]:
  try:
      return checkpoints._params_dir(path)[0]  # pylint: disable=protected-access
  except FileNotFoundError:
    return None


def _ours_shapes(path: str) -> Params:
  """Shapes of our checkpoint's params, from orbax metadata (nothing is read)."""
  return checkpoints.params_metadata(_ours_params_dir(path))


def load_ours(path: str, config: TransformerConfig) -> Params:
  params = checkpoints.restore_params(path, Model(config).param_shapes())
  return jax.tree.map(np.asarray, params)


# --- config inference -------------------------------------------------------------------------


def config_from_params(params: Params, **overrides) -> TransformerConfig:
  """Infers the model configuration from a parameter tree's shapes (arrays or metadata).

  Relative-attention max distance and dropout are not stored in weights: they keep the
  defaults of `TransformerConfig` unless overridden.
  """
  def shape(*path):
    node = params
    for key in path:
      node = node[key]
    return tuple(node.shape)

  decoder = params["decoder"]
  vocab, emb = shape("token_embedder", "embedding")
  heads, buckets = shape("decoder", "relpos_bias", "rel_embedding")
  joined = shape("decoder", "layers_0", "self_attention", "query", "kernel")[1]
  encoder_layers = len([k for k in params.get("encoder", {}) if k.startswith("layers_")])
  mlp_dim = shape("decoder", "layers_0", "mlp", "wi_0", "kernel")[1]
  encoder_mlp_dim = (shape("encoder", "layers_0", "mlp", "wi_0", "kernel")[1]
                     if encoder_layers else mlp_dim)
  kwargs = dict(
      kind="encoder_decoder" if "encoder" in params else "decoder_only",
      vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=joined // heads,
      mlp_dim=mlp_dim, encoder_mlp_dim=None if encoder_mlp_dim == mlp_dim else encoder_mlp_dim,
      num_encoder_layers=encoder_layers,
      num_decoder_layers=len([k for k in decoder if k.startswith("layers_")]),
      relative_attention_num_buckets=buckets,
      logits_via_embedding="logits_dense" not in decoder)
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


# --- format detection and loading --------------------------------------------------------------


def detect_format(path: str) -> str:
  """'hf', 't5x' or 'ours' for a checkpoint path; raises with what was expected otherwise."""
  hf_t5.refuse_pickle(path)
  if path.endswith(".safetensors") or (os.path.isdir(path) and (
      os.path.exists(os.path.join(path, hf_t5.SAFETENSORS_NAME)) or
      os.path.exists(os.path.join(path, hf_t5.SAFETENSORS_INDEX_NAME)))):
    return "hf"
  if os.path.isdir(path) and _ours_params_dir(path) is not None:
    return "ours"
  try:
    t5x_checkpoints.resolve_checkpoint_dir(path)
    return "t5x"
  except FileNotFoundError:
    pass
  raise ValueError(
      f"Cannot tell the checkpoint format of {path!r}: expected a Hugging Face safetensors "
      "file/directory (config.json + model.safetensors), a T5X checkpoint (checkpoint_<step>/ "
      "with a `checkpoint` msgpack file and target.* TensorStore arrays, or an orbax tree), or "
      "our orbax format (<path>/params or <MODEL_DIR>/<step>/params).")


def load_checkpoint(path: str, config: Optional[TransformerConfig] = None, *,
                    fmt: Optional[str] = None):
  """Loads any supported checkpoint. Returns (params as fp32 numpy, config).

  `config` None: taken from config.json (hf) or inferred from the stored shapes; otherwise
  every stored shape is checked against it. `fmt` None: detected (`detect_format`).
  """
  path = os.fspath(path)
  fmt = fmt or detect_format(path)
  if fmt == "hf":
    if config is None and os.path.isfile(path):
      raise ValueError(f"{path} is a bare .safetensors file: it has no config.json, so pass the "
                       "model configuration (convert: --model=<preset>).")
    return hf_t5.load_hf(path, config)
  if fmt == "t5x":
    if config is None:
      config = config_from_params(t5x_checkpoints.read_t5x_params(path))
    return t5x_checkpoints.load_t5x(path, config), config
  if fmt == "ours":
    if config is None:
      config = config_from_params(_ours_shapes(path))
    return load_ours(path, config), config
  raise ValueError(f"Unknown format {fmt!r}; use one of {FORMATS}.")


def load_initial_params(path: str, model) -> Params:
  """Parameters for `model` (a `models.Model`) from an HF, T5X or our checkpoint (autodetected).

  For the trainer's INITIAL_CHECKPOINT_PATH and for the target model. Shapes are checked
  against `model.config` (ValueError listing the first mismatches). Returns fp32 numpy arrays
  in our tree; the caller places/shards them.
  """
  params, _ = load_checkpoint(path, config=model.config)
  return params


def restore_any(path: str, abstract_params: Params) -> Params:
  """`checkpoints.RestoreFn`-compatible importer: `restore_fn(path, abstract_params)`.

  The model shape comes from `abstract_params` (ShapeDtypeStructs, optionally with
  `.sharding`); leaves are placed with those shardings.
  """
  if detect_format(os.fspath(path)) == "ours":
      params = checkpoints.restore_params(path, abstract_params)
  else:
    params, _ = load_checkpoint(path, config=config_from_params(abstract_params))

  def place(x, abstract):
    if not isinstance(x, jax.Array):
      x = np.asarray(x, abstract.dtype)
    sharding = getattr(abstract, "sharding", None)
    return jax.device_put(x, sharding) if sharding is not None else jax.numpy.asarray(x)

  return jax.tree.map(place, params, abstract_params)


def save_checkpoint(params: Params, config: TransformerConfig, path: str, fmt: str) -> None:
  if fmt == "ours":
    save_ours(params, path)
  elif fmt == "hf":
    hf_t5.save_hf(params, config, path)
  elif fmt == "t5x":
    t5x_checkpoints.save_t5x(params, path)
  else:
    raise ValueError(f"Unknown format {fmt!r}; use one of {FORMATS}.")
