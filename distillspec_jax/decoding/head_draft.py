"""A draft head (models/head.py) as the speculative engine's draft: its state and steps.

Head position t holds (the target's feature at t, the token at t + 1) and predicts the token
at t + 2. With n committed decoder tokens, the last one `pending` (the target has not scored
it yet), a round's first draft step is position n - 2: the target's feature there and
`pending`. The positions before it must hold target features, not the head's own outputs,
so after verification the head's cache is rolled back per row to the round's first step
and the positions of the accepted tokens are written again with the target's features; this
is merged into the next round's first call:

  * `HeadDraftState.features / tokens / count`: the positions still to write with target
    features (the last verification's first `count` = accepted + 1 features and the tokens
    after them: the accepted draft tokens and the target's token), written at `cache.positions`
    by the round's first call, whose last one is the round's first draft step;
  * later draft steps feed the head's own output (`own`) and the token it just drafted;
  * `commit` after verification: rows that go on return their cache to `start + count` (the
    round's first step, which used target features) and take the new block; finished rows
    return to `start` and keep theirs, so their later (unused) rounds write where this one did.

`HeadDrafter` gives the engine's draft loops (`speculative._draft_block` and its adaptive
twin) the `Model.extend` interface: a first call with [previous, pending] (two tokens), then
one token per call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from distillspec_jax.decoding.plain import sample_tokens
from distillspec_jax.models.cache import DecodingCache
from distillspec_jax.models.head import Head

Array = jax.Array
Params = Any


@flax.struct.dataclass
class HeadDraftState:
  """The head's decoding state over [batch] rows (see the module docstring).

  cache: the head's one-layer DecodingCache; positions: head positions written.
  features: [batch, W, n * embed], tokens: [batch, W], count: [batch] in [1, W]: the positions
    the round's first call writes (only the first `count` of each row are real).
  own: [batch, 1, embed], the head's output at its last draft step.
  start: [batch], cache.positions at the round's start.
  verified: [batch, W, n * embed], the round's verification features (zero past its width).
  """

  cache: DecodingCache
  features: Array
  tokens: Array
  count: Array
  own: Array
  start: Array
  verified: Array

  @property
  def width(self) -> int:
    return self.features.shape[-2]

  def resize(self, width: int) -> "HeadDraftState":
    """The block width W = gamma + 1 for another gamma, before any round (count is 1, so
    cutting or zero-padding past the first entry is exact)."""
    def fit(x, axis):
      size = x.shape[axis]
      if size >= width:
        return jax.lax.slice_in_dim(x, 0, width, axis=axis % x.ndim)
      pad = [(0, 0)] * x.ndim
      pad[axis % x.ndim] = (0, width - size)
      return jnp.pad(x, pad)
    return self.replace(features=fit(self.features, -2), tokens=fit(self.tokens, -1),
                        verified=fit(self.verified, -2))


def start(head: Head, head_params, target, target_params, prompt: Array, lengths: Array,
          pending: Array, features: Array, encoder_input_tokens, *, width: int,
          max_length: int) -> HeadDraftState:
  """The head's state after the prefill.

  prompt: [batch, P] the decoder prompt (right-padded), lengths: [batch] its rows' lengths;
  features: [batch, P, n * embed], the target's at the prompt's positions; pending: [batch],
  the first generated token. The head writes positions 0 .. lengths - 2 (prompt token t + 1
  with feature t); the round's first call writes position lengths - 1 (the last prompt
  feature and `pending`).
  """
  batch = prompt.shape[0]
  encoded = mask = None
  if head.is_encoder_decoder:
    encoded = target.encode(target_params, encoder_input_tokens)
    mask = encoder_input_tokens > 0
  cache = head.init_cache(head_params, batch, max_length, encoded, mask)
  if prompt.shape[1] > 1:
    _, _, cache = head.extend(head_params, cache, prompt[:, 1:], features[:, :-1],
                              from_target=True)
  cache = cache.replace(positions=(lengths - 1).astype(jnp.int32))
  last = jnp.take_along_axis(features, (lengths - 1)[:, None, None], axis=1)  # [b, 1, F]
  block = jnp.zeros((batch, width, features.shape[-1]), features.dtype)
  tokens = jnp.zeros((batch, width), jnp.int32).at[:, 0].set(pending)
  return HeadDraftState(
      cache=cache, features=block.at[:, :1].set(last), tokens=tokens,
      count=jnp.ones((batch,), jnp.int32),
      own=jnp.zeros((batch, 1, head.config.width), features.dtype),
      start=cache.positions, verified=block)


def prefill(target, target_params, head: Head, head_params, target_cache: DecodingCache,
            prompt: Array, lengths: Array, encoder_input_tokens, rng, *, temperature: float,
            width: int, max_length: int):
  """The target's prefill of the decoder `prompt: [batch, P]` (rows of `lengths`), its
  features at the prompt's positions included, the first token sampled from it, and the
  head's state (`start`). Returns (target cache, head state, first token [batch])."""
  logits, target_cache, features = target.extend(target_params, target_cache, prompt,
                                                 head.feature_layers)
  target_cache = target_cache.rollback(prompt.shape[1] - lengths)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  pending = sample_tokens(last, rng, temperature)
  state = start(head, head_params, target, target_params, prompt, lengths, pending, features,
                encoder_input_tokens, width=width, max_length=max_length)
  return target_cache, state, pending


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
  """`Model.extend`'s interface over a head: the engine's draft loops call it unchanged."""

  head: Head

  def extend(self, params: Params, state: HeadDraftState, tokens: Array):
    """A round's first call (`tokens` = [previous, pending], [batch, 2]: ignored, the state
    holds the block) or a later one (`tokens`: [batch, 1], the last drafted token). Returns
    (logits [batch, tokens' width, vocab]: the next token's at the last index; state)."""
    if tokens.shape[1] == 2:
      logits, out, cache = self.head.extend(params, state.cache, state.tokens, state.features,
                                            from_target=True)
      index = (state.count - 1)[:, None, None]
      first = jnp.take_along_axis(logits, index, axis=1)
      own = jnp.take_along_axis(out, index, axis=1)
      cache = cache.replace(positions=state.cache.positions + state.count)
      return (jnp.concatenate([first, first], axis=1),
              state.replace(cache=cache, own=own, start=state.cache.positions))
    logits, own, cache = self.head.extend(params, state.cache, tokens, state.own,
                                          from_target=False)
    return logits, state.replace(cache=cache, own=own)


def commit(state: HeadDraftState, block: Array, num_accepted: Array, next_token: Array,
           going_on: Array) -> HeadDraftState:
  """After verification of `block: [batch, W]` = [pending, draft tokens]: rows that go on
  keep the head positions up to the round's first step and take the block of
  `num_accepted + 1` positions to write next round (the verification features
  `state.verified`; the accepted draft tokens, then the target's `next_token`); the others
  return to the round's start and keep their block."""
  offsets = jnp.arange(block.shape[1])[None, :]
  new_tokens = jnp.where(offsets < num_accepted[:, None], jnp.roll(block, -1, axis=1),
                         next_token[:, None]).astype(jnp.int32)
  positions = jnp.where(going_on, state.start + state.count, state.start)
  keep = lambda new, old: jnp.where(going_on.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  return state.replace(
      cache=state.cache.replace(positions=positions.astype(jnp.int32)),
      features=keep(state.verified, state.features), tokens=keep(new_tokens, state.tokens),
      count=keep(num_accepted + 1, state.count))
