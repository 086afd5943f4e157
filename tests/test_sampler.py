"""The token sampler (`plain.sample_from_probabilities`) at T5's 32,128-entry vocabulary:
draw frequencies against exact probabilities, including a heavy tail of tiny probabilities that
a single fp32 inverse CDF over the vocabulary never draws; support and edge cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from distillspec_jax.decoding import plain

# Millions of draws: XLA's optimisations pay here (tests/conftest.py).
pytestmark = pytest.mark.optimized_compilation
T5_VOCAB = 32128


@functools.partial(jax.jit, static_argnames="sampler")
def _draw_chunk(probs, uniforms, sampler):
  """One distribution `probs: [V]`, many draws `uniforms: [N, UNIFORMS_PER_DRAW]` -> [N]."""
  return jax.vmap(lambda u: sampler(probs[None], u[None])[0])(uniforms)


def _draw(probs, num_draws, seed, sampler=plain.sample_from_probabilities, chunk=250_000):
  """`num_draws` tokens from `probs: [V]`, uniforms from PRNGKey(seed) in chunks."""
  key = jax.random.PRNGKey(seed)
  out = []
  for start in range(0, num_draws, chunk):
    uniforms = jax.random.uniform(jax.random.fold_in(key, start),
                                  (min(chunk, num_draws - start), plain.UNIFORMS_PER_DRAW))
    out.append(np.asarray(_draw_chunk(jnp.asarray(probs), uniforms, sampler)))
  return np.concatenate(out)


def _single_cdf_draws(probs, num_draws, seed):
  """The sampler this project had before, on the same uniforms as `_draw`: one fp32 cumsum
  over the whole vocabulary (the same XLA op), token = #{cdf < (1 - u) x total} for the draw's
  first uniform (searchsorted gives that count on a nondecreasing cdf without an [N, V] array).
  Kept here to show the tail test has teeth."""
  cdf = np.asarray(jnp.cumsum(jnp.asarray(probs, jnp.float32)[None], axis=-1))[0]
  key, chunk, out = jax.random.PRNGKey(seed), 250_000, []
  for start in range(0, num_draws, chunk):
    uniforms = np.asarray(jax.random.uniform(
        jax.random.fold_in(key, start),
        (min(chunk, num_draws - start), plain.UNIFORMS_PER_DRAW)))
    threshold = (np.float32(1.0) - uniforms[:, 0]) * cdf[-1]  # fp32, as before
    out.append(np.minimum(np.searchsorted(cdf, threshold, side="left"), len(cdf) - 1))
  return np.concatenate(out)


def _tail_distribution():
  """Token 0 holds half the mass; then 8,192 pairs (tiny, big) of 2^-26 (1.5e-8) and
  2^-14 - 2^-26, so the running total returns to a multiple of 2^-14 after every pair; the
  other 15,743 tokens have probability 0. Every value and total is exact in fp32 and sums
  to 1. The tiny tokens hold 1.2e-4 in all, each below half the fp32 spacing (6e-8) of the
  running total in [0.5, 1): a single fp32 cumsum over the vocabulary gives each an empty
  interval. Returns (probs fp32 [V], groups [V]: 0 head, 1 tiny, 2 big, 3 zero, exact group
  probabilities [4] in float64)."""
  groups = np.full(T5_VOCAB, 3)
  groups[0], groups[1:16385:2], groups[2:16385:2] = 0, 1, 2
  exact = np.zeros(T5_VOCAB)
  exact[0], exact[groups == 1], exact[groups == 2] = 0.5, 2.0 ** -26, 2.0 ** -14 - 2.0 ** -26
  assert exact.sum() == 1.0 and np.all(exact.astype(np.float32) == exact)
  group_probs = np.array([exact[groups == g].sum() for g in range(4)])
  return exact.astype(np.float32), groups, group_probs


def _tail_pvalue(tokens, groups, group_probs):
  counts = np.bincount(groups[tokens], minlength=4)
  assert counts[3] == 0, f"{counts[3]} draws of zero-probability tokens"
  n = len(tokens)
  return stats.chisquare(counts[:3], group_probs[:3] * n / group_probs[:3].sum()).pvalue, counts


@pytest.mark.slow
def test_tiny_probabilities_are_drawn_at_their_rate_at_t5_vocabulary():
  probs, groups, group_probs = _tail_distribution()
  num_draws = 2_000_000  # expected: 244 draws of tiny tokens (standard deviation 15.6)
  pvalue, counts = _tail_pvalue(_draw(probs, num_draws, seed=0), groups, group_probs)
  assert pvalue > 1e-3, f"tail drawn at the wrong rate: counts {counts}, p = {pvalue:.2e}"
  # Teeth: a single fp32 cumsum over the vocabulary (the former sampler) misses the tail.
  old_pvalue, old_counts = _tail_pvalue(_single_cdf_draws(probs, num_draws, seed=0), groups,
                                        group_probs)
  assert old_pvalue < 1e-6, (old_counts, old_pvalue)


def test_draw_frequencies_match_a_spread_distribution_at_t5_vocabulary():
  """Softmax of random logits: a few hundred tokens carry most of the mass, spread over many
  blocks; a chi-square over every token expected >= 20 times (the rest pooled)."""
  logits = 4.0 * np.random.default_rng(0).standard_normal(T5_VOCAB)
  exact = np.exp(logits - logits.max())
  exact /= exact.sum()
  num_draws = 1_000_000
  tokens = _draw(exact.astype(np.float32), num_draws, seed=1)
  counts = np.bincount(tokens, minlength=T5_VOCAB).astype(np.float64)
  cells = exact * num_draws >= 20
  assert cells.sum() > 500
  observed = np.append(counts[cells], counts[~cells].sum())
  expected = np.append(exact[cells], exact[~cells].sum()) * num_draws
  assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_support_edges_and_padding():
  """Only positive entries are drawn, at the extreme uniforms too, and a vocabulary that is
  not a multiple of the block size never yields an index past its end."""
  vocab = 300  # 3 blocks of 128, the last one padded
  probs = np.zeros((5, vocab), np.float32)
  probs[0, [3, 200]] = [0.25, 0.75]
  probs[1, vocab - 1] = 2.0                   # unnormalised, the very last entry
  probs[2, [0, 127, 128, 299]] = 1.0          # block edges
  probs[3, 130] = 1e-30                       # a lone tiny entry
  probs[4, 5:260] = np.linspace(0.0, 1.0, 255, dtype=np.float32)  # zero at 5
  edge = np.float32(1.0) - np.finfo(np.float32).epsneg  # largest uniform below 1
  for u in [(0.0, 0.0), (edge, edge), (0.0, edge), (edge, 0.0), (0.5, 0.5), (0.3, 0.9)]:
    uniform = jnp.tile(jnp.asarray(u, jnp.float32), (5, 1))
    tokens = np.asarray(plain.sample_from_probabilities(jnp.asarray(probs), uniform))
    assert np.all(tokens < vocab)
    assert np.all(probs[np.arange(5), tokens] > 0), (u, tokens)
  # Inverse CDF: a uniform of 0 takes the last positive entry, one just below 1 the first.
  low = plain.sample_from_probabilities(jnp.asarray(probs), jnp.zeros((5, 2)))
  high = plain.sample_from_probabilities(jnp.asarray(probs), jnp.full((5, 2), edge))
  np.testing.assert_array_equal(low, [200, 299, 299, 130, 259])
  np.testing.assert_array_equal(high, [3, 299, 0, 130, 6])


@pytest.mark.slow
def test_sample_tokens_is_deterministic_given_its_uniforms():
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, T5_VOCAB))
  uniform = jax.random.uniform(jax.random.PRNGKey(1), (4, plain.UNIFORMS_PER_DRAW))
  a = plain.sample_tokens(logits, None, 1.0, uniform)
  b = plain.sample_tokens(logits, None, 1.0, uniform)
  np.testing.assert_array_equal(a, b)
  c = plain.sample_tokens(logits, jax.random.PRNGKey(2), 1.0)
  assert c.shape == (4,) and c.dtype == jnp.int32
