"""Model configurations: one frozen dataclass per network, and the named presets.

Every network takes a single `TransformerConfig`; decode/eval variants are made with
`.replace(...)` (for example `config.replace(dropout_rate=0.0)`). The named presets
mirror the published T5 1.1 shapes (the T5X `t5_1_1/*.gin` files) and the GPT-like
LM1B models of the DistillSpec paper.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal

import jax.numpy as jnp

from distillspec_jax.core.validation import check_field_types

ModelKind = Literal["encoder_decoder", "decoder_only", "llama", "qwen3", "gemma3"]
MODEL_KINDS = ("encoder_decoder", "decoder_only", "llama", "qwen3", "gemma3")
# The RoPE decoders of models/llama.py: 'llama' (Llama 2/3, Qwen2), 'qwen3' (an RMSNorm on each
# query and key head before RoPE) and 'gemma3' (Gemma 3 text: those norms too, (1 + w) norms
# before and after attention and MLP, GeGLU, a scaled embedding, local/global attention).
ROPE_KINDS = ("llama", "qwen3", "gemma3")
# RoPE frequency scalings of the RoPE kinds (Hugging Face `rope_type`): 'none' (plain RoPE),
# 'linear' (positions divided by rope_scaling_factor) and 'llama3' (Llama 3.1+'s per-frequency
# scheme: low frequencies divided by the factor, high ones kept, a smooth ramp between).
ROPE_SCALINGS = ("none", "linear", "llama3")
# Rematerialisation of each encoder / decoder layer in the backward pass (T5X's
# `remat_policy`): what the forward pass keeps for the gradient.
#   'none'     no remat: every intermediate of every layer is kept (fastest, most memory);
#   'minimal'  keeps the matmul outputs that have no batch dimension in the dot (the
#              projections of the flattened [rows, features] inputs: jax's
#              dots_with_no_batch_dims_saveable) and recomputes the rest (norms, GELU,
#              softmax, the batched attention matmuls);
#   'full'     keeps only each layer's inputs and recomputes the whole layer.
REMAT_POLICIES = ("none", "minimal", "full")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shapes and options of a Transformer: T5 1.1-style, or one of the RoPE decoders.

  Attributes:
    kind: "encoder_decoder" (T5 1.1), "decoder_only" (GPT-like LM from the same layers), or a
      RoPE decoder of models/llama.py: "llama" (Llama 2/3, Qwen2), "qwen3", "gemma3".
    vocab_size: rows of the token embedding and columns of the logits layer.
    emb_dim: d_model.
    num_heads: attention heads.
    num_encoder_layers: encoder depth (ignored by decoder-only models).
    num_decoder_layers: decoder depth.
    head_dim: per-head width (d_kv).
    mlp_dim: width of the gated-GELU MLP (d_ff).
    encoder_mlp_dim: width of the encoder's MLP; None means mlp_dim (T5 1.1 has one d_ff).
      Ignored by decoder-only models. In decoding the encoder runs once per prompt, so a
      narrower encoder MLP makes training and prefill cheaper, a decoding step no cheaper.
    dropout_rate: dropout after every sub-layer, on embeddings and attention weights.
    dtype: activation dtype name ("float32" on CPU, "bfloat16" on TPU; gin macro
      ACTIVATION_DTYPE); parameters stay fp32 (a frozen target's may be cast: TARGET_PARAM_DTYPE).
    remat_policy: one of REMAT_POLICIES, applied to every encoder and decoder layer (gin macro
      REMAT_POLICY); it changes memory and compute of a backward pass, never the values.
    relative_attention_num_buckets / relative_attention_max_distance: T5 relative bias.
    logits_via_embedding: tie the logits layer to the embedding (False for T5 1.1).
    max_decode_length: default capacity of the decoding cache.

  Fields of the RoPE kinds (ROPE_KINDS: "llama", "qwen3", "gemma3"; grouped-query attention,
  gated MLP, RMSNorm; T5 kinds refuse values other than the defaults):
    num_kv_heads: key/value heads (grouped-query attention); None means num_heads. Must
      divide num_heads.
    rope_theta: RoPE base. head_dim must be even (RoPE rotates pairs of features).
    rope_scaling: one of ROPE_SCALINGS; rope_scaling_factor, rope_low_freq_factor,
      rope_high_freq_factor and rope_original_max_length parameterise 'linear' and 'llama3'
      (Hugging Face's `factor`, `low_freq_factor`, `high_freq_factor`,
      `original_max_position_embeddings`).
    norm_epsilon: the RMSNorms' epsilon (Hugging Face `rms_norm_eps`).
    use_qkv_bias: biases on the query/key/value projections (Qwen2; kind "llama" only).
    For the RoPE kinds `logits_via_embedding` ties the logits layer to the embedding without
    T5's d**-0.5 rescale (Hugging Face `tie_word_embeddings`).

  Fields of kind "gemma3" only (Hugging Face Gemma3TextConfig's names; other kinds refuse
  values other than the defaults):
    query_pre_attn_scalar: attention logits are scaled by query_pre_attn_scalar**-0.5; None
      means head_dim (the other kinds' scale).
    sliding_window: keys a local layer sees, the query's own included (a query at position
      q attends to positions q - sliding_window + 1 .. q); None: every layer is global.
    sliding_window_pattern: layer i is global when (i + 1) % sliding_window_pattern == 0,
      local otherwise (Gemma 3: 6, five local layers per global one); 1 with no window.
    rope_local_theta: RoPE base of the local layers (Hugging Face `rope_local_base_freq`);
      the global layers use rope_theta and rope_scaling, the local ones plain RoPE.
    final_logit_softcapping: cap * tanh(logits / cap) on the output logits; None: no capping.
      (Gemma 3 has no attention-logit capping: its query/key norms bound the logits, and
      transformers' Gemma3 ignores `attn_logit_softcapping`; the importer refuses it.)
  """

  kind: ModelKind = "encoder_decoder"
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  encoder_mlp_dim: int | None = None
  dropout_rate: float = 0.1
  dtype: str = "float32"
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  logits_via_embedding: bool = False
  max_decode_length: int = 512
  remat_policy: str = "none"
  num_kv_heads: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_length: int = 8192
  norm_epsilon: float = 1e-6
  use_qkv_bias: bool = False
  query_pre_attn_scalar: int | None = None
  sliding_window: int | None = None
  sliding_window_pattern: int = 1
  rope_local_theta: float = 10000.0
  final_logit_softcapping: float | None = None

  def __post_init__(self):
    if self.kind not in MODEL_KINDS:
      raise ValueError(f"kind={self.kind!r} is not a model kind; use one of {MODEL_KINDS}.")
    # Types first (a quoted gin number, a bool for a count), so the range checks below
    # compare numbers and nothing is coerced.
    check_field_types(self)
    for name in ("vocab_size", "emb_dim", "num_heads", "num_decoder_layers", "head_dim",
                 "mlp_dim", "relative_attention_num_buckets", "max_decode_length"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer.")
    if self.encoder_mlp_dim is not None and self.encoder_mlp_dim < 1:
      raise ValueError(f"encoder_mlp_dim={self.encoder_mlp_dim!r} must be a positive integer, "
                       "or None for the decoder's mlp_dim.")
    if self.kind == "encoder_decoder" and self.num_encoder_layers < 1:
      raise ValueError(f"num_encoder_layers={self.num_encoder_layers} must be >= 1 for an "
                       "encoder-decoder; use kind='decoder_only' for a model without encoder.")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate={self.dropout_rate} must be in [0, 1).")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r} is not an activation dtype; use one of {DTYPES} "
                       "(gin: ACTIVATION_DTYPE).")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy={self.remat_policy!r} is not a remat policy; use one of "
                       f"{REMAT_POLICIES} (gin: REMAT_POLICY).")
    _check_llama_fields(self)
    _check_gemma_fields(self)

  @property
  def is_rope_decoder(self) -> bool:
    """Whether the network is models/llama.py's (ROPE_KINDS)."""
    return self.kind in ROPE_KINDS

  @property
  def has_qk_norm(self) -> bool:
    """An RMSNorm over head_dim on every query and key head, before RoPE (Qwen3, Gemma 3)."""
    return self.kind in ("qwen3", "gemma3")

  @property
  def attention_scale(self) -> float:
    """The factor of the attention logits: query_pre_attn_scalar**-0.5 (head_dim by default)."""
    scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    return float(scalar) ** -0.5

  def is_local_layer(self, index: int) -> bool:
    """Whether decoder layer `index` attends within `sliding_window` (Gemma 3's local layers)."""
    return (self.sliding_window is not None
            and (index + 1) % self.sliding_window_pattern != 0)

  @property
  def kv_heads(self) -> int:
    """Key/value heads: num_kv_heads, or num_heads when that is None (every T5 kind)."""
    return self.num_heads if self.num_kv_heads is None else int(self.num_kv_heads)

  @property
  def encoder_mlp_width(self) -> int:
    """The encoder's MLP width: encoder_mlp_dim, or mlp_dim when that is None."""
    return self.mlp_dim if self.encoder_mlp_dim is None else int(self.encoder_mlp_dim)

  @property
  def activation_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


_LLAMA_FIELDS = ("num_kv_heads", "rope_theta", "rope_scaling", "rope_scaling_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_length",
                 "norm_epsilon", "use_qkv_bias")


def _changed(config: TransformerConfig, names) -> list[str]:
  defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
  return [f"{n}={getattr(config, n)!r}" for n in names if getattr(config, n) != defaults[n]]


def _check_llama_fields(config: TransformerConfig) -> None:
  """Ranges of the RoPE kinds' fields (their types: check_field_types); T5 kinds must leave
  them at their defaults (their network would ignore them silently)."""
  if not config.is_rope_decoder:
    changed = _changed(config, _LLAMA_FIELDS)
    if changed:
      raise ValueError(f"{', '.join(changed)} applies to the RoPE kinds {ROPE_KINDS} only; the "
                       f"{config.kind} network (T5 relative position bias, full multi-head "
                       "attention) would ignore it. Use one of those kinds or leave these "
                       "fields at their defaults.")
    return
  if config.kind != "llama" and config.use_qkv_bias:
    raise ValueError(f"use_qkv_bias=True applies to kind='llama' (Qwen2) only; the "
                     f"{config.kind} network has no query/key/value biases. Leave it False.")
  kv = config.kv_heads
  if kv < 1 or config.num_heads % kv:
    raise ValueError(f"num_kv_heads={config.num_kv_heads} must be >= 1 and divide num_heads="
                     f"{config.num_heads} (grouped-query attention shares each key/value head "
                     f"among num_heads / num_kv_heads query heads); use one of "
                     f"{[d for d in range(1, config.num_heads + 1) if config.num_heads % d == 0]}.")
  if config.head_dim % 2:
    raise ValueError(f"head_dim={config.head_dim} is odd, but RoPE rotates pairs of features; "
                     "use an even head_dim.")
  if config.rope_scaling not in ROPE_SCALINGS:
    raise ValueError(f"rope_scaling={config.rope_scaling!r} is not implemented; use one of "
                     f"{ROPE_SCALINGS}.")
  for name in ("rope_theta", "rope_scaling_factor", "norm_epsilon"):
    if not getattr(config, name) > 0:
      raise ValueError(f"{name}={getattr(config, name)!r} must be > 0.")
  if config.rope_scaling == "llama3" and not (
      0 < config.rope_low_freq_factor < config.rope_high_freq_factor):
    raise ValueError(f"rope_low_freq_factor={config.rope_low_freq_factor} and "
                     f"rope_high_freq_factor={config.rope_high_freq_factor}: 'llama3' RoPE "
                     "scaling needs 0 < low < high (Llama 3.1+: 1.0 and 4.0).")
  if config.rope_original_max_length < 1:
    raise ValueError(f"rope_original_max_length={config.rope_original_max_length} must be >= 1.")


_GEMMA_FIELDS = ("query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
                 "rope_local_theta", "final_logit_softcapping")


def _check_gemma_fields(config: TransformerConfig) -> None:
  """Ranges of the gemma3 kind's fields (their types: check_field_types); other kinds must
  leave them at their defaults (their network would ignore them)."""
  if config.kind != "gemma3":
    changed = _changed(config, _GEMMA_FIELDS)
    if changed:
      raise ValueError(f"{', '.join(changed)} applies to kind='gemma3' only; the {config.kind} "
                       "network would ignore it. Use kind='gemma3' or leave these fields at "
                       "their defaults.")
    return
  for name in ("query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping"):
    value = getattr(config, name)
    if value is not None and not value > 0:
      raise ValueError(f"{name}={value!r} must be > 0 (or None where None is allowed).")
  if config.sliding_window_pattern < 1:
    raise ValueError(f"sliding_window_pattern={config.sliding_window_pattern} must be >= 1 "
                     "(every pattern-th layer is global; Gemma 3: 6).")
  if config.sliding_window is None and config.sliding_window_pattern != 1:
    raise ValueError(f"sliding_window_pattern={config.sliding_window_pattern} needs a "
                     "sliding_window (without one every layer is global); set sliding_window "
                     "or sliding_window_pattern=1.")
  if config.sliding_window is not None:
    if config.sliding_window < 1:
      raise ValueError(f"sliding_window={config.sliding_window} must be >= 1, or None for "
                       "global attention in every layer.")
    if config.sliding_window_pattern == 1:
      raise ValueError(f"sliding_window={config.sliding_window} with sliding_window_pattern=1 "
                       "makes every layer global, so the window is never used; set "
                       "sliding_window=None or a pattern > 1 (Gemma 3: 6).")


def _t5_1_1(emb_dim, num_heads, num_layers, mlp_dim):
  return TransformerConfig(kind="encoder_decoder", vocab_size=32128, emb_dim=emb_dim,
                           num_heads=num_heads, num_encoder_layers=num_layers,
                           num_decoder_layers=num_layers, head_dim=64, mlp_dim=mlp_dim)


def _decoder_only(emb_dim, num_heads, num_layers, mlp_dim, vocab_size=32128):
  return TransformerConfig(kind="decoder_only", vocab_size=vocab_size, emb_dim=emb_dim,
                           num_heads=num_heads, num_encoder_layers=0,
                           num_decoder_layers=num_layers, head_dim=64, mlp_dim=mlp_dim)


# Published T5 1.1 shapes (Raffel et al.; T5X configs/models/t5_1_1/*.gin).
# The GPT-like LM1B sizes follow the DistillSpec paper's 33M draft and 234M target.
MODEL_CONFIGS: dict[str, TransformerConfig] = {
    "t5_1_1_small": _t5_1_1(512, 6, 8, 1024),
    "t5_1_1_base": _t5_1_1(768, 12, 12, 2048),
    "t5_1_1_large": _t5_1_1(1024, 16, 24, 2816),
    "t5_1_1_xl": _t5_1_1(2048, 32, 24, 5120),
    "t5_1_1_xxl": _t5_1_1(4096, 64, 24, 10240),
    "decoder_only_33m": _decoder_only(384, 6, 5, 1024),
    "decoder_only_234m": _decoder_only(1024, 16, 12, 3072),
    # Tiny models for tests and the embedded CPU demo (small vocabulary: a tiny model with a
    # 32k vocabulary spends most of its time in the output projection).
    "tiny_encoder_decoder": TransformerConfig(
        kind="encoder_decoder", vocab_size=512, emb_dim=64, num_heads=4,
        num_encoder_layers=2, num_decoder_layers=2, head_dim=16, mlp_dim=128,
        dropout_rate=0.0, max_decode_length=128),
    "tiny_decoder_only": TransformerConfig(
        kind="decoder_only", vocab_size=512, emb_dim=64, num_heads=4, num_encoder_layers=0,
        num_decoder_layers=2, head_dim=16, mlp_dim=128, dropout_rate=0.0,
        max_decode_length=128),
    # The CPU demo's target: the smoke target's shapes with a 2048-wide decoder MLP, so that
    # the 7 MB of decoder weights read at every decoding step make a draft step cost ~6% of a
    # target step and speculative decoding pays on CPU (docs/results.md). The encoder runs
    # once per prompt, so its MLP stays 512 wide: a training step costs 39% less (249 ms, not
    # 407 ms, forward+backward at batch 32 on a 2-core VM), a decoding step the same.
    "demo_target": TransformerConfig(
        kind="encoder_decoder", vocab_size=256, emb_dim=128, num_heads=4,
        num_encoder_layers=2, num_decoder_layers=2, head_dim=32, mlp_dim=2048,
        encoder_mlp_dim=512, dropout_rate=0.0, max_decode_length=64),
    # The test suite's smoke-run target (the earlier demo target: its decoding step is
    # overhead-bound, so speculative decoding barely pays with it).
    "smoke_target": TransformerConfig(
        kind="encoder_decoder", vocab_size=256, emb_dim=128, num_heads=4,
        num_encoder_layers=2, num_decoder_layers=2, head_dim=32, mlp_dim=512,
        dropout_rate=0.0, max_decode_length=64),
    "demo_draft": TransformerConfig(
        kind="encoder_decoder", vocab_size=256, emb_dim=64, num_heads=2,
        num_encoder_layers=1, num_decoder_layers=1, head_dim=32, mlp_dim=128,
        dropout_rate=0.0, max_decode_length=64),
}


def _llama(vocab_size, emb_dim, num_heads, num_kv_heads, num_layers, head_dim, mlp_dim,
           kind="llama", **fields) -> TransformerConfig:
  return TransformerConfig(kind=kind, vocab_size=vocab_size, emb_dim=emb_dim,
                           num_heads=num_heads, num_kv_heads=num_kv_heads, num_encoder_layers=0,
                           num_decoder_layers=num_layers, head_dim=head_dim, mlp_dim=mlp_dim,
                           dropout_rate=0.0, **fields)


_LLAMA_3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0,
                     rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_length=8192, norm_epsilon=1e-5)
# Llama-family decoders (kind "llama"). The published shapes (config.json of
# meta-llama/Llama-3.2-1B, -3B and Qwen/Qwen2.5-0.5B; 1.24B, 3.21B and 0.49B parameters, tied
# embeddings) are for `jax.eval_shape` and the memory table; the small ones run on a CPU.
MODEL_CONFIGS.update({
    "llama_3_2_1b": _llama(128256, 2048, 32, 8, 16, 64, 8192, logits_via_embedding=True,
                           max_decode_length=2048, **_LLAMA_3_ROPE),
    "llama_3_2_3b": _llama(128256, 3072, 24, 8, 28, 128, 8192, logits_via_embedding=True,
                           max_decode_length=2048, **_LLAMA_3_ROPE),
    "qwen2_5_0_5b": _llama(151936, 896, 14, 2, 24, 64, 4864, logits_via_embedding=True,
                           max_decode_length=2048, rope_theta=1000000.0, norm_epsilon=1e-6,
                           use_qkv_bias=True),
    # Tests: two query heads per key/value head.
    "tiny_llama": _llama(512, 64, 4, 2, 2, 16, 128, max_decode_length=128, norm_epsilon=1e-5),
    # The Llama-family CPU demo pair (the embedded task's 256-token vocabulary): the target's
    # 1024-wide MLP makes a draft step a small fraction of a target step, as in demo_target.
    # 256 cache slots: the prompt and answer of the task (96 positions as a prefix LM) plus a
    # sampled answer and a speculative block.
    "llama_demo_target": _llama(256, 128, 4, 2, 2, 32, 1024, max_decode_length=256,
                                norm_epsilon=1e-5),
    "llama_demo_draft": _llama(256, 64, 2, 1, 1, 32, 256, max_decode_length=256,
                               norm_epsilon=1e-5),
})


def _qwen3(emb_dim, num_heads, num_layers, mlp_dim, tied) -> TransformerConfig:
  return _llama(151936, emb_dim, num_heads, 8, num_layers, 128, mlp_dim, kind="qwen3",
                logits_via_embedding=tied, max_decode_length=2048, rope_theta=1000000.0,
                norm_epsilon=1e-6)


def _gemma3(vocab_size, emb_dim, num_heads, num_kv_heads, num_layers, head_dim, mlp_dim,
            query_pre_attn_scalar, sliding_window, **fields) -> TransformerConfig:
  return _llama(vocab_size, emb_dim, num_heads, num_kv_heads, num_layers, head_dim, mlp_dim,
                kind="gemma3", logits_via_embedding=True, max_decode_length=2048,
                rope_theta=1000000.0, rope_local_theta=10000.0, norm_epsilon=1e-6,
                query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=sliding_window,
                sliding_window_pattern=6, **fields)


# Qwen3 and Gemma 3 (text) with the shapes of their Hugging Face config.json files (Qwen/
# Qwen3-0.6B, -8B; google/gemma-3-270m, -1b-pt, and the text_config of -12b-pt, -27b-pt). Their
# parameter counts (tests/test_families.py) equal those of transformers' Qwen3ForCausalLM /
# Gemma3ForCausalLM built from the same values, and the non-embedding counts the model cards and
# the Gemma 3 report give, within 0.5%.
_GEMMA3_LONG_ROPE = dict(rope_scaling="linear", rope_scaling_factor=8.0)
MODEL_CONFIGS.update({
    "qwen3_0_6b": _qwen3(1024, 16, 28, 3072, tied=True),
    "qwen3_8b": _qwen3(4096, 32, 36, 12288, tied=False),
    "gemma3_270m": _gemma3(262144, 640, 4, 1, 18, 256, 2048, 256, 512),
    "gemma3_1b": _gemma3(262144, 1152, 4, 1, 26, 256, 6912, 256, 512),
    "gemma3_12b": _gemma3(262208, 3840, 16, 8, 48, 256, 15360, 256, 1024,
                          **_GEMMA3_LONG_ROPE),
    "gemma3_27b": _gemma3(262208, 5376, 32, 16, 62, 128, 21504, 168, 1024,
                          **_GEMMA3_LONG_ROPE),
    # Tests: Qwen3's per-head norms; Gemma 3 with a 4-key window on layers 0 and 2 (global
    # layer 1), capped output logits and a query scale other than head_dim**-0.5.
    "tiny_qwen3": _llama(512, 64, 4, 2, 2, 16, 128, kind="qwen3", max_decode_length=128,
                         norm_epsilon=1e-6, rope_theta=1000000.0),
    "tiny_gemma3": _llama(512, 64, 4, 2, 3, 16, 128, kind="gemma3", logits_via_embedding=True,
                          max_decode_length=128, norm_epsilon=1e-6, rope_theta=1000000.0,
                          query_pre_attn_scalar=24, sliding_window=4,
                          sliding_window_pattern=2, final_logit_softcapping=30.0),
})


def model_config(name: str, **overrides) -> TransformerConfig:
  """Returns the named preset, with `overrides` applied (e.g. vocab_size=..., dtype=...)."""
  if name not in MODEL_CONFIGS:
    close = difflib.get_close_matches(name, MODEL_CONFIGS, n=3)
    hint = f" Did you mean {close}?" if close else ""
    raise ValueError(f"Unknown model name {name!r}.{hint} Known models: {sorted(MODEL_CONFIGS)}.")
  config = MODEL_CONFIGS[name]
  return config.replace(**overrides) if overrides else config


def check_same_vocabulary(target: TransformerConfig, draft: TransformerConfig,
                          roles: tuple[str, str] = ("target", "draft")) -> None:
  """Speculative decoding and distillation compare distributions token by token.

  `roles` names the two models in the message, e.g. ("target", "reference") for AdaSPEC's
  reference model.
  """
  if target.vocab_size != draft.vocab_size:
    first, second = roles
    raise ValueError(
        f"The {second}'s vocab_size={draft.vocab_size} differs from the {first}'s "
        f"vocab_size={target.vocab_size}; {second} and {first} must share one vocabulary "
        "(build both with the same SentencePiece model and the same vocab_size).")


def check_token_ids(tokens, vocab_size: int, where: str) -> None:
  """Raises ValueError unless every id in `tokens` lies in [0, vocab_size).

  An id outside it does not fail by itself: the embedding gather (`jnp.take`) fills NaN or
  clamps, and a loss reads 0.0 or NaN. Host-side NumPy check (one min and one max over the
  array); call it where token arrays enter (trainer batches, decoding prompts). Traced
  values (inside jit) cannot be checked and are skipped.

  Args:
    tokens: integer array (NumPy, a list, or a concrete jax.Array, fetched to the host).
    vocab_size: the model's vocabulary size.
    where: what the tokens are and where they came from, for the message, e.g.
      "decoder_target_tokens of the batch for step 3 (data: task 'x', MODEL_DIR=...)".
  """
  import jax  # local: this module otherwise needs only jax.numpy
  import numpy as np
  if isinstance(tokens, jax.core.Tracer):
    return
  tokens = np.asarray(tokens)
  if tokens.size == 0:
    return
  if not (np.issubdtype(tokens.dtype, np.integer) or tokens.dtype == np.bool_):
    if not np.all(np.isfinite(tokens)) or not np.all(tokens == np.round(tokens)):
      raise ValueError(f"{where}: token ids must be integers; got dtype {tokens.dtype} with "
                       "non-integer values. Pass integer token ids.")
  low, high = tokens.min(), tokens.max()
  if low >= 0 and high < vocab_size:
    return
  bad = np.argwhere((tokens < 0) | (tokens >= vocab_size))
  index = tuple(int(i) for i in bad[0])
  value = int(tokens[index])
  kind = "negative" if value < 0 else f">= vocab_size={vocab_size}"
  raise ValueError(
      f"{where}: token id {value} at position {list(index)} is {kind}; ids must lie in "
      f"[0, {vocab_size}) ({len(bad)} id(s) outside, range found [{int(low)}, {int(high)}]). "
      "The data's vocabulary does not match the model's: use the model's SentencePiece "
      f"vocabulary for the data, or build the model with the data's vocab_size.")
