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

ModelKind = Literal["encoder_decoder", "decoder_only"]
MODEL_KINDS = ("encoder_decoder", "decoder_only")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shapes and options of a T5 1.1-style Transformer.

  Attributes:
    kind: "encoder_decoder" (T5 1.1) or "decoder_only" (GPT-like LM from the same layers).
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
    dtype: activation dtype name ("float32" on CPU, "bfloat16" on TPU); parameters stay fp32.
    relative_attention_num_buckets / relative_attention_max_distance: T5 relative bias.
    logits_via_embedding: tie the logits layer to the embedding (False for T5 1.1).
    max_decode_length: default capacity of the decoding cache.
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

  def __post_init__(self):
    if self.kind not in MODEL_KINDS:
      raise ValueError(f"kind={self.kind!r} is not a model kind; use one of {MODEL_KINDS}.")
    for name in ("vocab_size", "emb_dim", "num_heads", "num_decoder_layers", "head_dim",
                 "mlp_dim", "relative_attention_num_buckets", "max_decode_length"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer.")
    if self.encoder_mlp_dim is not None and int(self.encoder_mlp_dim) < 1:
      raise ValueError(f"encoder_mlp_dim={self.encoder_mlp_dim!r} must be a positive integer, "
                       "or None for the decoder's mlp_dim.")
    if self.kind == "encoder_decoder" and self.num_encoder_layers < 1:
      raise ValueError(f"num_encoder_layers={self.num_encoder_layers} must be >= 1 for an "
                       "encoder-decoder; use kind='decoder_only' for a model without encoder.")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate={self.dropout_rate} must be in [0, 1).")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype={self.dtype!r} must be 'float32', 'bfloat16' or 'float16'.")

  @property
  def encoder_mlp_width(self) -> int:
    """The encoder's MLP width: encoder_mlp_dim, or mlp_dim when that is None."""
    return self.mlp_dim if self.encoder_mlp_dim is None else int(self.encoder_mlp_dim)

  @property
  def activation_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


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
