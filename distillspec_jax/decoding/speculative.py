"""Speculative decoding (Leviathan et al. 2023; DistillSpec Knowl 5) as one jitted while_loop.

Each round, per batch row: the draft proposes `gamma` tokens, the target scores them all in
one (gamma + 1)-token call, the row accepts a prefix of n <= gamma draft tokens and appends one
more token from the target (the correction at the first rejection, or the bonus token when all
gamma were accepted). Rows advance by their own n + 1; both caches are rolled back per row by
lowering positions, never copied. Under an adaptive `DraftLength` each row proposes k <= gamma
(then gamma_max) tokens, chosen by the draft alone, and the target scores the batch's longest
proposal (`_draft_block_adaptive`, `_verify_proposals`).

Cache invariant at the start of a round (n committed decoder tokens, the last one `pending`):
the target cache holds the n - 1 tokens before `pending`; the draft cache holds the n - 2 tokens
before `previous, pending`. The draft's first step feeds [previous, pending] (rewriting
`previous` where it was already cached gives identical keys/values), so a fully accepted block
never needs an extra draft call to catch up on its last token.

Statistics (per row, counted only while the row is unfinished; the first generated token comes
from the prompt's prefill in both plain and speculative decoding and is not counted):
  target_calls: verification calls.   draft_calls: draft forward calls (gamma per round
            under the fixed rule; an adaptive round that stops early makes one more call than
            it proposes tokens: the call that found the next token unsure).
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
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.validation import (check_field_types, check_positive_int,
                                             check_probability)

from distillspec_jax.decoding.plain import (UNIFORMS_PER_DRAW, SamplingConfig, cache_capacity,
                                      check_capacity, check_prompts,
                                      check_rng, probabilities, sample_from_probabilities,
                                      sample_tokens)
from distillspec_jax.models.cache import DecodingCache
from distillspec_jax.models.model import Model, check_same_tokens, decoder_prompt

Array = jax.Array

LENIENCE_FUNCTIONS = ("lin", "sq", "exp")


@dataclasses.dataclass(frozen=True)
class Lenience:
  """Lossy acceptance f(p, eps) (DistillSpec Knowl 5): lin p/eps, sq p/eps^2, exp p^eps.

  eps = 1 is lossless speculative sampling; smaller eps accepts more draft tokens.
  """

  kind: str = "lin"
  epsilon: float = 1.0

  def __post_init__(self):
    check_field_types(self)
    if self.kind not in LENIENCE_FUNCTIONS:
      raise ValueError(f"Unknown lenience function {self.kind!r}; use one of "
                       f"{LENIENCE_FUNCTIONS}.")
    check_probability(self.epsilon, "lenience epsilon", zero=False,
                      fix="pass a number in (0, 1]; 1 is lossless.")

  def __call__(self, p: Array) -> Array:
    if self.kind == "lin":
      return p / self.epsilon
    if self.kind == "sq":
      return p / self.epsilon ** 2
    return jnp.power(p, self.epsilon)


DRAFT_LENGTH_RULES = ("fixed", "confidence", "cumulative", "cost")


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
  The verification scores only the batch's longest proposal, and the draft stops once every
  row has stopped. Lossless: whether a token is proposed depends on the draft alone, and
  every proposed token goes through the same acceptance test (DistillSpec Knowl 5 at each
  position), so the output distribution is the target's.
  """

  rule: str = "fixed"
  threshold: float = 0.0
  costs: tuple = ()
  draft_cost: float = 0.0

  def __post_init__(self):
    check_field_types(self)
    if self.rule not in DRAFT_LENGTH_RULES:
      raise ValueError(f"Unknown draft length rule {self.rule!r}; use one of "
                       f"{DRAFT_LENGTH_RULES}.")
    check_probability(self.threshold, "draft length threshold",
                      fix="pass a probability in [0, 1] (0 proposes gamma_max every round).")
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
      if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not (
          np.isfinite(cost) and cost > 0):
        raise ValueError(f"costs[{width - 1}]={cost!r} (a {width}-token verification) must "
                         f"be a positive finite number; {fix}")
    if isinstance(self.draft_cost, bool) or not (np.isfinite(self.draft_cost)
                                                and self.draft_cost >= 0):
      raise ValueError(f"draft_cost={self.draft_cost!r} must be finite and >= 0; {fix}")

  def check_gamma_max(self, gamma_max: int) -> None:
    """Refuses a 'cost' rule without the price of every width up to gamma_max + 1."""
    if self.rule == "cost" and len(self.costs) < gamma_max + 1:
      raise ValueError(f"costs has {len(self.costs)} entries but gamma_max={gamma_max} "
                       f"verifies up to {gamma_max + 1} tokens; pass a cost for every width "
                       f"1..{gamma_max + 1}.")

  @property
  def adaptive(self) -> bool:
    return self.rule != "fixed"


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

  @property
  def block_efficiency(self) -> Array:
    """tau = tokens produced by verification rounds / target verification calls."""
    return jnp.sum(self.produced) / jnp.maximum(jnp.sum(self.target_calls), 1)

  @property
  def acceptance_rate(self) -> Array:
    """alpha = accepted draft tokens that reach the output / drafted tokens."""
    return jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.drafted), 1)

  @property
  def proposed_acceptance_rate(self) -> Array:
    """Accepted draft tokens, including those EOS or the length limit cut off / drafted."""
    return jnp.sum(self.accepted_proposed) / jnp.maximum(jnp.sum(self.drafted), 1)


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
  check_same_tokens(target, draft)
  if target.config.kind != draft.config.kind:
    raise ValueError(f"The target is {target.config.kind} but the draft is {draft.config.kind}; "
                     "pair models of the same kind.")
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
    lenience: lossy acceptance (eps = 1, the default, is exact).
    rng: PRNG key, required when temperature > 0 (optional when greedy).
    max_length: cache capacity of both models (default: the target's max_decode_length); needs
      P + max_new_tokens + gamma where P is prompt_tokens' width (0 for encoder-decoders), or
      1 + P when max_new_tokens = 1 (see the module docstring).
    draft_length: how many of its gamma tokens a row proposes each round (DraftLength; the
      default proposes all gamma).
  Returns:
    SpeculativeResult, tokens [batch, max_new_tokens].
  """
  gamma = _validate(target, draft, gamma, lenience, draft_length)
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
  accepted_per_round, proposed_per_round: [batch, max_new_tokens] int32, as
    `SpeculativeResult`'s.
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
  first_logits, target_cache = target.prefill(target_params, target_cache, prompt,
                                              prompt_lengths)
  draft_cache = draft.init_cache(draft_params, batch, max_length, encoder_input_tokens)
  if prompt.shape[1] > 1:  # a one-token prompt (encoder-decoders) leaves the draft empty
    _, draft_cache = draft.extend(draft_params, draft_cache, prompt)
    draft_cache = draft_cache.rollback(prompt.shape[1] - (prompt_lengths - 1))
  previous = jnp.take_along_axis(prompt, (prompt_lengths - 1)[:, None], axis=1)[:, 0]
  pending = sample_tokens(first_logits, first_rng, sampling.temperature)

  out = jnp.full((batch, max_new_tokens + gamma + 1), target.tokens.pad_id,
                 jnp.int32).at[:, 0].set(pending)
  zeros = jnp.zeros_like(pending)
  return SpeculativeState(
      generated=jnp.ones_like(pending), target_calls=zeros, accepted=zeros,
      accepted_proposed=zeros, rejections=zeros, output_rejections=zeros, drafted=zeros,
      draft_calls=zeros,
      previous=previous, pending=pending,
      done=(pending == sampling.eos_for(target)) | (max_new_tokens <= 1), round=jnp.int32(0),
      target_cache=target_cache, draft_cache=draft_cache, out=out,
      accepted_per_round=jnp.full((batch, max_new_tokens), -1, jnp.int32),
      proposed_per_round=jnp.full((batch, max_new_tokens), -1, jnp.int32), loop_rng=loop_rng)


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
  return state.replace(out=out)


def _draft_block(draft: Model, draft_params, draft_cache, context: Array, rng: Array, *,
                 gamma: int, temperature: float):
  """gamma draft steps from `context: [batch, 2]` = [previous, pending] (the first step feeds
  both). Returns (tokens [batch, gamma], logits [batch, gamma, vocab], draft cache)."""
  uniform = jax.random.uniform(rng, (context.shape[0], gamma, UNIFORMS_PER_DRAW))
  logits, draft_cache = draft.extend(draft_params, draft_cache, context)
  step_logits = logits[:, 1]
  tokens, all_logits = [], []
  for i in range(gamma):
    if i > 0:
      logits, draft_cache = draft.extend(draft_params, draft_cache, tokens[-1][:, None])
      step_logits = logits[:, 0]
    all_logits.append(step_logits)
    tokens.append(sample_tokens(step_logits, None, temperature, uniform[:, i]))
  return jnp.stack(tokens, 1), jnp.stack(all_logits, 1), draft_cache


def _confidence(logits: Array, temperature: float) -> Array:
  """The draft's top probability for its next token, [batch], from logits [batch, vocab]: at
  the sampling temperature, at temperature 1 when greedy (one-hot would always be 1)."""
  scale = temperature if temperature > 0.0 else 1.0
  return jnp.max(jax.nn.softmax(logits.astype(jnp.float32) / scale, axis=-1), axis=-1)


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


def _draft_block_adaptive(draft: Model, draft_params, draft_cache, context: Array, rng: Array,
                          active: Array, *, gamma: int, temperature: float,
                          rule: "DraftLength"):
  """Up to gamma draft steps from `context: [batch, 2]` (as `_draft_block`), each row
  proposing its first token and then each next one while `rule` says so (`DraftLength`:
  `_confidence` of it, the product of the round's confidences up to it, or `_worth_drafting`);
  the steps stop once no `active` row proposes more. Returns (tokens [batch, gamma], logits
  [batch, gamma, vocab], draft cache, proposed [batch] in [1, gamma], draft calls []: the
  cache advanced by calls + 1). Entries past a row's proposal are drawn but never tested;
  the uniforms are `_draft_block`'s, so a row that proposes gamma tokens draws the same
  tokens."""
  batch = context.shape[0]
  uniform = jax.random.uniform(rng, (batch, gamma, UNIFORMS_PER_DRAW))
  logits, draft_cache = draft.extend(draft_params, draft_cache, context)
  first = logits[:, 1]
  tokens = jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(
      sample_tokens(first, None, temperature, uniform[:, 0]))
  all_logits = jnp.zeros((batch, gamma) + first.shape[1:], first.dtype).at[:, 0].set(first)

  def cond(carry):
    step, _, _, _, going, _, _, _ = carry
    return (step < gamma) & jnp.any(going)

  def body(carry):
    step, tokens, all_logits, cache, going, proposed, product, expected = carry
    previous = jax.lax.dynamic_index_in_dim(tokens, step - 1, axis=1, keepdims=True)
    logits, cache = draft.extend(draft_params, cache, previous)
    step_logits = logits[:, 0]
    confidence = _confidence(step_logits, temperature)
    if rule.rule == "cost":
      going = going & _worth_drafting(rule, gamma, step, confidence, product, expected)
    else:
      metric = product * confidence if rule.rule == "cumulative" else confidence
      going = going & (metric >= rule.threshold)
    product = product * confidence
    expected = expected + jnp.where(going, product, 0.0)
    u = jax.lax.dynamic_index_in_dim(uniform, step, axis=1, keepdims=False)
    token = sample_tokens(step_logits, None, temperature, u)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, step, axis=1)
    all_logits = jax.lax.dynamic_update_index_in_dim(all_logits, step_logits, step, axis=1)
    return (step + 1, tokens, all_logits, cache, going, proposed + going.astype(jnp.int32),
            product, expected)

  ones = jnp.ones((batch,), jnp.int32)
  first_confidence = _confidence(first, temperature)
  steps, tokens, all_logits, draft_cache, _, proposed, _, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(1), tokens, all_logits, draft_cache, active, ones,
                   first_confidence, 1.0 + first_confidence))
  return tokens, all_logits, draft_cache, proposed, steps


def _verify_proposals(target: Model, target_params, target_cache, block: Array,
                      width: Array, gamma: int):
  """The target's call on the first `width` tokens of `block: [batch, gamma + 1]` (a traced
  width in [2, gamma + 1]: one compiled branch per width, so a shorter proposal is a
  cheaper call). Returns (logits [batch, gamma + 1, vocab], zero past `width`; cache)."""
  def branch(columns):
    def call(cache):
      logits, cache = target.extend(target_params, cache, block[:, :columns])
      pad = jnp.zeros(logits.shape[:1] + (gamma + 1 - columns,) + logits.shape[2:],
                      logits.dtype)
      return jnp.concatenate([logits, pad], axis=1), cache
    return call

  return jax.lax.switch(width - 2, [branch(w) for w in range(2, gamma + 2)], target_cache)


def _round_output(state: SpeculativeState, block: Array, num_accepted: Array,
                  next_token: Array, *, max_new_tokens: int, gamma: int, eos: int):
  """What a round appends: (out with the round's tokens written, produced [batch] tokens
  appended (0 for finished rows), first_eos [batch]: the offset of the first EOS among the
  round's tokens, gamma + 1 where there is none).

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
  is_eos = (new_tokens == eos) & (offsets <= num_accepted[:, None])
  first_eos = accepted_prefix_length(~is_eos)
  produced = jnp.minimum(jnp.minimum(num_accepted, first_eos) + 1,
                         max_new_tokens - state.generated) * active
  # Elementwise select instead of a scatter: XLA fuses it, and small scatters dominate the
  # per-round cost of tiny models.
  relative = jnp.arange(state.out.shape[1])[None, :] - state.generated[:, None]
  shifted = jnp.take_along_axis(new_tokens, jnp.clip(relative, 0, gamma), axis=1)
  out = jnp.where((relative >= 0) & (relative < produced[:, None]), shifted, state.out)
  return out, produced, first_eos


def _propose_and_verify(target, target_params, draft, draft_params, state: SpeculativeState,
                        draft_rng, verify_rng, *, gamma, sampling, lenience, draft_length):
  """A round's drafting and verification: (block [batch, gamma + 1] = [pending, draft
  tokens], num_accepted, next_token, proposed [batch], draft calls [], target width [],
  target cache, draft cache); the caches advanced by width and draft calls + 1."""
  context = jnp.stack([state.previous, state.pending], axis=1)
  if not draft_length.adaptive:
    draft_tokens, draft_logits, draft_cache = _draft_block(
        draft, draft_params, state.draft_cache, context, draft_rng, gamma=gamma,
        temperature=sampling.temperature)
    block = jnp.concatenate([context[:, 1:], draft_tokens], axis=1)
    target_logits, target_cache = target.extend(target_params, state.target_cache, block)
    num_accepted, next_token = verify_block(target_logits, draft_logits, draft_tokens,
                                            verify_rng, sampling.temperature, lenience)
    return (block, num_accepted, next_token, jnp.full_like(num_accepted, gamma),
            jnp.int32(gamma), jnp.int32(gamma + 1), target_cache, draft_cache)
  draft_tokens, draft_logits, draft_cache, proposed, calls = _draft_block_adaptive(
      draft, draft_params, state.draft_cache, context, draft_rng, ~state.done, gamma=gamma,
      temperature=sampling.temperature, rule=draft_length)
  block = jnp.concatenate([context[:, 1:], draft_tokens], axis=1)
  width = jnp.max(jnp.where(state.done, 1, proposed)) + 1
  target_logits, target_cache = _verify_proposals(target, target_params, state.target_cache,
                                                  block, width, gamma)
  num_accepted, next_token = verify_block(target_logits, draft_logits, draft_tokens,
                                          verify_rng, sampling.temperature, lenience,
                                          proposed=proposed)
  return (block, num_accepted, next_token, proposed, calls, width, target_cache, draft_cache)


def _round(target, target_params, draft, draft_params, state: SpeculativeState, *,
           max_new_tokens, gamma, sampling, lenience, draft_length) -> SpeculativeState:
  """One round for every row: draft up to gamma tokens, verify them in one target call,
  commit the accepted prefix and the target's token, roll both caches back. Finished rows
  keep their counters and output."""
  round_rng = jax.random.fold_in(state.loop_rng, state.round)
  draft_rng, verify_rng = jax.random.split(round_rng)
  active = ~state.done
  (block, num_accepted, next_token, proposed, calls, width, target_cache,
   draft_cache) = _propose_and_verify(target, target_params, draft, draft_params, state,
                                      draft_rng, verify_rng, gamma=gamma, sampling=sampling,
                                      lenience=lenience, draft_length=draft_length)
  out, produced, first_eos = _round_output(state, block, num_accepted, next_token,
                                           max_new_tokens=max_new_tokens, gamma=gamma,
                                           eos=sampling.eos_for(target))
  # Accepted draft tokens that reach the output: all n, unless EOS or the length limit cut
  # the round at produced <= n tokens, all of them draft tokens.
  kept = jnp.minimum(num_accepted, produced)
  finished = (first_eos <= num_accepted) | (state.generated + produced >= max_new_tokens)
  # Roll back what was not accepted: each cache keeps the round's first num_accepted + 1
  # tokens. Rows finished before or in this round return to where the round began, so later
  # rounds' writes stay within the capacity check's bound.
  going_on = active & ~finished
  target_rollback = jnp.where(going_on, width - 1 - num_accepted, width)
  draft_rollback = jnp.where(going_on, calls - num_accepted, calls + 1)
  this_round = active[:, None] & (
      jnp.arange(max_new_tokens)[None, :] == state.target_calls[:, None])
  accepted_per_round = jnp.where(this_round, kept[:, None], state.accepted_per_round)
  proposed_per_round = jnp.where(this_round, proposed[:, None], state.proposed_per_round)
  keep = lambda new, old: jnp.where(active, new, old)  # finished rows keep their counters
  last_accepted = jnp.take_along_axis(block, num_accepted[:, None], axis=1)[:, 0]
  # The rejected position reaches the output when the round keeps its correction token.
  rejected = num_accepted < proposed
  return state.replace(
      generated=keep(state.generated + produced, state.generated),
      target_calls=keep(state.target_calls + 1, state.target_calls),
      accepted=keep(state.accepted + kept, state.accepted),
      accepted_proposed=keep(state.accepted_proposed + num_accepted, state.accepted_proposed),
      rejections=keep(state.rejections + rejected, state.rejections),
      output_rejections=keep(state.output_rejections + (rejected & (produced > num_accepted)),
                             state.output_rejections),
      drafted=keep(state.drafted + proposed, state.drafted),
      draft_calls=keep(state.draft_calls + calls, state.draft_calls),
      previous=keep(last_accepted, state.previous), pending=keep(next_token, state.pending),
      done=keep(finished, state.done), round=state.round + 1,
      target_cache=target_cache.rollback(target_rollback),
      draft_cache=draft_cache.rollback(draft_rollback),
      out=out, accepted_per_round=accepted_per_round, proposed_per_round=proposed_per_round)


def speculative_rounds(target, target_params, draft, draft_params, state: SpeculativeState, *,
                       max_new_tokens, gamma, sampling, lenience,
                       draft_length: DraftLength = DraftLength()) -> SpeculativeResult:
  """Runs the rounds from `speculative_start`'s state until every row is done."""
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
      output_rejections=state.output_rejections)
