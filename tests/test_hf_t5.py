"""Our T5 on HF weights matches transformers; ours -> HF -> ours is exact; no unpickling."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import testing

from distillspec_jax.interop import hf_t5
from distillspec_jax.models.model import Model


TINY = testing.T5_TINY
TINY_DECODER_ONLY = TINY.replace(kind="decoder_only", num_encoder_layers=0)


def _random_hf_t5(seed=0):
  """A random tiny T5 1.1 in transformers, with lm_head explicitly untied from `shared`."""
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  transformers = pytest.importorskip("transformers",
                                     reason="transformers (extra 'reference') is not installed")
  torch.manual_seed(seed)
  config = transformers.T5Config(
      vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
      num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  model = transformers.T5ForConditionalGeneration(config).eval()
  # transformers 5 ties lm_head to `shared` regardless of the config: give it its own weights.
  model.lm_head.weight = torch.nn.Parameter(torch.randn(128, 64) * 0.3)
  with torch.no_grad():  # HF's init leaves small norms at 1: perturb so every weight matters.
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.add_(torch.randn_like(p) * 0.1)
  assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
  tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
  return torch, model, tensors


def _inputs():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 128, size=(2, 7)).astype(np.int32)
  enc[1, 5:] = 0  # right padding in the second row
  dec = rng.randint(2, 128, size=(2, 6)).astype(np.int32)
  dec[:, 0] = 0  # decoder start token
  return enc, dec


@pytest.mark.slow
def test_logits_match_transformers_teacher_forcing_and_cached():
  torch, hf_model, tensors = _random_hf_t5()
  config = hf_t5.config_from_hf(hf_model.config.to_dict(), dropout_rate=0.0,
                                max_decode_length=32)
  assert config.logits_via_embedding is False
  params = hf_t5.params_from_hf(tensors, config)
  model = Model(config)
  enc, dec = _inputs()
  with torch.no_grad():
    ref = hf_model(input_ids=torch.tensor(enc, dtype=torch.long),
                   attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                   decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
  ours = np.asarray(jax.jit(model.logits)(params, {"encoder_input_tokens": jnp.asarray(enc),
                                                   "decoder_input_tokens": jnp.asarray(dec)}))
  assert np.abs(ref).max() > 1e-2  # not a degenerate all-zero comparison
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)

  # Cached: one token at a time through `extend`, against HF with past_key_values.
  cache = model.init_cache(params, 2, 32, jnp.asarray(enc))
  extend = jax.jit(model.extend)  # one compilation for all steps (same shapes)
  past = None
  with torch.no_grad():
    encoder_out = hf_model.get_encoder()(input_ids=torch.tensor(enc, dtype=torch.long),
                                         attention_mask=torch.tensor(enc > 0, dtype=torch.long))
    for t in range(dec.shape[1]):
      step, cache = extend(params, cache, jnp.asarray(dec[:, t:t + 1]))
      out = hf_model(encoder_outputs=encoder_out,
                     attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                     decoder_input_ids=torch.tensor(dec[:, t:t + 1], dtype=torch.long),
                     cache=past, use_cache=True)
      past = out.past_key_values
      np.testing.assert_allclose(np.asarray(step[:, 0]), out.logits[:, 0].numpy(), atol=1e-4,
                                 rtol=1e-4)
      np.testing.assert_allclose(np.asarray(step[:, 0]), ref[:, t], atol=1e-4, rtol=1e-4)


def test_to_transformers_matches_our_logits():
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  pytest.importorskip("transformers", reason="transformers (extra 'reference') is not installed")
  model = Model(TINY)
  params = model.init(jax.random.PRNGKey(1))
  hf_model = hf_t5.to_transformers(params, TINY)
  enc, dec = _inputs()
  with torch.no_grad():
    ref = hf_model(input_ids=torch.tensor(enc, dtype=torch.long),
                   attention_mask=torch.tensor(enc > 0, dtype=torch.long),
                   decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
  ours = jax.jit(model.logits)(params, {"encoder_input_tokens": enc, "decoder_input_tokens": dec})
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=1e-4)


def test_decoder_only_matches_transformers_t5_decoder_with_silent_cross_attention():
  """No transformers class is our decoder-only LM, but T5's decoder with zero cross-attention
  output is: an independent check of our decoder-only logits."""
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  pytest.importorskip("transformers", reason="transformers (extra 'reference') is not installed")
  model = Model(TINY_DECODER_ONLY)
  params = model.init(jax.random.PRNGKey(4))
  ed_params, ed_config = hf_t5.decoder_only_as_encoder_decoder(params, TINY_DECODER_ONLY)
  hf_model = hf_t5.to_transformers(ed_params, ed_config)
  _, dec = _inputs()
  with torch.no_grad():
    ref = hf_model(input_ids=torch.ones((2, 3), dtype=torch.long),
                   decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
  ours = jax.jit(model.logits)(params, {"decoder_input_tokens": jnp.asarray(dec)})
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=1e-4)


def _assert_trees_identical(a, b):
  flat_a = dict(jax.tree_util.tree_flatten_with_path(a)[0])
  flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
  assert flat_a.keys() == flat_b.keys()
  for key, value in flat_a.items():
    other = np.asarray(flat_b[key])
    assert other.dtype == np.asarray(value).dtype, key
    np.testing.assert_array_equal(np.asarray(value), other, err_msg=str(key))


@pytest.mark.parametrize("config", [TINY, TINY_DECODER_ONLY], ids=["enc_dec", "decoder_only"])
def test_round_trip_ours_hf_ours_is_exact(tmp_path, config):
  params = Model(config).init(jax.random.PRNGKey(2))
  hf_t5.save_hf(params, config, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    saved = json.load(f)
  assert saved["tie_word_embeddings"] is False
  loaded, loaded_config = hf_t5.load_hf(str(tmp_path))
  assert loaded_config.replace(dropout_rate=config.dropout_rate) == config.replace(
      max_decode_length=loaded_config.max_decode_length)
  _assert_trees_identical(params, loaded)
  # In memory too (no file format in between).
  _assert_trees_identical(params, hf_t5.params_from_hf(hf_t5.params_to_hf(params, config),
                                                       config))


def test_shape_mismatch_is_refused_with_paths(tmp_path):
  params = Model(TINY).init(jax.random.PRNGKey(3))
  hf_t5.save_hf(params, TINY, str(tmp_path))
  wider = TINY.replace(mlp_dim=256)
  with pytest.raises(ValueError) as info:
    hf_t5.load_hf(str(tmp_path), wider)
  message = str(info.value)
  assert "mlp/wi_0/kernel: expected (64, 256), found (64, 128)" in message
  assert "mismatches" in message


def test_pickle_checkpoints_are_refused(tmp_path, monkeypatch):
  (tmp_path / "config.json").write_text(json.dumps(hf_t5.config_to_hf(TINY)))
  (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
  try:
    import torch
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
  except ImportError:
    pass
  with pytest.raises(ValueError, match="convert it to safetensors|Convert it to safetensors"):
    hf_t5.load_hf(str(tmp_path))
  with pytest.raises(ValueError, match="never unpickles"):
    hf_t5.load_hf(str(tmp_path / "pytorch_model.bin"), TINY)


def test_bfloat16_safetensors_load_widened_exactly(tmp_path):
  import ml_dtypes
  from safetensors.numpy import save_file
  params = Model(TINY).init(jax.random.PRNGKey(5))
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_t5.params_to_hf(params, TINY).items()}
  try:
    save_file(tensors, str(tmp_path / "model.safetensors"))
  except Exception:  # older safetensors numpy backends cannot write bf16: use the flax one
    from safetensors.flax import save_file as save_flax
    save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
  loaded = hf_t5.params_from_hf(hf_t5.read_hf_tensors(str(tmp_path / "model.safetensors")), TINY)
  want = np.asarray(params["decoder"]["logits_dense"]["kernel"]).astype(ml_dtypes.bfloat16)
  got = loaded["decoder"]["logits_dense"]["kernel"]
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want.astype(np.float32))


def test_relu_t5_is_refused():
  with pytest.raises(ValueError, match="gated-gelu"):
    hf_t5.config_from_hf({"model_type": "t5", "vocab_size": 8, "d_model": 4, "d_kv": 2,
                          "d_ff": 8, "num_heads": 2, "feed_forward_proj": "relu"})


def test_shapes_come_from_the_safetensors_header_only(tmp_path):
  """`read_hf_shapes` parses the header: it works with the tensor data cut off, and
  `shapes_from_hf` maps the names (and transposes) onto our tree."""
  params = Model(TINY).init(jax.random.PRNGKey(6))
  hf_t5.save_hf(params, TINY, str(tmp_path))
  file = tmp_path / hf_t5.SAFETENSORS_NAME
  full = file.read_bytes()
  header_end = 8 + int.from_bytes(full[:8], "little")
  file.write_bytes(full[:header_end])  # no tensor data left
  with pytest.raises(Exception):
    hf_t5.read_hf_tensors(str(tmp_path))
  shapes = hf_t5.shapes_from_hf(hf_t5.read_hf_shapes(str(tmp_path)), TINY)
  want = jax.tree_util.tree_flatten_with_path(Model(TINY).param_shapes())[0]
  got = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
  assert len(got) == len(want)
  for path, leaf in want:
    assert got[path].shape == leaf.shape, path
  # A third decoder layer: its 14 tensors are missing.
  with pytest.raises(ValueError, match=r"missing 14 tensors \[.decoder\.block\.2\."):
    hf_t5.shapes_from_hf(hf_t5.read_hf_shapes(str(tmp_path)),
                         TINY.replace(num_decoder_layers=3))
  (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 16)
  with pytest.raises(ValueError, match="header cannot be read"):
    hf_t5.read_hf_shapes(str(tmp_path / "garbage.safetensors"))
