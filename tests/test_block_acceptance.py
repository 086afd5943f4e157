"""Block-acceptance weights: the detached probability that a round reaches each position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.distill import block_acceptance


ALPHA = np.array([[0.9, 0.8, 0.5, 0.7, 0.6, 0.4],
                  [0.3, 0.9, 0.2, 0.5, 0.1, 0.6]], np.float32)
# Row 0: loss positions 0-4; row 1: a prompt (0, 1), loss positions 2, 3, a gap at 4, then 5.
MASK = np.array([[1, 1, 1, 1, 1, 0],
                 [0, 0, 1, 1, 0, 1]], np.float32)


@pytest.mark.parametrize("block_size, want", [
    # Blocks of 2 loss positions: row 0 {0, 1} {2, 3} {4}; row 1 {2, 3} {5}. Each weight is the
    # product of alpha over the earlier loss positions of its block; outside the mask, the
    # product so far (no loss there).
    (2, [[1, 0.9, 1, 0.5, 1, 0.6],
         [1, 1, 1, 0.2, 0.2 * 0.5, 1]]),
    # Blocks of 3: row 0 {0, 1, 2} {3, 4}; row 1 {2, 3, 5}: the gap at 4 neither starts nor
    # breaks the block.
    (3, [[1, 0.9, 0.9 * 0.8, 1, 0.7, 0.7 * 0.6],
         [1, 1, 1, 0.2, 0.2 * 0.5, 0.2 * 0.5]]),
    # One block per row: the cumulative product along the loss positions.
    (8, [[1, 0.9, 0.72, 0.72 * 0.5, 0.72 * 0.5 * 0.7, 0.72 * 0.5 * 0.7 * 0.6],
         [1, 1, 1, 0.2, 0.1, 0.1]]),
])
def test_weights_are_the_cumulative_products_within_each_block(block_size, want):
  got = block_acceptance.reach_weights(jnp.asarray(ALPHA), jnp.asarray(MASK), block_size)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_weights_carry_no_gradient_and_nan_propagates():
  grad = jax.grad(lambda a: jnp.sum(block_acceptance.reach_weights(a, MASK, 3)))(
      jnp.asarray(ALPHA))
  assert np.all(np.asarray(grad) == 0.0)
  nan = block_acceptance.reach_weights(jnp.asarray(ALPHA).at[0, 0].set(jnp.nan), MASK, 3)
  # The NaN reaches the rest of its block, not the next one.
  assert np.all(np.isnan(np.asarray(nan)[0, 1:3])) and np.all(np.isfinite(nan[0, 3:]))


@pytest.mark.parametrize("block_size, needle", [(0, "block_size=0"), (2.0, "block_size=2.0"),
                                                (True, "block_size=True")])
def test_bad_block_size_names_the_value(block_size, needle):
  with pytest.raises(ValueError, match=needle):
    block_acceptance.reach_weights(jnp.asarray(ALPHA), jnp.asarray(MASK), block_size)
