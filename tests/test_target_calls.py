"""Target calls after the setup: plain decoding makes L - 1 for L new tokens (the first token
comes from the prefill, the last one is never fed back), speculative decoding one per round.
Counted on the model itself (a Model whose `extend` reports every call), through the public
`decode` and `speculative_decode`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.decoding.speculative import speculative_decode
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.model import Model


_CALLS = []  # the token width of every extend call of a _CountedModel


@dataclasses.dataclass(frozen=True)
class _CountedModel(Model):
  """A Model that records each `extend` call (the prefill's included) as it runs."""

  def extend(self, params, cache, tokens):
    jax.debug.callback(lambda width: _CALLS.append(int(width)), tokens.shape[1])
    return super().extend(params, cache, tokens)


def _counted(fn) -> tuple:
  """(fn(), target calls after the setup): every extend call less the prefill's."""
  _CALLS.clear()
  out = jax.block_until_ready(fn())
  jax.effects_barrier()
  assert _CALLS, "the counting model was never called"
  return out, len(_CALLS) - 1


def _pair(kind: str) -> tuple:
  common = dict(kind=kind, vocab_size=61, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                dropout_rate=0.0, max_decode_length=40)
  encoders = 1 if kind == "encoder_decoder" else 0
  target = _CountedModel(TransformerConfig(num_encoder_layers=encoders, num_decoder_layers=2,
                                           **common))
  draft = Model(TransformerConfig(num_encoder_layers=encoders, num_decoder_layers=1, **common))
  plain_target = Model(target.config)
  return (target, plain_target, target.init(jax.random.PRNGKey(0)), draft,
          draft.init(jax.random.PRNGKey(1)))


def _prompt(kind: str, batch: int = 1) -> dict:
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (batch, 5), 2, 61), np.int32)
  key = "encoder_input_tokens" if kind == "encoder_decoder" else "prompt_tokens"
  return {key: jnp.asarray(tokens)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_decoding_makes_one_target_call_fewer_than_its_tokens(kind, temperature):
  target, plain_target, params, _, _ = _pair(kind)
  prompt = _prompt(kind)
  for new_tokens in (1, 9):  # the prefill's token alone, and a longer output
    sampling = SamplingConfig(temperature, eos_id=-1)  # every row runs to the length limit
    rng = jax.random.PRNGKey(5)
    result, calls = _counted(lambda: decode(target, params, max_new_tokens=new_tokens,
                                            sampling=sampling, rng=rng, **prompt))
    assert int(result.lengths[0]) == new_tokens
    assert calls == new_tokens - 1, (new_tokens, calls)
  # The skipped call changes no output: the uncounted model decodes the same tokens.
  reference = decode(plain_target, params, max_new_tokens=new_tokens, sampling=sampling,
                     rng=rng, **prompt)
  np.testing.assert_array_equal(result.tokens, reference.tokens)


def test_plain_decoding_stops_calling_once_every_row_has_its_eos():
  """With EOS, the batch's calls are its longest row's tokens less one."""
  target, _, params, _, _ = _pair("decoder_only")
  prompt = _prompt("decoder_only", batch=3)
  free = np.asarray(decode(target, params, max_new_tokens=12,
                           sampling=SamplingConfig(eos_id=-1), **prompt).tokens)
  eos = int(free[0, 3])  # row 0 then ends at its 4th token at the latest
  result, calls = _counted(lambda: decode(target, params, max_new_tokens=12,
                                          sampling=SamplingConfig(eos_id=eos), **prompt))
  lengths = np.asarray(result.lengths)
  assert lengths.min() <= 4
  assert calls == lengths.max() - 1, (lengths, calls)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_makes_one_target_call_per_round(temperature):
  target, _, params, draft, draft_params = _pair("decoder_only")
  prompt = _prompt("decoder_only")
  for gamma in (1, 4):
    result, calls = _counted(lambda: speculative_decode(
        target, params, draft, draft_params, max_new_tokens=9, gamma=gamma,
        sampling=SamplingConfig(temperature, eos_id=-1), rng=jax.random.PRNGKey(5),
        **prompt))
    assert calls == int(result.target_calls[0]) >= 1
    # Every round yields at least one token: never more calls than plain decoding's L - 1.
    assert calls <= 9 - 1
