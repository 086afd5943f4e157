"""Target-conditioned draft heads (EAGLE-3 style): one decoder layer over the target's features.

A head drafts from what the target already computed. At head position t it reads the target's
hidden states at position t (from `feature_layers`: low, middle and high by default) and the
embedding of the token at t + 1, and predicts the token at t + 2:

    fused_t  = fc(concat(h_t[l1], h_t[l2], h_t[l3]))            [d]   (fc: n*d -> d)
    input_t  = concat(norm_e(embed(x_{t+1})), norm_h(fused_t))   [2d]
    out_t    = fused_t + attention(input_t)  (+ cross-attention to the encoder output)
    out_t    = out_t + mlp(norm(out_t))                           (the head's own feature)
    logits_t = lm_head(norm(out_t))                               [draft vocabulary]

Drafting a second token, the head has no target feature for the token it just proposed, so it
feeds its own `out_t` where `fused` stood (EAGLE-3's "training-time test" trains exactly
that: `Head.unroll`). The layer is the target kind's: RoPE, grouped-query attention and SwiGLU
for 'llama'; T5 relative position bias, gated GELU (and cross-attention to the target's encoder
output, with the head's own projections) for the T5 kinds. Its MLP width is the head's own
(`HeadConfig.mlp_dim`). The output head may cover a reduced draft vocabulary:
`HeadConfig.draft_ids[i]` is the target id of draft id i (the serving engines' d2t map holds
`draft_ids[i] - i`, their t2d mask marks the target ids present).

Parameters (stored shape, logical axes):

  token_embedder/embedding            [vocab, embed]        (vocab, embed)
  fc/kernel                           [n * embed, embed]    (mlp, embed)
  layer/input_norm/scale, layer/hidden_norm/scale, layer/pre_mlp_layer_norm/scale  [embed]
  layer/self_attention/...            query/key/value read [2 * embed] (the kind's layout)
  layer/relpos_bias/rel_embedding     [heads, buckets]      (T5 kinds)
  layer/pre_cross_attention_layer_norm, layer/encoder_decoder_attention/...  (encoder-decoder)
  layer/mlp/{wi_0, wi_1, wo}/kernel   [embed, mlp], [mlp, embed]
  norm/scale                          [embed]
  lm_head/kernel                      [embed, draft vocab]  (embed, vocab)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.files import read_json, write_json_atomic
from distillspec_jax.core.validation import check_field_types, check_int, check_positive_int
from distillspec_jax.models import layers
from distillspec_jax.models import llama
from distillspec_jax.models.cache import DecodingCache, empty_self_attention
from distillspec_jax.models.config import TransformerConfig

Array = jax.Array
Params = Any


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """Low, middle and high hidden-state indices of a target with `num_layers` decoder layers
  (0 is the embedding output, i layer i's output). A target of 32 layers gives (2, 16, 29),
  the layers EAGLE-3 reads; a shallow one gives what it has: (0, 1, 2) for two layers."""
  if num_layers <= 2:
    return tuple(range(num_layers + 1))
  if num_layers < 8:
    return (1, (num_layers + 1) // 2, num_layers)
  return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """A draft head for one target.

  Attributes:
    target: the target's TransformerConfig (the head's kind, width, attention shape and
      vocabulary are the target's).
    feature_layers: hidden-state indices the head reads (0 = embedding output, i = decoder
      layer i's output, up to target.num_decoder_layers); None = `default_feature_layers`.
    mlp_dim: the head layer's MLP width; None = the target's mlp_dim.
    draft_ids: the target ids of a reduced draft vocabulary (draft id i is target id
      draft_ids[i]); distinct ids in [0, vocab_size). None = the full vocabulary.
    emb_dim: the head's width; None = the target's. A head is only paired with a target of its
      width (stated when a head is built or loaded for a given target).
  """

  target: TransformerConfig
  feature_layers: Optional[tuple] = None
  mlp_dim: Optional[int] = None
  draft_ids: Optional[tuple] = None
  emb_dim: Optional[int] = None

  def __post_init__(self):
    check_field_types(self)
    if not isinstance(self.target, TransformerConfig):
      raise TypeError(f"HeadConfig.target={self.target!r} must be the target's "
                      "TransformerConfig.")
    if self.emb_dim is not None and self.emb_dim != self.target.emb_dim:
      raise ValueError(f"HeadConfig.emb_dim={self.emb_dim} does not match the target's "
                       f"emb_dim={self.target.emb_dim}: a head reads and writes the target's "
                       "hidden states, so its width must be the target's; build the head for "
                       "this target (emb_dim=None).")
    if self.mlp_dim is not None:
      check_positive_int(self.mlp_dim, "HeadConfig.mlp_dim")
    check_feature_layers(self.layers, self.target.num_decoder_layers)
    if self.draft_ids is not None:
      check_draft_ids(self.draft_ids, self.target.vocab_size)

  @property
  def layers(self) -> tuple[int, ...]:
    """The hidden-state indices read (`feature_layers` or the default)."""
    if self.feature_layers is None:
      return default_feature_layers(self.target.num_decoder_layers)
    return tuple(self.feature_layers)

  @property
  def layer_config(self) -> TransformerConfig:
    """The head layer's shapes: the target's with the head's MLP width, one layer, no
    dropout."""
    mlp = self.target.mlp_dim if self.mlp_dim is None else self.mlp_dim
    return self.target.replace(mlp_dim=mlp, num_decoder_layers=1, dropout_rate=0.0)

  # What the trainer and the engine read from a model config.
  @property
  def kind(self) -> str:
    return self.target.kind

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  @property
  def dropout_rate(self) -> float:
    return 0.0  # the head trains without dropout

  @property
  def max_decode_length(self) -> int:
    return self.target.max_decode_length

  @property
  def width(self) -> int:
    return self.target.emb_dim

  @property
  def draft_vocab_size(self) -> int:
    return self.target.vocab_size if self.draft_ids is None else len(self.draft_ids)

  def replace(self, **changes) -> "HeadConfig":
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict:
    """The head's own fields (not the target's config), as a checkpoint's `head.json` holds
    them beside the parameters."""
    as_list = lambda v: None if v is None else [int(x) for x in v]
    return {"feature_layers": list(self.layers), "mlp_dim": self.layer_config.mlp_dim,
            "draft_ids": as_list(self.draft_ids)}

  @classmethod
  def from_json(cls, data: dict, target: TransformerConfig) -> "HeadConfig":
    """The HeadConfig of `to_json`'s fields for `target` (checked as any HeadConfig)."""
    as_tuple = lambda v: None if v is None else tuple(int(x) for x in v)
    return cls(target, feature_layers=as_tuple(data.get("feature_layers")),
               mlp_dim=data.get("mlp_dim"), draft_ids=as_tuple(data.get("draft_ids")))


# A head checkpoint's folder holds its HeadConfig's own fields in this file beside the
# parameters, so that a reader can rebuild the head for its target.
HEAD_CONFIG_FILE = "head.json"


def write_head_config(directory: str, config: HeadConfig) -> None:
  """`directory`/head.json of `config` (written atomically)."""
  write_json_atomic(os.path.join(directory, HEAD_CONFIG_FILE), config.to_json())


def read_head_config(directory: str, target: TransformerConfig, name: str) -> HeadConfig:
  """The HeadConfig a head checkpoint folder records, for `target`; a ValueError naming
  `name` (the setting that points there) when the folder holds no head."""
  path = os.path.join(directory, HEAD_CONFIG_FILE)
  if not os.path.exists(path):
    raise ValueError(f"{name}={directory!r} holds no draft head ({HEAD_CONFIG_FILE} is "
                     "missing): point it at a head's folder (the main job's "
                     "distill_head_<recipe>), or evaluate a draft model there instead.")
  return HeadConfig.from_json(read_json(path), target)


def check_feature_layers(feature_layers, num_layers: int) -> None:
  """Refuses an empty, repeated or out-of-range list of hidden-state indices."""
  if not isinstance(feature_layers, (tuple, list)) or not feature_layers:
    raise ValueError(f"feature_layers={feature_layers!r} must be a non-empty tuple of "
                     f"hidden-state indices in [0, {num_layers}].")
  for index in feature_layers:
    check_int(index, "feature layer index", 0)
    if index > num_layers:
      raise ValueError(f"feature layer index {index} is outside the target: it has "
                       f"{num_layers} decoder layers, so indices run 0 (embedding output) to "
                       f"{num_layers}; pick layers in that range (default "
                       f"{default_feature_layers(num_layers)}).")
  if len(set(feature_layers)) != len(feature_layers):
    raise ValueError(f"feature_layers={tuple(feature_layers)} repeats a layer; list each "
                     "hidden state once.")


def check_draft_ids(draft_ids, vocab_size: int) -> None:
  """Refuses a draft vocabulary map that is not a permutation of a subset of the target's
  ids: each entry an int in [0, vocab_size), none repeated, at least one."""
  if not isinstance(draft_ids, (tuple, list)) or not draft_ids:
    raise ValueError(f"draft_ids must be a non-empty tuple of target token ids (got "
                     f"{type(draft_ids).__name__}).")
  ids = np.asarray(draft_ids)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"draft_ids must hold integer token ids; got dtype {ids.dtype}.")
  bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
  if bad.size:
    raise ValueError(f"draft_ids[{bad[0]}]={int(ids[bad[0]])} is not a target token id: ids "
                     f"must lie in [0, {vocab_size}). The draft vocabulary map must be a "
                     "permutation of a subset of the target's vocabulary.")
  values, counts = np.unique(ids, return_counts=True)
  if np.any(counts > 1):
    raise ValueError(f"draft_ids maps several draft ids to target id "
                     f"{int(values[counts > 1][0])}; the draft vocabulary map must be a "
                     "permutation of a subset of the target's vocabulary (each id once).")


def check_unroll_steps(steps, name: str = "unroll steps") -> int:
  """The training-time test's unroll depth k >= 1 (`name`: the setting, for the message)."""
  try:
    return check_positive_int(steps, name)
  except ValueError as error:
    raise ValueError(f"{error} The training-time test unrolls the head k >= 1 steps on its "
                     "own features (k = 1 trains on target features only); unroll as deep as "
                     "the rounds it drafts (k = gamma).") from None


# --- the network ---------------------------------------------------------------------------------


class HeadLayer(nn.Module):
  """The head's decoder layer: attention over [token embedding, fused feature] (2 * embed
  wide), the fused feature as residual stream, cross-attention (encoder-decoders) and MLP."""

  config: HeadConfig

  def setup(self):
    c = self.config.layer_config
    dtype, eps = c.activation_dtype, c.norm_epsilon
    self.llama = c.is_rope_decoder
    self.input_norm = layers.RMSNorm(eps, dtype)
    self.hidden_norm = layers.RMSNorm(eps, dtype)
    if self.llama:
      self.self_attention = llama.GroupedQueryAttention(c)
      self.mlp = llama.GatedMlp(c)
    else:
      self.self_attention = layers.MultiHeadDotProductAttention(
          c.num_heads, c.head_dim, c.emb_dim, 0.0, dtype)
      self.relpos_bias = layers.RelativePositionBiases(
          c.relative_attention_num_buckets, c.relative_attention_max_distance, c.num_heads,
          bidirectional=False, dtype=dtype)
      self.mlp = layers.MlpBlock(c.mlp_dim, c.emb_dim, 0.0, dtype)
    if c.kind == "encoder_decoder":
      self.pre_cross_attention_layer_norm = layers.RMSNorm(eps, dtype)
      self.encoder_decoder_attention = layers.MultiHeadDotProductAttention(
          c.num_heads, c.head_dim, c.emb_dim, 0.0, dtype)
    self.pre_mlp_layer_norm = layers.RMSNorm(eps, dtype)

  def cross_key_values(self, encoded: Array):
    """[batch, input_len, embed] -> keys, values [batch, input_len, heads, head_dim]."""
    return self.encoder_decoder_attention.project_kv(encoded)

  def project(self, embedded: Array, fused: Array, positions: Array):
    """(query input, keys, values) of `embedded, fused: [batch, k, embed]` at `positions:
    [batch, k]`; keys/values [batch, k, kv heads, head_dim] (rotated for 'llama')."""
    h = jnp.concatenate([self.input_norm(embedded), self.hidden_norm(fused)], axis=-1)
    if self.llama:
      return self.self_attention.project(h, positions)
    keys, values = self.self_attention.project_kv(h)
    return h, keys, values

  def _bias(self, query_positions, key_positions, allowed):
    mask = jnp.where(allowed, 0.0, layers.NEG_INF).astype(jnp.float32)[:, None]
    if self.llama:
      return mask[:, None]  # [batch, 1, 1, q, keys]
    return self.relpos_bias(query_positions, key_positions) + mask

  def attend(self, query, keys, values, query_positions, key_positions, allowed):
    """Attention of `query` (from `project`) to keys/values [batch, keys, heads, head_dim] at
    `key_positions: [batch, keys]`, where `allowed: [batch, q, keys]`."""
    bias = self._bias(query_positions, key_positions, allowed)
    return self.self_attention(query, keys, values, bias)

  def attend_cache(self, query, cache, query_positions):
    """Attention of `query` to a decoding cache's (keys, values) (`layers.write_cache`
    layouts), keys at or before each query's position."""
    batch, max_length = query.shape[0], cache[0].shape[-1]
    key_positions = jnp.broadcast_to(jnp.arange(max_length)[None], (batch, max_length))
    allowed = key_positions[:, None, :] <= query_positions[:, :, None]
    bias = self._bias(query_positions, key_positions, allowed)
    return self.self_attention.attend_cache(query, cache[0], cache[1], bias)

  def finish(self, fused: Array, attended: Array, cross, encoder_mask,
             cached: bool = False) -> Array:
    """The rest of the layer after self-attention: [batch, k, embed]. `cross`: the
    cross-attention (keys, values) as `cross_key_values` gives them, or in a decoding cache's
    layouts (`cached`, `layers.to_cache_layout`)."""
    x = fused + attended
    if cross is not None:
      bias = jnp.where(encoder_mask, 0.0, layers.NEG_INF).astype(jnp.float32)[:, None, None]
      attention = self.encoder_decoder_attention
      attend = attention.attend_cache if cached else attention
      x = x + attend(self.pre_cross_attention_layer_norm(x), cross[0], cross[1], bias)
    return x + self.mlp(self.pre_mlp_layer_norm(x))


class HeadNetwork(nn.Module):
  """Embedding, feature fusion, one `HeadLayer`, final norm and output head."""

  config: HeadConfig

  def setup(self):
    c = self.config
    t, dtype = c.target, c.target.activation_dtype
    self.token_embedder = layers.Embed(t.vocab_size, t.emb_dim, dtype=dtype)
    self.fc = layers.DenseGeneral((t.emb_dim,), ("mlp", "embed"), dtype=dtype)
    self.layer = HeadLayer(c)
    self.norm = layers.RMSNorm(c.layer_config.norm_epsilon, dtype)
    self.lm_head = layers.DenseGeneral((c.draft_vocab_size,), ("embed", "vocab"), dtype=dtype)

  def cross_key_values(self, encoded: Array):
    return self.layer.cross_key_values(encoded)

  def _logits(self, x: Array) -> Array:
    return self.lm_head(self.norm(x)).astype(jnp.float32)

  def extend(self, tokens: Array, inputs: Array, positions: Array, cache, cross=None,
             encoder_mask=None, from_target: bool = True):
    """k head positions per row at `positions: [batch]` against a decoding cache.

    tokens: [batch, k], the token after each position's feature; inputs: the target's
    features [batch, k, n * embed] (`from_target`) or the head's own outputs [batch, k, embed].
    Returns (draft-vocabulary logits [batch, k, draft vocab] fp32, outputs [batch, k, embed],
    the cache (keys, values) with the k positions written).
    """
    fused = self.fc(inputs) if from_target else inputs
    query_positions = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
    query, keys, values = self.layer.project(self.token_embedder(tokens), fused,
                                             query_positions)
    cache = layers.write_key_values(cache, keys, values, positions)
    attended = self.layer.attend_cache(query, cache, query_positions)
    out = self.layer.finish(fused, attended, cross, encoder_mask, cached=True)
    return self._logits(out), out, cache

  def unroll(self, tokens: Array, features: Array, steps: int, encoded=None,
             encoder_mask=None) -> Array:
    """The training-time test: `steps` draft steps from every position at once.

    tokens: [batch, T], tokens[:, t] the token after position t (the target's training
    targets); features: [batch, T, n * embed], the target's at each position. Step j at
    position t stands for drafting token t + j + 1 from a round that starts at t: it reads
    token t + j (tokens shifted left by j - 1) and its own step j - 1 output (the target's
    feature at j = 1), and attends to step 1's keys at positions <= t and to the keys of its
    own chain (steps 2..j at t), as a drafting round's cache holds them.
    Returns draft-vocabulary logits [steps, batch, T, draft vocab] fp32.
    """
    batch, length = tokens.shape
    t = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    cross = None if encoded is None else self.layer.cross_key_values(encoded)
    hidden = self.fc(features)
    all_keys, all_values, key_positions, allowed, outputs = [], [], [], [], []
    causal = t[:, None, :] <= t[:, :, None]            # [batch, q, keys]
    diagonal = t[:, None, :] == t[:, :, None]
    for step in range(steps):
      shifted = jnp.pad(tokens[:, step:], ((0, 0), (0, step)))
      positions = t + step
      query, keys, values = self.layer.project(self.token_embedder(shifted), hidden, positions)
      all_keys.append(keys)
      all_values.append(values)
      key_positions.append(positions)
      allowed.append(causal if step == 0 else diagonal)
      attended = self.layer.attend(query, jnp.concatenate(all_keys, 1),
                                   jnp.concatenate(all_values, 1), positions,
                                   jnp.concatenate(key_positions, 1),
                                   jnp.concatenate(allowed, 2))
      hidden = self.layer.finish(hidden, attended, cross, encoder_mask)
      outputs.append(self._logits(hidden))
    return jnp.stack(outputs)

  def __call__(self, tokens: Array, features: Array, encoded=None, encoder_mask=None):
    """One unrolled step (initialises every parameter)."""
    return self.unroll(tokens, features, 1, encoded, encoder_mask)


# --- the functional face --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Head:
  """A head network plus its config; hashable (a static argument of `jax.jit`). The face the
  trainer, the engine and the exporter use, as `Model` is for whole models."""

  config: HeadConfig

  @property
  def module(self) -> HeadNetwork:
    return HeadNetwork(self.config)

  @property
  def is_encoder_decoder(self) -> bool:
    return self.config.kind == "encoder_decoder"

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.config.layers

  @property
  def draft_ids(self) -> Optional[np.ndarray]:
    return None if self.config.draft_ids is None else np.asarray(self.config.draft_ids,
                                                                  np.int32)

  def _init_boxed(self, rng: Array):
    c = self.config
    tokens = jnp.ones((1, 4), jnp.int32)
    features = jnp.zeros((1, 4, len(c.layers) * c.width), jnp.float32)
    encoded = mask = None
    if self.is_encoder_decoder:
      encoded, mask = jnp.zeros((1, 3, c.width), jnp.float32), jnp.ones((1, 3), bool)
    return self.module.init(rng, tokens, features, encoded, mask)["params"]

  def init(self, rng: Array, target_params: Optional[Params] = None) -> Params:
    """Random parameters; with `target_params` the token embedding starts as the target's
    (EAGLE-3 heads share the target's embedding space)."""
    params = nn.unbox(self._init_boxed(rng))
    if target_params is not None:
      embedding = target_params["token_embedder"]["embedding"]
      params["token_embedder"]["embedding"] = jnp.asarray(embedding, jnp.float32)
    return params

  def param_shapes(self) -> Params:
    return nn.unbox(_abstract_init(self))

  def logical_axes(self) -> Params:
    return nn.get_partition_spec(_abstract_init(self))

  def num_params(self) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.param_shapes())))

  def check_target(self, target) -> None:
    """Refuses a target (a `Model`) this head was not built for: kind, width, vocabulary,
    or a feature layer the target lacks."""
    t, mine = target.config, self.config.target
    if t.emb_dim != mine.emb_dim:
      raise ValueError(f"The head's width {mine.emb_dim} does not match the target's "
                       f"emb_dim={t.emb_dim}; build the head for this target "
                       "(HeadConfig(target=<the target's config>)).")
    if t.kind != mine.kind or t.vocab_size != mine.vocab_size:
      raise ValueError(f"The head was built for a {mine.kind} target of vocab_size="
                       f"{mine.vocab_size}, not this {t.kind} target of vocab_size="
                       f"{t.vocab_size}; build the head for this target.")
    check_feature_layers(self.feature_layers, t.num_decoder_layers)

  def to_target_logits(self, logits: Array) -> Array:
    """Draft-vocabulary logits [..., draft vocab] -> target-vocabulary logits [..., vocab]
    (NEG_INF on the ids outside the draft vocabulary: probability 0)."""
    ids = self.draft_ids
    if ids is None:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.config.vocab_size,), layers.NEG_INF,
                    logits.dtype)
    return full.at[..., ids].set(logits)

  def to_draft_logits(self, logits: Array) -> Array:
    """Target-vocabulary logits [..., vocab] restricted to the draft vocabulary."""
    ids = self.draft_ids
    return logits if ids is None else jnp.take(logits, jnp.asarray(ids), axis=-1)

  # --- decoding --------------------------------------------------------------------------------

  def init_cache(self, params: Params, batch_size: int, max_length: int,
                 encoded: Optional[Array] = None,
                 encoder_mask: Optional[Array] = None) -> DecodingCache:
    """An empty one-layer cache; for encoder-decoders the head's cross-attention keys/values
    of the target's encoder output `encoded: [batch, input_len, embed]`."""
    c = self.config.layer_config
    self_attention = empty_self_attention(1, batch_size, max_length, c.kv_heads, c.head_dim,
                                          c.activation_dtype)
    positions = jnp.zeros((batch_size,), jnp.int32)
    if not self.is_encoder_decoder:
      return DecodingCache(positions=positions, self_attention=self_attention)
    if encoded is None or encoder_mask is None:
      raise ValueError("An encoder-decoder target's head needs the encoder output and mask.")
    module = self.module
    cross = module.apply({"params": params}, encoded, method=module.cross_key_values)
    return DecodingCache(positions=positions, self_attention=self_attention,
                         cross_attention=(layers.to_cache_layout(*cross),),
                         encoder_mask=encoder_mask)

  def extend(self, params: Params, cache: DecodingCache, tokens: Array, inputs: Array, *,
             from_target: bool):
    """`HeadNetwork.extend` at the cache's positions. Returns (target-vocabulary logits
    [batch, k, vocab] fp32, outputs [batch, k, embed], cache advanced by k)."""
    module = self.module
    cross = None if cache.cross_attention is None else cache.cross_attention[0]
    logits, out, kv = module.apply(
        {"params": params}, tokens, inputs, cache.positions, cache.self_attention[0], cross,
        cache.encoder_mask, from_target, method=module.extend)
    cache = cache.replace(self_attention=(kv,)).advance(tokens.shape[1])
    return self.to_target_logits(logits), out, cache

  # --- training --------------------------------------------------------------------------------

  def unroll(self, params: Params, tokens: Array, features: Array, steps: int,
             encoded: Optional[Array] = None, encoder_mask: Optional[Array] = None) -> Array:
    """`HeadNetwork.unroll`: draft-vocabulary logits [steps, batch, T, draft vocab]."""
    steps = check_unroll_steps(steps)
    length = tokens.shape[1]
    if steps >= length:
      raise ValueError(f"unroll steps={steps} reaches past the sequence's {length} positions: "
                       f"step s (1-based) is compared with the target at positions t + s < "
                       f"{length}, so k >= {length} leaves a step with no token to learn. "
                       f"Unroll fewer steps (k < {length}) or train on longer sequences.")
    module = self.module
    return module.apply({"params": params}, tokens, features, steps, encoded, encoder_mask,
                        method=module.unroll)


@functools.lru_cache(maxsize=32)
def _abstract_init(head: Head):
  return jax.eval_shape(head._init_boxed, jax.random.PRNGKey(0))
