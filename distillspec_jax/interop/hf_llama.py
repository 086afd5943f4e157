"""Hugging Face RoPE decoders <-> our tree (safetensors): `LlamaForCausalLM`,
`Qwen2ForCausalLM` (kind 'llama'), `Qwen3ForCausalLM` (kind 'qwen3') and `Gemma3ForCausalLM`
(Gemma 3 text, kind 'gemma3').

The mapping reshapes and transposes only, so it is exact both ways (H = heads, K = kv_heads,
D = head_dim; torch Linear weights are [out, in]):

  ours (models/llama.py)                             Hugging Face (model.layers.i = L)
  token_embedder/embedding [vocab, embed]            model.embed_tokens.weight [vocab, embed]
  decoder/layers_i/pre_self_attention_layer_norm/scale   L.input_layernorm.weight
  .../self_attention/query/kernel [embed, H, D]      L.self_attn.q_proj.weight [H*D, embed]
  .../self_attention/{key,value}/kernel [embed, K, D]  L.self_attn.{k,v}_proj.weight [K*D, embed]
  .../self_attention/{query,key,value}/bias [H|K, D]   L.self_attn.{q,k,v}_proj.bias (Qwen2)
  .../self_attention/{query,key}_norm/scale [D]      L.self_attn.{q,k}_norm.weight (Qwen3, Gemma 3)
  .../self_attention/out/kernel [H, D, embed]        L.self_attn.o_proj.weight [embed, H*D]
  decoder/layers_i/pre_mlp_layer_norm/scale          L.post_attention_layernorm.weight (Llama,
                                                     Qwen); L.pre_feedforward_layernorm.weight
                                                     (Gemma 3)
  decoder/layers_i/post_self_attention_layer_norm/scale  L.post_attention_layernorm.weight (Gemma 3)
  decoder/layers_i/post_mlp_layer_norm/scale         L.post_feedforward_layernorm.weight (Gemma 3)
  .../mlp/{wi_0, wi_1}/kernel [embed, mlp]           L.mlp.{gate_proj, up_proj}.weight [mlp, embed]
  .../mlp/wo/kernel [mlp, embed]                     L.mlp.down_proj.weight [embed, mlp]
  decoder/decoder_norm/scale                         model.norm.weight
  decoder/logits_dense/kernel [embed, vocab]         lm_head.weight [vocab, embed] (untied only)

Gemma's norm weights are stored as they are (the network multiplies by 1 + scale).
The config.json is read in both spellings of RoPE: transformers 4's `rope_theta` +
`rope_scaling` (+ Gemma 3's `rope_local_base_freq`) and transformers 5's `rope_parameters`
(per layer type for Gemma 3); it is written in both (they agree). Gemma 3's local/global
layers are read from `layer_types` or `sliding_window_pattern`; a `layer_types` that is not
"every n-th layer global" is refused. A llama-kind model with q/k/v biases is exported as
`Qwen2ForCausalLM` (Llama's `attention_bias` also puts a bias on o_proj, which this network
does not have), any other as `LlamaForCausalLM`. From a multimodal
`Gemma3ForConditionalGeneration` (Gemma 3 4B-27B as published) the text decoder is read
(`text_config`; tensors under `language_model.`) and the vision tower left out.
Only safetensors are read (no unpickling); tokenizer files of a source folder are copied
next to an export.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping, Optional

import jax
import numpy as np

from distillspec_jax.data import tokenizer_files
from distillspec_jax.interop import hf_t5
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import DECODER_START_ID, EOS_ID, PAD_ID, Model

Params = Any

# model_type -> the transformers class of that family (config.json's `architectures`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# model_type -> our kind.
KINDS = {"llama": "llama", "qwen2": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# Gemma 3 4B/12B/27B are published as Gemma3ForConditionalGeneration (model_type 'gemma3'):
# the text decoder is read from them (`text_config`, tensors under `language_model.`), the
# vision tower and projector are left out; an export is always the text model.
MULTIMODAL = {"gemma3": "Gemma3ForConditionalGeneration"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
# Files of a tokenizer (and generation defaults) copied from a source folder on export;
# sentencepiece.model is the main job's vocab stage's (pad 0, eos 1, as config_to_hf writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "spiece.model", "sentencepiece.model")
# Hugging Face rope types and ours (TransformerConfig.rope_scaling).
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
# transformers' defaults where a family's config.json may leave a value out (Gemma 3's
# multimodal configs spell out only what differs from Gemma3TextConfig's defaults).
_GEMMA_DEFAULTS = dict(head_dim=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                       tie_word_embeddings=True)
_GEMMA_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                            num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072)
_HEAD_DIM_DEFAULTS = {"qwen3": 128, "gemma3_text": 256}


def _is_multimodal(hf: Mapping[str, Any]) -> bool:
  return (hf.get("model_type") in MULTIMODAL
          or any(a in MULTIMODAL.values() for a in hf.get("architectures") or []))


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text decoder's config.json dict: `hf` itself, or a multimodal Gemma 3's
  `text_config` with Gemma3TextConfig's defaults filled in."""
  if not _is_multimodal(hf):
    return hf
  text = dict(_GEMMA_TEXT_DEFAULTS, **(hf.get("text_config") or {}))
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  return dict(text, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])


def text_tensors(tensors: Mapping[str, Any]) -> dict:
  """{name: tensor or shape} under Gemma3ForCausalLM's names: a multimodal checkpoint's text
  decoder renamed (`language_model.model.X` -> `model.X`), its vision tower and projector
  left out; any other checkpoint's tensors as they are."""
  if not any(k.startswith(("language_model.", "model.language_model.")) for k in tensors):
    return dict(tensors)
  out = {}
  for name, value in tensors.items():
    if name.startswith(_VISION_PREFIXES):
      continue
    for old, new in _TEXT_PREFIXES:
      if name.startswith(old):
        name = new + name[len(old):]
        break
    out[name] = value
  return out


def model_type(hf: Mapping[str, Any]) -> Optional[str]:
  """The family of an HF config.json dict among ARCHITECTURES (by model_type, else by
  architectures; a multimodal Gemma 3 is 'gemma3_text', its text decoder), or None."""
  hf = text_config(hf)
  if hf.get("model_type") in ARCHITECTURES:
    return hf["model_type"]
  by_class = {v: k for k, v in ARCHITECTURES.items()}
  for architecture in hf.get("architectures") or []:
    if architecture in by_class:
      return by_class[architecture]
  return None


def is_llama_family(hf: Mapping[str, Any]) -> bool:
  """Whether an HF config.json dict describes a RoPE causal LM we load (ARCHITECTURES, or a
  multimodal Gemma 3's text decoder)."""
  return model_type(hf) is not None


# --- config -------------------------------------------------------------------------------------


def _rope_from_hf(hf: Mapping[str, Any], default_theta: float = 10000.0) -> dict:
  """Our rope fields from config.json's `rope_theta` / `rope_scaling` (transformers 4) or
  `rope_parameters` (transformers 5); both present must agree."""
  spellings = []
  if "rope_theta" in hf or hf.get("rope_scaling"):
    spellings.append(("rope_theta/rope_scaling",
                      dict(hf.get("rope_scaling") or {},
                           rope_theta=hf.get("rope_theta", default_theta))))
  if hf.get("rope_parameters"):
    spellings.append(("rope_parameters", dict(hf["rope_parameters"])))
  if not spellings:
    spellings.append(("defaults", {"rope_theta": default_theta}))
  parsed = [(where, _rope_fields(where, values, default_theta, hf))
            for where, values in spellings]
  if len(parsed) == 2 and parsed[0][1] != parsed[1][1]:
    raise ValueError(f"config.json's {parsed[0][0]} gives {parsed[0][1]} but its "
                     f"{parsed[1][0]} gives {parsed[1][1]}; keep one spelling of RoPE.")
  return parsed[0][1]


# The keys a scaled RoPE must give (transformers fails on their absence too).
_SCALING_KEYS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _rope_fields(where: str, values: Mapping[str, Any], default_theta: float = 10000.0,
                 hf: Optional[Mapping[str, Any]] = None) -> dict:
  rope_type = values.get("rope_type", values.get("type", "default"))
  if rope_type not in _ROPE_TYPES:
    raise ValueError(f"config.json's {where} has rope_type={rope_type!r}, which this network "
                     f"does not implement; supported: {sorted(_ROPE_TYPES)}.")
  for key in _SCALING_KEYS.get(rope_type, ()):
    if values.get(key) is None:
      raise ValueError(f"config.json's {where} has rope_type={rope_type!r} without {key}; add "
                       f"it (the model's published config.json has it).")
  fields = {"rope_theta": float(values.get("rope_theta", default_theta)),
            "rope_scaling": _ROPE_TYPES[rope_type]}
  if rope_type in ("linear", "llama3"):
    fields["rope_scaling_factor"] = float(values["factor"])
  if rope_type == "llama3":
    fields.update(rope_low_freq_factor=float(values["low_freq_factor"]),
                  rope_high_freq_factor=float(values["high_freq_factor"]),
                  rope_original_max_length=_original_context(where, values, hf or {}))
  return fields


def _original_context(where: str, values: Mapping[str, Any], hf: Mapping[str, Any]) -> int:
  """The original context of 'llama3' scaling as transformers 5 reads it: config.json's
  top-level original_max_position_embeddings, else the scaling's own, else
  max_position_embeddings. A top-level value beside another in the scaling is refused:
  transformers 4 reads the scaling's, 5 the top-level one."""
  top = hf.get("original_max_position_embeddings")
  own = values.get("original_max_position_embeddings")
  if top is not None and own is not None and int(top) != int(own):
    raise ValueError(f"config.json says original_max_position_embeddings={top} at its top "
                     f"level but original_max_position_embeddings={own} in its {where} "
                     "(transformers 4 reads the second, 5 the first); keep the one the model "
                     "was trained with.")
  for value in (top, own, hf.get("max_position_embeddings")):
    if value is not None:
      return int(value)
  raise ValueError(f"config.json's {where} has rope_type='llama3' without "
                   "original_max_position_embeddings (nor max_position_embeddings); add it.")


def _gemma_rope_from_hf(hf: Mapping[str, Any]) -> dict:
  """Gemma 3's two RoPEs: the global layers' (rope_theta, rope_scaling) and the local layers'
  plain one (rope_local_base_freq), or transformers 5's rope_parameters per layer type."""
  local_theta = float(hf.get("rope_local_base_freq", _GEMMA_DEFAULTS["rope_local_base_freq"]))
  per_type = hf.get("rope_parameters")
  if per_type and "full_attention" in per_type:
    local = dict(per_type.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
      raise ValueError(f"config.json's rope_parameters gives the sliding-window layers "
                       f"rope_type={local['rope_type']!r}; this network gives them plain RoPE "
                       "(only the global layers are scaled).")
    local_theta = float(local.get("rope_theta", local_theta))
    hf = dict(hf, rope_parameters=per_type["full_attention"])
  # Gemma's RoPE is per layer type in transformers 5, which then reads no top-level context.
  hf = {k: v for k, v in hf.items() if k != "original_max_position_embeddings"}
  fields = _rope_from_hf(hf, default_theta=_GEMMA_DEFAULTS["rope_theta"])
  return dict(fields, rope_local_theta=local_theta)


def _window_pattern(hf: Mapping[str, Any], layers: int) -> dict:
  """sliding_window and sliding_window_pattern from `layer_types` (or the older
  `sliding_window_pattern`): layer i global iff (i + 1) % pattern == 0."""
  types = hf.get("layer_types")
  if types is None:
    default = hf.get("_sliding_window_pattern", _GEMMA_DEFAULTS["sliding_window_pattern"])
    pattern = int(hf.get("sliding_window_pattern", default))
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(layers)]
  unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
  if unknown or len(types) != layers:
    raise ValueError(f"config.json's layer_types={types} has {len(types)} entries for "
                     f"num_hidden_layers={layers} or unknown types {unknown}; expected "
                     "'full_attention' / 'sliding_attention' per layer.")
  if "sliding_attention" not in types:
    return {"sliding_window": None, "sliding_window_pattern": 1}
  for pattern in range(2, layers + 2):
    if all((t == "full_attention") == ((i + 1) % pattern == 0) for i, t in enumerate(types)):
      window = hf.get("sliding_window", _GEMMA_DEFAULTS["sliding_window"])
      return {"sliding_window": int(window), "sliding_window_pattern": pattern}
  raise ValueError(f"config.json's layer_types={types} is not 'every n-th layer global', the "
                   "pattern this network computes (sliding_window_pattern); use such a model.")


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
  """What the config.json may say that this network does not compute: refused, naming it."""
  family = model_type(hf)
  if family is None:
    raise ValueError(
        f"config.json describes model_type={hf.get('model_type')!r} (architectures="
        f"{hf.get('architectures')}), not a causal LM this network computes; supported: "
        f"{sorted(ARCHITECTURES.values())}, the text decoder of {sorted(MULTIMODAL.values())} "
        "(and T5 1.1 through interop.hf_t5).")
  multimodal, hf = _is_multimodal(hf), text_config(hf)
  gemma = family == "gemma3_text"
  problems = []
  activation_key = "hidden_activation" if gemma and "hidden_activation" in hf else "hidden_act"
  activation = hf.get(activation_key, "gelu_pytorch_tanh" if gemma else "silu")
  expected = "gelu_pytorch_tanh" if gemma else "silu"
  if activation != expected:
    problems.append(f"{activation_key}={activation!r} (the gated MLP uses {expected!r})")
  if family != "qwen2" and hf.get("attention_bias"):
    problems.append(f"attention_bias=True ({ARCHITECTURES[family]} then also biases o_proj; use "
                    "a model without it, or Qwen2's q/k/v-only biases)")
  if hf.get("mlp_bias"):
    problems.append("mlp_bias=True (the MLP has no biases)")
  if not gemma and (hf.get("use_sliding_window")
                    or "sliding_attention" in (hf.get("layer_types") or [])):
    problems.append("use_sliding_window=True / sliding_attention layers (attention here is "
                    f"full causal for {ARCHITECTURES[family]}; sliding windows are Gemma 3's)")
  if gemma and hf.get("attn_logit_softcapping") is not None:
    problems.append(f"attn_logit_softcapping={hf['attn_logit_softcapping']!r} (Gemma 3 bounds "
                    "attention logits with query/key norms instead; transformers' "
                    "Gemma3ForCausalLM does not apply it either, so set it to null)")
  if multimodal and hf.get("final_logit_softcapping") is not None:
    problems.append(f"text_config.final_logit_softcapping={hf['final_logit_softcapping']!r} "
                    "(transformers' Gemma3ForConditionalGeneration does not apply it, its "
                    "Gemma3ForCausalLM does: which one the checkpoint means is unclear; set it "
                    "to null)")
  if gemma and hf.get("use_bidirectional_attention"):
    problems.append("use_bidirectional_attention=True (attention here is causal)")
  if problems:
    raise ValueError("config.json asks for what this network does not compute: "
                     + "; ".join(problems) + ".")


def config_from_hf(hf: Mapping[str, Any], **overrides) -> TransformerConfig:
  """An HF Llama / Qwen2 / Qwen3 / Gemma 3 text config.json dict -> our config (`overrides`
  win). A multimodal Gemma 3 gives its text decoder's."""
  _refuse_unsupported(hf)
  hf = text_config(hf)
  family = model_type(hf)
  heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or _HEAD_DIM_DEFAULTS.get(family) or (
      int(hf["hidden_size"]) // heads)
  layers = int(hf["num_hidden_layers"])
  gemma = family == "gemma3_text"
  kwargs = dict(
      kind=KINDS[family], vocab_size=int(hf["vocab_size"]), emb_dim=int(hf["hidden_size"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim), mlp_dim=int(hf["intermediate_size"]), num_encoder_layers=0,
      num_decoder_layers=layers, norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
      use_qkv_bias=family == "qwen2",
      logits_via_embedding=bool(hf.get("tie_word_embeddings", gemma)),
      dropout_rate=0.0,  # HF's attention_dropout is narrower than our dropout_rate
      max_decode_length=min(int(hf.get("max_position_embeddings", 2048)), 2048))
  if gemma:
    scalar = hf.get("query_pre_attn_scalar", _GEMMA_DEFAULTS["query_pre_attn_scalar"])
    cap = hf.get("final_logit_softcapping")
    kwargs.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  final_logit_softcapping=None if cap is None else float(cap),
                  **_window_pattern(hf, layers), **_gemma_rope_from_hf(hf))
  else:
    kwargs.update(_rope_from_hf(hf))
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


def _rope_to_hf(config: TransformerConfig) -> Optional[dict]:
  if config.rope_scaling == "none":
    return None
  scaling = {"rope_type": config.rope_scaling, "factor": float(config.rope_scaling_factor)}
  if config.rope_scaling == "llama3":
    scaling.update(low_freq_factor=float(config.rope_low_freq_factor),
                   high_freq_factor=float(config.rope_high_freq_factor),
                   original_max_position_embeddings=int(config.rope_original_max_length))
  return scaling


def _export_type(config: TransformerConfig) -> str:
  if config.kind == "llama":
    return "qwen2" if config.use_qkv_bias else "llama"
  return {"qwen3": "qwen3", "gemma3": "gemma3_text"}[config.kind]


def _family_fields(config: TransformerConfig, family: str) -> dict:
  """config.json entries of one family beyond the common ones."""
  if family == "llama":
    return dict(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  if family in ("qwen2", "qwen3"):
    out = dict(use_sliding_window=False, sliding_window=None,
               max_window_layers=config.num_decoder_layers)
    return dict(out, attention_bias=False) if family == "qwen3" else out
  types = ["sliding_attention" if config.is_local_layer(i) else "full_attention"
           for i in range(config.num_decoder_layers)]
  return dict(
      hidden_activation="gelu_pytorch_tanh", attention_bias=False,
      query_pre_attn_scalar=int(config.query_pre_attn_scalar or config.head_dim),
      sliding_window=config.sliding_window, sliding_window_pattern=config.sliding_window_pattern,
      layer_types=types, rope_local_base_freq=float(config.rope_local_theta),
      attn_logit_softcapping=None,
      final_logit_softcapping=config.final_logit_softcapping,
      use_bidirectional_attention=False)


def config_to_hf(config: TransformerConfig, token_ids: Optional[Mapping[str, Any]] = None) -> dict:
  """Our config -> a config.json dict of its family (`LlamaForCausalLM`, `Qwen2ForCausalLM`
  with q/k/v biases, `Qwen3ForCausalLM`, `Gemma3ForCausalLM`). `token_ids`: bos/eos/pad ids to
  write (a source config.json's); by default ours (pad 0, eos 1, and 0 as the start token
  every decoder prompt begins with)."""
  if not config.is_rope_decoder:
    raise ValueError(f"kind={config.kind!r}: interop.hf_llama exports the RoPE kinds only "
                     "(llama, qwen3, gemma3); T5 kinds go through interop.hf_t5.")
  family = _export_type(config)
  scaling = _rope_to_hf(config)
  global_rope = dict(scaling or {"rope_type": "default"}, rope_theta=float(config.rope_theta))
  if family == "gemma3_text":
    rope_parameters = {"full_attention": global_rope,
                       "sliding_attention": {"rope_type": "default",
                                             "rope_theta": float(config.rope_local_theta)}}
  else:
    rope_parameters = global_rope
  out = {
      "model_type": family, "architectures": [ARCHITECTURES[family]],
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_decoder_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
      "head_dim": config.head_dim, "hidden_act": "silu",
      # transformers wants the original context of 'llama3' scaling below this.
      "max_position_embeddings": max(config.max_decode_length,
                                     config.rope_original_max_length + 1
                                     if config.rope_scaling == "llama3" else 0),
      "rms_norm_eps": float(config.norm_epsilon),
      "tie_word_embeddings": bool(config.logits_via_embedding),
      "rope_theta": float(config.rope_theta), "rope_scaling": scaling,
      "rope_parameters": rope_parameters,
      "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
      "torch_dtype": "float32",
      "bos_token_id": DECODER_START_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
  }
  if family == "gemma3_text":
    del out["hidden_act"]
  out.update(_family_fields(config, family))
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if token_ids and key in token_ids:
      out[key] = token_ids[key]
  return out


# --- parameter mapping --------------------------------------------------------------------------


# `param_mapping`'s layouts other than a kernel's number of input axes.
SAME = 0   # stored as it is (embedding, norm scales)
FLAT = -1  # flattened to one dimension (biases [heads, head_dim] -> [heads * head_dim])


def param_mapping(config: TransformerConfig) -> list[tuple[tuple[str, ...], str, int]]:
  """(our path, HF name, layout) for every parameter of `config`. Layout n >= 1: a kernel
  with n input axes, stored by HF flattened to [inputs, outputs] and transposed; SAME or
  FLAT otherwise."""
  if config.kind == "gemma3":
    norms = (("pre_self_attention_layer_norm", "input_layernorm"),
             ("post_self_attention_layer_norm", "post_attention_layernorm"),
             ("pre_mlp_layer_norm", "pre_feedforward_layernorm"),
             ("post_mlp_layer_norm", "post_feedforward_layernorm"))
  else:
    norms = (("pre_self_attention_layer_norm", "input_layernorm"),
             ("pre_mlp_layer_norm", "post_attention_layernorm"))
  m = [(("token_embedder", "embedding"), "model.embed_tokens.weight", SAME)]
  for i in range(config.num_decoder_layers):
    ours, hf = ("decoder", f"layers_{i}"), f"model.layers.{i}"
    for name, theirs in norms:
      m.append((ours + (name, "scale"), f"{hf}.{theirs}.weight", SAME))
    attention = ours + ("self_attention",)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      m.append((attention + (name, "kernel"), f"{hf}.self_attn.{proj}.weight", 1))
      if config.use_qkv_bias:
        m.append((attention + (name, "bias"), f"{hf}.self_attn.{proj}.bias", FLAT))
    if config.has_qk_norm:
      for name, theirs in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
        m.append((attention + (name, "scale"), f"{hf}.self_attn.{theirs}.weight", SAME))
    m.append((attention + ("out", "kernel"), f"{hf}.self_attn.o_proj.weight", 2))
    for name, proj in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
      m.append((ours + ("mlp", name, "kernel"), f"{hf}.mlp.{proj}.weight", 1))
  m.append((("decoder", "decoder_norm", "scale"), "model.norm.weight", SAME))
  if not config.logits_via_embedding:
    m.append((("decoder", "logits_dense", "kernel"), "lm_head.weight", 1))
  return m


def _hf_shape(shape: tuple, layout: int) -> tuple:
  if layout == SAME:
    return tuple(shape)
  if layout == FLAT:
    return (int(np.prod(shape)),)
  return (int(np.prod(shape[layout:])), int(np.prod(shape[:layout])))


def _to_hf(value: np.ndarray, layout: int) -> np.ndarray:
  if layout in (SAME, FLAT):
    return value.reshape(_hf_shape(value.shape, layout))
  return value.reshape(int(np.prod(value.shape[:layout])), -1).T


def _our_shapes(config: TransformerConfig) -> dict:
  shapes = Model(config).param_shapes()
  return {path: tuple(hf_t5.tree_get(shapes, path).shape) for path, _, _ in param_mapping(config)}


def params_to_hf(params: Params, config: TransformerConfig) -> dict[str, np.ndarray]:
  """Our params -> {HF name: contiguous numpy array} (exact: reshapes and transposes)."""
  return {name: np.ascontiguousarray(_to_hf(np.asarray(hf_t5.tree_get(params, path)), axes))
          for path, name, axes in param_mapping(config)}


def _describe(config: TransformerConfig) -> str:
  return (f"the {config.kind}-kind model (vocab_size={config.vocab_size}, "
          f"emb_dim={config.emb_dim}, "
          f"heads={config.num_heads}, kv_heads={config.kv_heads}, head_dim={config.head_dim}, "
          f"mlp_dim={config.mlp_dim}, layers={config.num_decoder_layers}, use_qkv_bias="
          f"{config.use_qkv_bias}, tied={config.logits_via_embedding})")


def _matched(found: Mapping[str, tuple], config: TransformerConfig) -> dict:
  """{HF name: stored shape} checked against `config`: every name present, none unexpected
  (a tied model's stored lm_head copy is ignored), every shape as `config` makes it. Returns
  {HF name: our shape}; raises ValueError listing the first problems."""
  ours = _our_shapes(config)
  expected = {name: (ours[path], axes) for path, name, axes in param_mapping(config)}
  ignored = {"lm_head.weight"} if config.logits_via_embedding else set()
  problems = [f"{name}: missing (expected shape {_hf_shape(*expected[name])})"
              for name in expected if name not in found]
  problems += [f"{name}: shape {tuple(found[name])}, expected {_hf_shape(*expected[name])}"
               for name in expected if name in found
               and tuple(found[name]) != _hf_shape(*expected[name])]
  problems += [f"{name}: unexpected (shape {tuple(found[name])})" for name in found
               if name not in expected and name not in ignored
               and not name.endswith("rotary_emb.inv_freq")]
  if problems:
    listed = "; ".join(problems[:5])
    more = f"; ... {len(problems) - 5} more" if len(problems) > 5 else ""
    raise ValueError(f"The checkpoint does not hold {_describe(config)}: {len(problems)} "
                     f"problems: {listed}{more}. Check config.json or the --model preset.")
  return {name: shape for name, (shape, _) in expected.items()}


def params_from_hf(tensors: Mapping[str, np.ndarray], config: TransformerConfig) -> Params:
  """{HF name: array} -> our params (fp32 nested dict), every name and shape checked (a
  multimodal Gemma 3's text decoder: `text_tensors`)."""
  tensors = text_tensors(tensors)
  ours = _matched({k: np.shape(v) for k, v in tensors.items()}, config)
  params: dict = {}
  for path, name, axes in param_mapping(config):
    value = np.asarray(tensors[name]).astype(np.float32)
    value = value.reshape(ours[name]) if axes in (SAME, FLAT) else value.T.reshape(ours[name])
    hf_t5.tree_set(params, path, np.ascontiguousarray(value))
  return params


def shapes_from_hf(shapes: Mapping[str, tuple], config: TransformerConfig) -> Params:
  """{HF name: stored shape} -> our tree of fp32 `jax.ShapeDtypeStruct` (names and shapes
  checked; nothing read)."""
  shapes = text_tensors(shapes)
  ours = _matched(shapes, config)
  tree: dict = {}
  for path, name, _ in param_mapping(config):
    hf_t5.tree_set(tree, path, jax.ShapeDtypeStruct(ours[name], np.float32))
  return tree


# --- files --------------------------------------------------------------------------------------


STRUCTURE_FIELDS = ("kind", "num_heads", "num_kv_heads", "head_dim", "use_qkv_bias",
                    "logits_via_embedding")
COMPUTATION_FIELDS = ("rope_theta", "rope_scaling", "rope_scaling_factor",
                      "rope_low_freq_factor", "rope_high_freq_factor",
                      "rope_original_max_length", "norm_epsilon", "query_pre_attn_scalar",
                      "sliding_window", "sliding_window_pattern", "rope_local_theta",
                      "final_logit_softcapping")


def config_mismatches(hf: Mapping[str, Any], config: TransformerConfig,
                      fields=STRUCTURE_FIELDS + COMPUTATION_FIELDS) -> list[str]:
  """Fields where config.json and `config` disagree (`fields`: which to compare)."""
  stored = config_from_hf(hf)
  value = lambda c, name: c.kv_heads if name == "num_kv_heads" else getattr(c, name)  # noqa: E731
  return [f"config.json gives {name}={value(stored, name)!r}, the model {value(config, name)!r}"
          for name in fields if value(stored, name) != value(config, name)]


def load_hf(path: str, config: Optional[TransformerConfig] = None):
  """Loads a Llama / Qwen2 / Qwen3 / Gemma 3 text safetensors checkpoint (a folder with
  config.json, or a file with `config`). With `config`, config.json (when present) must agree
  on how the stored tensors split into heads. Returns (params, config)."""
  hf = hf_t5.read_hf_config(path)
  if config is None:
    if hf is None:
      raise FileNotFoundError(f"No {hf_t5.CONFIG_NAME} next to {path}: pass a model config "
                              "(--model=...).")
    config = config_from_hf(hf)
  elif hf is not None:
    wrong = config_mismatches(hf, config, STRUCTURE_FIELDS)
    if wrong:
      raise ValueError(f"{path} does not hold {_describe(config)}: " + "; ".join(wrong) + ".")
  return params_from_hf(hf_t5.read_hf_tensors(path), config), config


def _source_ids(source_dir: str, hf: Optional[dict]) -> dict:
  """bos/eos/pad ids for an export next to the `source_dir` tokenizer: the source model's
  config.json's, else the tokenizer's own (tokenizer_config.json); none: ours. Where the
  folder's config.json / generation_config.json list several end-of-sequence ids (an instruct
  model's: TokenIds.stop_ids), eos_token_id is that list, the one EOS first."""
  if hf:
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
  elif os.path.isfile(os.path.join(source_dir, tokenizer_files.TOKENIZER_FILE)):
    from distillspec_jax.data import hf_vocabulary  # seqio and TF: only for an export
    vocab = hf_vocabulary.load_hf_vocabulary(source_dir)
    ids = {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id,
           "pad_token_id": vocab.pad_token_id}
  else:
    return {}
  listed = tokenizer_files.listed_eos_ids(source_dir)
  if len(listed) > 1:
    first = ids.get("eos_token_id")
    first = first[0] if isinstance(first, list) and first else first
    head = [first] if isinstance(first, int) and first in listed else []
    ids["eos_token_id"] = head + [i for i in listed if i not in head]
  return ids


def source_token_ids(path: str) -> dict:
  """The bos/eos/pad ids of the Hugging Face checkpoint at `path` (a folder, or a
  .safetensors file beside its config.json): its config.json's, else its tokenizer's."""
  folder = path if os.path.isdir(path) else os.path.dirname(path)
  return _source_ids(folder, hf_t5.read_hf_config(folder))


def save_hf(params: Params, config: TransformerConfig, directory: str,
            source: Optional[str] = None,
            token_ids: Optional[Mapping[str, Any]] = None) -> None:
  """Writes config.json and model.safetensors (fp32, exact) into `directory`, plus the
  tokenizer files of the `source` folder (an HF checkpoint or a tokenizer folder): the
  special ids are its config.json's or else its tokenizer's, the context length (max_position_embeddings) the source
  config.json's when longer than ours (our max_decode_length is only a cache size), and
  generation_config.json the source's or, without one, the special ids. `token_ids`:
  bos/eos/pad ids to write where `source` gives none (a checkpoint's own, kept by an import)."""
  from safetensors.numpy import save_file
  tensors = params_to_hf(params, config)
  _matched({k: v.shape for k, v in tensors.items()}, config)
  source_dir = None if source is None else (source if os.path.isdir(source)
                                            else os.path.dirname(source))
  source_hf = hf_t5.read_hf_config(source_dir) if source_dir else None
  token_ids = dict(token_ids or {}, **(_source_ids(source_dir, source_hf) if source_dir else {}))
  hf_config = config_to_hf(config, token_ids)
  if source_hf and int(source_hf.get("max_position_embeddings") or 0) > hf_config[
      "max_position_embeddings"]:
    hf_config["max_position_embeddings"] = int(source_hf["max_position_embeddings"])
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, hf_t5.CONFIG_NAME), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(directory, hf_t5.SAFETENSORS_NAME), metadata={"format": "pt"})
  for name in TOKENIZER_FILES if source_dir else ():
    if os.path.isfile(os.path.join(source_dir, name)):
      shutil.copyfile(os.path.join(source_dir, name), os.path.join(directory, name))
  generation = os.path.join(directory, "generation_config.json")
  if not os.path.isfile(generation):
    with open(generation, "w") as f:
      json.dump({k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
                f, indent=2, sort_keys=True)


def to_transformers(params: Params, config: TransformerConfig):
  """A transformers model of our config's family (eval mode, fp32) holding our weights, built
  in memory from `config_to_hf` (for checks and benchmarks)."""
  import torch
  import transformers
  hf = config_to_hf(config)
  cls = getattr(transformers, hf["architectures"][0])
  config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                "qwen3": transformers.Qwen3Config,
                "gemma3_text": transformers.Gemma3TextConfig}[hf["model_type"]]
  dropped = ("model_type", "architectures", "torch_dtype", "rope_scaling", "rope_theta",
             "rope_local_base_freq", "sliding_window_pattern")
  keys = {k: v for k, v in hf.items() if k not in dropped}
  model = cls(config_cls(**keys)).eval()
  state = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(params, config).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [m for m in missing if not (config.logits_via_embedding and m == "lm_head.weight")]
  if missing or unexpected:
    raise ValueError(f"transformers' {cls.__name__} expects {missing[:5]} and does not know "
                     f"{unexpected[:5]}.")
  return model

