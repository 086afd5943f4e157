"""Hugging Face T5 1.1 <-> our parameter tree, safetensors load/save, config conversion.

The mapping is a pure renaming plus transposes, so it is exact in both directions:

  ours (T5X names)                                         HF `T5ForConditionalGeneration`
  token_embedder/embedding [vocab, embed]                  shared.weight [vocab, embed]
  encoder/relpos_bias/rel_embedding [heads, buckets]       encoder.block.0.layer.0.SelfAttention.
                                                             relative_attention_bias.weight [buckets, heads]
  encoder/layers_i/attention/{query,key,value}/kernel      encoder.block.i.layer.0.SelfAttention.{q,k,v}.weight
    [embed, heads*head_dim]                                  [heads*head_dim, embed]   (torch Linear is [out, in])
  encoder/layers_i/attention/out/kernel [hd, embed]        ....SelfAttention.o.weight [embed, hd]
  encoder/layers_i/pre_attention_layer_norm/scale          encoder.block.i.layer.0.layer_norm.weight
  encoder/layers_i/mlp/{wi_0,wi_1}/kernel [embed, mlp]     encoder.block.i.layer.1.DenseReluDense.{wi_0,wi_1}.weight
  encoder/layers_i/mlp/wo/kernel [mlp, embed]              encoder.block.i.layer.1.DenseReluDense.wo.weight
  encoder/layers_i/pre_mlp_layer_norm/scale                encoder.block.i.layer.1.layer_norm.weight
  encoder/encoder_norm/scale                               encoder.final_layer_norm.weight
  decoder/layers_i/{self_attention, encoder_decoder_attention, mlp}
                                                           decoder.block.i.layer.{0: SelfAttention, 1: EncDecAttention,
                                                             2: DenseReluDense}
  decoder/decoder_norm/scale                               decoder.final_layer_norm.weight
  decoder/logits_dense/kernel [embed, vocab]               lm_head.weight [vocab, embed]

HF keeps `relative_attention_bias` only in block 0 of each stack and shares it with the other
blocks, exactly like T5X's single `relpos_bias` per stack.

Decoder-only models have no transformers class (see `DECODER_ONLY_NOTE`); they are exported with
the same HF-style names (decoder stack without `layer.1` cross attention, MLP at `layer.2`) and a
config.json whose `model_type` is `distillspec_t5_decoder_only`, so our own round trip works and a
reader can see at a glance what the tensors are.

Loading never unpickles: only safetensors are read; `pytorch_model.bin` and friends are refused.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping, Optional

import jax
import numpy as np

from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model

Params = Any

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DECODER_ONLY_MODEL_TYPE = "distillspec_t5_decoder_only"
# Files that can only be read by unpickling (arbitrary code execution): never loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

DECODER_ONLY_NOTE = (
    "transformers has no decoder-only class with this architecture: T5's bucketed relative "
    "position bias exists only in its encoder-decoder families (T5, MT5, UMT5, LongT5, "
    "SwitchTransformers, Pop2Piano); its decoder-only LMs use RoPE, ALiBi or learned absolute "
    "positions (Llama, Gemma, Mistral, GPT-2, BLOOM, ...), and those with RMSNorm + gated MLP also "
    "scale attention by 1/sqrt(head_dim) (Gemma adds (1 + scale) norms and sqrt(d) embedding "
    "scaling). Decoder-only checkpoints are therefore exported with HF T5-style names but a "
    f"'{DECODER_ONLY_MODEL_TYPE}' config that only distillspec-jax reads.")


# --- config ---------------------------------------------------------------------------------


def config_to_hf(config: TransformerConfig) -> dict:
  """Our config -> an HF `config.json` dict (T5 1.1: gated-gelu, untied lm_head, no rescale)."""
  if config.encoder_mlp_width != config.mlp_dim:
    raise ValueError(
        f"encoder_mlp_dim={config.encoder_mlp_dim} differs from mlp_dim={config.mlp_dim}, and an "
        "HF T5 config has one d_ff for both stacks; export a model whose encoder_mlp_dim is None "
        "(or equal to mlp_dim), or keep this one in the orbax/T5X formats.")
  out = {
      "vocab_size": config.vocab_size,
      "d_model": config.emb_dim,
      "d_kv": config.head_dim,
      "d_ff": config.mlp_dim,
      "num_heads": config.num_heads,
      "num_layers": config.num_encoder_layers if config.kind == "encoder_decoder" else 0,
      "num_decoder_layers": config.num_decoder_layers,
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "dropout_rate": config.dropout_rate,
      "layer_norm_epsilon": 1e-6,
      "feed_forward_proj": "gated-gelu",
      "dense_act_fn": "gelu_new",
      "is_gated_act": True,
      # T5 1.1 has an untied logits layer; with tied embeddings HF also rescales by d**-0.5,
      # which is what our `logits_via_embedding` does.
      "tie_word_embeddings": bool(config.logits_via_embedding),
      "scale_decoder_outputs": bool(config.logits_via_embedding),  # transformers >= 5 reads this
      "pad_token_id": 0,
      "eos_token_id": 1,
      "decoder_start_token_id": 0,
      "use_cache": True,
  }
  if config.kind == "encoder_decoder":
    out.update(model_type="t5", architectures=["T5ForConditionalGeneration"],
               is_encoder_decoder=True)
  else:
    out.update(model_type=DECODER_ONLY_MODEL_TYPE, architectures=["DistillSpecT5DecoderOnly"],
               is_encoder_decoder=False, note=DECODER_ONLY_NOTE)
  return out


def config_from_hf(hf: Mapping[str, Any], **overrides) -> TransformerConfig:
  """An HF T5 `config.json` dict (or a `T5Config.to_dict()`) -> our config.

  Refuses what our network does not implement (T5 1.0's ReLU MLP, other model types), since
  silently loading such weights would give wrong logits.
  """
  model_type = hf.get("model_type", "t5")
  if model_type not in ("t5", DECODER_ONLY_MODEL_TYPE):
    raise ValueError(f"model_type={model_type!r} is not supported; expected 't5' (T5 1.1) or "
                     f"'{DECODER_ONLY_MODEL_TYPE}'.")
  proj = hf.get("feed_forward_proj", "relu")
  if proj != "gated-gelu":
    raise ValueError(
        f"feed_forward_proj={proj!r}: only T5 1.1's 'gated-gelu' MLP (gelu_new) is implemented; "
        "original T5 ('relu') checkpoints cannot be loaded into this network.")
  eps = float(hf.get("layer_norm_epsilon", 1e-6))
  if abs(eps - 1e-6) > 1e-12:
    raise ValueError(f"layer_norm_epsilon={eps}: our RMSNorm uses 1e-6.")
  decoder_only = model_type == DECODER_ONLY_MODEL_TYPE
  num_layers = int(hf.get("num_layers", 6))
  kwargs = dict(
      kind="decoder_only" if decoder_only else "encoder_decoder",
      vocab_size=int(hf["vocab_size"]), emb_dim=int(hf["d_model"]), head_dim=int(hf["d_kv"]),
      mlp_dim=int(hf["d_ff"]), num_heads=int(hf["num_heads"]),
      num_encoder_layers=0 if decoder_only else num_layers,
      num_decoder_layers=int(hf.get("num_decoder_layers") or num_layers),
      relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
      relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
      dropout_rate=float(hf.get("dropout_rate", 0.1)),
      logits_via_embedding=_rescaled_tied_logits(hf),
  )
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


def _rescaled_tied_logits(hf: Mapping[str, Any]) -> bool:
  """Whether logits are `embedding @ x * d**-0.5` (T5 1.0 style) rather than T5 1.1's lm_head.

  Hub T5 1.1 configs say `tie_word_embeddings: false` (absent means T5's old default, tied).
  transformers >= 5 always writes `tie_word_embeddings: true` and records the rescale in
  `scale_decoder_outputs` instead; its lm_head is then `shared` without rescale, which
  `params_from_hf` reproduces by copying `shared.weight` into our untied logits layer.
  """
  if "scale_decoder_outputs" in hf:
    return bool(hf["scale_decoder_outputs"])
  return bool(hf.get("tie_word_embeddings", True))


# --- parameter mapping ------------------------------------------------------------------------


def _attention(ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  for ours_name, hf_name in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    yield ours + (ours_name, "kernel"), f"{hf}.{hf_name}.weight", True


def _mlp(ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  for name in ("wi_0", "wi_1", "wo"):
    yield ours + (name, "kernel"), f"{hf}.DenseReluDense.{name}.weight", True
  yield ours[:-1] + ("pre_mlp_layer_norm", "scale"), f"{hf}.layer_norm.weight", False


def param_mapping(config: TransformerConfig) -> list[tuple[tuple[str, ...], str, bool]]:
  """(our parameter path, HF tensor name, transpose?) for every parameter of `config`."""
  m = [(("token_embedder", "embedding"), "shared.weight", False)]
  if config.kind == "encoder_decoder":
    m.append((("encoder", "relpos_bias", "rel_embedding"),
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True))
    for i in range(config.num_encoder_layers):
      ours, hf = ("encoder", f"layers_{i}"), f"encoder.block.{i}.layer"
      m.append((ours + ("pre_attention_layer_norm", "scale"), f"{hf}.0.layer_norm.weight", False))
      m += _attention(ours + ("attention",), f"{hf}.0.SelfAttention")
      m += _mlp(ours + ("mlp",), f"{hf}.1")
    m.append((("encoder", "encoder_norm", "scale"), "encoder.final_layer_norm.weight", False))
  m.append((("decoder", "relpos_bias", "rel_embedding"),
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True))
  for i in range(config.num_decoder_layers):
    ours, hf = ("decoder", f"layers_{i}"), f"decoder.block.{i}.layer"
    m.append((ours + ("pre_self_attention_layer_norm", "scale"), f"{hf}.0.layer_norm.weight",
              False))
    m += _attention(ours + ("self_attention",), f"{hf}.0.SelfAttention")
    if config.kind == "encoder_decoder":
      m.append((ours + ("pre_cross_attention_layer_norm", "scale"), f"{hf}.1.layer_norm.weight",
                False))
      m += _attention(ours + ("encoder_decoder_attention",), f"{hf}.1.EncDecAttention")
    # The MLP stays at layer.2 in decoder-only exports too, so the names mean the same thing.
    m += _mlp(ours + ("mlp",), f"{hf}.2")
  m.append((("decoder", "decoder_norm", "scale"), "decoder.final_layer_norm.weight", False))
  if not config.logits_via_embedding:
    m.append((("decoder", "logits_dense", "kernel"), "lm_head.weight", True))
  return m


def tree_get(tree: Mapping, path: tuple):
  """The leaf of a nested dict at `path` (a tuple of keys)."""
  for key in path:
    tree = tree[key]
  return tree


def tree_set(tree: dict, path: tuple, value) -> None:
  """Puts `value` at `path` in a nested dict, creating the inner dicts."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_to_hf(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
  """Our params -> {HF name: contiguous numpy array} (exact: transposes only)."""
  out = {}
  for path, name, transpose in param_mapping(config):
    value = np.asarray(tree_get(params, path))
    out[name] = np.ascontiguousarray(value.T if transpose else value)
  return out


# Names HF may hold in place of (or besides) `shared.weight`; all are the same tensor.
_EMBEDDING_ALIASES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# HF modules that exist but hold nothing we need (HF never uses a cross-attention bias).
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
            "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _match_names(tensors: Mapping[str, Any], config: TransformerConfig) -> dict[str, Any]:
  """{HF name: value} -> {HF name: value} for exactly the names `param_mapping(config)` uses.

  Values may be arrays or shapes: only names are looked at. Resolves the embedding aliases and
  transformers >= 5's lm_head tied to `shared`; raises ValueError listing missing and
  unexpected tensors.
  """
  tensors = dict(tensors)
  if "shared.weight" not in tensors:
    for alias in _EMBEDDING_ALIASES[1:]:
      if alias in tensors:
        tensors["shared.weight"] = tensors[alias]
        break
  if (not config.logits_via_embedding and "lm_head.weight" not in tensors
      and "shared.weight" in tensors):
    # transformers >= 5 ties lm_head to `shared` and may save only `shared.weight`; the model it
    # describes then really computes logits with the embedding (without rescaling).
    tensors["lm_head.weight"] = tensors["shared.weight"]
  expected = {name for _, name, _ in param_mapping(config)}
  ignored = set(_IGNORED)
  if config.logits_via_embedding:
    ignored.add("lm_head.weight")  # tied: a stored copy of the embedding, unused
  missing = sorted(expected - set(tensors))
  unexpected = sorted(set(tensors) - expected - ignored)
  if missing or unexpected:
    raise ValueError(
        f"The checkpoint does not match a {config.kind} model with {config.num_encoder_layers}+"
        f"{config.num_decoder_layers} layers: missing {len(missing)} tensors {missing[:5]}, "
        f"unexpected {len(unexpected)} tensors {unexpected[:5]}. Check --model / config.json.")
  return {name: tensors[name] for name in expected}


def params_from_hf(tensors: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
  """{HF name: array} -> our params (fp32 nested dict), checked against `config`'s shapes.

  Raises ValueError listing missing tensors, unexpected tensors and the first shape mismatches.
  """
  tensors = _match_names(tensors, config)
  params: dict = {}
  for path, name, transpose in param_mapping(config):
    value = np.asarray(tensors[name])
    value = value.T if transpose else value
    tree_set(params, path, np.ascontiguousarray(value.astype(np.float32)))
  check_param_shapes(params, config)
  return params


def shapes_from_hf(shapes: Mapping[str, tuple], config: TransformerConfig) -> Params:
  """{HF name: stored shape} -> our tree of `jax.ShapeDtypeStruct` (fp32) for `config`'s names.

  The shapes-only twin of `params_from_hf`, for checks that must not read the weights
  (`read_hf_shapes` gives the stored shapes). Names are checked here; shapes are not.
  """
  shapes = _match_names(shapes, config)
  tree: dict = {}
  for path, name, transpose in param_mapping(config):
    shape = tuple(shapes[name])
    tree_set(tree, path, jax.ShapeDtypeStruct(shape[::-1] if transpose else shape, np.float32))
  return tree


# --- shape checks (shared by every importer) --------------------------------------------------


def expected_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """{'encoder/layers_0/attention/query/kernel': shape, ...} of a model built from `config`."""
  shapes = Model(config).param_shapes()
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  return {_path_str(p): tuple(x.shape) for p, x in flat}


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def check_param_shapes(params: Params, config: TransformerConfig, max_listed: int = 5) -> None:
  """Raises ValueError unless `params` has exactly the parameters and shapes of `config`.

  The message lists the first `max_listed` mismatches as `path: expected (..), found (..)`.
  """
  want = expected_shapes(config)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  have = {_path_str(p): tuple(np.shape(x)) for p, x in flat}
  problems = []
  for path, shape in want.items():
    if path not in have:
      problems.append(f"{path}: expected {shape}, found nothing (missing)")
    elif have[path] != shape:
      problems.append(f"{path}: expected {shape}, found {have[path]}")
  problems += [f"{p}: expected nothing, found {have[p]} (unexpected)"
               for p in have if p not in want]
  if problems:
    listed = "\n  ".join(problems[:max_listed])
    more = f"\n  ... and {len(problems) - max_listed} more" if len(problems) > max_listed else ""
    raise ValueError(
        f"The checkpoint's parameters do not match the configured {config.kind} model "
        f"(emb_dim={config.emb_dim}, heads={config.num_heads}x{config.head_dim}, "
        f"mlp_dim={config.mlp_dim} (encoder {config.encoder_mlp_width}), layers={config.num_encoder_layers}+"
        f"{config.num_decoder_layers}, vocab={config.vocab_size}); {len(problems)} "
        f"mismatches, first ones:\n  {listed}{more}\nPick the matching --model preset.")


# --- files ------------------------------------------------------------------------------------


def refuse_pickle(path: str) -> None:
  """Raises for pickle-based weight files, which we never load (torch.load can run code)."""
  candidates = [path]
  if os.path.isdir(path):
    candidates = [os.path.join(path, f) for f in os.listdir(path)]
  pickled = [p for p in candidates if p.endswith(PICKLE_SUFFIXES) and os.path.isfile(p)]
  has_safetensors = any(p.endswith(".safetensors") for p in candidates)
  if pickled and not has_safetensors:
    raise ValueError(
        f"{pickled[0]} is a pickle-based PyTorch checkpoint; distillspec-jax never unpickles "
        "files (loading a pickle can execute arbitrary code). Convert it to safetensors first, "
        "in an environment you trust: `transformers` `model.save_pretrained(dir, "
        "safe_serialization=True)` or `safetensors.torch.save_file(state_dict, "
        "'model.safetensors')`.")


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open
  try:
    with safe_open(file, framework="numpy") as f:
      return {k: f.get_tensor(k) for k in f.keys()}
  except (TypeError, ValueError):
    # numpy has no bfloat16 in safetensors' numpy backend; the flax backend (ml_dtypes) does.
    with safe_open(file, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}


def _safetensors_files(path: str) -> list[str]:
  """The safetensors files of an HF checkpoint: the file itself, a directory's
  `model.safetensors`, or else the shards its `model.safetensors.index.json` lists.

  The single file comes first, as in transformers' from_pretrained: save_pretrained of a
  whole model into a folder that held a sharded save leaves the old index behind."""
  refuse_pickle(path)
  if os.path.isfile(path):
    if not path.endswith(".safetensors"):
      raise ValueError(f"{path} is not a .safetensors file.")
    return [path]
  single = os.path.join(path, SAFETENSORS_NAME)
  if os.path.exists(single):
    return [single]
  index = os.path.join(path, SAFETENSORS_INDEX_NAME)
  if os.path.exists(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(path, shard) for shard in shards]
  raise FileNotFoundError(f"No {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME} in {path}.")


def read_hf_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of an HF checkpoint: a `.safetensors` file, or a directory holding
  `model.safetensors` or a sharded `model.safetensors.index.json`."""
  tensors = {}
  for file in _safetensors_files(path):
    tensors.update(_read_safetensors(file))
  return tensors


def read_hf_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """{tensor name: shape} of an HF checkpoint, from the safetensors headers only.

  A safetensors file starts with an 8-byte little-endian header length and a JSON header
  {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}; no tensor is read.
  """
  shapes = {}
  for file in _safetensors_files(path):
    with open(file, "rb") as f:
      size = int.from_bytes(f.read(8), "little")
      header = None
      if 0 < size <= os.path.getsize(file) - 8:
        try:
          header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError):
          pass
    if not isinstance(header, dict):
      raise ValueError(f"{file} is not a safetensors file: its header cannot be read. Re-save "
                       "it with `safetensors` (or transformers' save_pretrained).")
    shapes.update({name: tuple(entry["shape"]) for name, entry in header.items()
                   if name != "__metadata__"})
  return shapes


def read_hf_config(path: str) -> Optional[dict]:
  """The checkpoint's `config.json` as a dict (next to a .safetensors file, or in the
  directory), or None when there is none."""
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  config_file = os.path.join(directory, CONFIG_NAME)
  if not os.path.exists(config_file):
    return None
  with open(config_file) as f:
    return json.load(f)


def load_hf(path: str, config: Optional[TransformerConfig] = None):
  """Loads an HF T5 1.1 safetensors checkpoint (file or directory).

  `config`: the model to load into; when None it is built from the directory's config.json.
  Returns (params, config).
  """
  if config is None:
    hf_config = read_hf_config(path)
    if hf_config is None:
      directory = path if os.path.isdir(path) else os.path.dirname(path)
      raise FileNotFoundError(f"{os.path.join(directory, CONFIG_NAME)} not found: pass a model "
                              "config (--model=...).")
    config = config_from_hf(hf_config)
  return params_from_hf(read_hf_tensors(path), config), config


def save_hf(params: Params, config: TransformerConfig, directory: str) -> None:
  """Writes `config.json` and `model.safetensors` (fp32, exact) into `directory`."""
  from safetensors.numpy import save_file
  check_param_shapes(params, config)
  hf_config = config_to_hf(config)  # refuses what HF T5 cannot express before writing anything
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, CONFIG_NAME), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  save_file(params_to_hf(params, config), os.path.join(directory, SAFETENSORS_NAME),
            metadata={"format": "pt"})


def decoder_only_as_encoder_decoder(params: Params, config: TransformerConfig):
  """An encoder-decoder that computes exactly our decoder-only model's logits.

  The cross-attention output projections are zero, so each decoder layer adds exactly 0 from
  the (dummy, 1-layer) encoder and the decoder is our decoder-only stack. Feed it any encoder
  input and `decoder_input_tokens = [0] + prompt`. This lets transformers' T5 check our
  decoder-only model; it is not an efficient way to serve one (see DECODER_ONLY_NOTE).
  Returns (params, config) of the encoder-decoder.
  """
  if config.kind != "decoder_only":
    raise ValueError("Expected a decoder_only config.")
  c = config
  ed_config = c.replace(kind="encoder_decoder", num_encoder_layers=1, encoder_mlp_dim=None)
  inner = c.num_heads * c.head_dim
  zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
  ones = lambda n: np.ones((n,), np.float32)  # noqa: E731
  attention = lambda: {"query": {"kernel": zeros(c.emb_dim, inner)},  # noqa: E731
                       "key": {"kernel": zeros(c.emb_dim, inner)},
                       "value": {"kernel": zeros(c.emb_dim, inner)},
                       "out": {"kernel": zeros(inner, c.emb_dim)}}
  mlp = {"wi_0": {"kernel": zeros(c.emb_dim, c.mlp_dim)},
         "wi_1": {"kernel": zeros(c.emb_dim, c.mlp_dim)},
         "wo": {"kernel": zeros(c.mlp_dim, c.emb_dim)}}
  encoder = {"relpos_bias": {"rel_embedding": zeros(c.num_heads,
                                                     c.relative_attention_num_buckets)},
             "layers_0": {"pre_attention_layer_norm": {"scale": ones(c.emb_dim)},
                          "attention": attention(), "pre_mlp_layer_norm": {"scale": ones(c.emb_dim)},
                          "mlp": mlp},
             "encoder_norm": {"scale": ones(c.emb_dim)}}
  decoder = jax.tree.map(np.asarray, dict(params["decoder"]))
  for i in range(c.num_decoder_layers):
    layer = dict(decoder[f"layers_{i}"])
    layer["pre_cross_attention_layer_norm"] = {"scale": ones(c.emb_dim)}
    layer["encoder_decoder_attention"] = attention()
    decoder[f"layers_{i}"] = layer
  out = {"token_embedder": jax.tree.map(np.asarray, params["token_embedder"]),
         "encoder": encoder, "decoder": decoder}
  check_param_shapes(out, ed_config)
  return out, ed_config


def to_transformers(params: Params, config: TransformerConfig):
  """A `transformers.T5ForConditionalGeneration` (eval mode, fp32) holding our weights.

  transformers >= 5 always ties `lm_head` to `shared`; T5 1.1's logits layer is separate, so it
  is untied here by giving `lm_head` its own Parameter (and `tie_word_embeddings=False` in the
  config turns off the d**-0.5 output rescale, as in T5 1.1).
  """
  if config.kind != "encoder_decoder":
    raise ValueError(DECODER_ONLY_NOTE)
  import torch
  import transformers
  hf = config_to_hf(config)
  keys = ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "num_layers",
          "num_decoder_layers", "relative_attention_num_buckets",
          "relative_attention_max_distance", "dropout_rate", "layer_norm_epsilon",
          "feed_forward_proj", "tie_word_embeddings", "pad_token_id", "eos_token_id",
          "decoder_start_token_id")
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**{k: hf[k] for k in keys})).eval()
  if not config.logits_via_embedding:
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
  state = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(params, config).items()}
  with torch.no_grad():
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, value in state.items():
      named[name].copy_(value)
  if not config.logits_via_embedding:
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
  return model
