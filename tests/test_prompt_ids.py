"""Prompt ids outside the vocabulary are refused where prompts enter decoding."""

import jax
import numpy as np
import pytest

from distillspec_jax.decoding.plain import decode, prompt_inputs
from distillspec_jax.models.model import Model
from distillspec_jax.decoding.speculative import speculative_decode


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
@pytest.mark.parametrize("decoder", ["plain", "speculative"])
def test_prompt_ids_outside_the_vocabulary_are_refused(kind, decoder):
  model = Model.from_name(f"tiny_{kind}", max_decode_length=32)
  params = model.init(jax.random.PRNGKey(0))
  prompts = np.random.default_rng(0).integers(3, 512, size=(2, 5)).astype(np.int32)
  prompts[1, 2] = model.config.vocab_size + 7  # id 519 in a 512-entry vocabulary
  with pytest.raises(ValueError, match="519.*vocab|vocab.*519"):
    if decoder == "plain":
      decode(model, params, max_new_tokens=4, **prompt_inputs(model, prompts))
    else:
      speculative_decode(model, params, model, params, max_new_tokens=4, gamma=2,
                         **prompt_inputs(model, prompts))
  prompts[1, 2] = -1
  with pytest.raises(ValueError, match="-1"):
    decode(model, params, max_new_tokens=4, **prompt_inputs(model, prompts))
