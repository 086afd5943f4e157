"""Draft heads (models/head.py): the target's hidden states, the head's layer on every kind,
the training-time test's unroll against cached drafting, logical axes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.head import Head, HeadConfig, default_feature_layers
from distillspec_jax.models.model import Model


KINDS = ("encoder_decoder", "decoder_only", "llama")


def tiny_target(kind, vocab=97, layers=2):
  common = dict(kind=kind, vocab_size=vocab, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                dropout_rate=0.0, max_decode_length=64, num_decoder_layers=layers)
  if kind == "llama":
    common.update(num_kv_heads=1, norm_epsilon=1e-5)
  return Model(TransformerConfig(num_encoder_layers=1 if kind == "encoder_decoder" else 0,
                                 **common))


def _batch(kind, length=6, seed=2):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, length + 1), 2, 97)
  batch = {"decoder_input_tokens": tokens[:, :-1]}
  if kind == "encoder_decoder":
    batch["encoder_input_tokens"] = tokens[:, :4]
  return batch, tokens[:, 1:]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_leave_default_outputs_and_match_layers(kind):
  target = tiny_target(kind)
  params = target.init(jax.random.PRNGKey(0))
  batch, _ = _batch(kind)
  # Compiled programs (called eagerly, each operation compiles on its own for every kind).
  logits, hidden, encoded = jax.jit(target.layer_features, static_argnums=2)(params, batch,
                                                                             (0, 2))
  np.testing.assert_array_equal(logits, jax.jit(target.logits)(params, batch))
  assert hidden.shape == (2, 6, 64) and (encoded is None) == (kind != "encoder_decoder")
  # Index 0 is the embedding output: the embedding rows of the input tokens.
  np.testing.assert_allclose(hidden[..., :32], params["token_embedder"]["embedding"][
      batch["decoder_input_tokens"]], rtol=1e-6)
  # Incremental scoring returns the same features, and no third output by default.
  cache = target.init_cache(params, 2, 16, batch.get("encoder_input_tokens"))
  extend = jax.jit(target.extend, static_argnums=3)
  out = extend(params, cache, batch["decoder_input_tokens"])
  assert len(out) == 2
  _, _, step_hidden = extend(params, cache, batch["decoder_input_tokens"], (0, 2))
  np.testing.assert_allclose(step_hidden, hidden, atol=1e-5)


def test_default_feature_layers_are_low_middle_high():
  assert default_feature_layers(32) == (2, 16, 29)
  assert default_feature_layers(2) == (0, 1, 2)  # a shallow target: what it has
  assert default_feature_layers(1) == (0, 1)
  assert default_feature_layers(5) == (1, 3, 5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_unrolled_training_steps_equal_cached_drafting(kind):
  """Step j of the training-time test at position t is what drafting computes: target
  features at positions <= t in the cache, then the head's own outputs."""
  target = tiny_target(kind)
  params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, mlp_dim=48))
  head_params = head.init(jax.random.PRNGKey(1), params)
  batch, next_tokens = _batch(kind)
  # Compiled programs (called eagerly, each operation compiles on its own for every kind).
  _, features, encoded = jax.jit(target.layer_features, static_argnums=2)(
      params, batch, head.feature_layers)
  mask = None if encoded is None else batch["encoder_input_tokens"] > 0
  unrolled = jax.jit(head.unroll, static_argnums=3)(head_params, next_tokens, features, 3,
                                                    encoded, mask)
  assert unrolled.shape == (3, 2, 6, 97)
  cache = head.init_cache(head_params, 2, 16, encoded, mask)
  extend = jax.jit(head.extend, static_argnames="from_target")
  logits, out, cache = extend(head_params, cache, next_tokens[:, :3], features[:, :3],
                              from_target=True)
  np.testing.assert_allclose(logits, unrolled[0, :, :3], atol=1e-4)
  own = out[:, 2:3]
  for step in (1, 2):
    logits, own, cache = extend(head_params, cache, next_tokens[:, 2 + step:3 + step], own,
                                from_target=False)
    np.testing.assert_allclose(logits[:, 0], unrolled[step, :, 2], atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_every_head_parameter_has_logical_axes(kind):
  head = Head(HeadConfig(tiny_target(kind).config, mlp_dim=40))
  shapes, axes = head.param_shapes(), head.logical_axes()
  flat_shapes = jax.tree.leaves(shapes)
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert len(flat_shapes) == len(flat_axes)
  for shape, spec in zip(flat_shapes, flat_axes):
    assert len(spec) == len(shape.shape) and all(name is not None for name in spec)
  # The head's MLP width is its own, apart from the target's 64.
  assert shapes["layer"]["mlp"]["wo"]["kernel"].shape[0] == 40
  assert shapes["fc"]["kernel"].shape == (3 * 32, 32)


def test_reduced_draft_vocabulary_maps_to_target_ids():
  target = tiny_target("decoder_only")
  ids = (5, 3, 40, 96, 2)
  head = Head(HeadConfig(target.config, draft_ids=ids))
  assert head.param_shapes()["lm_head"]["kernel"].shape == (32, 5)
  draft = jnp.arange(10.0).reshape(2, 5)
  full = head.to_target_logits(draft)
  assert full.shape == (2, 97)
  np.testing.assert_array_equal(full[:, list(ids)], draft)
  assert float(jnp.max(jax.nn.softmax(full)[:, [0, 1, 4]])) == 0.0
  np.testing.assert_array_equal(head.to_draft_logits(full), draft)


def test_bad_head_input_names_the_value():
  config = tiny_target("llama").config
  with pytest.raises(ValueError, match="feature layer index 3 is outside the target"):
    HeadConfig(config, feature_layers=(0, 3))
  with pytest.raises(ValueError, match="emb_dim=48 does not match the target's emb_dim=32"):
    HeadConfig(config, emb_dim=48)
  with pytest.raises(ValueError, match=r"draft_ids\[1\]=97 is not a target token id"):
    HeadConfig(config, draft_ids=(4, 97))
  with pytest.raises(ValueError, match="several draft ids to target id 4"):
    HeadConfig(config, draft_ids=(4, 5, 4))
  with pytest.raises(ValueError, match="mlp_dim"):
    HeadConfig(config, mlp_dim=0)
  head = Head(HeadConfig(config))
  with pytest.raises(ValueError, match="unroll steps=0 must be an integer >= 1"):
    head.unroll(None, jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2, 96)), 0)
  wider = Model(config.replace(emb_dim=48))
  with pytest.raises(ValueError, match="head's width 32 does not match the target's emb_dim=48"):
    head.check_target(wider)
  shallow = Model(config.replace(num_decoder_layers=1))
  with pytest.raises(ValueError, match="feature layer index 2 is outside the target"):
    head.check_target(shallow)
