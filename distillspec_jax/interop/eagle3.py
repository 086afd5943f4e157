"""EAGLE-3 export of a llama-kind draft head (models/head.py) for SGLang and vLLM.

`export_eagle3(head, params, directory, ...)` writes two folders, each a `config.json` and a
`model.safetensors` with the same tensors:

  sglang/       config.json of `LlamaForCausalLMEagle3` (a one-layer Llama config with
                `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`);
  speculators/  config.json of vLLM's speculators format (`speculators_model_type: eagle3`,
                `speculators_config` with the verifier, `transformer_layer_config`,
                `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, ...).

Tensors (torch Linear weights are [out, in]; H heads, K kv heads, D head_dim, n features):

  ours                                          SGLang EAGLE-3
  fc/kernel [n*d, d]                            fc.weight [d, n*d]
  layer/input_norm/scale                        midlayer.input_layernorm.weight
  layer/hidden_norm/scale                       midlayer.hidden_norm.weight
  layer/self_attention/query/kernel [2d, H, D]  midlayer.self_attn.q_proj.weight [H*D, 2d]
  layer/self_attention/{key,value}/kernel       midlayer.self_attn.{k,v}_proj.weight [K*D, 2d]
  layer/self_attention/out/kernel [H, D, d]     midlayer.self_attn.o_proj.weight [d, H*D]
  layer/pre_mlp_layer_norm/scale                midlayer.post_attention_layernorm.weight
  layer/mlp/{wi_0, wi_1}/kernel [d, m]          midlayer.mlp.{gate_proj, up_proj}.weight [m, d]
  layer/mlp/wo/kernel [m, d]                    midlayer.mlp.down_proj.weight [d, m]
  norm/scale                                    norm.weight
  lm_head/kernel [d, draft vocab]               lm_head.weight [draft vocab, d]
  draft_ids                                     d2t [draft vocab] int64 (target id - draft id),
                                                t2d [vocab] bool (target ids in the draft vocab)
  token_embedder/embedding                      embed_tokens.weight, only where it differs from
                                                the target's (the engines share the target's)

Feature layers: our hidden-state index i (the output of decoder layer i, the input of layer
i + 1) is written as each engine reads it. SGLang's `eagle_config` ids name the layer whose
output is captured (it captures before layer id + 1): id i - 1. vLLM captures before decoder
layer id and reads the speculators config's ids as they are: id i. Index 0, the embedding
output, has no SGLang id and is refused. The engines' heads read exactly three hidden states, each
captured before a decoder layer runs: a head of another number of feature layers, or one
reading the last decoder layer's output, is refused too.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import numpy as np

from distillspec_jax.interop import hf_llama
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.head import Head, HeadConfig

Params = Any

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# (ours, theirs, how): how = "T" transposes a 2-D kernel, "in1" / "in2" flatten a kernel of
# 1 / 2 input axes to 2-D then transpose, "same" keeps it.
_TENSORS = (
    (("fc", "kernel"), "fc.weight", "T"),
    (("layer", "input_norm", "scale"), "midlayer.input_layernorm.weight", "same"),
    (("layer", "hidden_norm", "scale"), "midlayer.hidden_norm.weight", "same"),
    (("layer", "self_attention", "query", "kernel"), "midlayer.self_attn.q_proj.weight", "in1"),
    (("layer", "self_attention", "key", "kernel"), "midlayer.self_attn.k_proj.weight", "in1"),
    (("layer", "self_attention", "value", "kernel"), "midlayer.self_attn.v_proj.weight", "in1"),
    (("layer", "self_attention", "out", "kernel"), "midlayer.self_attn.o_proj.weight", "in2"),
    (("layer", "pre_mlp_layer_norm", "scale"), "midlayer.post_attention_layernorm.weight",
     "same"),
    (("layer", "mlp", "wi_0", "kernel"), "midlayer.mlp.gate_proj.weight", "T"),
    (("layer", "mlp", "wi_1", "kernel"), "midlayer.mlp.up_proj.weight", "T"),
    (("layer", "mlp", "wo", "kernel"), "midlayer.mlp.down_proj.weight", "T"),
    (("norm", "scale"), "norm.weight", "same"),
    (("lm_head", "kernel"), "lm_head.weight", "T"),
)
EMBEDDING_KEY = "embed_tokens.weight"
# The tensors an export holds (plus EMBEDDING_KEY where the head's embedding is its own).
SGLANG_KEYS = tuple(sorted([theirs for _, theirs, _ in _TENSORS] + ["d2t", "t2d"]))
# The hidden states an engine's EAGLE-3 head reads (SGLang's and vLLM's fc: 3 * hidden_size).
NUM_FEATURE_LAYERS = 3
# The config.json fields of the head's layer that come from the target: an export is imported
# only for a target whose fields equal them.
TARGET_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling")
SPECULATORS_FIELDS = ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                      "embed_requires_grad", "norm_before_residual", "speculators_config",
                      "speculators_model_type", "target_hidden_size",
                      "transformer_layer_config")


# What a head's layer has beyond the engines' EAGLE-3 Llama layer, by target kind.
_KIND_LAYERS = {"qwen3": "q/k norms (an RMSNorm over every query and key head)",
                "gemma3": "GELU-gated MLP, q/k norms and Gemma's attention scale",
                "t5": "T5 relative-position attention and a gated-GELU MLP"}


def _check_exportable(head: Head) -> None:
  c = head.config
  if c.kind != "llama":
    raise ValueError(f"EAGLE-3 export takes a llama-kind head; this head is {c.kind} (its "
                     f"layer has {_KIND_LAYERS.get(c.kind, _KIND_LAYERS['t5'])}, which the "
                     "engines' EAGLE-3 Llama layer lacks: the head's layer is its target "
                     "kind's). Export heads of llama-kind targets.")
  if c.target.use_qkv_bias:
    raise ValueError("EAGLE-3 export: the engines' EAGLE-3 Llama layer has no q/k/v biases; "
                     "this target (Qwen2-style use_qkv_bias=True) cannot be exported.")
  if 0 in head.feature_layers:
    raise ValueError(f"feature_layers={head.feature_layers} reads the embedding output (index "
                     "0), which EAGLE-3's layer ids cannot name; export a head of layers >= 1.")
  layers, last = head.feature_layers, c.target.num_decoder_layers
  if len(layers) != NUM_FEATURE_LAYERS:
    raise ValueError(f"feature_layers={layers} has {len(layers)} hidden states; SGLang's and "
                     f"vLLM's EAGLE-3 heads read exactly {NUM_FEATURE_LAYERS} (their fc is "
                     f"{NUM_FEATURE_LAYERS} * hidden_size wide), so neither engine would load "
                     f"this export. Train the head on {NUM_FEATURE_LAYERS} feature layers "
                     "(HeadConfig.feature_layers; for a target of 8 or more layers the default "
                     "low, middle, high).")
  if last in layers:
    raise ValueError(f"feature layer {last} is the output of the target's last decoder layer, "
                     "which the engines cannot hand the head: they capture a hidden state "
                     f"before a decoder layer runs (SGLang never reaches layer id {last - 1}). "
                     f"Export a head of layers 1 .. {last - 1} (for a target of 8 or more layers "
                     "the default low, middle, high layers qualify).")


def layer_config(head: Head) -> dict:
  """The head layer's Llama config.json fields (one layer, the head's MLP width)."""
  out = hf_llama.config_to_hf(head.config.layer_config)
  out.update(architectures=[SGLANG_ARCHITECTURE], draft_vocab_size=head.config.draft_vocab_size,
             tie_word_embeddings=False)
  return out


def sglang_config(head: Head) -> dict:
  out = layer_config(head)
  out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in
                                                              head.feature_layers],
                         "use_aux_hidden_state": True}
  return out


def speculators_config(head: Head, verifier: str, speculative_tokens: int,
                       own_embedding: bool = False) -> dict:
  layer = layer_config(head)
  layer["architectures"] = ["LlamaForCausalLM"]
  return {
      "architectures": [SPECULATORS_ARCHITECTURE],
      "speculators_model_type": "eagle3",
      "speculators_config": {
          "algorithm": "eagle3",
          "proposal_methods": [{"proposal_type": "greedy",
                                "speculative_tokens": int(speculative_tokens)}],
          "default_proposal_method": "greedy",
          "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
      },
      "transformer_layer_config": layer,
      "draft_vocab_size": head.config.draft_vocab_size,
      "norm_before_residual": False,  # the residual stream is the fused feature before norm
      "target_hidden_size": head.config.width,
      # vLLM captures before decoder layer id and reads the ids as they are: our index i.
      "eagle_aux_hidden_state_layer_ids": [int(i) for i in head.feature_layers],
      # Whether the embedding was trained apart from the target's (exported as embed_tokens).
      "embed_requires_grad": bool(own_embedding),
  }


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return np.asarray(tree, np.float32)


def to_tensors(head: Head, params: Params, target_params: Optional[Params] = None) -> dict:
  """The head's tensors under EAGLE-3 names (`embed_tokens.weight` only where the head's
  embedding is not the target's, or no target params are given)."""
  _check_exportable(head)
  out = {}
  for ours, theirs, how in _TENSORS:
    value = _get(params, ours)
    if how == "in1":
      value = value.reshape(value.shape[0], -1)
    elif how == "in2":
      value = value.reshape(-1, value.shape[-1])
    out[theirs] = np.ascontiguousarray(value if how == "same" else value.T)
  vocab = head.config.vocab_size
  ids = head.draft_ids if head.draft_ids is not None else np.arange(vocab)
  out["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
  out["t2d"] = np.zeros((vocab,), bool)
  out["t2d"][ids] = True
  embedding = _get(params, ("token_embedder", "embedding"))
  if target_params is None or not np.array_equal(
      embedding, _get(target_params, ("token_embedder", "embedding"))):
    out[EMBEDDING_KEY] = embedding
  return out


def export_eagle3(head: Head, params: Params, directory: str, *, verifier: str,
                  target_params: Optional[Params] = None, speculative_tokens: int = 3) -> dict:
  """Writes `directory/sglang` and `directory/speculators` (module docstring). `verifier`:
  the target's name or path as the engines load it. Returns {folder: path}."""
  from safetensors.numpy import save_file  # the interop layer's optional dependency
  tensors = to_tensors(head, params, target_params)
  own_embedding = EMBEDDING_KEY in tensors
  if own_embedding:
    logging.warning(
        "EAGLE-3 export to %s: the head's token embedding is not the target's (or no "
        "target_params were given to compare), so the export carries it as %s. vLLM loads it, "
        "but SGLang replaces the head's embed_tokens with the target's when it serves an "
        "EAGLE-3 head (its worker's set_embed), so the sglang folder would be served with "
        "another embedding than the one trained: serve it with vLLM, or train the head with "
        "the target's embedding.", directory, EMBEDDING_KEY)
  first = head.feature_layers[0]
  if first != 2:
    logging.warning(
        "EAGLE-3 export to %s: the first feature layer %d is not hidden state 2, so the sglang "
        "config's first layer id is %d, not 1. SGLang before PR 25454 adds 1 to every id (the "
        "layers trained on); later SGLang adds 1 only when the first id is 1 and otherwise reads "
        "the ids one layer lower, silently. Serve it with an SGLang that adds 1, or train the "
        "head with hidden state 2 first (the default low, middle, high layers of a target of 8 "
        "or more layers).", directory, first, first - 1)
  configs = {"sglang": sglang_config(head),
             "speculators": speculators_config(head, verifier, speculative_tokens,
                                               own_embedding)}
  paths = {}
  for name, config in configs.items():
    folder = os.path.join(directory, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    paths[name] = folder
  return paths


def _from_tensors(tensors: dict, head: Head, target_params: Optional[Params]) -> Params:
  shapes = head.param_shapes()
  params: dict = {}
  for ours, theirs, how in _TENSORS:
    value = np.asarray(tensors[theirs], np.float32)
    shape = _shape_at(shapes, ours)
    value = value if how == "same" else value.T
    node = params
    for key in ours[:-1]:
      node = node.setdefault(key, {})
    node[ours[-1]] = value.reshape(shape)
  if EMBEDDING_KEY in tensors:
    embedding = np.asarray(tensors[EMBEDDING_KEY], np.float32)
  elif target_params is not None:
    embedding = _get(target_params, ("token_embedder", "embedding"))
  else:
    raise ValueError(f"The export has no {EMBEDDING_KEY} (it shares the target's); pass "
                     "target_params to import it.")
  params["token_embedder"] = {"embedding": embedding}
  return params


def _shape_at(shapes, path) -> tuple:
  for key in path:
    shapes = shapes[key]
  return tuple(shapes.shape)


def import_eagle3(folder: str, target: TransformerConfig,
                  target_params: Optional[Params] = None) -> tuple[Head, Params]:
  """Reads an export's `sglang` or `speculators` folder back: (Head for `target`, params)."""
  from safetensors.numpy import load_file
  with open(os.path.join(folder, "config.json")) as f:
    raw = json.load(f)
  speculators = "transformer_layer_config" in raw  # vLLM's format: the layer's fields nested
  config = raw["transformer_layer_config"] if speculators else raw
  _check_import_target(config, target, folder)
  tensors = load_file(os.path.join(folder, "model.safetensors"))
  missing = [theirs for _, theirs, _ in _TENSORS if theirs not in tensors]
  if missing:
    raise ValueError(f"{folder}/model.safetensors lacks {', '.join(missing)}: it is not an "
                     "EAGLE-3 head of SGLang's LlamaForCausalLMEagle3 layout (module "
                     "docstring); point import_eagle3 at an export's sglang folder.")
  if "d2t" in tensors:
    ids = (np.asarray(tensors["d2t"]) + np.arange(len(tensors["d2t"]))).astype(int)
  else:  # no map: the draft vocabulary is the target's (SGLang reads no hot tokens either)
    rows = tensors["lm_head.weight"].shape[0]
    if rows != target.vocab_size:
      raise ValueError(f"{folder}/model.safetensors has no d2t (draft id -> target id "
                       f"offsets) but lm_head.weight has {rows} rows for the target's "
                       f"vocab_size={target.vocab_size}; a reduced draft vocabulary needs its "
                       "d2t tensor (SpecForge and export_eagle3 write it).")
    ids = np.arange(target.vocab_size)
  if speculators:  # vLLM's ids: captured before layer id, our hidden-state index id
    layer_ids, offset = raw.get("eagle_aux_hidden_state_layer_ids"), 0
  else:  # SGLang's ids: the output of layer id, our hidden-state index id + 1
    layer_ids, offset = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), 1
  if layer_ids is None:
    # The engines' default capture (before layers 2, n // 2, n - 3): those hidden-state indices.
    n = target.num_decoder_layers
    layers = (2, n // 2, n - 3)
  else:
    layers = tuple(int(i) + offset for i in layer_ids)
  full = len(ids) == target.vocab_size and np.array_equal(ids, np.arange(target.vocab_size))
  head = Head(HeadConfig(target, feature_layers=layers, mlp_dim=int(config["intermediate_size"]),
                         draft_ids=None if full else tuple(int(i) for i in ids)))
  return head, _from_tensors(tensors, head, target_params)


def _check_import_target(config: dict, target: TransformerConfig, folder: str) -> None:
  """Refuses a target whose attention shape, width, vocabulary, norm epsilon or RoPE differ
  from the export's: the head's layer is built from the target, so such an export would
  fail to reshape or, where the sizes agree (2 heads x 16 against 4 heads x 8), load into
  the wrong layout silently."""
  if target.kind != "llama" or target.use_qkv_bias:
    raise ValueError(f"import_eagle3 builds a llama-kind head; this target is {target.kind}"
                     f"{' with q/k/v biases' if target.use_qkv_bias else ''}, whose head "
                     "layer differs from the engines' EAGLE-3 Llama layer. Import it for the "
                     "llama-kind target it was exported from.")
  expected = hf_llama.config_to_hf(target)
  for key in TARGET_FIELDS:
    if key in config and config[key] != expected[key]:
      raise ValueError(f"{folder}/config.json: {key}={config[key]!r} does not match the "
                       f"target's {key}={expected[key]!r}; the export was made for another "
                       "target. Import it for the target it was exported from (the "
                       "speculators config names it as the verifier).")
