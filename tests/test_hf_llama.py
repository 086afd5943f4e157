"""Llama-family interop: our llama kind on Hugging Face weights matches transformers'
LlamaForCausalLM / Qwen2ForCausalLM (teacher forcing and the cache, rows of different lengths);
an export loads in transformers and decodes greedily as we do; round trips are exact; bad
checkpoints and configs are refused, naming the value."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec_jax import convert
from distillspec_jax.decoding.plain import decode
from distillspec_jax.interop import hf_llama
from distillspec_jax.interop import importer
from hf_fixtures import LENGTHS, TOKENS, check_cached_decoding, check_real_positions, hf_logits
from distillspec_jax.models.model import Model


VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)
# Llama 3's RoPE scaling with a short original context, so that the kept (wavelength < 16),
# interpolated and stretched (> 64) frequencies all occur at head_dim 16 and base 500.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama_llama3_rope_untied": ("llama", dict(rope_theta=500.0, rope_scaling=LLAMA3_ROPE,
                                               tie_word_embeddings=False)),
    "llama_linear_rope_tied": ("llama", dict(rope_theta=300.0, tie_word_embeddings=True,
                                             rope_scaling={"rope_type": "linear",
                                                           "factor": 2.0})),
    "qwen2_biases_tied": ("qwen2", dict(rope_theta=1000.0, tie_word_embeddings=True)),
}


def _transformers():
  torch = pytest.importorskip("torch", reason="torch (extra 'reference') is not installed")
  transformers = pytest.importorskip("transformers",
                                     reason="transformers (extra 'reference') is not installed")
  return torch, transformers


def _random_hf(family, fields, directory, seed=0):
  """A random tiny transformers model saved with save_pretrained (safetensors) in
  `directory`. Weights are redrawn larger than transformers' 0.02 init, so attention is far
  from uniform and RoPE's angles change the logits."""
  torch, transformers = _transformers()
  torch.manual_seed(seed)
  if family == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **fields))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, **fields))
  model = model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.3 if "bias" in name or "embed" in name else 0.15)
  model.save_pretrained(directory)
  return torch, model


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers_through_the_importer(name, tmp_path):
  family, fields = FAMILIES[name]
  torch, hf_model = _random_hf(family, fields, tmp_path / "hf")
  params, config = importer.load_checkpoint(str(tmp_path / "hf"))  # config from config.json
  assert config.kind == "llama" and config.use_qkv_bias == (family == "qwen2")
  assert config.logits_via_embedding == fields["tie_word_embeddings"]
  model = Model(config.replace(max_decode_length=16))
  ref = hf_logits(torch, hf_model)
  ours = np.asarray(jax.jit(model.logits)(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
  check_real_positions(ours, ref)

  # The cache: rows prefilled to their own lengths, then one token per row per call.
  check_cached_decoding(model, params, ref)

  # Teeth: the same weights with plain RoPE (or another base) do not match.
  if config.rope_scaling != "none":
    wrong = Model(config.replace(rope_scaling="none", rope_scaling_factor=1.0))
  else:
    wrong = Model(config.replace(rope_theta=10000.0))
  off = np.asarray(wrong.logits(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
  assert np.abs(off[0] - ref[0]).max() > 1e-2


@pytest.mark.slow
def test_export_loads_in_transformers_and_decodes_greedily_as_ours(tmp_path):
  torch, transformers = _transformers()
  model = Model.from_name("tiny_llama", vocab_size=VOCAB, max_decode_length=32)
  params = model.init(jax.random.PRNGKey(3))
  importer.save_checkpoint(params, model.config, str(tmp_path / "export"), "hf")
  hf_config = json.load(open(tmp_path / "export" / "config.json"))
  assert hf_config["architectures"] == ["LlamaForCausalLM"]
  assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in os.listdir(tmp_path / "export"))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
  assert type(hf_model).__name__ == "LlamaForCausalLM"
  ours = np.asarray(model.logits(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
  check_real_positions(ours, hf_logits(torch, hf_model))

  prompts = TOKENS[:, 1:]  # right-padded prompts; the engine puts the 0 start token first
  result = decode(model, params, prompt_tokens=jnp.asarray(prompts), max_new_tokens=12)
  for row, n in enumerate(LENGTHS):
    with torch.no_grad():
      out = hf_model.generate(torch.tensor(TOKENS[row:row + 1, :n], dtype=torch.long),
                              attention_mask=torch.ones((1, n), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, eos_token_id=1,
                              pad_token_id=0)
    theirs = out[0, n:].tolist()
    mine = np.asarray(result.tokens[row, :int(result.lengths[row])]).tolist()
    assert mine == theirs, (row, mine, theirs)


def test_round_trips_are_exact_and_tokenizer_files_pass_through(tmp_path):
  config = Model.from_name("tiny_llama", use_qkv_bias=True, logits_via_embedding=True,
                           rope_scaling="llama3", rope_scaling_factor=8.0,
                           rope_theta=500000.0).config
  params = Model(config).init(jax.random.PRNGKey(1))
  source = tmp_path / "tokenizer"
  source.mkdir()
  (source / "tokenizer.json").write_text('{"model": "stand-in"}')
  (source / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
  (source / "config.json").write_text(json.dumps(
      {"model_type": "llama", "bos_token_id": 5, "eos_token_id": 6, "pad_token_id": None}))
  importer.save_checkpoint(params, config, str(tmp_path / "hf"), "hf", source=str(source))
  written = json.load(open(tmp_path / "hf" / "config.json"))
  assert written["architectures"] == ["Qwen2ForCausalLM"]  # q/k/v biases
  assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (5, 6, None)
  assert written["rope_scaling"]["rope_type"] == "llama3"
  assert written["rope_parameters"]["rope_theta"] == 500000.0
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "hf" / name).read_text() == (source / name).read_text()
  loaded, loaded_config = importer.load_checkpoint(str(tmp_path / "hf"))
  assert loaded_config == config.replace(max_decode_length=loaded_config.max_decode_length)
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))
  # Our format stores the configuration with the weights: no preset needed to read it back.
  importer.save_checkpoint(params, config, str(tmp_path / "ours"), "ours")
  again, again_config = importer.load_checkpoint(str(tmp_path / "ours"))
  assert again_config == config
  jax.tree.map(np.testing.assert_array_equal, again, jax.tree.map(np.asarray, params))
  # Weights saved without it (older checkpoints) still need the configuration said.
  from distillspec_jax.training import checkpoints
  checkpoints.save_params(str(tmp_path / "bare"), jax.tree.map(np.asarray, params))
  with pytest.raises(ValueError, match="rope_theta, rope_scaling and norm_epsilon"):
    importer.load_checkpoint(str(tmp_path / "bare"))
  again, _ = importer.load_checkpoint(str(tmp_path / "bare"), config)
  jax.tree.map(np.testing.assert_array_equal, again, jax.tree.map(np.asarray, params))


def test_a_whole_save_over_a_sharded_one_loads_the_whole_file_as_transformers_does(tmp_path):
  """save_pretrained of a model in one file into a folder that held a sharded save leaves the
  old model.safetensors.index.json behind (and deletes its shards); transformers then reads
  model.safetensors. So does the importer: neither the stale index's missing shards nor, when
  they survive (copied back here), their old weights."""
  import shutil
  torch, transformers = _transformers()
  folder = tmp_path / "hf"
  _, old = _random_hf("llama", FAMILIES["llama_linear_rope_tied"][1], folder, seed=0)
  old.save_pretrained(folder, max_shard_size="50KB")
  shards = sorted(f for f in os.listdir(folder) if f.startswith("model-"))
  assert len(shards) > 1 and (folder / "model.safetensors.index.json").exists()
  for name in shards:
    shutil.copyfile(folder / name, tmp_path / name)
  _, new = _random_hf("llama", FAMILIES["llama_linear_rope_tied"][1], folder, seed=1)
  assert (folder / "model.safetensors").exists()
  assert (folder / "model.safetensors.index.json").exists()  # stale, as transformers leaves it
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
  ref = hf_logits(torch, reloaded)
  np.testing.assert_array_equal(ref, hf_logits(torch, new))
  for shards_back in (False, True):
    if shards_back:
      for name in shards:
        shutil.copyfile(tmp_path / name, folder / name)
    params, config = importer.load_checkpoint(str(folder))
    ours = np.asarray(Model(config).logits(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
    check_real_positions(ours, ref)
    importer.check_checkpoint(str(folder), config)


@pytest.mark.integration
def test_convert_cli_exports_a_preset_with_its_tokenizer(tmp_path, capsys):
  model = Model.from_name("tiny_llama")
  importer.save_checkpoint(model.init(jax.random.PRNGKey(0)), model.config,
                           str(tmp_path / "ours"), "ours")
  import hf_fixtures
  tokenizer = hf_fixtures.save_tokenizer(str(tmp_path / "tok"), "llama")
  assert convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'ours'}",
                       f"--output={tmp_path / 'hf'}", "--model=tiny_llama",
                       f"--tokenizer_dir={tokenizer}"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "llama"
  assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json",
                                                 "model.safetensors", "tokenizer.json",
                                                 "tokenizer_config.json"]
  written = json.load(open(tmp_path / "hf" / "config.json"))
  assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (
      298, 299, None)  # the tokenizer's, not T5's 0 / 1 / 0
  assert convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
                       f"--output={tmp_path / 'back'}"]) == 0
  # The import kept the model's ids, so an export with no tokenizer folder still says them.
  assert convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'back'}",
                       f"--output={tmp_path / 'hf_again'}"]) == 0
  again = json.load(open(tmp_path / "hf_again" / "config.json"))
  assert (again["bos_token_id"], again["eos_token_id"], again["pad_token_id"]) == (298, 299, None)
  fmt = importer.check_checkpoint(str(tmp_path / "hf"), model.config)
  assert fmt == "hf"
  with pytest.raises(ValueError, match="rope_theta=10000.0, the model 500000.0"):
    importer.check_checkpoint(str(tmp_path / "hf"), model.config.replace(rope_theta=500000.0))


# --- bad input ------------------------------------------------------------------------------


def _write_config(directory, hf_config):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f)


def test_other_architectures_and_unsupported_options_are_refused(tmp_path):
  model = Model.from_name("tiny_llama")
  importer.save_checkpoint(model.init(jax.random.PRNGKey(0)), model.config,
                           str(tmp_path / "hf"), "hf")
  good = json.load(open(tmp_path / "hf" / "config.json"))
  # Another architecture's config.json, with llama-like tensors beside it.
  _write_config(tmp_path / "hf", dict(good, model_type="gpt2", architectures=["GPT2LMHeadModel"]))
  with pytest.raises(ValueError, match="model_type='gpt2'.*GPT2LMHeadModel.*Llama"):
    importer.load_checkpoint(str(tmp_path / "hf"))
  bad = {"attention_bias": True, "hidden_act": "gelu", "use_sliding_window": True,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
  for key, value in bad.items():
    _write_config(tmp_path / "hf", dict(good, **{key: value}))
    with pytest.raises(ValueError, match=f"{key if key != 'rope_scaling' else 'yarn'}"):
      importer.load_checkpoint(str(tmp_path / "hf"))
  # The two spellings of RoPE disagree.
  _write_config(tmp_path / "hf", dict(good, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 123.0}))
  with pytest.raises(ValueError, match="rope_parameters"):
    importer.load_checkpoint(str(tmp_path / "hf"))
  # A T5 preset for a Llama checkpoint.
  _write_config(tmp_path / "hf", good)
  with pytest.raises(ValueError, match="kind='decoder_only'"):
    importer.load_checkpoint(str(tmp_path / "hf"), Model.from_name("tiny_decoder_only").config)


@pytest.mark.parametrize("context", ["max_position_embeddings", "top_level"])
def test_llama3_rope_without_its_original_context_is_read_as_transformers_reads_it(tmp_path,
                                                                                     context):
  """A 'llama3' rope_scaling without original_max_position_embeddings: transformers takes
  config.json's top-level original_max_position_embeddings, else max_position_embeddings (the
  logits here equal its); a top-level value beside another in rope_scaling (transformers 4
  and 5 read different ones) and a scaling without its factor are refused by name."""
  torch, transformers = _transformers()
  _random_hf("llama", FAMILIES["llama_llama3_rope_untied"][1], tmp_path / "hf")
  hf = json.load(open(tmp_path / "hf" / "config.json"))
  scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
  hf.pop("rope_parameters")
  hf.update(rope_theta=500.0, rope_scaling=scaling, max_position_embeddings=256)
  if context == "top_level":
    hf["original_max_position_embeddings"] = 16
  _write_config(tmp_path / "hf", hf)
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  params, config = importer.load_checkpoint(str(tmp_path / "hf"))
  assert config.rope_original_max_length == (16 if context == "top_level" else 256)
  ours = np.asarray(Model(config).logits(params, {"decoder_input_tokens": jnp.asarray(TOKENS)}))
  check_real_positions(ours, hf_logits(torch, reference))

  _write_config(tmp_path / "hf", dict(hf, original_max_position_embeddings=16,
                                      rope_scaling=dict(LLAMA3_ROPE)))
  with pytest.raises(ValueError, match=r"original_max_position_embeddings=16.*"
                                       r"original_max_position_embeddings=64"):
    importer.load_checkpoint(str(tmp_path / "hf"))
  for key in ("factor", "low_freq_factor"):
    _write_config(tmp_path / "hf", dict(hf, rope_scaling={k: v for k, v in LLAMA3_ROPE.items()
                                                          if k != key}))
    with pytest.raises(ValueError, match=f"rope_type='llama3' without {key}"):
      importer.load_checkpoint(str(tmp_path / "hf"))


def test_mismatched_shapes_name_the_tensor_and_the_field(tmp_path):
  model = Model.from_name("tiny_llama")
  importer.save_checkpoint(model.init(jax.random.PRNGKey(0)), model.config,
                           str(tmp_path / "hf"), "hf")
  with pytest.raises(ValueError, match=r"gate_proj.weight: shape \(128, 64\), expected "
                                       r"\(256, 64\)"):
    importer.load_checkpoint(str(tmp_path / "hf"), model.config.replace(mlp_dim=256))
  with pytest.raises(ValueError, match="num_kv_heads=2, the model 4"):
    importer.load_checkpoint(str(tmp_path / "hf"), model.config.replace(num_kv_heads=4))
  with pytest.raises(ValueError, match=r"k_proj.weight: shape \(32, 64\), expected \(64, 64\)"):
    importer.check_checkpoint(str(tmp_path / "hf"), model.config.replace(num_kv_heads=4))
  tensors = hf_llama.params_to_hf(model.init(jax.random.PRNGKey(0)), model.config)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match="up_proj.weight: missing"):
    hf_llama.params_from_hf(tensors, model.config)


@pytest.mark.slow
def test_distilled_draft_serves_as_assistant_model_of_its_target_in_transformers(tmp_path):
  """A draft distilled here (a few on-policy steps) and exported, used by transformers'
  assisted generation for the exported target: the target's greedy output, ours and theirs."""
  torch, transformers = _transformers()
  from distillspec_jax.distill import objectives
  from distillspec_jax.training import trainer
  target = Model.from_name("tiny_llama", vocab_size=VOCAB, max_decode_length=32)
  draft = Model.from_name("tiny_llama", vocab_size=VOCAB, num_decoder_layers=1,
                          num_kv_heads=1, max_decode_length=32)
  target_params = target.init(jax.random.PRNGKey(2))
  config = trainer.TrainConfig(model_dir=str(tmp_path / "draft"), train_steps=2, batch_size=4,
                         optimizer="adamw", learning_rate=3e-3, warmup_steps=0,
                         decay_steps=10, save_every=2, log_every=1, progress_bar=False)
  data = trainer.SyntheticData(4, input_length=4, target_length=6, vocab_size=VOCAB,
                         decoder_only=True)
  draft_params = trainer.distill(config, target, target_params, draft, data,
                           objectives.DistillationConfig.from_recipe("gkd")).state.params
  for name, model, params in (("target", target, target_params),
                              ("draft", draft, draft_params)):
    importer.save_checkpoint(jax.device_get(params), model.config, str(tmp_path / name), "hf")
  load = lambda name: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
      str(tmp_path / name)).eval()
  hf_target, hf_draft = load("target"), load("draft")
  ours = decode(target, target_params, prompt_tokens=jnp.asarray(TOKENS[:, 1:]),
                max_new_tokens=12)
  for row, n in enumerate(LENGTHS):  # assisted generation takes one row at a time
    prompt = torch.tensor(TOKENS[row:row + 1, :n], dtype=torch.long)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                  eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
      plain = hf_target.generate(prompt, **kwargs)[0, n:].tolist()
      assisted = hf_target.generate(prompt, assistant_model=hf_draft, **kwargs)[0, n:].tolist()
    assert assisted == plain
    assert np.asarray(ours.tokens[row, :int(ours.lengths[row])]).tolist() == plain


def test_several_end_of_sequence_ids_reach_the_exports_generation_config(tmp_path):
  """A source whose config.json names one EOS (299) and generation_config.json several
  ([299, 297]: Qwen Instruct's layout) gives the list as eos_token_id (what an import keeps);
  an export given those ids and no source writes the list to generation_config.json."""
  import hf_fixtures
  folder = hf_fixtures.save_tokenizer(str(tmp_path / "tok"), "qwen2")
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"bos_token_id": None, "eos_token_id": 299, "pad_token_id": 297}, f)
  with open(os.path.join(folder, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [299, 297]}, f)
  ids = hf_llama.source_token_ids(folder)
  assert ids["eos_token_id"] == [299, 297]
  model = Model.from_name("tiny_llama")
  hf_llama.save_hf(model.init(jax.random.PRNGKey(0)), model.config, str(tmp_path / "hf"),
                   token_ids=ids)
  generation = json.load(open(tmp_path / "hf" / "generation_config.json"))
  assert generation["eos_token_id"] == [299, 297]
  assert json.load(open(tmp_path / "hf" / "config.json"))["eos_token_id"] == [299, 297]
