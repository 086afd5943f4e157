"""Conversion CLI between HF / T5X / our formats, and `load_initial_params` autodetection."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from distillspec_jax import convert
from distillspec_jax.interop import importer
from distillspec_jax.interop import hf_t5
from distillspec_jax.interop import t5x as t5x_lib
from distillspec_jax.models.config import TransformerConfig
from distillspec_jax.models.config_json import config_to_json
from distillspec_jax.models.model import NO_TOKEN, Model, TokenIds
from distillspec_jax.training import checkpoints


TINY = TransformerConfig(kind="encoder_decoder", vocab_size=128, emb_dim=64, num_heads=4,
                         num_encoder_layers=2, num_decoder_layers=1, head_dim=16, mlp_dim=96,
                         dropout_rate=0.0, max_decode_length=32)


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_identical(a, b):
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys()
  for key in fa:
    np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


@pytest.fixture(scope="module")
def params():
  return Model(TINY).init(jax.random.PRNGKey(0))


@pytest.mark.integration
def test_cli_chain_hf_ours_t5x_hf_is_exact(tmp_path, params, capsys):
  hf_t5.save_hf(params, TINY, str(tmp_path / "hf"))
  assert convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
                       f"--output={tmp_path / 'ours'}"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "encoder_decoder"
  # Config inferred from stored shapes (no --model) for ours and t5x inputs.
  assert convert.main(["--from=ours", "--to=t5x", f"--input={tmp_path / 'ours'}",
                       f"--output={tmp_path / 't5x'}"]) == 0
  assert convert.main(["--from=t5x", "--to=hf", f"--input={tmp_path / 't5x'}",
                       f"--output={tmp_path / 'hf2'}"]) == 0
  loaded, config = hf_t5.load_hf(str(tmp_path / "hf2"))
  assert (config.num_encoder_layers, config.num_decoder_layers, config.mlp_dim) == (2, 1, 96)
  _assert_identical(params, loaded)
  with pytest.raises(SystemExit):  # never overwrite an existing output
    convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
                  f"--output={tmp_path / 'ours'}"])


def test_load_initial_params_autodetects_every_format(tmp_path, params):
  model = Model(TINY)
  hf_t5.save_hf(params, TINY, str(tmp_path / "hf"))
  t5x_lib.save_t5x(params, str(tmp_path / "t5x_model_dir"), step=3)
  importer.save_ours(params, str(tmp_path / "ours"))
  paths = {"hf": tmp_path / "hf", "t5x": tmp_path / "t5x_model_dir", "ours": tmp_path / "ours",
           "safetensors_file": tmp_path / "hf" / "model.safetensors"}
  for name, path in paths.items():
    expected = "hf" if name == "safetensors_file" else name
    assert importer.detect_format(str(path)) == expected, name
    _assert_identical(params, importer.load_initial_params(str(path), model))
  # The trainer's restore_fn hook: (path, abstract_params) -> params.
  abstract = model.param_shapes()
  for path in paths.values():
    restored = importer.restore_any(str(path), abstract)
    assert isinstance(jax.tree.leaves(restored)[0], jax.Array)
    _assert_identical(params, restored)


def test_load_initial_params_refuses_wrong_model_and_pickles(tmp_path, params):
  hf_t5.save_hf(params, TINY, str(tmp_path / "hf"))
  with pytest.raises(ValueError, match=r"mlp/wi_0/kernel: expected \(64, 128\), found \(64, 96\)"):
    importer.load_initial_params(str(tmp_path / "hf"), Model(TINY.replace(mlp_dim=128)))
  os.makedirs(tmp_path / "torch")
  (tmp_path / "torch" / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
  with pytest.raises(ValueError, match="safetensors"):
    importer.load_initial_params(str(tmp_path / "torch"), Model(TINY))
  with pytest.raises(ValueError, match="Cannot tell the checkpoint format"):
    importer.load_initial_params(str(tmp_path), Model(TINY))


def test_config_inference_decoder_only():
  config = TINY.replace(kind="decoder_only", num_encoder_layers=0)
  inferred = importer.config_from_params(Model(config).param_shapes(), dropout_rate=0.0,
                                        max_decode_length=32)
  assert inferred == config


def test_config_inference_keeps_a_narrower_encoder_mlp():
  narrow = TINY.replace(encoder_mlp_dim=32)
  shapes = Model(narrow).param_shapes()
  assert shapes["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].shape == (64, 32)
  assert shapes["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].shape == (64, 96)
  assert importer.config_from_params(shapes, dropout_rate=0.0, max_decode_length=32) == narrow
  # Same width in both stacks: inferred as None, the T5 1.1 default.
  assert importer.config_from_params(Model(TINY).param_shapes(), dropout_rate=0.0,
                                    max_decode_length=32).encoder_mlp_dim is None


def test_hf_export_refuses_a_narrower_encoder_mlp(tmp_path):
  narrow = TINY.replace(encoder_mlp_dim=32)
  with pytest.raises(ValueError, match=r"encoder_mlp_dim=32 differs from mlp_dim=96"):
    hf_t5.save_hf(Model(narrow).init(jax.random.PRNGKey(0)), narrow, str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()


@pytest.mark.integration
def test_cli_vocab_size_overrides_the_preset(tmp_path, capsys):
  """`--model=tiny_encoder_decoder` alone expects vocab 512; `--vocab_size=64` fits a vocab-64
  checkpoint, and the shapes are still checked against the overridden preset."""
  small_vocab = Model.from_name("tiny_encoder_decoder", vocab_size=64)
  params = small_vocab.init(jax.random.PRNGKey(1))
  hf_t5.save_hf(params, small_vocab.config, str(tmp_path / "hf"))
  common = ["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}",
            "--model=tiny_encoder_decoder"]
  with pytest.raises(SystemExit) as exit_info:
    convert.main(common + [f"--output={tmp_path / 'refused'}"])
  assert exit_info.value.code == 1
  err = capsys.readouterr().err
  assert "--input=" in err and "expected (512, 64), found (64, 64)" in err
  assert convert.main(common + ["--vocab_size=64", f"--output={tmp_path / 'ours'}"]) == 0
  _assert_identical(params, importer.load_checkpoint(str(tmp_path / "ours"),
                                                     small_vocab.config)[0])
  for bad, needle in ((["--vocab_size=0"], "--vocab_size=0 must be an integer >= 1"),
                      (["--vocab_size=64.5"], "invalid int value")):
    with pytest.raises(SystemExit):
      convert.main(common + bad + [f"--output={tmp_path / 'bad'}"])
    assert needle in capsys.readouterr().err
  with pytest.raises(SystemExit):  # no preset to override: the checkpoint gives the vocabulary
    convert.main(["--from=hf", "--to=ours", f"--input={tmp_path / 'hf'}", "--vocab_size=64",
                  f"--output={tmp_path / 'bad'}"])
  assert "needs --model" in capsys.readouterr().err


def test_check_checkpoint_reads_shapes_for_every_format(tmp_path, params):
  """The train binary's up-front check: the format back, or one paragraph naming the first
  mismatching parameters (from stored shapes; nothing is loaded)."""
  hf_t5.save_hf(params, TINY, str(tmp_path / "hf"))
  t5x_lib.save_t5x(params, str(tmp_path / "t5x"), step=1)
  importer.save_ours(params, str(tmp_path / "ours"))
  wider = TINY.replace(mlp_dim=128)
  for fmt in ("hf", "t5x", "ours"):
    assert importer.check_checkpoint(str(tmp_path / fmt), TINY) == fmt
    with pytest.raises(ValueError) as info:
      importer.check_checkpoint(str(tmp_path / fmt), wider)
    message = str(info.value)
    assert f"({fmt} checkpoint) does not hold the configured encoder_decoder model" in message
    assert "decoder/layers_0/mlp/wi_0/kernel: checkpoint shape (64, 96) vs model shape " \
           "(64, 128)" in message
    assert "\n" not in message
  with pytest.raises(ValueError, match="does not exist"):
    importer.check_checkpoint(str(tmp_path / "nowhere"), TINY)


def test_a_tokenizer_dir_without_tokenizer_files_is_refused(tmp_path, capsys):
  """--tokenizer_dir naming a folder with no tokenizer files and no config.json (a data folder,
  a typo'd sibling) is refused before anything is written; it used to give exit 0 and an
  export without a tokenizer whose config.json said our SentencePiece ids (bos 0, eos 1, pad
  0: real tokens of a Llama / Qwen tokenizer, so generate() stopped at id 1)."""
  model = Model.from_name("tiny_llama")
  importer.save_ours(model.init(jax.random.PRNGKey(0)), str(tmp_path / "ours"), model.config)
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.jsonl").write_text("{}\n")
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'ours'}",
                  f"--output={tmp_path / 'hf'}", f"--tokenizer_dir={tmp_path / 'data'}"])
  assert exit_info.value.code == 1  # the binaries' user-error status
  err = capsys.readouterr().err
  assert f"--tokenizer_dir={tmp_path / 'data'} holds no tokenizer files" in err
  assert "pass the target's Hugging Face folder" in err
  assert not (tmp_path / "hf").exists()


def test_an_export_without_a_tokenizer_keeps_the_trained_ids_or_is_refused(tmp_path, capsys):
  """--from=ours --to=hf of a RoPE-kind model with no --tokenizer_dir: a checkpoint trained
  with our vocabulary's ids (the trainer's `meta`) exports with them (bos 0, eos 1, pad 0);
  one trained with a user's tokenizer (eos 299) is refused, exit 1, nothing written: its
  export would say eos 1, a real token of that tokenizer."""
  model = Model.from_name("tiny_llama")
  params = jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(0)))
  stored = {"model_config": config_to_json(model.config), "objective": "fkl"}
  ours = dataclasses.asdict(TokenIds())
  theirs = dataclasses.asdict(TokenIds(eos_id=299, decoder_start_id=None, pad_id=NO_TOKEN))
  for name, ids in (("ours", ours), ("theirs", theirs)):
    checkpoints.save_params(str(tmp_path / name), params, dict(stored, token_ids=ids))
  assert convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'ours'}",
                       f"--output={tmp_path / 'hf_ours'}"]) == 0
  written = json.load(open(tmp_path / "hf_ours" / "config.json"))
  assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (0, 1, 0)
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'theirs'}",
                  f"--output={tmp_path / 'hf_theirs'}"])
  assert exit_info.value.code == 1
  err = capsys.readouterr().err
  assert "'eos_id': 299" in err and "pass --tokenizer_dir=" in err
  assert not (tmp_path / "hf_theirs").exists()


def test_a_missing_input_is_named_before_anything_is_read(tmp_path, capsys):
  """--input that does not exist: exit 1 naming it (it read as '<input>/config.json not
  found: pass a model config', which sent a user to --model)."""
  missing = tmp_path / "no_such_checkpoint"
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["--from=hf", "--to=ours", f"--input={missing}",
                  f"--output={tmp_path / 'out'}"])
  assert exit_info.value.code == 1
  assert f"--input={missing} does not exist" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()
