"""Presets and configuration errors: bad input fails early with a message that says how to fix it."""

import dataclasses

import pytest

from distillspec_jax.models.config import (MODEL_CONFIGS, TransformerConfig, check_same_vocabulary,
                                    model_config)

# Published T5 1.1 shapes: (d_model, heads, layers, d_ff); head_dim 64, vocab 32128.
T5_1_1_SHAPES = {
    "t5_1_1_small": (512, 6, 8, 1024),
    "t5_1_1_base": (768, 12, 12, 2048),
    "t5_1_1_large": (1024, 16, 24, 2816),
    "t5_1_1_xl": (2048, 32, 24, 5120),
    "t5_1_1_xxl": (4096, 64, 24, 10240),
}


@pytest.mark.parametrize("name", sorted(T5_1_1_SHAPES))
def test_t5_1_1_presets(name):
  c = model_config(name)
  emb, heads, layers, mlp = T5_1_1_SHAPES[name]
  assert (c.kind, c.vocab_size, c.head_dim) == ("encoder_decoder", 32128, 64)
  assert (c.emb_dim, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.mlp_dim) == (
      emb, heads, layers, layers, mlp)
  assert not c.logits_via_embedding and c.dtype == "float32"


def test_every_preset_is_valid_and_hashable():
  for name, c in MODEL_CONFIGS.items():
    assert model_config(name) is c
    hash(c)  # configs are static jit arguments
  # Small vocabularies: a tiny model with a 32k vocabulary spends its time in the logits layer.
  for name in ("tiny_encoder_decoder", "tiny_decoder_only", "smoke_target", "demo_target",
               "demo_draft"):
    assert MODEL_CONFIGS[name].dropout_rate == 0.0 and MODEL_CONFIGS[name].vocab_size <= 512
  check_same_vocabulary(MODEL_CONFIGS["demo_target"], MODEL_CONFIGS["demo_draft"])


def test_overrides_and_replace():
  c = model_config("tiny_encoder_decoder", dtype="bfloat16", dropout_rate=0.1)
  assert c.dtype == "bfloat16" and c.dropout_rate == 0.1
  assert MODEL_CONFIGS["tiny_encoder_decoder"].dtype == "float32"  # presets are not mutated
  assert c.replace(dtype="float32").activation_dtype.name == "float32"
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.dtype = "float32"  # type: ignore[misc]


def test_unknown_model_name_suggests_close_match():
  with pytest.raises(ValueError) as info:
    model_config("t5_1_1_smal")
  message = str(info.value)
  assert "'t5_1_1_smal'" in message  # names the bad value
  assert "Did you mean" in message and "'t5_1_1_small'" in message  # and the fix
  assert "Known models" in message and "tiny_decoder_only" in message


def test_unknown_model_name_without_close_match_lists_known_models():
  with pytest.raises(ValueError, match="Known models") as info:
    model_config("gpt5")
  assert "Did you mean" not in str(info.value)


def test_different_vocabularies_are_rejected():
  target = model_config("t5_1_1_base")
  draft = model_config("tiny_decoder_only")
  with pytest.raises(ValueError) as info:
    check_same_vocabulary(target, draft)
  message = str(info.value)
  assert "vocab_size=512" in message and "vocab_size=32128" in message  # both values
  assert "draft" in message and "target" in message
  assert "same vocab_size" in message  # how to fix it
  check_same_vocabulary(target, model_config("t5_1_1_small"))  # same vocabulary: fine


@pytest.mark.parametrize("changes,needle", [
    ({"kind": "encoder_only"}, "kind='encoder_only'"),
    ({"dtype": "float8"}, "dtype='float8'"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"num_heads": -1}, "num_heads=-1"),
    ({"dropout_rate": 1.0}, "dropout_rate=1.0"),
    ({"num_encoder_layers": 0}, "kind='decoder_only'"),
])
def test_invalid_config_values(changes, needle):
  with pytest.raises(ValueError) as info:
    TransformerConfig(**{**dataclasses.asdict(MODEL_CONFIGS["tiny_encoder_decoder"]), **changes})
  assert needle in str(info.value)
  with pytest.raises(ValueError):
    MODEL_CONFIGS["tiny_encoder_decoder"].replace(**changes)  # replace validates too


@pytest.mark.parametrize("changes,needle", [
    ({"dropout_rate": "0.1"}, "dropout_rate='0.1' is of type str"),  # a quoted gin number
    ({"vocab_size": "64"}, "vocab_size='64' is of type str"),       # int("64") took it before
    ({"num_heads": True}, "num_heads=True is of type bool"),
    ({"emb_dim": 64.0}, "emb_dim=64.0 is of type float"),
])
def test_config_values_of_the_wrong_type_are_refused_not_coerced(changes, needle):
  with pytest.raises(TypeError, match=needle):
    MODEL_CONFIGS["tiny_encoder_decoder"].replace(**changes)


def test_decoder_only_needs_no_encoder_layers():
  c = model_config("tiny_decoder_only")
  assert c.kind == "decoder_only" and c.num_encoder_layers == 0


def test_encoder_mlp_dim_defaults_to_mlp_dim_and_is_validated():
  c = model_config("tiny_encoder_decoder")
  assert c.encoder_mlp_dim is None and c.encoder_mlp_width == c.mlp_dim
  assert c.replace(encoder_mlp_dim=48).encoder_mlp_width == 48
  demo = MODEL_CONFIGS["demo_target"]
  assert demo.encoder_mlp_width < demo.mlp_dim  # the encoder runs once per prompt
  with pytest.raises(ValueError, match=r"encoder_mlp_dim=0 must be a positive integer"):
    c.replace(encoder_mlp_dim=0)
