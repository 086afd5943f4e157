"""Model shapes, parameter names/axes, parameter counts and dtype configurability."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.models.config import MODEL_CONFIGS
from distillspec_jax.models.model import Model


ALLOWED_AXES = {"embed", "mlp", "heads", "kv", "joined_kv", "vocab", "relpos_buckets"}

# Published T5 1.1 sizes (T5X / HF model cards), with the 32128-token vocabulary.
PUBLISHED_PARAMS = {
    "t5_1_1_small": 77e6,
    "t5_1_1_base": 248e6,
    "t5_1_1_large": 783e6,
    "t5_1_1_xl": 2.85e9,
    "t5_1_1_xxl": 11.1e9,
}


@functools.lru_cache(maxsize=None)
def model_and_params(name, **overrides):
  model = Model.from_name(name, **overrides)
  return model, jax.jit(model.init)(jax.random.PRNGKey(0))


def batch_for(model, batch=2, input_len=7, target_len=6, seed=0):
  rng = np.random.default_rng(seed)
  v = model.config.vocab_size
  out = {"decoder_input_tokens": jnp.asarray(rng.integers(2, v, (batch, target_len)), jnp.int32)}
  if model.is_encoder_decoder:
    enc = rng.integers(2, v, (batch, input_len)).astype(np.int32)
    enc[1, 4:] = 0  # padding
    out["encoder_input_tokens"] = jnp.asarray(enc)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name,expected", sorted(PUBLISHED_PARAMS.items()))
def test_t5_1_1_parameter_counts(name, expected):
  model = Model.from_name(name)
  shapes = model.param_shapes()
  # eval_shape: abstract shapes only, nothing allocated (xxl would need 44 GB).
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))
  n = model.num_params()
  assert abs(n - expected) / expected < 0.03, f"{name}: {n:,} params, published {expected:,.0f}"


def test_t5x_parameter_names_and_shapes():
  """The tree T5X checkpoints map onto (t5x/examples/t5/network.py names, 2-D kernels)."""
  c = MODEL_CONFIGS["t5_1_1_small"]
  shapes = jax.tree.map(lambda x: x.shape, Model(c).param_shapes())
  assert shapes["token_embedder"]["embedding"] == (c.vocab_size, c.emb_dim)
  enc0 = shapes["encoder"]["layers_0"]
  assert enc0["attention"]["query"]["kernel"] == (c.emb_dim, c.num_heads * c.head_dim)
  assert enc0["attention"]["out"]["kernel"] == (c.num_heads * c.head_dim, c.emb_dim)
  assert enc0["mlp"]["wi_0"]["kernel"] == (c.emb_dim, c.mlp_dim)
  assert enc0["mlp"]["wo"]["kernel"] == (c.mlp_dim, c.emb_dim)
  assert enc0["pre_attention_layer_norm"]["scale"] == (c.emb_dim,)
  assert shapes["encoder"]["relpos_bias"]["rel_embedding"] == (c.num_heads, 32)
  dec = shapes["decoder"]
  assert set(dec["layers_0"]) == {
      "pre_self_attention_layer_norm", "self_attention", "pre_cross_attention_layer_norm",
      "encoder_decoder_attention", "pre_mlp_layer_norm", "mlp"}
  assert dec["logits_dense"]["kernel"] == (c.emb_dim, c.vocab_size)
  assert f"layers_{c.num_decoder_layers - 1}" in dec and f"layers_{c.num_decoder_layers}" not in dec
  assert "decoder_norm" in dec and "encoder_norm" in shapes["encoder"]
  # Decoder-only: same decoder, no encoder, no cross-attention.
  only = Model.from_name("tiny_decoder_only").param_shapes()
  assert set(only) == {"token_embedder", "decoder"}
  assert "encoder_decoder_attention" not in only["decoder"]["layers_0"]
  # Tied logits drop logits_dense.
  tied = Model.from_name("tiny_decoder_only", logits_via_embedding=True).param_shapes()
  assert "logits_dense" not in tied["decoder"]


@pytest.mark.parametrize("name,overrides", [
    ("tiny_encoder_decoder", {}),
    ("tiny_decoder_only", {}),
    ("tiny_decoder_only", {"logits_via_embedding": True}),
    ("t5_1_1_small", {}),
    ("decoder_only_33m", {}),
])
def test_every_parameter_has_logical_axes(name, overrides):
  model = Model.from_name(name, **overrides)
  shapes = model.param_shapes()
  axes = model.logical_axes()
  shape_leaves, shape_tree = jax.tree.flatten_with_path(shapes)[0], jax.tree.structure(shapes)
  axes_leaves = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert jax.tree.structure(
      axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == shape_tree
  assert len(axes_leaves) == len(shape_leaves) > 0
  for (path, shape), spec in zip(shape_leaves, axes_leaves):
    where = jax.tree_util.keystr(path)
    assert isinstance(spec, jax.sharding.PartitionSpec), f"{where}: no logical axes ({spec!r})"
    assert len(spec) == len(shape.shape), f"{where}: axes {spec} for shape {shape.shape}"
    for name_ in spec:
      assert name_ in ALLOWED_AXES, f"{where}: axis {name_!r} not in {sorted(ALLOWED_AXES)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_encoder_decoder", "tiny_decoder_only"])
def test_logits_shape_dtype_and_determinism(name):
  model, params = model_and_params(name)
  batch = batch_for(model)
  fn = jax.jit(model.logits)
  logits = fn(params, batch)
  assert logits.shape == (2, 6, model.config.vocab_size) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  np.testing.assert_array_equal(logits, fn(params, batch))


def test_dropout_only_with_rng():
  """dropout_rng=None is deterministic; a key turns dropout on, reproducibly."""
  model, params = model_and_params("tiny_decoder_only")
  model = Model(model.config.replace(dropout_rate=0.3))
  batch = batch_for(model)
  fn = jax.jit(model.logits)
  plain = model_and_params("tiny_decoder_only")[0]
  np.testing.assert_allclose(fn(params, batch), jax.jit(plain.logits)(params, batch), atol=1e-6)
  a = fn(params, batch, dropout_rng=jax.random.PRNGKey(1))
  b = fn(params, batch, dropout_rng=jax.random.PRNGKey(1))
  c = fn(params, batch, dropout_rng=jax.random.PRNGKey(2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, fn(params, batch))
  assert not np.allclose(a, c)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_encoder_decoder", "tiny_decoder_only"])
def test_bfloat16_activations(name):
  """dtype is configurable: bf16 activations run, stay close to fp32, and really are bf16."""
  model32, params = model_and_params(name)
  model16 = Model(model32.config.replace(dtype="bfloat16"))
  batch = batch_for(model32)
  ref = np.asarray(jax.jit(model32.logits)(params, batch))
  out = jax.jit(model16.logits)(params, batch)  # same fp32 parameters
  assert out.dtype == jnp.float32  # logits are returned in fp32 for the losses
  out = np.asarray(out)
  assert np.all(np.isfinite(out))
  rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert rel < 5e-2, f"bf16 logits differ from fp32 by {rel:.3g} (relative L2)"
  assert rel > 1e-6, "bf16 logits equal fp32 logits: dtype was not applied"
  assert np.mean(out.argmax(-1) == ref.argmax(-1)) > 0.8
  # The decoding cache is stored in the activation dtype, and cached scoring runs in bf16.
  enc = batch.get("encoder_input_tokens")
  cache = model16.init_cache(params, 2, 8, enc)
  assert cache.self_attention[0][0].dtype == jnp.bfloat16
  step, _ = jax.jit(model16.extend)(params, cache, batch["decoder_input_tokens"])
  rel = np.linalg.norm(np.asarray(step) - ref) / np.linalg.norm(ref)
  assert rel < 5e-2


def test_params_are_fp32_and_init_is_seeded():
  model, params = model_and_params("tiny_decoder_only")
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  init = jax.jit(model.init)
  again, other = init(jax.random.PRNGKey(0)), init(jax.random.PRNGKey(1))
  leaf = lambda p: np.asarray(p["decoder"]["logits_dense"]["kernel"])
  np.testing.assert_array_equal(leaf(params), leaf(again))
  assert not np.allclose(leaf(params), leaf(other))
  assert model.num_params() == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_table_matches_t5_bucketing(bidirectional):
  """The clipped lookup table gives T5's bucket for every (query, key) pair, far beyond
  max_distance too, so decoding at any cache position sees the same bias as the formula."""
  from distillspec_jax.models import layers
  num_buckets, max_distance, heads = 32, 20, 3
  module = layers.RelativePositionBiases(num_buckets, max_distance, heads, bidirectional)
  query = jnp.array([[0, 7, 45, 300], [1, 2, 3, 250]])
  key = jnp.array([[0, 3, 19, 20, 21, 44, 90, 299, 350, 600],
                   [5, 6, 7, 0, 1, 2, 230, 260, 270, 290]])
  params = module.init(jax.random.PRNGKey(0), query, key)
  bias = module.apply(params, query, key)
  relative = key[:, None, :] - query[:, :, None]
  buckets = layers.relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
  table = nn.unbox(params)["params"]["rel_embedding"]
  expected = jnp.transpose(table[:, buckets], (1, 0, 2, 3))
  assert bias.shape == (2, heads, 4, 10)
  np.testing.assert_array_equal(np.asarray(bias), np.asarray(expected))
  # The pairs reach past +-max_distance, where clipping must land in the last bucket.
  assert int(jnp.max(jnp.abs(relative))) > 10 * max_distance


@pytest.mark.slow
@pytest.mark.parametrize("features, num_input_axes", [((6,), 1), ((2, 3), 1), ((5,), 2)])
def test_dense_general_is_the_contraction_of_its_stored_kernel(features, num_input_axes):
  # DenseGeneral runs one flattened [rows, in] x [in, out] matmul (its backward pass is about
  # 2x faster on CPU than a dot over several batch axes): values and gradients must equal the
  # contraction of x's last axes with the 2-D kernel read as [*input dims, *features].
  from distillspec_jax.models.layers import DenseGeneral
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4) if num_input_axes == 1 else (2, 3, 2, 2))
  layer = DenseGeneral(features, ("embed", "mlp"), num_input_axes=num_input_axes)
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x)["params"])
  kernel = params["kernel"]
  input_dims = x.shape[x.ndim - num_input_axes:]
  assert kernel.shape == (int(np.prod(input_dims)), int(np.prod(features)))

  def reference(kernel, x):
    full = kernel.reshape(input_dims + features)
    return jnp.tensordot(x, full, axes=num_input_axes)

  out = layer.apply({"params": params}, x)
  assert out.shape == x.shape[:x.ndim - num_input_axes] + features
  np.testing.assert_allclose(out, reference(kernel, x), rtol=1e-5, atol=1e-6)
  loss = lambda k, x: jnp.sum(jnp.sin(layer.apply({"params": {"kernel": k}}, x)))
  ref_loss = lambda k, x: jnp.sum(jnp.sin(reference(k, x)))
  for got, want in zip(jax.grad(loss, (0, 1))(kernel, x), jax.grad(ref_loss, (0, 1))(kernel, x)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
