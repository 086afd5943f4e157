"""The llama kind (RoPE, grouped-query attention, SwiGLU, RMSNorm): config checks, published
shapes, the per-row cache, sharding of key/value heads, the speculative engine's exactness
checks and a few distillation steps on a Llama pair."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from distillspec_jax.decoding.plain import SamplingConfig, decode
from distillspec_jax.decoding.speculative import Lenience, speculative_decode
from distillspec_jax.distill import objectives
from distillspec_jax.models.config import TransformerConfig, model_config
from distillspec_jax.models.llama import rope_inverse_frequencies
from distillspec_jax.models.model import Model
from distillspec_jax.training import partitioning
from distillspec_jax.training import trainer as trainer_lib
from test_speculative import _exact_sequence_distribution, _goodness_of_fit_pvalue


def _llama(**fields):
  base = dict(kind="llama", vocab_size=97, emb_dim=32, num_heads=4, num_kv_heads=2,
              num_encoder_layers=0, num_decoder_layers=2, head_dim=8, mlp_dim=64,
              dropout_rate=0.0, max_decode_length=64)
  return TransformerConfig(**dict(base, **fields))


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,error,needle", [
    (dict(num_kv_heads=3), ValueError, "num_kv_heads=3 must be >= 1 and divide num_heads=4"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads=0"),
    (dict(head_dim=7), ValueError, "head_dim=7 is odd, but RoPE rotates pairs"),
    (dict(rope_scaling="yarn"), ValueError, "rope_scaling='yarn' is not implemented"),
    (dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
     ValueError, "rope_low_freq_factor=4.0"),
    (dict(rope_theta=0.0), ValueError, "rope_theta=0.0 must be > 0"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads=True"),
    (dict(rope_theta="1e4"), TypeError, "rope_theta='1e4'"),
    (dict(use_qkv_bias=1), TypeError, "use_qkv_bias=1"),
])
def test_bad_llama_fields_name_the_value(fields, error, needle):
  with pytest.raises(error, match=needle):
    _llama(**fields)


def test_t5_kinds_refuse_llama_fields():
  with pytest.raises(ValueError, match=r"num_kv_heads=2 applies to the RoPE kinds "
                                       r"\('llama', 'qwen3', 'gemma3'\) only"):
    model_config("tiny_decoder_only", num_kv_heads=2)
  with pytest.raises(ValueError, match="rope_theta=500.0, use_qkv_bias=True applies to"):
    model_config("tiny_encoder_decoder", rope_theta=500.0, use_qkv_bias=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,published", [("llama_3_2_1b", 1.24e9), ("llama_3_2_3b", 3.21e9),
                                            ("qwen2_5_0_5b", 0.49e9)])
def test_published_shapes_have_the_published_parameter_counts(name, published):
  model = Model.from_name(name)
  count = model.num_params()  # jax.eval_shape: nothing allocated
  assert abs(count - published) / published < 0.01, (name, count)
  # Every parameter carries a logical axis name per dimension, each one a rule maps.
  ruled = {rule for rule, _ in partitioning.LOGICAL_AXIS_RULES}
  specs = jax.tree.leaves(model.logical_axes(), is_leaf=lambda x: isinstance(x, PartitionSpec))
  shapes = jax.tree.leaves(model.param_shapes())
  assert len(specs) == len(shapes)
  for spec, shape in zip(specs, shapes):
    assert len(spec) == len(shape.shape) and all(n in ruled for n in spec), (spec, shape)


def test_llama3_rope_scaling_keeps_high_stretches_low_frequencies():
  plain = rope_inverse_frequencies(_llama(head_dim=16, rope_theta=500.0))
  scaled = rope_inverse_frequencies(_llama(head_dim=16, rope_theta=500.0,
                                           rope_scaling="llama3", rope_scaling_factor=4.0,
                                           rope_original_max_length=64))
  wavelength = 2 * np.pi / plain
  np.testing.assert_allclose(scaled[wavelength < 16], plain[wavelength < 16])
  np.testing.assert_allclose(scaled[wavelength > 64], plain[wavelength > 64] / 4.0)
  middle = (wavelength >= 16) & (wavelength <= 64)
  assert middle.any() and np.all((scaled[middle] < plain[middle])
                                 & (scaled[middle] > plain[middle] / 4.0))
  linear = rope_inverse_frequencies(_llama(rope_scaling="linear", rope_scaling_factor=2.0))
  np.testing.assert_allclose(linear, rope_inverse_frequencies(_llama()) / 2.0)


# --- the network and its cache ---------------------------------------------------------------


@pytest.mark.slow
def test_grouped_query_attention_equals_full_attention_with_shared_heads():
  """kv_heads = 2 of 4: query head h reads key/value head h // 2, i.e. the same model with 4
  key/value heads whose heads 2k and 2k + 1 are copies of head k."""
  grouped = Model(_llama())
  full = Model(_llama(num_kv_heads=None))
  params = grouped.init(jax.random.PRNGKey(0))
  copied = jax.tree.map(lambda x: x, params)
  for i in range(2):
    attention = copied["decoder"][f"layers_{i}"]["self_attention"]
    for name in ("key", "value"):
      attention[name]["kernel"] = jnp.repeat(attention[name]["kernel"], 2, axis=1)
  tokens = jnp.asarray(np.random.RandomState(0).randint(2, 97, (2, 7)))
  # Compiled (called eagerly, each operation compiles on its own, here and below).
  np.testing.assert_allclose(jax.jit(grouped.logits)(params, {"decoder_input_tokens": tokens}),
                             jax.jit(full.logits)(copied, {"decoder_input_tokens": tokens}),
                             atol=1e-5, rtol=1e-5)


def test_cache_rows_of_different_lengths_and_rollback_are_exact():
  model = Model(_llama(use_qkv_bias=True, logits_via_embedding=True, rope_scaling="llama3",
                       rope_scaling_factor=4.0, rope_original_max_length=8))
  params = model.init(jax.random.PRNGKey(1))
  rng = np.random.RandomState(2)
  full = rng.randint(2, 97, (3, 12)).astype(np.int32)
  full[:, 0] = 0
  lengths = np.array([5, 2, 8])
  reference = np.asarray(jax.jit(model.logits)(params,
                                               {"decoder_input_tokens": jnp.asarray(full)}))
  cache = model.init_cache(params, 3, 16)
  prompt = np.where(np.arange(8)[None] < lengths[:, None], full[:, :8], 0)
  last, cache = jax.jit(model.prefill)(params, cache, jnp.asarray(prompt), jnp.asarray(lengths))
  np.testing.assert_allclose(last, reference[np.arange(3), lengths - 1], atol=1e-5)
  # Three wrong tokens per row, scored, then rolled back and replaced by the right ones.
  extend = jax.jit(model.extend)
  _, cache = extend(params, cache, jnp.full((3, 3), 7, jnp.int32))
  cache = cache.rollback(jnp.array([3, 3, 3]))
  rows = np.arange(3)[:, None]
  right = full[rows, lengths[:, None] + np.arange(3)[None]]
  logits, cache = extend(params, cache, jnp.asarray(right))
  np.testing.assert_allclose(logits, reference[rows, lengths[:, None] + np.arange(3)[None]],
                             atol=1e-5)
  np.testing.assert_array_equal(cache.positions, lengths + 3)
  assert cache.self_attention[0][0].shape == (3 * 2, 8, 16)  # [batch * kv_heads, head_dim, len]


@pytest.mark.slow
def test_remat_policies_keep_logits_and_gradients():
  tokens = jnp.asarray(np.random.RandomState(3).randint(2, 97, (2, 6)))
  base = Model(_llama())
  params = base.init(jax.random.PRNGKey(4))

  def loss(model, p):
    return jnp.mean(jax.nn.log_softmax(model.logits(p, {"decoder_input_tokens": tokens}))[..., 3])

  want = jax.jit(jax.grad(lambda p: loss(base, p)))(params)
  for policy in ("minimal", "full"):
    model = Model(_llama(remat_policy=policy))
    got = jax.jit(jax.grad(lambda p: loss(model, p)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got, want)


def test_kv_heads_are_replicated_when_the_model_axis_does_not_divide_them():
  model = Model.from_name("llama_3_2_1b")  # 32 query heads, 8 key/value heads
  logical = model.logical_axes()["decoder"]["layers_0"]["self_attention"]
  shapes = model.param_shapes()["decoder"]["layers_0"]["self_attention"]
  for model_axis, kv_split in ((4, "model"), (8, "model"), (16, None)):
    mesh = AbstractMesh((1, model_axis), partitioning.MESH_AXES)
    key = partitioning.logical_to_mesh_spec(logical["key"]["kernel"],
                                            shapes["key"]["kernel"].shape, mesh)
    query = partitioning.logical_to_mesh_spec(logical["query"]["kernel"],
                                              shapes["query"]["kernel"].shape, mesh)
    assert tuple(key) == (None, kv_split, None), (model_axis, key)
    assert tuple(query) == (None, "model", None)


# --- the speculative engine ----------------------------------------------------------------------


def _pair():
  target = Model(_llama(max_decode_length=48))
  draft = Model(_llama(num_decoder_layers=1, num_kv_heads=1, max_decode_length=48))
  return target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1))


@pytest.mark.slow
def test_greedy_speculative_equals_greedy_target_for_rows_of_different_lengths():
  target, tp, draft, dp = _pair()
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(7), (4, 6), 2, 97))
  tokens[1, 3:] = 0
  tokens[2, 1:] = 0
  prompts = {"prompt_tokens": jnp.asarray(tokens)}
  reference = decode(target, tp, max_new_tokens=16, **prompts)
  for gamma in (1, 4):
    result = speculative_decode(target, tp, draft, dp, max_new_tokens=16, gamma=gamma,
                                **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    np.testing.assert_array_equal(result.lengths, reference.lengths)
  assert 0.0 <= float(result.acceptance_rate) < 1.0  # a different draft: some rejections


@pytest.mark.slow
def test_sampled_speculative_matches_the_target_distribution():
  """χ² test of whole sampled sequences (3 tokens, vocabulary 5) against the exact target
  probabilities; lossy acceptance (epsilon 0.5) on the same models fails it."""
  config = _llama(vocab_size=5, emb_dim=16, num_heads=2, num_kv_heads=1, head_dim=8,
                  mlp_dim=32, num_decoder_layers=1, max_decode_length=16)
  model = Model(config)

  def peaked(seed):
    params = model.init(jax.random.PRNGKey(seed))
    params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * 3
    return params

  tp, dp = peaked(0), peaked(1)
  expected = _exact_sequence_distribution(model, tp, 3, eos=1)
  draft_expected = _exact_sequence_distribution(model, dp, 3, eos=1)
  assert 0.5 * sum(abs(expected[k] - draft_expected.get(k, 0.0)) for k in expected) > 0.1

  def sample(lenience):
    result = speculative_decode(model, tp, model, dp,
                                prompt_tokens=jnp.zeros((20000, 1), jnp.int32),
                                max_new_tokens=3, gamma=2, sampling=SamplingConfig(1.0, eos_id=1),
                                lenience=lenience, rng=jax.random.PRNGKey(11))
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    return [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]

  assert _goodness_of_fit_pvalue(sample(Lenience("lin", 1.0)), expected) > 1e-3
  assert _goodness_of_fit_pvalue(sample(Lenience("lin", 0.5)), expected) < 1e-6


# --- training -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_distillation_steps_on_a_llama_pair(tmp_path):
  """On-policy GKD (draft samples) with AdaSPEC selection on a Llama pair: finite losses, every
  draft parameter moves."""
  target, tp, draft, _ = _pair()
  config = trainer_lib.TrainConfig(model_dir=str(tmp_path), train_steps=3, batch_size=4,
                         optimizer="adamw", learning_rate=3e-3, warmup_steps=0,
                         decay_steps=10, save_every=3, log_every=1, progress_bar=False)
  data = trainer_lib.SyntheticData(4, input_length=4, target_length=6, vocab_size=97, decoder_only=True)
  result = trainer_lib.distill(config, target, tp, draft, data,
                     objectives.DistillationConfig(lambda1=0.0, lambda2=1.0, top_k_fraction=0.5,
                                          max_new_tokens=6),
                     reference=draft, reference_params=draft.init(jax.random.PRNGKey(5)))
  losses = [r["loss"] for r in result.history if "loss" in r]
  assert len(losses) == 3 and np.all(np.isfinite(losses))
  assert all(r["source_total/draft"] == r["step"] for r in result.history if "loss" in r)
  init = draft.init(jax.random.split(jax.random.PRNGKey(0))[0])  # the trainer's init key
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       result.state.params, init)
  assert min(jax.tree.leaves(moved)) > 0.0


# --- run files -----------------------------------------------------------------------------------


def test_llama_run_files_build_llama_pairs():
  import gin
  from distillspec_jax import gin_utils
  from distillspec_jax import main
  from distillspec_jax import train
  gin.clear_config()
  try:
    config = main.load_pipeline(["--gin_file=gin/runs/llama_gsm8k.gin",
                                 "--gin.MODEL_DIR=/tmp/unused"])
    assert (config.target_model, config.draft_model) == ("llama_demo_target", "llama_demo_draft")
    assert config.feature_converter == "decoder"
    gin.clear_config()
    train.register_configurables()
    gin_utils.parse_gin(["gin/runs/distill_llama_demo.gin"],
                        ["MODEL_DIR = '/tmp/unused'", "TRAIN_STEPS = 1"])
    spec = train.resolve()
    assert spec.model.config.kind == spec.target.config.kind == "llama"
    assert spec.target.config.kv_heads < spec.target.config.num_heads
  finally:
    gin.clear_config()
