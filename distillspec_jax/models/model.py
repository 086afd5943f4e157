"""`Model`: the functional face of a network, the one object the rest of the framework uses.

It wraps a `TransformerConfig` and exposes pure functions of explicit parameters:
teacher-forced logits for training, and incremental scoring against an explicit
`DecodingCache` for decoding and speculative decoding. Encoder-decoder and decoder-only
models present the same decoding interface: the *decoder prompt* is `[start]` for an
encoder-decoder and `[start] + prompt` for a decoder-only model, where `start` is T5's start
token 0; a model whose `TokenIds` come from a Hugging Face tokenizer has no start token and
takes its prompt exactly as the tokenizer encoded it.

A draft may carry an acceptance head (`acceptance_head`, models/acceptance_head.py): its
parameters sit under `acceptance_head/` beside the network's, `logits` and `extend` ignore
them, and `logits_with_acceptance` / `extend_with_acceptance` also give the head's output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.models import acceptance_head as head_lib
from distillspec_jax.models import layers
from distillspec_jax.models import llama
from distillspec_jax.models import network
from distillspec_jax.models.cache import DecodingCache, empty_self_attention
from distillspec_jax.models.config import TransformerConfig, check_same_vocabulary, model_config

Array = jax.Array
Params = Any

# T5 vocabulary conventions.
PAD_ID = 0
EOS_ID = 1
DECODER_START_ID = 0
# Padding of token rows when 0 is a real token: no token has a negative id.
NO_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """The ids decoding relies on, from the model's vocabulary (the defaults are T5's).

  eos_id: ends a row's output; also the EOS of training targets and of padding rows.
  decoder_start_id: put before every decoder prompt; None (a Hugging Face tokenizer): the
    prompt is used as the tokenizer encoded it (its own BOS, if any).
  pad_id: the value right-padding token rows (prompts `[batch, P]`, decoded outputs); 0 for
    T5 (its real pad), NO_TOKEN where 0 is a real token, so that no id is read as padding.
  num_tokens: the tokenizer's size when the embedding has more rows (rows past it are never
    sampled: logits are cut to `num_tokens`); None: every row is a token.
  stop_ids: further ids that end a row's output exactly as `eos_id` does, in every decoder
    (an instruct model's turn end: the other end-of-sequence ids its config.json /
    generation_config.json list); a tuple of distinct ints in [0, num_tokens), none of them
    eos_id or pad_id. `end_ids` is eos_id followed by them; `Model.ends_row` tests them.
  """

  eos_id: int = EOS_ID
  decoder_start_id: Optional[int] = DECODER_START_ID
  pad_id: int = PAD_ID
  num_tokens: Optional[int] = None
  stop_ids: tuple = ()

  def __post_init__(self):
    for name in ("eos_id", "decoder_start_id", "pad_id", "num_tokens"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"TokenIds.{name}={value!r} must be an int.")
    if self.num_tokens is not None and self.num_tokens <= self.eos_id:
      raise ValueError(f"TokenIds.num_tokens={self.num_tokens} must exceed eos_id="
                       f"{self.eos_id}.")
    self._check_stop_ids()

  def _check_stop_ids(self) -> None:
    stops = self.stop_ids
    what = f"TokenIds.stop_ids={stops!r}"
    if not isinstance(stops, tuple):
      raise TypeError(f"{what} must be a tuple of ints (the further ids that end a row).")
    for i, value in enumerate(stops):
      if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {value!r} is not an int.")
      problem = None
      if value < 0:
        problem = f"{value} is negative"
      elif value == self.eos_id:
        problem = f"{value} is eos_id, which ends a row already"
      elif value == self.pad_id:
        problem = f"{value} is the pad id (every padded position would read as a stop)"
      elif self.num_tokens is not None and value >= self.num_tokens:
        problem = f"{value} is past num_tokens={self.num_tokens} (never output)"
      elif value in stops[:i]:
        problem = f"it lists {value} twice"
      if problem:
        raise ValueError(f"{what}: {problem}. Pass distinct token ids of the vocabulary "
                         "other than eos_id and the pad id.")
    if any(not isinstance(v, int) for v in stops):  # NumPy ints: plain ones, for hashing/JSON
      object.__setattr__(self, "stop_ids", tuple(int(v) for v in stops))

  @property
  def end_ids(self) -> tuple:
    """Every id that ends a row: eos_id, then the stop ids."""
    return (self.eos_id,) + self.stop_ids

  @classmethod
  def from_json(cls, values: dict) -> "TokenIds":
    """TokenIds from `dataclasses.asdict` read back from JSON (a checkpoint's meta): lists
    become tuples; a field the meta lacks (older meta: stop_ids) takes its default."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()
              if k in known}
    return cls(**values)


def ends_row(tokens, end_ids: tuple):
  """Whether each of `tokens` is one of `end_ids` (a static tuple; empty: never)."""
  tokens = jnp.asarray(tokens)
  out = jnp.zeros(tokens.shape, bool)
  for end in end_ids:
    out = out | (tokens == end)
  return out


@dataclasses.dataclass(frozen=True)
class Model:
  """A network plus its config; hashable, so it can be a static argument of `jax.jit`.

  `tokens` gives the special ids decoding uses (T5's unless a vocabulary says otherwise;
  `with_tokens`).
  acceptance_head: the config of an acceptance-probability head on the last hidden state, or
    None (no head; the parameter tree is the network's alone).
  """

  config: TransformerConfig
  tokens: TokenIds = TokenIds()
  acceptance_head: Optional[head_lib.AcceptanceHeadConfig] = None

  def __post_init__(self):
    if self.acceptance_head is not None and not isinstance(self.acceptance_head,
                                                           head_lib.AcceptanceHeadConfig):
      raise TypeError(f"acceptance_head must be an AcceptanceHeadConfig or None, got "
                      f"{self.acceptance_head!r}.")
    t = self.tokens
    if self.config.kind == "encoder_decoder" and t.decoder_start_id is None:
      raise ValueError("An encoder-decoder model needs a decoder start id; its TokenIds "
                       "have decoder_start_id=None.")
    if t.num_tokens is not None and t.num_tokens > self.config.vocab_size:
      raise ValueError(
          f"The vocabulary has {t.num_tokens} tokens but the model only {self.config.vocab_size} "
          "embedding rows; use a model with vocab_size >= the tokenizer's size.")
    for stop in t.stop_ids:
      if stop >= self.config.vocab_size:
        raise ValueError(f"TokenIds.stop_ids={t.stop_ids!r}: stop id {stop} is past the "
                         f"model's {self.config.vocab_size} embedding rows (never output).")

  def with_tokens(self, tokens: TokenIds) -> "Model":
    return dataclasses.replace(self, tokens=tokens)

  def ends_row(self, tokens):
    """Whether each of `tokens` (any shape, traced or not) ends a row: the EOS or any stop id
    (`TokenIds.end_ids`). The one test every decoder, the speculative rounds' cut and the
    quality texts apply."""
    return ends_row(tokens, self.tokens.end_ids)

  @property
  def output_size(self) -> int:
    """Width of the logits: the tokenizer's size when it is smaller than the embedding."""
    return self.tokens.num_tokens or self.config.vocab_size

  def _cut(self, logits: Array) -> Array:
    n = self.tokens.num_tokens
    return logits if n is None or n == logits.shape[-1] else logits[..., :n]

  @classmethod
  def from_name(cls, name: str, **overrides) -> "Model":
    return cls(model_config(name, **overrides))

  @property
  def is_encoder_decoder(self) -> bool:
    return self.config.kind == "encoder_decoder"

  @property
  def module(self) -> nn.Module:
    if self.is_encoder_decoder:
      return network.EncoderDecoder(self.config)
    if self.config.is_rope_decoder:
      return llama.LlamaDecoderOnly(self.config)
    return network.DecoderOnly(self.config)

  # --- parameters -------------------------------------------------------------------------

  def _init_boxed(self, rng: Array):
    tokens = jnp.ones((1, 4), jnp.int32)
    network_rng, head_rng = jax.random.split(rng) if self.acceptance_head else (rng, None)
    if self.is_encoder_decoder:
      params = self.module.init(network_rng, tokens, tokens)["params"]
    else:
      params = self.module.init(network_rng, tokens)["params"]
    if self.acceptance_head is None:
      return params
    return dict(params, **{head_lib.PARAMS_KEY: head_lib.init_boxed(
        self.acceptance_head, head_rng, self.config.emb_dim)})

  def init(self, rng: Array) -> Params:
    """Random parameters (fp32), as a plain nested dict of arrays."""
    return nn.unbox(self._init_boxed(rng))

  def param_shapes(self) -> Params:
    """Parameter ShapeDtypeStructs via `jax.eval_shape`: nothing is allocated."""
    return nn.unbox(_abstract_init(self))  # fresh containers around the shared leaves

  def logical_axes(self) -> Params:
    """The logical axis names of every parameter (a tree of `jax.sharding.PartitionSpec`)."""
    return nn.get_partition_spec(_abstract_init(self))

  def num_params(self) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.param_shapes())))

  def with_acceptance_head(self, params: Params, head: head_lib.AcceptanceHeadConfig,
                           rng: Array) -> tuple["Model", Params]:
    """(this model with `head`, `params` plus the head's fresh parameters): a trained draft
    without a head gains one, its network parameters unchanged."""
    if self.acceptance_head is not None:
      raise ValueError("This model already has an acceptance head.")
    model = dataclasses.replace(self, acceptance_head=head)
    head_params = nn.unbox(head_lib.init_boxed(head, rng, self.config.emb_dim))
    return model, dict(_network_params(params), **{head_lib.PARAMS_KEY: head_params})

  def check_acceptance_head(self, what: str) -> None:
    """Refuses a model without an acceptance head where `what` needs one."""
    if self.acceptance_head is None:
      raise ValueError(f"{what} needs a draft with an acceptance head, but this draft has "
                       "none; build it with Model(config, acceptance_head="
                       "AcceptanceHeadConfig()) (or Model.with_acceptance_head) and train the "
                       "head (DistillationConfig.acceptance_weight > 0).")

  # --- training -----------------------------------------------------------------------------

  def logits(self, params: Params, batch: dict, *, dropout_rng: Optional[Array] = None) -> Array:
    """Teacher-forced logits [batch, target_len, vocab] (fp32) from T5X feature names.

    batch: `decoder_input_tokens: [batch, target_len]` and, for encoder-decoders,
    `encoder_input_tokens: [batch, input_len]`. Dropout is on iff `dropout_rng` is given.
    """
    logits, _ = self._teacher_forced(params, batch, dropout_rng, hidden=False)
    return logits

  def logits_with_acceptance(self, params: Params, batch: dict, *,
                             dropout_rng: Optional[Array] = None) -> tuple[Array, Array]:
    """(`logits`, the acceptance head's logits [batch, target_len] fp32): the head reads the
    last hidden state at each position, before the next token is drawn from it."""
    self.check_acceptance_head("logits_with_acceptance")
    logits, hidden = self._teacher_forced(params, batch, dropout_rng, hidden=True)
    return logits, head_lib.apply(self.acceptance_head, params[head_lib.PARAMS_KEY], hidden)

  def _teacher_forced(self, params: Params, batch: dict, dropout_rng, *, hidden: bool):
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    variables = {"params": _network_params(params)}
    if self.is_encoder_decoder:
      args = (batch["encoder_input_tokens"], batch["decoder_input_tokens"], deterministic)
    else:
      args = (batch["decoder_input_tokens"], deterministic)
    if not hidden:
      return self._cut(self.module.apply(variables, *args, rngs=rngs)), None
    logits, state = self.module.apply(variables, *args, rngs=rngs,
                                      capture_intermediates=_is_final_norm)
    return self._cut(logits), _final_norm_output(state)

  def hidden_states(self, params: Params, batch: dict, *,
                    dropout_rng: Optional[Array] = None) -> Array:
    """Teacher-forced last-layer states [batch, target_len, embed], before the output
    projection: `project(params, hidden_states(params, batch))` equals `logits(params, batch)`
    (without dropout). The blocked loss projects them a block of positions at a time."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    module = self.module
    tokens = ((batch["encoder_input_tokens"], batch["decoder_input_tokens"])
              if self.is_encoder_decoder else (batch["decoder_input_tokens"],))
    return module.apply({"params": _network_params(params)}, *tokens, deterministic, rngs=rngs,
                        method=module.hidden_states)

  def project(self, params: Params, hidden: Array, *,
              dropout_rng: Optional[Array] = None) -> Array:
    """The output projection (final norm, dropout, logits): [..., embed] -> [..., vocab] fp32.

    Position-wise: any block of positions of `hidden_states` projects on its own."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    module = self.module
    return self._cut(module.apply({"params": _network_params(params)}, hidden, deterministic,
                                  rngs=rngs, method=module.project))

  def project_with_acceptance(self, params: Params, hidden: Array, *,
                              dropout_rng: Optional[Array] = None) -> tuple[Array, Array]:
    """(`project`'s logits [..., vocab], the acceptance head's logits [...]) of hidden states
    [..., embed]: the head reads the final norm's output at the same positions."""
    self.check_acceptance_head("project_with_acceptance")
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    module = self.module
    logits, state = module.apply({"params": _network_params(params)}, hidden, deterministic,
                                 rngs=rngs, method=module.project,
                                 capture_intermediates=_is_final_norm)
    return self._cut(logits), head_lib.apply(self.acceptance_head,
                                             params[head_lib.PARAMS_KEY],
                                             _final_norm_output(state))

  # --- incremental decoding -----------------------------------------------------------------

  def init_cache(self, params: Params, batch_size: int, max_length: int,
                 encoder_input_tokens: Optional[Array] = None) -> DecodingCache:
    """An empty cache of capacity `max_length` decoder tokens per row, positions at 0.

    For an encoder-decoder the prompt `encoder_input_tokens: [batch, input_len]` is encoded
    here, once, and each layer's cross-attention keys/values are stored in the cache.
    """
    c = self.config
    self_attention = empty_self_attention(c.num_decoder_layers, batch_size, max_length,
                                          c.kv_heads, c.head_dim, c.activation_dtype)
    positions = jnp.zeros((batch_size,), jnp.int32)
    if not self.is_encoder_decoder:
      return DecodingCache(positions=positions, self_attention=self_attention)
    if encoder_input_tokens is None:
      raise ValueError("An encoder-decoder model needs encoder_input_tokens to start decoding.")
    module, variables = self.module, {"params": _network_params(params)}
    encoded = module.apply(variables, encoder_input_tokens, method=module.encode)
    cross = module.apply(variables, encoded, method=module.cross_key_values)
    return DecodingCache(positions=positions, self_attention=self_attention,
                         cross_attention=tuple(layers.to_cache_layout(*kv) for kv in cross),
                         encoder_mask=encoder_input_tokens > 0)

  def extend(self, params: Params, cache: DecodingCache, tokens: Array,
             hidden_layers: tuple[int, ...] = ()):
    """Scores `tokens: [batch, k]` placed at each row's cache position and stores them.

    Returns (logits [batch, k, vocab] fp32, cache with positions advanced by k), and with
    `hidden_layers` (indices: 0 the embedding output, i decoder layer i's output) a third
    output, those hidden states side by side: [batch, k, len(hidden_layers) * emb_dim]. The
    caller guarantees `positions + k <= max_length`: writes past the end are not dropped but
    clamped onto the row's last valid slots or undefined (see `DecodingCache`).
    """
    logits, _, cache, extras = self._extend(params, cache, tokens, hidden=False,
                                            hidden_layers=hidden_layers)
    return (logits, cache) + extras

  def score_block(self, params: Params, cache: DecodingCache, tokens: Array,
                  hidden_layers: tuple[int, ...] = ()):
    """`extend` without the write: scores `tokens: [batch, k]` at each row's cache position
    against the cache, which it only reads. Returns (logits [batch, k, vocab] fp32, the block's
    entries: one (keys, values) pair per decoder layer, each [batch, k, kv_heads, head_dim],
    for `write_block`) and with `hidden_layers` `extend`'s third output. The logits are
    `extend`'s up to rounding (one softmax over the cache's and the block's keys).

    For a call inside a branch (`lax.switch` over block widths): a branch that writes into
    the cache makes XLA copy the whole cache on the way in or out, while one that only reads
    it does not, and `write_block` after the branch writes in place."""
    logits, _, entries, extras = self._extend(params, cache, tokens, hidden=False,
                                              hidden_layers=hidden_layers, write=False)
    return (logits, entries) + extras

  def write_block(self, cache: DecodingCache, entries: tuple, advance) -> DecodingCache:
    """Writes `score_block`'s entries (k positions per row) at each row's position and
    advances the rows by `advance` (an int or a traced [] int32, at most k): entries past
    `advance` land past the new positions, where they are never read. The caller guarantees
    `positions + k <= max_length` (see `extend`)."""
    written = tuple(layers.write_key_values(layer, keys, values, cache.positions)
                    for layer, (keys, values) in zip(cache.self_attention, entries))
    return cache.replace(self_attention=written).advance(advance)

  def encode(self, params: Params, encoder_input_tokens: Array) -> Array:
    """An encoder-decoder's encoder output [batch, input_len, emb_dim] (no dropout)."""
    module = self.module
    return module.apply({"params": _network_params(params)}, encoder_input_tokens,
                        method=module.encode)

  def layer_features(self, params: Params, batch: dict, hidden_layers: tuple[int, ...]):
    """Teacher-forced (logits [batch, len, vocab] fp32, hidden [batch, len, len(hidden_layers)
    * emb_dim], encoded [batch, input_len, emb_dim] or None), no dropout; `batch` as for
    `logits`. What a draft head is trained on."""
    module, variables = self.module, {"params": _network_params(params)}
    tokens = batch["decoder_input_tokens"]
    if not self.is_encoder_decoder:
      logits, _, hidden = module.apply(variables, tokens, hidden_layers=tuple(hidden_layers),
                                       method=module.decode)
      return self._cut(logits), hidden, None
    inputs = batch["encoder_input_tokens"]
    encoded = self.encode(params, inputs)
    cross = module.apply(variables, encoded, method=module.cross_key_values)
    logits, _, hidden = module.apply(variables, tokens, cross=cross, encoder_mask=inputs > 0,
                                     hidden_layers=tuple(hidden_layers), method=module.decode)
    return self._cut(logits), hidden, encoded

  def extend_with_acceptance(self, params: Params, cache: DecodingCache, tokens: Array):
    """`extend` plus the acceptance head's probability that the target accepts each next
    token: (logits [batch, k, vocab], acceptance [batch, k] in [0, 1], cache)."""
    self.check_acceptance_head("extend_with_acceptance")
    logits, hidden, cache, _ = self._extend(params, cache, tokens, hidden=True)
    acceptance = jax.nn.sigmoid(
        head_lib.apply(self.acceptance_head, params[head_lib.PARAMS_KEY], hidden))
    return logits, acceptance, cache

  def _extend(self, params: Params, cache: DecodingCache, tokens: Array, *, hidden: bool,
              hidden_layers: tuple[int, ...] = (), write: bool = True):
    """(logits, the final norm's output [batch, k, embed] or None, the advanced cache (with
    `write=False` the block's entries instead), the `hidden_layers` states as a 0- or
    1-tuple)."""
    module = self.module
    kwargs = dict(positions=cache.positions, self_caches=cache.self_attention,
                  cross=cache.cross_attention, encoder_mask=cache.encoder_mask,
                  method=module.decode)
    if hidden_layers:
      kwargs["hidden_layers"] = tuple(hidden_layers)
    if not write:
      kwargs["write"] = False
    variables = {"params": _network_params(params)}
    last_hidden = None
    if hidden:
      outputs, state = module.apply(variables, tokens, capture_intermediates=_is_final_norm,
                                    **kwargs)
      last_hidden = _final_norm_output(state)
    else:
      outputs = module.apply(variables, tokens, **kwargs)
    if write:
      cache = cache.replace(self_attention=outputs[1]).advance(tokens.shape[1])
    else:
      cache = outputs[1]
    return self._cut(outputs[0]), last_hidden, cache, tuple(outputs[2:])

  def prefill(self, params: Params, cache: DecodingCache, tokens: Array, lengths: Array):
    """Stores right-padded `tokens: [batch, P]` of per-row `lengths: [batch]` (>= 1).

    Returns (logits [batch, vocab] at each row's last real token, cache advanced by `lengths`).
    The padded tail is written but lies past the new positions, so it is never attended to.
    """
    logits, cache = self.extend(params, cache, tokens)
    cache = cache.rollback(tokens.shape[1] - lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


def _network_params(params: Params) -> Params:
  """The network's parameters: `params` without the acceptance head's."""
  if isinstance(params, dict) and head_lib.PARAMS_KEY in params:
    return {k: v for k, v in params.items() if k != head_lib.PARAMS_KEY}
  return params


def _is_final_norm(module: nn.Module, method_name: str) -> bool:
  """The decoder's final norm (every family names it `decoder_norm`): its output is the last
  hidden state, the vector the logits are read from."""
  return module.name == "decoder_norm" and method_name == "__call__"


def _final_norm_output(state) -> Array:
  """The captured output of the final norm, [batch, k, embed]."""
  (hidden,) = state["intermediates"]["decoder"]["decoder_norm"]["__call__"]
  return hidden


@functools.lru_cache(maxsize=64)
def _abstract_init(model: Model):
  """The boxed (logically partitioned) abstract parameters of `model`, traced once per config:
  `param_shapes` and `logical_axes` are called for every sharding, step and checkpoint, and
  each trace of the init costs about as much as tracing the model (0.5 s for a tiny one on
  CPU). The leaves are immutable; callers get new containers (`nn.unbox`,
  `nn.get_partition_spec`)."""
  return jax.eval_shape(model._init_boxed, jax.random.PRNGKey(0))


def decoder_prompt(model: Model, prompt_tokens: Optional[Array], batch_size: int):
  """The decoder's prompt and per-row lengths.

  Encoder-decoder: `[start]` for every row (the prompt goes to the encoder). Decoder-only:
  `[start] + prompt`, or the prompt alone when the model has no start id, where
  `prompt_tokens: [batch, P]` is right-padded with `model.tokens.pad_id` (the padding
  is read as a mask; the padded slots are given id 0, which is never attended to).
  Returns (tokens [batch, P (+ 1 with a start id)], lengths [batch] int32).
  """
  start_id = model.tokens.decoder_start_id
  if model.is_encoder_decoder or prompt_tokens is None:
    if start_id is None:
      raise ValueError("Decoding without a prompt needs a decoder start id; this model's "
                       "tokenizer has none, so pass prompt_tokens.")
    return jnp.full((batch_size, 1), start_id, jnp.int32), jnp.ones((batch_size,), jnp.int32)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  real = prompt_tokens != model.tokens.pad_id
  lengths = jnp.sum(real, axis=1).astype(jnp.int32)
  prompt_tokens = jnp.where(real, prompt_tokens, 0)
  if start_id is None:
    return prompt_tokens, lengths
  start = jnp.full((batch_size, 1), start_id, jnp.int32)
  return jnp.concatenate([start, prompt_tokens], axis=1), lengths + 1


def check_same_layout(target: Model, draft: Model,
                      roles: tuple[str, str] = ("target", "draft")) -> None:
  """Refuses an encoder-decoder paired with a decoder-only model (they read a prompt
  differently). Decoder-only kinds pair with each other (a Qwen3 target, a Qwen2 draft: kinds
  'qwen3' and 'llama') when their tokens agree (`check_same_tokens`)."""
  first, second = roles
  if target.is_encoder_decoder != draft.is_encoder_decoder:
    raise ValueError(
        f"The {first} is {target.config.kind} but the {second} is {draft.config.kind}: an "
        "encoder-decoder reads the prompt with its encoder, a decoder-only model as its first "
        f"tokens; pair two encoder-decoders or two decoder-only models.")


def check_same_tokens(target: Model, draft: Model,
                      roles: tuple[str, str] = ("target", "draft")) -> None:
  """Refuses a pair whose distributions cannot be compared token by token.

  With a tokenizer's TokenIds on both (`num_tokens` set) the two must agree on them; their
  embeddings may have different row counts (the rows past `num_tokens` are never output).
  Otherwise (T5's conventions) the vocab sizes must be equal. That the two tokenizers are
  the same is checked where the vocabulary is read (`data.vocabularies`)."""
  first, second = roles
  if target.tokens.num_tokens is None and draft.tokens.num_tokens is None:
    check_same_vocabulary(target.config, draft.config, roles)
    return
  if target.tokens != draft.tokens:
    raise ValueError(
        f"The {second}'s token ids {draft.tokens} differ from the {first}'s {target.tokens}; "
        f"give both models the one tokenizer they share (Model.with_tokens).")
