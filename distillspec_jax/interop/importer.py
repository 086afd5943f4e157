"""The one importer: checkpoints in our orbax format, T5X or Hugging Face, detected by layout.

    params, config = load_checkpoint(path)                 # config from config.json / shapes
    params, config = load_checkpoint(path, config=preset)  # every shape checked against it

Formats:
  hf    Hugging Face T5 1.1, or a RoPE causal LM (LlamaForCausalLM, Qwen2ForCausalLM: kind
        'llama'; Qwen3ForCausalLM: 'qwen3'; Gemma3ForCausalLM: 'gemma3'; interop.hf_llama),
        told apart by config.json's model_type: a directory
        with config.json + model.safetensors (or a sharded index), or a single .safetensors
        file (then a config is needed). Pickles are refused.
  t5x   T5X checkpoint: a checkpoint_<step> directory (msgpack + TensorStore) or a MODEL_DIR of
        them, or an orbax checkpoint written by T5X.
  ours  Our orbax format (`training.checkpoints`): `<path>/params`, or a MODEL_DIR of
        `<step>/params`, with the complete model configuration in `meta` (written by the
        trainer and by `save_ours`): the checkpoint alone rebuilds its model, and a preset
        given beside it is checked against it field by field (RoPE, norm epsilon, shapes).

`restore_any(path, abstract_params)` is the trainer's `restore_fn` for INITIAL_CHECKPOINT_PATH
and the target: the binaries pass it (the training layer never imports this one), so every
path that names a checkpoint accepts all three. `check_checkpoint(path, config)` checks a path
against a model before any work starts, from stored shapes only (`stored_shapes`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

import jax
import numpy as np

from distillspec_jax.core.validation import is_remote
from distillspec_jax.data import vocabularies
from distillspec_jax.interop import hf_llama
from distillspec_jax.interop import hf_t5
from distillspec_jax.interop import t5x as t5x_lib
from distillspec_jax.models import acceptance_head as head_lib
from distillspec_jax.models.acceptance_head import AcceptanceHeadConfig
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.config_json import config_from_json, config_to_json
from distillspec_jax.models.model import EOS_ID, Model
from distillspec_jax.training import checkpoints
from distillspec_jax.training import multihost

Params = Any
FORMATS = ("hf", "t5x", "ours")


# --- our format (delegates to distillspec_jax.training.checkpoints) ----------------------------------


# The `meta` key holding a Hugging Face model's bos/eos/pad ids (its config.json's), written by
# an import so that an export without a tokenizer folder keeps the model's own ids.
HF_TOKEN_IDS = "hf_token_ids"


def save_ours(params: Params, path: str, config: Optional[TransformerConfig] = None,
              hf_token_ids: Optional[Mapping[str, Any]] = None) -> None:
  """Writes `params` in our orbax format, with the model configuration `config` beside them
  (`meta`), so that the checkpoint alone rebuilds its model; `load_checkpoint` reads both.
  `hf_token_ids`: the source model's bos/eos/pad ids (its config.json's), kept in `meta`."""
  meta = None if config is None else {"model_config": config_to_json(config)}
  if meta is not None and hf_token_ids:
    meta[HF_TOKEN_IDS] = dict(hf_token_ids)
  checkpoints.save_params(path, jax.tree.map(np.asarray, params), meta)


def ours_config(path: str) -> Optional[TransformerConfig]:
  """The model configuration stored with our checkpoint (its `meta`), or None (none stored)."""
  meta = checkpoints.read_meta(path)
  if not meta or "model_config" not in meta:
    return None
  return config_from_json(meta["model_config"], f"{path}: meta model_config")


# Fields of a configuration that the computation does not depend on (a run may set them
# afresh): everything else must agree between a stored configuration and a preset.
RUN_FIELDS = ("dropout_rate", "max_decode_length", "remat_policy", "dtype")


def stored_config_mismatches(stored: TransformerConfig, config: TransformerConfig) -> list:
  """'field: stored a vs configured b' for every model field (RoPE, norm epsilon, shapes,
  ...) where a checkpoint's stored configuration and the configured model differ."""
  a, b = config_to_json(stored)["fields"], config_to_json(config)["fields"]
  return [f"{k}: checkpoint {a.get(k)!r} vs configured {b.get(k)!r}"
          for k in sorted(set(a) | set(b)) if k not in RUN_FIELDS and a.get(k) != b.get(k)]


def _ours_params_dir(path: str) -> Optional[str]:
  try:
    return checkpoints.params_dir_of(path)[0]
  except FileNotFoundError:
    return None


def _ours_shapes(path: str) -> Params:
  """Shapes of our checkpoint's params, from orbax metadata (nothing is read)."""
  return checkpoints.params_metadata(_ours_params_dir(path))


def load_ours(path: str, config: TransformerConfig) -> Params:
  params = checkpoints.restore_params(path, Model(config).param_shapes())
  return jax.tree.map(np.asarray, params)


def acceptance_head_of(path: str) -> Optional[AcceptanceHeadConfig]:
  """The acceptance head (models/acceptance_head.py) our checkpoint at `path` holds beside
  its network, its width read from the stored shapes; None when it holds none."""
  shapes = _ours_shapes(path)
  if head_lib.PARAMS_KEY not in shapes:
    return None
  return AcceptanceHeadConfig(int(shapes[head_lib.PARAMS_KEY]["hidden"]["kernel"].shape[1]))


def load_ours_with_head(path: str, config: Optional[TransformerConfig],
                        head: AcceptanceHeadConfig) -> tuple:
  """(config, fp32 params) of our checkpoint holding a draft and its acceptance head: the
  stored (or inferred) configuration, checked against `config` when one is given."""
  shapes = _ours_shapes(path)
  stored = ours_config(path) or config_from_params(
      {k: v for k, v in shapes.items() if k != head_lib.PARAMS_KEY})
  if config is not None:
    wrong = stored_config_mismatches(stored, config)
    if wrong:
      raise ValueError(f"{path} holds another model than the configured one: "
                       + "; ".join(wrong[:6]) + ".")
  params = checkpoints.restore_params(path, Model(stored, acceptance_head=head).param_shapes())
  return stored, jax.tree.map(np.asarray, params)


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
  if "relpos_bias" not in decoder:
    return _llama_config_from_params(params, shape, **overrides)
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


def _llama_config_from_params(params: Params, shape, **overrides) -> TransformerConfig:
  """A RoPE-kind config from the shapes of its tree (models/llama.py): 'gemma3' with norms
  after the MLP, 'qwen3' with query norms, 'llama' otherwise. RoPE, the norm epsilon and
  Gemma's window are not stored in weights: they keep TransformerConfig's defaults unless
  given."""
  decoder = params["decoder"]
  attention = ("decoder", "layers_0", "self_attention")
  _, heads, head_dim = shape(*attention, "query", "kernel")
  if "post_mlp_layer_norm" in decoder["layers_0"]:
    kind = "gemma3"
  else:
    kind = "qwen3" if "query_norm" in decoder["layers_0"]["self_attention"] else "llama"
  kwargs = dict(
      kind=kind, vocab_size=shape("token_embedder", "embedding")[0],
      emb_dim=shape("token_embedder", "embedding")[1], num_heads=heads, head_dim=head_dim,
      num_kv_heads=shape(*attention, "key", "kernel")[1],
      mlp_dim=shape("decoder", "layers_0", "mlp", "wi_0", "kernel")[1], num_encoder_layers=0,
      num_decoder_layers=len([k for k in decoder if k.startswith("layers_")]),
      use_qkv_bias="bias" in decoder["layers_0"]["self_attention"]["query"],
      logits_via_embedding="logits_dense" not in decoder)
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


def _refuse_llama_without_config(params: Params, path: str) -> None:
  """A RoPE-kind tree in our or the T5X format does not record its RoPE base, scaling or
  norm epsilon, so it is loaded only with a config that says them."""
  if "relpos_bias" not in params["decoder"]:
    raise ValueError(
        f"{path} holds a RoPE-kind model (llama, qwen3 or gemma3), whose rope_theta, "
        "rope_scaling and norm_epsilon (and Gemma 3's sliding_window) are not stored with the "
        "weights; pass its model configuration (convert: --model=<preset>, e.g. llama_3_2_1b, "
        "qwen3_0_6b, gemma3_1b; gin: the model's preset).")


def _hf_family(path: str, config: Optional[TransformerConfig]):
  """The interop module of an HF checkpoint: hf_llama for a RoPE-family config.json (or a
  RoPE-kind `config` when there is no config.json), hf_t5 for T5; config.json of another
  architecture, or of a family other than `config`'s, is refused."""
  hf = hf_t5.read_hf_config(path)
  if hf is None:
    return hf_llama if config is not None and config.is_rope_decoder else hf_t5
  if hf_llama.is_llama_family(hf):
    family = hf_llama
  elif hf.get("model_type", "t5") in ("t5", hf_t5.DECODER_ONLY_MODEL_TYPE):
    family = hf_t5
  else:
    raise ValueError(
        f"{path}: config.json describes model_type={hf.get('model_type')!r} (architectures="
        f"{hf.get('architectures')}), which distillspec-jax cannot load; supported: T5 1.1 "
        "(model_type 't5'), Llama ('llama', LlamaForCausalLM), Qwen2 ('qwen2', "
        "Qwen2ForCausalLM), Qwen3 ('qwen3', Qwen3ForCausalLM) and Gemma 3 text ('gemma3_text', "
        "Gemma3ForCausalLM).")
  if family is hf_llama:
    hf_llama.config_from_hf(hf)  # refuses, by name, what the network does not compute
  wanted = hf_llama.KINDS.get(hf_llama.model_type(hf)) if family is hf_llama else None
  if config is not None and (config.is_rope_decoder != (family is hf_llama)
                             or (wanted is not None and config.kind != wanted)):
    raise ValueError(
        f"{path} holds a {hf.get('model_type')!r} checkpoint but the configured model is "
        f"kind={config.kind!r}; use a {wanted or 'T5'}-kind preset "
        "(or leave the model out to take it from config.json).")
  return family


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
    t5x_lib.resolve_checkpoint_dir(path)
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
    return _hf_family(path, config).load_hf(path, config)
  if fmt == "t5x":
    if config is None:
      stored = t5x_lib.read_t5x_params(path)
      _refuse_llama_without_config(stored, path)
      config = config_from_params(stored)
    return t5x_lib.load_t5x(path, config), config
  if fmt == "ours":
    stored_config = ours_config(path)
    if config is None:
      config = stored_config
    elif stored_config is not None:
      wrong = stored_config_mismatches(stored_config, config)
      if wrong:
        raise ValueError(f"{path} holds another model than the configured one: "
                         + "; ".join(wrong[:6]) + ".")
    if config is None:
      stored = _ours_shapes(path)
      _refuse_llama_without_config(stored, path)
      config = config_from_params(stored)
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


def stored_shapes(path: str, config: TransformerConfig, fmt: Optional[str] = None) -> Params:
  """The parameter shapes a checkpoint holds, in our tree (leaves have `.shape`).

  Cheap: orbax metadata (ours, T5X orbax), msgpack specs / zarr headers (T5X), safetensors
  headers (hf); no weight is read. `config` is needed for hf only, to map the names (missing
  or unexpected tensors raise ValueError there).
  """
  fmt = fmt or detect_format(path)
  if fmt == "hf":
    return _hf_family(path, config).shapes_from_hf(hf_t5.read_hf_shapes(path), config)
  if fmt == "t5x":
    return t5x_lib.read_t5x_shapes(path)
  if fmt == "ours":
    return _ours_shapes(path)
  raise ValueError(f"Unknown format {fmt!r}; use one of {FORMATS}.")


def _hf_config_mismatches(path: str, config: TransformerConfig) -> list[str]:
  """Fields of an HF config.json that change the computation but not the stored shapes."""
  hf = hf_t5.read_hf_config(path)
  if hf is None:
    return []
  if config.is_rope_decoder:
    return hf_llama.config_mismatches(hf, config)
  stored = hf_t5.config_from_hf(hf)  # refuses what the network does not implement
  return [f"config.json gives {name}={getattr(stored, name)!r}, the model "
          f"{getattr(config, name)!r}"
          for name in ("kind", "relative_attention_max_distance", "logits_via_embedding")
          if getattr(stored, name) != getattr(config, name)]


def check_checkpoint(path: str, config: TransformerConfig) -> str:
  """Checks, cheaply, that `path` holds a checkpoint of the model `config` describes.

  Existence, format (`detect_format`), every stored parameter shape (`stored_shapes`: no
  weight is read) and, for hf, config.json's non-shape fields. Returns the format; raises
  ValueError with a one-paragraph reason (first mismatches joined by '; ').
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise ValueError(f"{path!r} does not exist.")
  fmt = detect_format(path)
  model = (f"the configured {config.kind} model (emb_dim={config.emb_dim}, vocab_size="
           f"{config.vocab_size}, layers={config.num_encoder_layers}+"
           f"{config.num_decoder_layers})")
  try:
    shapes = stored_shapes(path, config, fmt)
    lines = checkpoints.shape_mismatches(Model(config).param_shapes(), shapes)
    if fmt == "hf":
      lines += _hf_config_mismatches(path, config)
    if fmt == "ours" and not lines:
      stored_config = ours_config(path)
      lines += [] if stored_config is None else stored_config_mismatches(stored_config, config)
  except (ValueError, KeyError, FileNotFoundError) as error:
    raise ValueError(f"{path!r} ({fmt} checkpoint) cannot be read as {model}: "
                     f"{' '.join(str(error).split())}") from error
  if lines:
    raise ValueError(f"{path!r} ({fmt} checkpoint) does not hold {model}; first mismatches: "
                     + "; ".join(lines) + ".")
  return fmt


def stored_config(opened: "OpenedCheckpoint", path: str, macro: str,
                  preset_field: str) -> TransformerConfig:
  """The model the checkpoint `opened` (at `path`) describes, or a ValueError naming `macro`,
  the path and the fix: its config.json, or a preset in `preset_field`."""
  if opened.config is not None:
    return opened.config
  if opened.format == "hf":
    raise ValueError(f"{macro}={path!r} has no config.json beside its safetensors, so its "
                     "model is unknown: put the config.json that save_pretrained wrote into "
                     f"that folder (or name its preset: {preset_field}).")
  raise ValueError(f"{macro}={path!r} does not say its whole model (a llama-kind tree "
                   f"without its configuration); name its preset ({preset_field}).")


def check_own_checkpoint(path: str, macro: str, preset_field: str,
                         vocab=None) -> TransformerConfig:
  """The model of a checkpoint named by no preset (its config.json or stored configuration),
  checked before work, every error naming `macro` and the path: the checkpoint says its whole
  model (else the fix is its config.json or a preset in `preset_field`), an HF folder's
  tensors are the ones its config.json describes (headers only), and the model has an
  embedding row for each id of the job's vocabulary `vocab` (None: not checked) that text
  encodes to (a tokenizer's ids past the rows must all be added special tokens other than BOS,
  EOS and pad: vocabularies.token_ids)."""
  try:
    opened = open_checkpoint(path)
  except ValueError as error:
    raise ValueError(f"{macro}={path!r}: {error}") from None
  config = stored_config(opened, path, macro, preset_field)
  if opened.format == "hf":
    try:
      check_checkpoint(path, config)
    except ValueError as error:
      raise ValueError(f"{macro}={path!r}: its config.json and its safetensors disagree: "
                       f"{error} Re-save the model with save_pretrained (or fix config.json)."
                       ) from None
  if vocab is not None and vocabularies.is_tokenizer(vocab):
    try:
      vocabularies.token_ids(vocab, rows=config.vocab_size)
    except ValueError as error:
      raise ValueError(f"{macro}={path!r} does not fit VOCABULARY: {error}") from None
  return config


def check_checkpoint_tokenizers(checkpoints, vocab=None, name: str = "VOCABULARY") -> None:
  """Before work, the job's vocabulary (`vocab`, a seqio.Vocabulary; None when `name` is not
  set) against its checkpoints ((macro, path) pairs; None paths skipped): with none set, a
  RoPE-family folder that carries its own tokenizer is refused (`_check_tokenizer_given`);
  a SentencePiece vocabulary, or none, against a folder whose config.json names another EOS
  (`check_sentencepiece_ids`)."""
  if vocab is None:
    _check_tokenizer_given(checkpoints, name)
  check_sentencepiece_ids(checkpoints, vocab, name)


def _check_tokenizer_given(checkpoints, name: str) -> None:
  """With no vocabulary set (`name`), refuses a RoPE-family checkpoint of `checkpoints` that
  carries its own tokenizer (an HF folder's tokenizer.json): the task would be tokenized with
  its own vocabulary (T5's SentencePiece, or one trained here), whose ids are not the ones the
  model was trained on. T5 checkpoints keep T5's SentencePiece conventions and are not
  refused."""
  for macro, path in checkpoints:
    own = vocabularies.checkpoint_tokenizer(path) if path else None
    if own is None:
      continue
    config = open_checkpoint(path).config
    if config is not None and config.is_rope_decoder:
      raise ValueError(
          f"{macro}={path!r} carries its own tokenizer ({own}) but {name} is not set, so the "
          "task would be tokenized with another vocabulary (T5's SentencePiece, or one the "
          "job trains), not the one the model was trained with: set "
          f"--gin.{name}=\"'{os.path.dirname(own)}'\" (the target's folder).")


def check_sentencepiece_ids(checkpoints, vocab=None, name: str = "VOCABULARY") -> None:
  """A SentencePiece vocabulary (or none: the task's or a trained one) has T5's conventions,
  EOS = 1 (models.model.EOS_ID); refuses an HF checkpoint of `checkpoints` ((macro, path)
  pairs) whose config.json names other EOS ids (a Llama-2 folder with only tokenizer.model:
  unk 0, BOS 1, EOS 2), whose text the job would end at its BOS. `vocab`: a
  seqio.Vocabulary; a Hugging Face tokenizer takes its ids from its files and is not
  checked here."""
  if vocab is not None and vocabularies.is_tokenizer(vocab):
    return
  for macro, path in checkpoints:
    if not path or is_remote(path) or not os.path.exists(path):
      continue
    hf = hf_t5.read_hf_config(path)  # None without a config.json (its format checked later)
    eos = (hf or {}).get("eos_token_id")
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    if eos and EOS_ID not in eos:
      what = (f"{name}={getattr(vocab, 'sentencepiece_model_file', vocab)!r}" if vocab is not None
              else f"{name} unset (the task's or a trained SentencePiece vocabulary)")
      raise ValueError(
          f"{macro}={path!r}: its config.json says eos_token_id={hf['eos_token_id']!r}, but "
          f"{what} has T5's conventions (pad 0, EOS {EOS_ID}), so the job would tokenize and "
          "stop with other ids than the model's. Give the folder a tokenizer.json (transformers "
          "writes one: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) and pass "
          f"that folder as {name}.")


def restore_any(path: str, abstract_params: Params) -> Params:
  """`checkpoints.RestoreFn`-compatible importer: `restore_fn(path, abstract_params)`.

  The model shape comes from `abstract_params` (ShapeDtypeStructs, optionally with
  `.sharding`); leaves are placed with those shardings (each process its own shards).
  """
  if detect_format(os.fspath(path)) == "ours":
    params = checkpoints.restore_params(path, abstract_params)
    if all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
      return params  # restored straight into the asked shardings
  else:
    config = config_from_params(abstract_params)
    if config.is_rope_decoder and hf_t5.read_hf_config(os.fspath(path)) is not None:
      config = None  # RoPE and the norm epsilon come from config.json, not from shapes
    params, _ = load_checkpoint(path, config=config)
    wrong = checkpoints.shape_mismatches(abstract_params, params)
    if wrong:
      raise ValueError(f"{path!r} does not hold the parameters asked for: " + "; ".join(wrong))
  params = jax.tree.map(lambda x, a: np.asarray(x, a.dtype), params, abstract_params)
  shardings = [getattr(a, "sharding", None) for a in jax.tree.leaves(abstract_params)]
  if any(s is None for s in shardings):
    return jax.tree.map(jax.numpy.asarray, params)
  return multihost.put_global(params, jax.tree.map(lambda a: a.sharding, abstract_params))


def save_checkpoint(params: Params, config: TransformerConfig, path: str, fmt: str,
                    source: Optional[str] = None,
                    hf_token_ids: Optional[Mapping[str, Any]] = None) -> None:
  """Writes `params` of `config` at `path` in `fmt`. `source`: for an hf export of a
  RoPE-kind model, a folder whose tokenizer files are copied along (an HF checkpoint's,
  whose bos/eos/pad ids are kept). `hf_token_ids`: the model's bos/eos/pad ids where no
  `source` gives them (kept in our `meta`, or written to an hf export's config.json)."""
  if fmt == "ours":
    save_ours(params, path, config, hf_token_ids)
  elif fmt == "hf" and config.is_rope_decoder:
    hf_llama.save_hf(params, config, path, source, hf_token_ids)
  elif fmt == "hf":
    hf_t5.save_hf(params, config, path)
  elif fmt == "t5x":
    t5x_lib.save_t5x(params, path)
  else:
    raise ValueError(f"Unknown format {fmt!r}; use one of {FORMATS}.")


# --- one typed handle for an opened checkpoint ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpenedCheckpoint:
  """What a checkpoint path holds, read once (no weights): its format, the model
  configuration it carries (HF config.json, our stored `meta`; None where only shapes are
  stored and they do not say everything, as for a llama-kind T5X tree) and the tokenizer
  folder it carries (an HF folder's tokenizer.json; None without one)."""

  path: str
  format: str
  config: Optional[TransformerConfig]
  tokenizer: Optional[str]


def open_checkpoint(path: str) -> OpenedCheckpoint:
  """The OpenedCheckpoint of `path` (ValueError naming the path when it holds none)."""
  path = os.fspath(path)
  if not os.path.exists(path) and "://" not in path:
    raise ValueError(f"{path!r} does not exist.")
  fmt = detect_format(path)
  config = None
  if fmt == "hf":
    hf = hf_t5.read_hf_config(path)
    if hf is not None:
      family = _hf_family(path, None)
      config = family.config_from_hf(hf)
  elif fmt == "ours":
    config = ours_config(path)
  if config is None and fmt in ("ours", "t5x"):
    shapes = _ours_shapes(path) if fmt == "ours" else t5x_lib.read_t5x_shapes(path)
    if "relpos_bias" in shapes["decoder"]:  # T5 kinds: the shapes say everything
      config = config_from_params(shapes)
  tokenizer = vocabularies.checkpoint_tokenizer(path)
  return OpenedCheckpoint(path=path, format=fmt, config=config,
                          tokenizer=None if tokenizer is None else os.path.dirname(tokenizer))
