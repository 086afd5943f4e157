"""Speculative decoding (Leviathan et al. 2023; DistillSpec Knowl 5) as one jitted while_loop.

Each round, per batch row: the draft proposes `gamma` tokens, the target scores them all in
one (gamma + 1)-token call, the row accepts a prefix of n <= gamma draft tokens and appends one
more token from the target (the correction at the first rejection, or the bonus token when all
gamma were accepted). Rows advance by their own n + 1; both caches are rolled back per row by
lowering positions, never copied. Under an adaptive `DraftLength` each row proposes k <= gamma
(then gamma_max) tokens, chosen by the draft alone, and the target scores the batch's longest
proposal (`_draft_block_adaptive`, `_verify_proposals`). A drafter returns a `DraftBlock`
(tokens, their logits, the advanced cache, each row's proposal and draft calls);
`_propose_and_verify` gives the round's `VerifiedRound`, which `_round` commits.

A draft head (models/head.py) stands in for the draft model the same way: its state, its
per-row rollback and the verification's features are decoding/head_draft.py's.

Cache invariant at the start of a round (n committed decoder tokens, the last one `pending`):
the target cache holds the n - 1 tokens before `pending`; the draft cache holds the n - 2 tokens
before `previous, pending`. The draft's first step feeds [previous, pending] (rewriting
`previous` where it was already cached gives identical keys/values), so a fully accepted block
never needs an extra draft call to catch up on its last token.

EOS below means every id that ends a row: the target's EOS and its further stop ids
(`TokenIds.stop_ids`, `SamplingConfig.end_ids`); an accepted stop id cuts a round, and counts
in the statistics, exactly as an accepted EOS does.

Statistics (per row, counted only while the row is unfinished; the first generated token comes
from the prompt's prefill in both plain and speculative decoding and is not counted):
  target_calls: verification calls.   draft_calls: the row's own draft forward calls (gamma
            per round under the fixed rule; under an adaptive rule a round that stops early
            makes one more call than it proposes tokens, the call that found the next token
            not worth proposing; the batch's loop may run on for other rows, which the row's
            count leaves out, so a row counts the same alone and in a batch).
  drafted: draft tokens proposed (gamma per round under the fixed rule, the last round's
            included in full).
  accepted: accepted draft tokens that reach the output. A round accepts n <= gamma draft
            tokens, but an accepted EOS ends the row after itself and the length limit keeps
            only max_new_tokens tokens, so the round keeps min(n, produced) of them.
  accepted_proposed: accepted draft tokens before that cut (n summed over rounds); differs
            from `accepted` only in a row's last round.
  rejections: rounds whose acceptance test rejected a draft token (n below the round's
            proposal: gamma under the fixed rule); the others accepted every proposed token.
  output_rejections: those rejections whose position reaches the output (its correction
            token is kept: no accepted EOS before it, within the length limit).
  tested_per_round: each round's acceptance tests at output positions (its accepted tokens
            that reach the output, plus one where its rejection does); they sum to
            accepted + output_rejections.
  produced: tokens appended to the output by verification rounds (min(n, first EOS) + 1 per
            round, less what the length limit cut off); accepted <= produced.
  block efficiency tau = sum(produced) / sum(target_calls)   (the bonus/correction token counts)
  acceptance rate alpha = sum(accepted) / sum(drafted): the fraction of drafted tokens that
            were accepted and reached the output (`acceptance_rate`; the serving engines'
            draft acceptance rate). The rate of the acceptance test itself,
            sum(accepted_proposed) / sum(drafted), is `proposed_acceptance_rate`; it counts
            accepted tokens past EOS or the length limit.
  DistillSpec's alpha = sum(accepted) / (sum(accepted) + sum(output_rejections)): the
            per-token acceptance probability over the acceptance tests at output positions
            (a test past an accepted EOS or the length limit scores a context the output
            never has); what 1 - E[TVD] along the output predicts. decoding/stats.py derives
            every reported statistic from these counts.

Cache capacity: both caches need `max_length >= prompt width + max_new_tokens + gamma - 1`,
where prompt width = 1 + prompt_tokens' width (1 for encoder-decoders). That is exactly the
most this engine writes: a row's last round starts with max_new_tokens - 1 tokens generated
and writes its (gamma + 1)-token verification block after the prompt and the
max_new_tokens - 2 generated tokens before `pending`; a row that finishes returns its caches
to where its last round began, so the rounds other rows still run stay inside that bound.
With max_new_tokens = 1 no round runs and the prompt width suffices.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.validation import (check_field_types, check_positive_int,
                                             check_probability, check_real)
from distillspec_jax.decoding import head_draft
from distillspec_jax.decoding.plain import (UNIFORMS_PER_DRAW, SamplingConfig, cache_capacity,
                                      check_capacity, check_prompts,
                                      check_rng, probabilities, sample_from_probabilities,
                                      sample_tokens)
from distillspec_jax.models.cache import DecodingCache
from distillspec_jax.models.head import Head
from distillspec_jax.models.model import (Model, check_same_layout, check_same_tokens,
                                          decoder_prompt)

Array = jax.Array

LenienceKind = Literal["lin", "sq", "exp"]
LENIENCE_FUNCTIONS = typing.get_args(LenienceKind)


@dataclasses.dataclass(frozen=True)
class Lenience:
  """Lossy acceptance f(p, eps) (DistillSpec Knowl 5): lin p/eps, sq p/eps^2, exp p^eps.

  eps = 1 is lossless speculative sampling; smaller eps accepts more draft tokens.
  """

  kind: LenienceKind = "lin"
  epsilon: float = 1.0

  def __post_init__(self):
    check_field_types(self)
    check_probability(self.epsilon, "lenience epsilon", zero=False,
                      fix="pass a number in (0, 1]; 1 is lossless.")

  @property
  def lossless(self) -> bool:
    """epsilon 1: every kind is f(p) = p, exact speculative sampling."""
    return self.epsilon == 1.0

  def check_temperature(self, temperature: float) -> None:
    """Refuses a lossy lenience (epsilon < 1) at temperature 0: greedy acceptance asks whether
    the draft token is the target's argmax, the target's one-hot distribution gives f(0, eps)
    = 0 to every other token, so no lenience changes the output."""
    if temperature == 0.0 and not self.lossless:
      raise ValueError(
          f"Lenience({self.kind!r}, epsilon={self.epsilon}) at temperature 0: greedy "
          "verification accepts only the target's argmax, so a lenience changes nothing "
          "there. Decode at a temperature > 0 for lossy acceptance, or pass Lenience() "
          "(epsilon 1) at temperature 0.")

  def __call__(self, p: Array) -> Array:
    if self.kind == "lin":
      return p / self.epsilon
    if self.kind == "sq":
      return p / self.epsilon ** 2
    return jnp.power(p, self.epsilon)


DraftLengthRule = Literal["fixed", "confidence", "cumulative", "cost"]
DRAFT_LENGTH_RULES = typing.get_args(DraftLengthRule)
# What the adaptive rules read as a draft token's confidence: the draft's top probability, or
# its acceptance head's probability that the target accepts the token (models/acceptance_head.py).
ConfidenceSignal = Literal["top_probability", "acceptance_head"]
CONFIDENCE_SIGNALS = typing.get_args(ConfidenceSignal)


@dataclasses.dataclass(frozen=True)
class DraftLength:
  """How many draft tokens each row proposes per round, up to gamma (then gamma_max).

  fixed: gamma every round. confidence: a row proposes its first draft token, then each next
  one while the draft's top probability for it is at least `threshold` (at the sampling
  temperature; at temperature 1 when greedy, whose sampling distribution is one-hot).
  cumulative: the same with the product of the top probabilities of the round's tokens so
  far (the next one included), the draft's own estimate that the whole proposal is accepted:
  a row stops once a long proposal is unlikely to survive, not at the first unsure token.
  cost: a row proposes the next token while some longer proposal promises more tokens per
  unit of time than stopping now, by the machine's prices: `costs[w - 1]`, a round whose
  verification scores w tokens (in target steps; bench/verification_cost.py measures them),
  and `draft_cost`, a draft call; the acceptance of the tokens so far is estimated by the
  product of their top probabilities and that of later ones by the last token's (no
  threshold). Where a wider verification costs a jump (a CPU's vector width, a TPU's tile),
  the rule drafts past it only when the draft is sure enough to pay for it.
  signal: the per-token confidence the adaptive rules read in place of the top probability:
  "top_probability" (above), or "acceptance_head", the draft's acceptance head's estimate that
  the target accepts the token (a draft built with one; trained to be calibrated, where the
  top probability is not the acceptance probability).
  The verification scores only the batch's longest proposal, and the draft stops once every
  row has stopped. Lossless: whether a token is proposed depends on the draft alone, and
  every proposed token goes through the same acceptance test (DistillSpec Knowl 5 at each
  position), so the output distribution is the target's.
  """

  rule: DraftLengthRule = "fixed"
  threshold: float = 0.0
  costs: tuple = ()
  draft_cost: float = 0.0
  signal: ConfidenceSignal = "top_probability"

  def __post_init__(self):
    check_field_types(self)
    if self.signal != "top_probability" and self.rule == "fixed":
      raise ValueError(f"signal={self.signal!r} with rule 'fixed': the fixed rule reads no "
                       "confidence; pick an adaptive rule ('confidence', 'cumulative', "
                       "'cost') or leave the signal at 'top_probability'.")
    check_probability(self.threshold, "DraftLength.threshold",
                      fix="pass a probability in [0, 1] (0 proposes gamma_max every round).")
    if self.rule == "fixed" and self.threshold != 0.0:
      raise ValueError(f"threshold={self.threshold!r} with rule 'fixed': the fixed rule "
                       "proposes gamma tokens every round and reads no threshold; pick an "
                       "adaptive rule ('confidence', 'cumulative') or leave the threshold at 0.")
    if self.rule == "cost":
      self._check_costs()
    elif self.costs or self.draft_cost:
      raise ValueError(f"costs={self.costs!r} and draft_cost={self.draft_cost!r} are the "
                       f"'cost' rule's; rule {self.rule!r} takes a threshold only.")

  def _check_costs(self) -> None:
    fix = ("pass costs=(1.0, c2, c3, ...): a round verifying 1, 2, 3, ... tokens in target "
           "steps (bench/verification_cost.py prints them), draft_cost >= 0 in target steps.")
    if not self.costs:
      raise ValueError(f"The 'cost' rule needs costs; {fix}")
    for width, cost in enumerate(self.costs, 1):
      check_real(cost, f"DraftLength.costs[{width - 1}]", minimum=0.0, above=True,
                 fix=f"it prices a {width}-token verification; {fix}")
    check_real(self.draft_cost, "DraftLength.draft_cost", minimum=0.0, fix=fix)

  def check_gamma_max(self, gamma_max: int) -> None:
    """Refuses a 'cost' rule without the price of every width up to gamma_max + 1."""
    if self.rule == "cost" and len(self.costs) < gamma_max + 1:
      raise ValueError(f"costs has {len(self.costs)} entries but gamma_max={gamma_max} "
                       f"verifies up to {gamma_max + 1} tokens; pass a cost for every width "
                       f"1..{gamma_max + 1}.")

  @property
  def adaptive(self) -> bool:
    return self.rule != "fixed"

  def proposes(self, gamma: int, step, confidence, product, expected):
    """Whether each row proposes draft token `step` (>= 1; token 0 always is), [batch] bool:
    `confidence` is that token's signal, `product` the product of the round's earlier tokens'
    signals and `expected` 1 + the sum of their prefix products (all [batch]): the adaptive
    rule's one decision, made after each draft call."""
    if self.rule == "cost":
      return _worth_drafting(self, gamma, step, confidence, product, expected)
    metric = product * confidence if self.rule == "cumulative" else confidence
    return metric >= self.threshold

  def runs_on(self, draft) -> bool:
    """Whether `draft` (a Model or a Head) can run this rule: a rule on the acceptance
    head's signal needs a draft model built with one."""
    if self.signal != "acceptance_head":
      return True
    return not isinstance(draft, Head) and draft.acceptance_head is not None


def acceptance_probability(p_token: Array, q_token: Array, lenience: Lenience = Lenience()) -> Array:
  """min(1, f(p(y), eps) / q(y)) for the drafted token y; shapes broadcast."""
  ratio = lenience(p_token) / jnp.maximum(q_token, jnp.finfo(jnp.float32).tiny)
  return jnp.minimum(1.0, ratio)


def accepted_prefix_length(accepted: Array) -> Array:
  """Leading run of True per row: `accepted: [batch, gamma]` bool -> [batch] int32 in [0, gamma]."""
  # The index of the first rejection, with a rejection appended after the last draft token.
  rejected = jnp.concatenate([~accepted, jnp.ones_like(accepted[:, :1])], axis=1)
  return jnp.argmax(rejected, axis=1).astype(jnp.int32)


def verify_block(target_logits: Array, draft_logits: Array, draft_tokens: Array, rng: Array,
                 temperature: float, lenience: Lenience = Lenience(),
                 proposed: Optional[Array] = None):
  """Accepts a prefix of the drafted block and picks the next target token, per row.

  Args:
    target_logits: [batch, gamma + 1, vocab], the target's logits before each draft token and
      after the last one.
    draft_logits: [batch, gamma, vocab], the draft's logits each draft token was drawn from.
    draft_tokens: [batch, gamma].
    temperature: 0 = greedy (accept while the draft token is the target's argmax).
    proposed: [batch] in [1, gamma], how many of its draft tokens each row proposes (None:
      all gamma); the tokens after them are never tested, and the target's logits after
      position `proposed` are never read.
  Returns:
    (num_accepted [batch] in [0, proposed], next_token [batch]): the correction token sampled
    from normalize(max(0, p - q)) at the first rejection, or a bonus token from p when every
    proposed draft token is accepted.
  """
  batch, gamma = draft_tokens.shape
  in_proposal = (True if proposed is None
                 else jnp.arange(gamma)[None, :] < proposed[:, None])  # [b, g]
  if temperature == 0.0:
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    num_accepted = accepted_prefix_length((draft_tokens == target_argmax[:, :gamma])
                                          & in_proposal)
    next_token = jnp.take_along_axis(target_argmax, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token
  # One draw per round: gamma acceptance tests and the residual/bonus sample's uniforms.
  uniform = jax.random.uniform(rng, (batch, gamma + UNIFORMS_PER_DRAW))
  p = probabilities(target_logits, temperature)                    # [b, g+1, V]
  q = probabilities(draft_logits, temperature)                     # [b, g, V]
  p_token = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  q_token = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  accepted = uniform[:, :gamma] < acceptance_probability(p_token, q_token, lenience)
  num_accepted = accepted_prefix_length(accepted & in_proposal)
  # A zero draft row at index gamma (at `proposed`) turns the residual into p itself: the
  # bonus token.
  q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  if proposed is not None:
    q_padded = jnp.where(jnp.arange(gamma + 1)[None, :, None] < proposed[:, None, None],
                         q_padded, 0.0)
  index = num_accepted[:, None, None]
  p_next = jnp.take_along_axis(p, index, axis=1)[:, 0]
  residual = jnp.maximum(p_next - jnp.take_along_axis(q_padded, index, axis=1)[:, 0], 0.0)
  # p == q up to rounding leaves no residual mass; p is then the exact answer.
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_next)
  next_token = sample_from_probabilities(residual, uniform[:, gamma:])
  return num_accepted, next_token


@flax.struct.dataclass
class SpeculativeResult:
  """Output tokens and per-row statistics (see the module docstring for definitions).

  tokens: [batch, max_new_tokens] (EOS included, PAD after).
  accepted: [batch], accepted draft tokens that reach the output; accepted_proposed: [batch],
    accepted by the acceptance test, including those an EOS or the length limit cut off;
    rejections: [batch], rounds that rejected a draft token; output_rejections: [batch], those
    whose rejected position reaches the output.
  proposed_per_round: [batch, max_new_tokens], the draft tokens each of the row's rounds
    proposed (gamma under the fixed rule), -1 where the row had no such round.
  accepted_per_round: [batch, max_new_tokens], accepted draft tokens that reach the output in
    each of the row's rounds (only a row's last round can be cut), -1 where the row had no
    such round (lets tests rebuild every round's context).
  tested_per_round: [batch, max_new_tokens], the acceptance tests of each round at output
    positions: accepted_per_round, plus one where the round's rejection reaches the output;
    -1 where the row had no such round (`stats.acceptance_by_position` reads it).
  draft_calls: [batch], the row's own draft calls (under an adaptive rule the batch's loop
    may run longer for other rows; see `DraftBlock.row_calls`).
  Every other field: [batch] int32.
  """

  tokens: Array
  lengths: Array
  target_calls: Array
  draft_calls: Array
  drafted: Array
  accepted: Array
  accepted_proposed: Array
  produced: Array
  accepted_per_round: Array
  rejections: Array
  proposed_per_round: Array
  output_rejections: Array
  tested_per_round: Array

  # Each ratio is NaN where its denominator is 0 (no target call ran: every row ended at its
  # first token; nothing drafted): undefined, not a clamped 0.0 (stats.py's are None there).

  @property
  def block_efficiency(self) -> Array:
    """tau = tokens produced by verification rounds / target verification calls."""
    return jnp.sum(self.produced) / jnp.sum(self.target_calls)

  @property
  def acceptance_rate(self) -> Array:
    """alpha = accepted draft tokens that reach the output / drafted tokens."""
    return jnp.sum(self.accepted) / jnp.sum(self.drafted)

  @property
  def proposed_acceptance_rate(self) -> Array:
    """Accepted draft tokens, including those EOS or the length limit cut off / drafted."""
    return jnp.sum(self.accepted_proposed) / jnp.sum(self.drafted)


def check_pair(target: Model, draft: Model) -> None:
  """The engine's refusals of a (target, draft) pair (vocabulary, kind), for callers that
  load the models long before they decode."""
  _validate(target, draft, 1, Lenience())


def _validate(target: Model, draft: Model, gamma: int, lenience: Lenience,
              draft_length: Optional[DraftLength] = None) -> int:
  """Checks the pair, the lenience and the draft length rule; returns gamma as an int >= 1
  (named gamma_max under an adaptive rule)."""
  if draft_length is not None and not isinstance(draft_length, DraftLength):
    raise TypeError(f"draft_length must be a DraftLength, got {draft_length!r}.")
  adaptive = draft_length is not None and draft_length.adaptive
  gamma = check_positive_int(gamma, "gamma_max" if adaptive else "gamma")
  if adaptive:
    draft_length.check_gamma_max(gamma)
    if draft_length.signal == "acceptance_head" and isinstance(draft, Head):
      raise ValueError("DraftLength(signal='acceptance_head') reads a draft model's acceptance "
                       "head; a target-conditioned draft head has none: use "
                       "signal='top_probability' with a head.")
    if draft_length.signal == "acceptance_head":
      draft.check_acceptance_head("DraftLength(signal='acceptance_head')")
  if isinstance(draft, Head):
    draft.check_target(target)
  else:
    check_same_tokens(target, draft)
    check_same_layout(target, draft)
  if not isinstance(lenience, Lenience):
    raise TypeError(f"lenience must be a Lenience, got {lenience!r}.")
  return gamma


def speculative_decode(target: Model, target_params, draft: Model, draft_params, *,
                       encoder_input_tokens: Optional[Array] = None,
                       prompt_tokens: Optional[Array] = None, max_new_tokens: int,
                       gamma: int, sampling: SamplingConfig = SamplingConfig(),
                       lenience: Lenience = Lenience(), rng: Optional[Array] = None,
                       max_length: Optional[int] = None,
                       draft_length: DraftLength = DraftLength()) -> SpeculativeResult:
  """Speculative decoding of up to `max_new_tokens` per row (see the module docstring).

  Args:
    encoder_input_tokens: [batch, input_len] prompts of encoder-decoder pairs (0 = padding).
    prompt_tokens: [batch, P] right-padded prompts of decoder-only pairs (padding trailing
      only: interior padding is refused).
    max_new_tokens: int >= 1, tokens per row (EOS included).
    gamma: draft tokens per block, int >= 1 (NumPy integers accepted, bools refused); the
      most a row proposes (gamma_max) under an adaptive `draft_length`.
    sampling: temperature 0 = greedy; the draft samples at the same temperature.
    lenience: lossy acceptance (eps = 1, the default, is exact); a lossy one (eps < 1) is
      refused at temperature 0, where greedy verification leaves it nothing to relax.
    rng: PRNG key, required when temperature > 0 (optional when greedy).
    max_length: cache capacity of both models (default: the target's max_decode_length); needs
      prompt width + max_new_tokens + gamma - 1, prompt width = 1 + prompt_tokens' width (1
      for encoder-decoders), or the prompt width alone when max_new_tokens = 1 (see the
      module docstring).
    draft_length: how many of its gamma tokens a row proposes each round (DraftLength; the
      default proposes all gamma).
  Returns:
    SpeculativeResult, tokens [batch, max_new_tokens].
  """
  gamma = _validate(target, draft, gamma, lenience, draft_length)
  lenience.check_temperature(sampling.temperature)
  max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
  if target.is_encoder_decoder and encoder_input_tokens is None:
    raise ValueError("These models are encoder-decoders: pass encoder_input_tokens.")
  source = encoder_input_tokens if target.is_encoder_decoder else prompt_tokens
  if source is None:
    raise ValueError("Decoder-only models need prompt_tokens [batch, P].")
  max_length = cache_capacity(target, max_length)
  check_prompts(target, encoder_input_tokens, prompt_tokens)
  prompt_width = 1 if target.is_encoder_decoder else 1 + prompt_tokens.shape[1]
  if max_new_tokens > 1:
    check_capacity(prompt_width, max_new_tokens + gamma - 1, max_length,
                   "prompt + max_new_tokens + gamma - 1: the last round's verification block")
  else:
    check_capacity(prompt_width, 0, max_length, "the prompt; max_new_tokens=1 runs no round")
  rng = check_rng(rng, sampling)
  return _speculative_jit(target, target_params, draft, draft_params, encoder_input_tokens,
                          prompt_tokens, rng, max_new_tokens=max_new_tokens, gamma=gamma,
                          sampling=sampling, lenience=lenience, max_length=max_length,
                          draft_length=draft_length)


@flax.struct.dataclass(kw_only=True)
class SpeculativeState:
  """The rounds' loop state: `speculative_start` makes it, `speculative_rounds` runs it.

  Shapes are for one batch of `batch` rows; a state stacked over prompts (speed.py) has the
  same fields with leading axes added.

  Per-row counters, each [batch] int32, advanced only while the row is unfinished:
    generated: tokens in the output, the prefill's first token included.
    target_calls: verification rounds run.
    accepted: accepted draft tokens that reach the output.
    accepted_proposed: accepted draft tokens before EOS or the length limit cut them.
    rejections: rounds whose acceptance test rejected a draft token.
    output_rejections: those whose rejected position reaches the output.
    drafted: draft tokens proposed (gamma per round, fewer under an adaptive DraftLength).
    draft_calls: the draft's forward calls.
    previous, pending: the decoder sequence's last two tokens (the prompt's last token and
      the first generated one before the first round): the draft's next input; the target's
      next block starts with `pending`.
  done: [batch] bool, the row has its EOS or max_new_tokens tokens.
  round: [] int32, rounds run (each folds its index into `loop_rng`).
  target_cache, draft_cache: the models' DecodingCaches over [batch] rows (see the module
    docstring for what each holds at the start of a round).
  out: [batch, max_new_tokens + gamma + 1] int32, the output so far, the target's pad id after it (one
    spare block at the end so that a round's writes never fall off the buffer).
  accepted_per_round, proposed_per_round, tested_per_round: [batch, max_new_tokens] int32,
    as `SpeculativeResult`'s.
  loop_rng: the PRNG key the rounds draw from.
  """

  generated: Array
  target_calls: Array
  accepted: Array
  accepted_proposed: Array
  rejections: Array
  output_rejections: Array
  drafted: Array
  draft_calls: Array
  previous: Array
  pending: Array
  done: Array
  round: Array
  target_cache: DecodingCache
  draft_cache: DecodingCache
  out: Array
  accepted_per_round: Array
  proposed_per_round: Array
  tested_per_round: Array
  loop_rng: Array


@functools.partial(jax.jit, static_argnames=("target", "draft", "max_new_tokens", "gamma",
                                             "sampling", "lenience", "max_length",
                                             "draft_length"))
def _speculative_jit(target, target_params, draft, draft_params, encoder_input_tokens,
                     prompt_tokens, rng, *, max_new_tokens, gamma, sampling, lenience,
                     max_length, draft_length):
  state = speculative_start(target, target_params, draft, draft_params, encoder_input_tokens,
                            prompt_tokens, rng, max_new_tokens=max_new_tokens, gamma=gamma,
                            sampling=sampling, max_length=max_length)
  return speculative_rounds(target, target_params, draft, draft_params, state,
                            max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                            lenience=lenience, draft_length=draft_length)


def speculative_start(target, target_params, draft, draft_params, encoder_input_tokens,
                      prompt_tokens, rng, *, max_new_tokens, gamma, sampling,
                      max_length) -> SpeculativeState:
  """The rounds' initial state (traceable; `speculative_decode` checks the arguments): both
  caches after the prefill, the first token, the output buffer and the per-row counters.

  `speculative_rounds(..., speculative_start(...), ...)` is `speculative_decode`; the split
  lets speed.py time the rounds apart from the encoders and the prefill.
  """
  source = encoder_input_tokens if target.is_encoder_decoder else prompt_tokens
  batch = source.shape[0]
  first_rng, loop_rng = jax.random.split(rng)

  # Prefill: the target holds the decoder prompt and gives the first token; the draft holds
  # the prompt minus its last token (`previous`).
  prompt, prompt_lengths = decoder_prompt(target, prompt_tokens, batch)
  target_cache = target.init_cache(target_params, batch, max_length, encoder_input_tokens)
  if isinstance(draft, Head):
    target_cache, draft_cache, pending = head_draft.prefill(
        target, target_params, draft, draft_params, target_cache, prompt, prompt_lengths,
        encoder_input_tokens, first_rng, temperature=sampling.temperature, width=gamma + 1,
        max_length=max_length)
  else:
    first_logits, target_cache = target.prefill(target_params, target_cache, prompt,
                                                prompt_lengths)
    draft_cache = draft.init_cache(draft_params, batch, max_length, encoder_input_tokens)
    if prompt.shape[1] > 1:  # a one-token prompt (encoder-decoders) leaves the draft empty
      _, draft_cache = draft.extend(draft_params, draft_cache, prompt)
      draft_cache = draft_cache.rollback(prompt.shape[1] - (prompt_lengths - 1))
    pending = sample_tokens(first_logits, first_rng, sampling.temperature)
  previous = jnp.take_along_axis(prompt, (prompt_lengths - 1)[:, None], axis=1)[:, 0]

  out = jnp.full((batch, max_new_tokens + gamma + 1), target.tokens.pad_id,
                 jnp.int32).at[:, 0].set(pending)
  zeros = jnp.zeros_like(pending)
  return SpeculativeState(
      generated=jnp.ones_like(pending), target_calls=zeros, accepted=zeros,
      accepted_proposed=zeros, rejections=zeros, output_rejections=zeros, drafted=zeros,
      draft_calls=zeros,
      previous=previous, pending=pending,
      done=sampling.ends_row(target, pending) | (max_new_tokens <= 1), round=jnp.int32(0),
      target_cache=target_cache, draft_cache=draft_cache, out=out,
      accepted_per_round=jnp.full((batch, max_new_tokens), -1, jnp.int32),
      proposed_per_round=jnp.full((batch, max_new_tokens), -1, jnp.int32),
      tested_per_round=jnp.full((batch, max_new_tokens), -1, jnp.int32), loop_rng=loop_rng)


def start_state_for_gamma(state: SpeculativeState, *, gamma: int,
                          max_new_tokens: int) -> SpeculativeState:
  """`speculative_start`'s state (any leading axes) as `speculative_start` makes it with
  `gamma`: only the output buffer's width, `out: [..., max_new_tokens + gamma + 1]` (the pad
  id after the first token), depends on gamma, so cutting or padding it is exact. Lets one
  compiled start serve every gamma (speed.py). Refuses a state whose rounds have begun."""
  gamma = check_positive_int(gamma, "gamma")
  rounds = np.asarray(state.round)
  if np.any(rounds != 0):
    raise ValueError(f"start_state_for_gamma takes a state fresh from speculative_start, but "
                     f"its round is {rounds.max()}; resize before running any rounds.")
  out = state.out
  width = max_new_tokens + gamma + 1
  if out.shape[-1] >= width:
    out = out[..., :width]
  else:
    # Past the first token the buffer holds only padding (the model's pad id).
    pad = jnp.broadcast_to(out[..., -1:], out.shape[:-1] + (width - out.shape[-1],))
    out = jnp.concatenate([out, pad], axis=-1)
  if isinstance(state.draft_cache, head_draft.HeadDraftState):
    state = state.replace(draft_cache=state.draft_cache.resize(gamma + 1))
  return state.replace(out=out)


@flax.struct.dataclass
class DraftBlock:
  """What a round's drafting gives the verification (`_draft_block`, `_draft_block_adaptive`).

  tokens: [batch, gamma] int32, the drafted tokens (entries past a row's proposal are drawn
    but never tested).
  logits: [batch, gamma, vocab], the draft's logits each token was drawn from.
  cache: the draft's DecodingCache, advanced by `calls + 1` positions (the first call feeds
    [previous, pending]).
  proposed: [batch] int32 in [1, gamma], the tokens each row proposes.
  row_calls: [batch] int32, the draft calls the row itself needed: gamma when it proposed
    all gamma, else proposed + 1 (the call that found the next token not worth proposing),
    whatever the other rows of the batch did.
  calls: [] int32, the batch's draft calls (the most any row needed).
  """

  tokens: Array
  logits: Array
  cache: DecodingCache
  proposed: Array
  row_calls: Array
  calls: Array


def _draft_block(draft: Model, draft_params, draft_cache, context: Array, rng: Array, *,
                 gamma: int, temperature: float) -> DraftBlock:
  """gamma draft steps from `context: [batch, 2]` = [previous, pending] (the first step feeds
  both); every row proposes all gamma tokens."""
  batch = context.shape[0]
  uniform = jax.random.uniform(rng, (batch, gamma, UNIFORMS_PER_DRAW))
  logits, draft_cache = draft.extend(draft_params, draft_cache, context)
  first_logits = logits[:, 1]
  first = sample_tokens(first_logits, None, temperature, uniform[:, 0])

  def step(carry, u):
    cache, token = carry
    logits, cache = draft.extend(draft_params, cache, token[:, None])
    token = sample_tokens(logits[:, 0], None, temperature, u)
    return (cache, token), (token, logits[:, 0])

  (draft_cache, _), (tokens, all_logits) = jax.lax.scan(
      step, (draft_cache, first), jnp.swapaxes(uniform[:, 1:], 0, 1))
  full = jnp.full((batch,), gamma, jnp.int32)
  return DraftBlock(tokens=jnp.concatenate([first[:, None], jnp.swapaxes(tokens, 0, 1)], 1),
                    logits=jnp.concatenate([first_logits[:, None], jnp.swapaxes(all_logits, 0, 1)],
                                           1),
                    cache=draft_cache, proposed=full, row_calls=full, calls=jnp.int32(gamma))


def top_probability(logits: Array, temperature: float) -> Array:
  """The draft's top probability for its next token, [...], from logits [..., vocab]: at
  the sampling temperature, at temperature 1 when greedy (one-hot would always be 1)."""
  scale = temperature if temperature > 0.0 else 1.0
  return jnp.max(jax.nn.softmax(logits.astype(jnp.float32) / scale, axis=-1), axis=-1)


def _scored_extend(draft: Model, draft_params, cache, tokens: Array, temperature: float,
                   signal: str):
  """The draft's call on `tokens: [batch, k]` with each next token's confidence, the signal
  the adaptive rules read: (logits [batch, k, vocab], confidence [batch, k], cache)."""
  if signal == "acceptance_head":
    return draft.extend_with_acceptance(draft_params, cache, tokens)
  logits, cache = draft.extend(draft_params, cache, tokens)
  return logits, top_probability(logits, temperature), cache


def _worth_drafting(rule: "DraftLength", gamma: int, step: Array, confidence: Array,
                    product: Array, expected: Array) -> Array:
  """The 'cost' rule's decision, [batch] bool: whether proposing draft token `step` (so far
  `step` proposed, their estimated acceptance `product` and expected tokens `expected` = 1 +
  the sum of their prefix products) leads to a proposal of m in (step, gamma] tokens whose
  expected tokens per cost beat stopping now; later tokens are accepted with `confidence`,
  the next one's (all [batch])."""
  costs = jnp.asarray(rule.costs[:gamma + 1], jnp.float32)
  round_cost = lambda m: costs[m] + rule.draft_cost * m  # m proposed: width m + 1
  now = expected / round_cost(step)
  extra = jnp.arange(1, gamma + 1)  # n more tokens: a proposal of step + n
  gains = product[:, None] * jnp.cumsum(confidence[:, None] ** extra[None, :], axis=1)
  m = jnp.minimum(step + extra, gamma)
  later = (expected[:, None] + gains) / round_cost(m)[None, :]
  return jnp.any((step + extra <= gamma)[None, :] & (later > now[:, None]), axis=1)


@flax.struct.dataclass
class _AdaptiveDraft:
  """The adaptive draft loop's carry (`_draft_block_adaptive`).

  step: [] int32, the draft position the next call produces (1 after the first call).
  tokens: [batch, gamma] int32 and logits: [batch, gamma, vocab], filled up to `step`.
  cache: the draft's DecodingCache.
  going: [batch] bool, the row still proposes (False from the start for finished rows).
  proposed: [batch] int32, tokens the row proposes so far.
  product: [batch] float32, the product of the round's confidences so far.
  expected: [batch] float32, 1 + the sum of those prefix products (the 'cost' rule's
    expected tokens of the proposal so far).
  """

  step: Array
  tokens: Array
  logits: Array
  cache: DecodingCache
  going: Array
  proposed: Array
  product: Array
  expected: Array


def _adaptive_step(draft: Model, draft_params, uniform: Array, carry: _AdaptiveDraft, *,
                   gamma: int, temperature: float, rule: "DraftLength") -> _AdaptiveDraft:
  """One draft call of the adaptive loop: draws token `step` and decides, per row, whether it
  joins the proposal (`uniform`: [batch, gamma, UNIFORMS_PER_DRAW])."""
  step = carry.step
  previous = jax.lax.dynamic_index_in_dim(carry.tokens, step - 1, axis=1, keepdims=True)
  logits, confidences, cache = _scored_extend(draft, draft_params, carry.cache, previous,
                                              temperature, rule.signal)
  step_logits, confidence = logits[:, 0], confidences[:, 0]
  going = carry.going & rule.proposes(gamma, step, confidence, carry.product, carry.expected)
  product = carry.product * confidence
  u = jax.lax.dynamic_index_in_dim(uniform, step, axis=1, keepdims=False)
  token = sample_tokens(step_logits, None, temperature, u)
  return _AdaptiveDraft(
      step=step + 1,
      tokens=jax.lax.dynamic_update_index_in_dim(carry.tokens, token, step, axis=1),
      logits=jax.lax.dynamic_update_index_in_dim(carry.logits, step_logits, step, axis=1),
      cache=cache, going=going, proposed=carry.proposed + going.astype(jnp.int32),
      product=product, expected=carry.expected + jnp.where(going, product, 0.0))


def _draft_block_adaptive(draft: Model, draft_params, draft_cache, context: Array, rng: Array,
                          active: Array, *, gamma: int, temperature: float,
                          rule: "DraftLength") -> DraftBlock:
  """Up to gamma draft steps from `context: [batch, 2]` (as `_draft_block`), each row
  proposing its first token and then each next one while `rule` says so (`DraftLength`:
  its confidence (`_scored_extend`: the top probability or the acceptance head's), the
  product of the round's confidences up to it, or `_worth_drafting`);
  the steps stop once no `active` row proposes more. The uniforms are `_draft_block`'s, so a
  row that proposes gamma tokens draws the same tokens."""
  batch = context.shape[0]
  uniform = jax.random.uniform(rng, (batch, gamma, UNIFORMS_PER_DRAW))
  logits, confidences, draft_cache = _scored_extend(draft, draft_params, draft_cache, context,
                                                    temperature, rule.signal)
  first, first_confidence = logits[:, 1], confidences[:, 1]
  start = _AdaptiveDraft(
      step=jnp.int32(1),
      tokens=jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(
          sample_tokens(first, None, temperature, uniform[:, 0])),
      logits=jnp.zeros((batch, gamma) + first.shape[1:], first.dtype).at[:, 0].set(first),
      cache=draft_cache, going=active, proposed=jnp.ones((batch,), jnp.int32),
      product=first_confidence, expected=1.0 + first_confidence)
  body = functools.partial(_adaptive_step, draft, draft_params, uniform, gamma=gamma,
                           temperature=temperature, rule=rule)
  end = jax.lax.while_loop(lambda c: (c.step < gamma) & jnp.any(c.going), body, start)
  # A row stopped by the call after its last proposed token; alone it would have made
  # exactly those calls, whatever the rest of the batch needed.
  return DraftBlock(tokens=end.tokens, logits=end.logits, cache=end.cache,
                    proposed=end.proposed, row_calls=jnp.minimum(end.proposed + 1, gamma),
                    calls=end.step)


def _verify_proposals(target: Model, target_params, target_cache, block: Array,
                      width: Array, gamma: int, hidden_layers: tuple = ()):
  """The target's call on the first `width` tokens of `block: [batch, gamma + 1]` (a traced
  width in [2, gamma + 1]: one compiled branch per width, so a shorter proposal is a
  cheaper call). Returns (logits [batch, gamma + 1, vocab], zero past `width`; cache
  advanced by `width`), and with `hidden_layers` the hidden states [batch, gamma + 1, n *
  embed] (zero past `width`).

  The branches only read the cache (`Model.score_block`) and the block's entries are written
  after them, padded to gamma + 1 (within the capacity check's bound, past the new positions):
  a branch that wrote the cache would make XLA copy all of it every round."""
  def branch(columns):
    def call(cache):
      outputs = target.score_block(target_params, cache, block[:, :columns], hidden_layers)
      return jax.tree.map(
          lambda x: jnp.concatenate(
              [x, jnp.zeros(x.shape[:1] + (gamma + 1 - columns,) + x.shape[2:], x.dtype)],
              axis=1), outputs)
    return call

  logits, entries, *hidden = jax.lax.switch(width - 2, [branch(w) for w in range(2, gamma + 2)],
                                            target_cache)
  return (logits, target.write_block(target_cache, entries, width), *hidden)


def _round_output(state: SpeculativeState, block: Array, num_accepted: Array,
                  next_token: Array, *, max_new_tokens: int, gamma: int, ends_row):
  """What a round appends: (out with the round's tokens written, produced [batch] tokens
  appended (0 for finished rows), first_eos [batch]: the offset of the first EOS among the
  round's tokens, gamma + 1 where there is none). `ends_row(tokens)`: which tokens end a row
  (the EOS and any stop id, `SamplingConfig.ends_row`); each counts as the EOS here.

  block: [batch, gamma + 1] = [pending, draft tokens]; num_accepted, next_token: [batch]
  from `verify_block`.
  """
  active = ~state.done
  # New tokens of this round: the accepted draft tokens, then the target's token (what
  # follows is cut off by `produced` below).
  offsets = jnp.arange(gamma + 1)[None, :]
  new_tokens = jnp.where(offsets < num_accepted[:, None], jnp.roll(block, -1, axis=1),
                         next_token[:, None])
  # Keep tokens up to the first EOS and within the length budget.
  is_eos = ends_row(new_tokens) & (offsets <= num_accepted[:, None])
  first_eos = accepted_prefix_length(~is_eos)
  produced = jnp.minimum(jnp.minimum(num_accepted, first_eos) + 1,
                         max_new_tokens - state.generated) * active
  # Elementwise select instead of a scatter: XLA fuses it, and small scatters dominate the
  # per-round cost of tiny models.
  relative = jnp.arange(state.out.shape[1])[None, :] - state.generated[:, None]
  shifted = jnp.take_along_axis(new_tokens, jnp.clip(relative, 0, gamma), axis=1)
  out = jnp.where((relative >= 0) & (relative < produced[:, None]), shifted, state.out)
  return out, produced, first_eos


@flax.struct.dataclass
class VerifiedRound:
  """A round's drafting and verification (`_propose_and_verify`), before its output is cut.

  block: [batch, gamma + 1] int32, [pending, draft tokens].
  num_accepted: [batch] int32 in [0, proposed], the accepted prefix of the proposal.
  next_token: [batch] int32, the correction or bonus token.
  draft: the round's DraftBlock (its cache advanced by `draft.calls + 1`).
  width: [] int32, the tokens the target scored (gamma + 1 under the fixed rule).
  target_cache: the target's DecodingCache, advanced by `width`.
  """

  block: Array
  num_accepted: Array
  next_token: Array
  draft: DraftBlock
  width: Array
  target_cache: DecodingCache


def _propose_and_verify(target, target_params, draft, draft_params, state: SpeculativeState,
                        draft_rng, verify_rng, *, gamma, sampling, lenience,
                        draft_length) -> VerifiedRound:
  """A round's drafting (every row proposes gamma tokens under the fixed rule, up to gamma
  under an adaptive one) and the target's verification of the batch's longest proposal."""
  if isinstance(draft, Head):
    return _head_propose_and_verify(target, target_params, draft, draft_params, state,
                                    draft_rng, verify_rng, gamma=gamma, sampling=sampling,
                                    lenience=lenience, draft_length=draft_length)
  context = jnp.stack([state.previous, state.pending], axis=1)
  if not draft_length.adaptive:
    drafted = _draft_block(draft, draft_params, state.draft_cache, context, draft_rng,
                           gamma=gamma, temperature=sampling.temperature)
    block = jnp.concatenate([context[:, 1:], drafted.tokens], axis=1)
    target_logits, target_cache = target.extend(target_params, state.target_cache, block)
    num_accepted, next_token = verify_block(target_logits, drafted.logits, drafted.tokens,
                                            verify_rng, sampling.temperature, lenience)
    return VerifiedRound(block=block, num_accepted=num_accepted, next_token=next_token,
                         draft=drafted, width=jnp.int32(gamma + 1), target_cache=target_cache)
  drafted = _draft_block_adaptive(draft, draft_params, state.draft_cache, context, draft_rng,
                                  ~state.done, gamma=gamma, temperature=sampling.temperature,
                                  rule=draft_length)
  block = jnp.concatenate([context[:, 1:], drafted.tokens], axis=1)
  width = jnp.max(jnp.where(state.done, 1, drafted.proposed)) + 1
  target_logits, target_cache = _verify_proposals(target, target_params, state.target_cache,
                                                  block, width, gamma)
  num_accepted, next_token = verify_block(target_logits, drafted.logits, drafted.tokens,
                                          verify_rng, sampling.temperature, lenience,
                                          proposed=drafted.proposed)
  return VerifiedRound(block=block, num_accepted=num_accepted, next_token=next_token,
                       draft=drafted, width=width, target_cache=target_cache)


def _head_propose_and_verify(target, target_params, head: Head, head_params,
                             state: SpeculativeState, draft_rng, verify_rng, *, gamma,
                             sampling, lenience, draft_length) -> VerifiedRound:
  """`_propose_and_verify` with a draft head: the same draft loops over `HeadDrafter`, and a
  verification that also returns the target's features at the head's layers (kept in the
  round's head state for `head_draft.commit`)."""
  drafter, layers = head_draft.HeadDrafter(head), head.feature_layers
  context = jnp.stack([state.previous, state.pending], axis=1)
  if not draft_length.adaptive:
    drafted = _draft_block(drafter, head_params, state.draft_cache, context, draft_rng,
                           gamma=gamma, temperature=sampling.temperature)
    block = jnp.concatenate([context[:, 1:], drafted.tokens], axis=1)
    target_logits, target_cache, features = target.extend(target_params, state.target_cache,
                                                          block, layers)
    width = jnp.int32(gamma + 1)
  else:
    drafted = _draft_block_adaptive(drafter, head_params, state.draft_cache, context,
                                    draft_rng, ~state.done, gamma=gamma,
                                    temperature=sampling.temperature, rule=draft_length)
    block = jnp.concatenate([context[:, 1:], drafted.tokens], axis=1)
    width = jnp.max(jnp.where(state.done, 1, drafted.proposed)) + 1
    target_logits, target_cache, features = _verify_proposals(
        target, target_params, state.target_cache, block, width, gamma, layers)
  num_accepted, next_token = verify_block(
      target_logits, drafted.logits, drafted.tokens, verify_rng, sampling.temperature, lenience,
      proposed=drafted.proposed if draft_length.adaptive else None)
  drafted = drafted.replace(cache=drafted.cache.replace(verified=features))
  return VerifiedRound(block=block, num_accepted=num_accepted, next_token=next_token,
                       draft=drafted, width=width, target_cache=target_cache)


def _round(target, target_params, draft, draft_params, state: SpeculativeState, *,
           max_new_tokens, gamma, sampling, lenience, draft_length) -> SpeculativeState:
  """One round for every row: draft up to gamma tokens, verify them in one target call,
  commit the accepted prefix and the target's token, roll both caches back. Finished rows
  keep their counters and output."""
  round_rng = jax.random.fold_in(state.loop_rng, state.round)
  draft_rng, verify_rng = jax.random.split(round_rng)
  active = ~state.done
  verified = _propose_and_verify(target, target_params, draft, draft_params, state, draft_rng,
                                 verify_rng, gamma=gamma, sampling=sampling, lenience=lenience,
                                 draft_length=draft_length)
  block, num_accepted, drafted = verified.block, verified.num_accepted, verified.draft
  out, produced, first_eos = _round_output(state, block, num_accepted, verified.next_token,
                                           max_new_tokens=max_new_tokens, gamma=gamma,
                                           ends_row=functools.partial(sampling.ends_row, target))
  # Accepted draft tokens that reach the output: all n, unless EOS or the length limit cut
  # the round at produced <= n tokens, all of them draft tokens.
  kept = jnp.minimum(num_accepted, produced)
  # The rejected position reaches the output when the round keeps its correction token.
  rejected = num_accepted < drafted.proposed
  output_rejected = rejected & (produced > num_accepted)
  finished = (first_eos <= num_accepted) | (state.generated + produced >= max_new_tokens)
  # Roll back what was not accepted: each cache keeps the round's first num_accepted + 1
  # tokens. Rows finished before or in this round return to where the round began, so later
  # rounds' writes stay within the capacity check's bound.
  going_on = active & ~finished
  target_rollback = jnp.where(going_on, verified.width - 1 - num_accepted, verified.width)
  draft_rollback = jnp.where(going_on, drafted.calls - num_accepted, drafted.calls + 1)
  if isinstance(draft, Head):  # per row: back to the round's first step, then the accepted
    draft_cache = head_draft.commit(drafted.cache, block, num_accepted, verified.next_token,
                                    going_on)
  else:
    draft_cache = drafted.cache.rollback(draft_rollback)
  this_round = active[:, None] & (
      jnp.arange(max_new_tokens)[None, :] == state.target_calls[:, None])
  per_round = lambda new, old: jnp.where(this_round, new[:, None], old)
  keep = lambda new, old: jnp.where(active, new, old)  # finished rows keep their counters
  last_accepted = jnp.take_along_axis(block, num_accepted[:, None], axis=1)[:, 0]
  return state.replace(
      generated=keep(state.generated + produced, state.generated),
      target_calls=keep(state.target_calls + 1, state.target_calls),
      accepted=keep(state.accepted + kept, state.accepted),
      accepted_proposed=keep(state.accepted_proposed + num_accepted, state.accepted_proposed),
      rejections=keep(state.rejections + rejected, state.rejections),
      output_rejections=keep(state.output_rejections + output_rejected,
                             state.output_rejections),
      drafted=keep(state.drafted + drafted.proposed, state.drafted),
      draft_calls=keep(state.draft_calls + drafted.row_calls, state.draft_calls),
      previous=keep(last_accepted, state.previous),
      pending=keep(verified.next_token, state.pending),
      done=keep(finished, state.done), round=state.round + 1,
      target_cache=verified.target_cache.rollback(target_rollback),
      draft_cache=draft_cache, out=out,
      accepted_per_round=per_round(kept, state.accepted_per_round),
      proposed_per_round=per_round(drafted.proposed, state.proposed_per_round),
      tested_per_round=per_round(kept + output_rejected, state.tested_per_round))


def speculative_rounds(target, target_params, draft, draft_params, state: SpeculativeState, *,
                       max_new_tokens, gamma, sampling, lenience,
                       draft_length: DraftLength = DraftLength()) -> SpeculativeResult:
  """Runs the rounds from `speculative_start`'s state until every row is done."""
  lenience.check_temperature(sampling.temperature)  # static: refused while tracing
  body = functools.partial(_round, target, target_params, draft, draft_params,
                           max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                           lenience=lenience, draft_length=draft_length)
  state = jax.lax.while_loop(lambda state: jnp.any(~state.done), body, state)
  return SpeculativeResult(
      tokens=state.out[:, :max_new_tokens], lengths=state.generated,
      target_calls=state.target_calls, draft_calls=state.draft_calls,
      drafted=state.drafted, accepted=state.accepted,
      accepted_proposed=state.accepted_proposed, produced=state.generated - 1,
      accepted_per_round=state.accepted_per_round, rejections=state.rejections,
      proposed_per_round=state.proposed_per_round,
      output_rejections=state.output_rejections, tested_per_round=state.tested_per_round)
