"""Qwen3 and Gemma 3 (text): our kinds 'qwen3' and 'gemma3' on Hugging Face weights match
transformers' Qwen3ForCausalLM / Gemma3ForCausalLM (teacher forcing past Gemma's sliding window,
and the cache one token at a time past it); HF -> ours -> HF keeps the logits; greedy
speculative decoding of a pair of each equals the target's greedy output; the presets have the
published parameter counts; configs asking for what the network does not compute, and presets
that do not fit a checkpoint, are refused by name before any work."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax.decoding.plain import decode
from distillspec_jax.decoding.speculative import speculative_decode
from distillspec_jax.interop import hf_llama
from distillspec_jax.interop import importer
from hf_fixtures import LENGTHS, TOKENS, check_cached_decoding, check_real_positions, hf_logits
from distillspec_jax.models.config import MODEL_CONFIGS, TransformerConfig
from distillspec_jax.models.model import Model


VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6)
# Gemma 3 with a 3-key window on layers 0 and 1 (layer 2 global): the 10-token rows below
# reach past it; capped output logits, a query scale other than head_dim, linear RoPE scaling on the
# global layer and another base on the local ones, so that each of them changes the logits.
GEMMA = dict(sliding_window=3, layer_types=["sliding_attention", "sliding_attention",
                                            "full_attention"],
             query_pre_attn_scalar=24, final_logit_softcapping=5.0,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1000.0},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 50.0}},
             tie_word_embeddings=True)
FAMILIES = {
    "qwen3_untied": ("qwen3", dict(rope_theta=1000.0, tie_word_embeddings=False)),
    "qwen3_tied": ("qwen3", dict(rope_theta=300.0, tie_word_embeddings=True)),
    "gemma3_window_capped": ("gemma3", GEMMA),
}


def _transformers():
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  transformers = pytest.importorskip("transformers",
                                     reason="transformers (extra 'reference') is not installed")
  return torch, transformers


def _random_hf(family, fields, directory, seed=0):
  """A random tiny transformers model (eager attention, fp32) saved with save_pretrained in
  `directory`. Weights are redrawn larger than transformers' init so attention is far from
  uniform; Gemma's (1 + w) norm weights are drawn around 0, the others around 1."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  if family == "qwen3":
    config = transformers.Qwen3Config(**COMMON, **fields)
    cls = transformers.Qwen3ForCausalLM
  else:
    config = transformers.Gemma3TextConfig(**COMMON, **fields)
    cls = transformers.Gemma3ForCausalLM
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  model = cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.3 if "embed" in name else 0.15)
  model.save_pretrained(directory)
  return torch, model


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers_through_the_importer_and_the_cache(name, tmp_path):
  family, fields = FAMILIES[name]
  torch, hf_model = _random_hf(family, fields, tmp_path / "hf")
  params, config = importer.load_checkpoint(str(tmp_path / "hf"))  # config from config.json
  assert config.kind == family
  assert config.logits_via_embedding == fields["tie_word_embeddings"]
  if family == "gemma3":
    assert (config.sliding_window, config.sliding_window_pattern) == (3, 3)
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == (
        1000.0, 50.0, "linear")
  model = Model(config.replace(max_decode_length=16))
  ref = hf_logits(torch, hf_model)
  ours = np.asarray(jax.jit(model.logits)(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
  check_real_positions(ours, ref)

  # The cache: rows prefilled to their own lengths, then one token per row per call, on past
  # the window (row 0 reaches position 9 with a 3-key window).
  check_cached_decoding(model, params, ref)

  # Teeth: without the per-head norms, or with every Gemma layer global, the logits differ.
  if family == "gemma3":
    wrong = [config.replace(sliding_window=None, sliding_window_pattern=1)]
  else:
    unnormed = jax.tree.map(lambda x: x, params)
    for i in range(config.num_decoder_layers):
      attention = unnormed["decoder"][f"layers_{i}"]["self_attention"]
      attention["query_norm"]["scale"] = np.ones_like(attention["query_norm"]["scale"])
    wrong = [(config, unnormed)]
  for case in wrong:
    other, other_params = case if isinstance(case, tuple) else (case, params)
    off = np.asarray(jax.jit(Model(other).logits)(other_params,
                                                  {"decoder_input_tokens": jnp.asarray(TOKENS)}))
    assert np.abs(off[0] - ref[0]).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3_untied", "gemma3_window_capped"])
def test_hf_to_ours_to_hf_keeps_the_tensors_and_the_logits(name, tmp_path):
  torch, transformers = _transformers()
  family, fields = FAMILIES[name]
  _, hf_model = _random_hf(family, fields, tmp_path / "hf", seed=1)
  params, config = importer.load_checkpoint(str(tmp_path / "hf"))
  importer.save_checkpoint(params, config, str(tmp_path / "ours"), "ours")
  again, _ = importer.load_checkpoint(str(tmp_path / "ours"), config)
  importer.save_checkpoint(again, config, str(tmp_path / "back"), "hf",
                           source=str(tmp_path / "hf"))
  written = json.load(open(tmp_path / "back" / "config.json"))
  assert written["architectures"] == [hf_llama.ARCHITECTURES[hf_llama.model_type(written)]]
  back = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "back"), attn_implementation="eager").eval()
  assert type(back) is type(hf_model)
  original = dict(hf_model.state_dict())
  for key, value in back.state_dict().items():
    np.testing.assert_array_equal(value.numpy(), original[key].numpy(), err_msg=key)
  np.testing.assert_array_equal(hf_logits(torch, back), hf_logits(torch, hf_model))
  _, reread = importer.load_checkpoint(str(tmp_path / "back"))
  assert reread == config


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_greedy_speculative_decoding_of_a_pair_equals_the_target(kind):
  """Gemma's pair decodes 14 tokens after prompts of up to 6 with a 4-key window, so the
  verification blocks score positions far past the window and rollbacks cross it."""
  preset = MODEL_CONFIGS[f"tiny_{kind}"].replace(vocab_size=VOCAB, max_decode_length=40)
  target = Model(preset)
  draft = Model(preset.replace(num_decoder_layers=2, num_kv_heads=1, mlp_dim=64))
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(7), (3, 6), 2, VOCAB))
  tokens[1, 3:] = 0
  prompts = {"prompt_tokens": jnp.asarray(tokens)}
  reference = decode(target, tp, max_new_tokens=14, **prompts)
  result = speculative_decode(target, tp, draft, dp, max_new_tokens=14, gamma=3, **prompts)
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_array_equal(result.lengths, reference.lengths)
  assert 0.0 <= float(result.acceptance_rate) < 1.0  # another draft: some rejections


def test_a_pair_of_two_decoder_only_families_decodes_and_distils():
  """A Qwen3 target with a Qwen2-style draft (kind 'llama', q/k/v biases) or a Gemma 3 one,
  sharing one vocabulary: greedy speculative decoding gives the target's greedy output and the
  distillation loss has a finite gradient. An encoder-decoder beside a decoder-only model is
  refused, naming both."""
  from distillspec_jax.distill import objectives
  from distillspec_jax.training.trainer import SyntheticData
  target = Model(MODEL_CONFIGS["tiny_qwen3"].replace(vocab_size=VOCAB, max_decode_length=32))
  tp = target.init(jax.random.PRNGKey(0))
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(7), (3, 6), 2, VOCAB))
  tokens[1, 3:] = 0
  prompts = {"prompt_tokens": jnp.asarray(tokens)}
  reference = decode(target, tp, max_new_tokens=10, **prompts)
  batch = SyntheticData(2, input_length=3, target_length=4, vocab_size=VOCAB,
                        decoder_only=True).batch_at(0)
  for name, changes in (("tiny_llama", dict(use_qkv_bias=True)), ("tiny_gemma3", {})):
    draft = Model(MODEL_CONFIGS[name].replace(vocab_size=VOCAB, max_decode_length=32,
                                              **changes))
    dp = draft.init(jax.random.PRNGKey(1))
    result = speculative_decode(target, tp, draft, dp, max_new_tokens=10, gamma=3, **prompts)
    np.testing.assert_array_equal(result.tokens, reference.tokens)
    np.testing.assert_array_equal(result.lengths, reference.lengths)
    objective = objectives.DistillationObjective(target, draft)
    grads, _ = jax.grad(objective.loss, has_aux=True)(dp, {"target": tp}, batch)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  t5 = Model.from_name("tiny_encoder_decoder", vocab_size=VOCAB)
  with pytest.raises(ValueError, match="target is encoder_decoder but the draft is qwen3"):
    objectives.DistillationObjective(t5, target)
  with pytest.raises(ValueError, match="target is qwen3 but the draft is encoder_decoder"):
    speculative_decode(target, tp, t5, t5.init(jax.random.PRNGKey(2)), max_new_tokens=4,
                       gamma=2, **prompts)


# Published counts, in millions: total and non-embedding (the input embedding, counted once
# when tied). Sources: the Qwen3 model cards (Qwen/Qwen3-0.6B: 0.6B, non-embedding 0.44B;
# Qwen/Qwen3-8B: 8.2B, non-embedding 6.95B), the Gemma 3 270M model card (170M embedding,
# 100M in the transformer blocks) and the Gemma 3 technical report's Table 1 (embedding /
# non-embedding: 1B 302 / 698, 12B 1,012 / 10,759, 27B 1,416 / 25,600; text decoder only).
# The names 0.6B and 270M are rounded (to 1.3% and 0.7%), so their totals are checked exactly
# against transformers instead; the non-embedding counts hold to 0.5% everywhere.
PUBLISHED = {"qwen3_0_6b": (None, 440), "qwen3_8b": (8200, 6950),
             "gemma3_270m": (None, 100), "gemma3_1b": (1000, 698),
             "gemma3_12b": (1012 + 10759, 10759), "gemma3_27b": (1416 + 25600, 25600)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_equal_the_published_ones(name):
  torch, transformers = _transformers()
  config = MODEL_CONFIGS[name]
  shapes = jax.eval_shape(Model(config).init, jax.random.PRNGKey(0))
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  embedding = int(np.prod(shapes["token_embedder"]["embedding"].shape))
  if not config.logits_via_embedding:
    embedding += int(np.prod(shapes["decoder"]["logits_dense"]["kernel"].shape))
  published_total, published_body = PUBLISHED[name]
  assert abs((total - embedding) / 1e6 / published_body - 1) < 0.005, (name, total - embedding)
  if published_total is not None:
    assert abs(total / 1e6 / published_total - 1) < 0.005, (name, total)
  # The same shapes in transformers' own class, on the meta device (nothing allocated).
  hf = hf_llama.config_to_hf(config)
  config_class = (transformers.Qwen3Config if config.kind == "qwen3"
                  else transformers.Gemma3TextConfig)
  hf_config = config_class(**{k: v for k, v in hf.items()
                              if k not in ("model_type", "architectures", "torch_dtype")})
  with torch.device("meta"):
    hf_model = getattr(transformers, hf["architectures"][0])(hf_config)
  assert sum(p.numel() for p in hf_model.parameters()) == total


# --- bad input ------------------------------------------------------------------------------


def _export(name, directory, **overrides):
  model = Model.from_name(name, vocab_size=VOCAB, **overrides)
  importer.save_checkpoint(model.init(jax.random.PRNGKey(0)), model.config, str(directory),
                           "hf")
  return model, json.load(open(os.path.join(directory, "config.json")))


def _write_config(directory, hf_config):
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f)


@pytest.mark.parametrize("key,value,named", [
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("hidden_activation", "gelu", "hidden_activation='gelu'"),
    ("attention_bias", True, "attention_bias"),
    ("layer_types", ["full_attention", "sliding_attention", "sliding_attention"],
     "every n-th layer global"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
     "sliding-window layers rope_type='linear'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
])
def test_gemma_config_features_the_network_does_not_compute_are_refused(tmp_path, key, value,
                                                                         named):
  _, good = _export("tiny_gemma3", tmp_path)
  bad = dict(good, **{key: value})
  if key == "model_type":
    bad["architectures"] = ["Gemma3ForConditionalGeneration"]
  if key == "rope_scaling":
    del bad["rope_parameters"]
  _write_config(tmp_path, bad)
  for call in (lambda: importer.load_checkpoint(str(tmp_path)),
               lambda: importer.check_checkpoint(str(tmp_path), MODEL_CONFIGS["tiny_gemma3"])):
    with pytest.raises(ValueError, match=named):
      call()


def test_qwen3_options_the_network_does_not_compute_are_refused(tmp_path):
  _, good = _export("tiny_qwen3", tmp_path)
  for key, value in (("attention_bias", True), ("use_sliding_window", True),
                     ("hidden_act", "gelu")):
    _write_config(tmp_path, dict(good, **{key: value}))
    with pytest.raises(ValueError, match=key):
      importer.load_checkpoint(str(tmp_path))


def test_a_preset_that_does_not_fit_the_checkpoint_is_refused_before_loading(tmp_path):
  model, _ = _export("tiny_gemma3", tmp_path / "gemma")
  gemma = model.config
  with pytest.raises(ValueError, match="'gemma3_text' checkpoint.*kind='qwen3'"):
    importer.check_checkpoint(str(tmp_path / "gemma"), gemma.replace(
        kind="qwen3", query_pre_attn_scalar=None, sliding_window=None, sliding_window_pattern=1,
        rope_local_theta=10000.0, final_logit_softcapping=None,
        logits_via_embedding=False))
  with pytest.raises(ValueError, match="sliding_window=4, the model 8"):
    importer.check_checkpoint(str(tmp_path / "gemma"), gemma.replace(sliding_window=8))
  with pytest.raises(ValueError, match="query_pre_attn_scalar=24, the model None"):
    importer.check_checkpoint(str(tmp_path / "gemma"), gemma.replace(query_pre_attn_scalar=None))
  # A real preset's shapes against the tiny checkpoint: the tensors are named.
  with pytest.raises(ValueError, match=r"does not hold the gemma3-kind model.*layers=18.*"
                                       r"model.layers.3.input_layernorm.weight: missing"):
    importer.check_checkpoint(str(tmp_path / "gemma"), MODEL_CONFIGS["gemma3_270m"])
  # Our format carries its model: the window and RoPE come back from the checkpoint, and a
  # config given beside it is checked field by field.
  importer.save_checkpoint(model.init(jax.random.PRNGKey(0)), gemma, str(tmp_path / "ours"),
                           "ours")
  assert importer.open_checkpoint(str(tmp_path / "ours")).config == gemma
  with pytest.raises(ValueError, match="sliding_window"):
    importer.check_checkpoint(str(tmp_path / "ours"), gemma.replace(sliding_window=8))
  with pytest.raises(ValueError, match="post_mlp_layer_norm"):
    importer.check_checkpoint(str(tmp_path / "ours"), MODEL_CONFIGS["tiny_qwen3"].replace(
        vocab_size=VOCAB, num_decoder_layers=3))


@pytest.mark.parametrize("fields,named", [
    (dict(kind="qwen3", use_qkv_bias=True), "use_qkv_bias=True applies to kind='llama'"),
    (dict(kind="llama", sliding_window=4, sliding_window_pattern=2), "kind='gemma3' only"),
    (dict(kind="gemma3", sliding_window_pattern=6), "needs a sliding_window"),
    (dict(kind="gemma3", sliding_window=512), "sliding_window_pattern=1 makes every layer"),
    (dict(kind="gemma3", sliding_window=0, sliding_window_pattern=6), "sliding_window=0"),
    (dict(kind="gemma3", final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
    (dict(kind="gemma3", query_pre_attn_scalar="256"), "query_pre_attn_scalar='256'"),
    (dict(kind="decoder_only", rope_local_theta=5.0), "kind='gemma3' only"),
])
def test_bad_family_configs_are_refused_at_construction(fields, named):
  with pytest.raises((ValueError, TypeError), match=named):
    TransformerConfig(**dict(dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16,
                                  mlp_dim=64, num_decoder_layers=2, num_encoder_layers=0),
                             **fields))


def test_convert_cli_round_trips_gemma_and_refuses_a_mismatched_preset(tmp_path, capsys):
  from distillspec_jax import convert
  model, _ = _export("tiny_gemma3", tmp_path / "hf")
  assert convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
                       f"--output={tmp_path / 'ours'}", "--model=tiny_gemma3",
                       f"--vocab_size={VOCAB}"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "gemma3"
  assert convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'ours'}",
                       f"--output={tmp_path / 'back'}", "--model=tiny_gemma3",
                       f"--vocab_size={VOCAB}"]) == 0
  before, _ = importer.load_checkpoint(str(tmp_path / "hf"))
  after, config = importer.load_checkpoint(str(tmp_path / "back"))
  assert config == model.config.replace(max_decode_length=config.max_decode_length)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  with pytest.raises(SystemExit) as exit_info:  # a Qwen3 preset for the Gemma checkpoint
    convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
                  f"--output={tmp_path / 'wrong'}", "--model=tiny_qwen3",
                  f"--vocab_size={VOCAB}"])
  assert exit_info.value.code == 1
  assert "kind='qwen3'" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "wrong")


@pytest.mark.slow
def test_the_text_decoder_of_a_multimodal_gemma3_checkpoint_loads(tmp_path):
  """Gemma 3 4B-27B are published as Gemma3ForConditionalGeneration: the importer reads the
  text decoder (text_config; tensors under language_model.) and leaves the vision tower out;
  the logits equal transformers' on text."""
  torch, transformers = _transformers()
  text = dict(COMMON, **{k: v for k, v in GEMMA.items() if k != "final_logit_softcapping"})
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
  config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                     mm_tokens_per_image=4, image_token_index=95,
                                     boi_token_index=93, eoi_token_index=94)
  config.text_config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  hf_model.save_pretrained(tmp_path / "mm")
  params, ours_config = importer.load_checkpoint(str(tmp_path / "mm"))
  assert ours_config.kind == "gemma3" and ours_config.sliding_window == 3
  assert importer.check_checkpoint(str(tmp_path / "mm"), ours_config) == "hf"
  tokens = np.where(TOKENS >= 93, 7, TOKENS)  # no image tokens in the text
  ours = np.asarray(Model(ours_config).logits(params,
                                              {"decoder_input_tokens": jnp.asarray(tokens)}))
  check_real_positions(ours, hf_logits(torch, hf_model, tokens))
  # A capping this class does not apply (and Gemma3ForCausalLM would) is refused by name.
  written = json.load(open(tmp_path / "mm" / "config.json"))
  written["text_config"]["final_logit_softcapping"] = 30.0
  _write_config(tmp_path / "mm", written)
  with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
    importer.load_checkpoint(str(tmp_path / "mm"))


# --- remat, bf16 and the mesh rules ---------------------------------------------------------


@pytest.mark.slow
def test_gemma3_remat_policies_keep_gradients_and_bf16_stays_close():
  """Remat changes what the backward pass keeps, never the values (the local/global layers
  and the sandwich norms included); bf16 activations (the sqrt(emb_dim) embedding scale
  rounded as Gemma rounds it) keep the logits close and mostly the same argmax."""
  config = MODEL_CONFIGS["tiny_gemma3"].replace(vocab_size=VOCAB)
  tokens = jnp.asarray(np.random.RandomState(3).randint(2, VOCAB, (2, 9)))
  params = Model(config).init(jax.random.PRNGKey(4))

  def loss(model, p):
    logits = model.logits(p, {"decoder_input_tokens": tokens})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

  base = Model(config)
  want = jax.jit(jax.grad(lambda p: loss(base, p)))(params)
  for policy in ("minimal", "full"):
    model = Model(config.replace(remat_policy=policy))
    got = jax.jit(jax.grad(lambda p, m=model: loss(m, p)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got, want)
  batch = {"decoder_input_tokens": tokens}
  fp32 = np.asarray(jax.jit(base.logits)(params, batch))
  bf16 = np.asarray(jax.jit(Model(config.replace(dtype="bfloat16")).logits)(params, batch))
  assert bf16.dtype == np.float32 and not np.array_equal(bf16, fp32)
  assert np.abs(bf16 - fp32).max() < 0.05 * np.abs(fp32).max()
  assert np.mean(bf16.argmax(-1) == fp32.argmax(-1)) >= 0.8


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_gemma3"])
def test_every_parameter_has_logical_axes_the_mesh_rules_place(name):
  from distillspec_jax.training import partitioning
  model = Model(MODEL_CONFIGS[name])
  shapes, axes = model.param_shapes(), model.logical_axes()
  flat_axes = dict(jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0])
  for path, shape in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    assert len(flat_axes[path]) == len(shape.shape) and None not in flat_axes[path], path
  attention = axes["decoder"]["layers_0"]["self_attention"]
  assert tuple(attention["query_norm"]["scale"]) == ("kv",)
  mesh = partitioning.make_mesh(1, 1, jax.devices()[:1])
  shardings = partitioning.param_shardings(model, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(shapes)


# The presets' source: the config.json values of the published checkpoints (written from the
# model repositories' files as published; no download here), the fields that set the network.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
              head_dim=128, hidden_act="silu", max_position_embeddings=40960,
              num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
              sliding_window=None, use_sliding_window=False, vocab_size=151936)
_GEMMA3_TEXT = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                    attention_bias=False, attn_logit_softcapping=None,
                    final_logit_softcapping=None, head_dim=256,
                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
                    query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_local_base_freq=10000,
                    rope_scaling=None, rope_theta=1000000, sliding_window=512,
                    vocab_size=262144)
# Gemma 3 12B / 27B are Gemma3ForConditionalGeneration; their text_config spells out only
# what differs from transformers' Gemma3TextConfig defaults.
_GEMMA3_MULTIMODAL = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
PUBLISHED_CONFIGS = {
    "qwen3_0_6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, max_window_layers=28, tie_word_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, max_window_layers=36, tie_word_embeddings=False),
    "gemma3_270m": dict(_GEMMA3_TEXT, hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                        _sliding_window_pattern=6,
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
    "gemma3_1b": dict(_GEMMA3_TEXT, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                      sliding_window_pattern=6),
    "gemma3_12b": dict(_GEMMA3_MULTIMODAL, text_config=dict(
        model_type="gemma3_text", hidden_size=3840, intermediate_size=15360,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)),
    "gemma3_27b": dict(_GEMMA3_MULTIMODAL, text_config=dict(
        model_type="gemma3_text", head_dim=128, hidden_size=5376, intermediate_size=21504,
        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        query_pre_attn_scalar=168, rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_config_json_values_give_the_presets(name):
  preset = MODEL_CONFIGS[name]
  assert hf_llama.config_from_hf(PUBLISHED_CONFIGS[name]) == preset
  assert hf_llama.config_mismatches(PUBLISHED_CONFIGS[name], preset) == []


@pytest.mark.slow
def test_gemma3_export_generates_greedily_in_transformers_as_we_decode(tmp_path):
  """transformers' own incremental decoding (its sliding-window cache) of our export, past
  the 4-key window, gives our greedy tokens."""
  torch, transformers = _transformers()
  model, _ = _export("tiny_gemma3", tmp_path / "hf", max_decode_length=32)
  params = model.init(jax.random.PRNGKey(0))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  result = decode(model, params, prompt_tokens=jnp.asarray(TOKENS[:, 1:]), max_new_tokens=12)
  assert int(np.min(result.lengths)) > 4  # every row decodes past the window
  for row, n in enumerate(LENGTHS):
    with torch.no_grad():
      out = hf_model.generate(torch.tensor(TOKENS[row:row + 1, :n], dtype=torch.long),
                              attention_mask=torch.ones((1, n), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, eos_token_id=1,
                              pad_token_id=0)
    mine = np.asarray(result.tokens[row, :int(result.lengths[row])]).tolist()
    assert mine == out[0, n:].tolist(), row
