"""A user's own pretrained pair through the binaries: Hugging Face Llama-3-style and Qwen2
folders (tiny, random, one byte-level BPE tokenizer), a GSM8K-style JSONL folder, the models'
own tokenizer as VOCABULARY; bad inputs refused before anything is written."""

import json
import os
import subprocess
import sys

import pytest

import hf_fixtures
from distillspec_jax import eval as eval_lib
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig

pytestmark = pytest.mark.integration

LENGTHS = {"inputs": 160, "targets": 8}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def own(tmp_path_factory):
  root = tmp_path_factory.mktemp("own")
  out = {}
  for kind in ("llama", "qwen2"):
    tokenizer = hf_fixtures.fast_tokenizer(kind)
    out[kind] = {
        "target": hf_fixtures.save_model(str(root / kind / "target"), kind, tokenizer,
                                         vocab_size=len(tokenizer) + 36),
        "draft": hf_fixtures.save_model(str(root / kind / "draft"), kind, tokenizer,
                                        vocab_size=len(tokenizer) + 20, seed=1,
                                        num_hidden_layers=1)}
  other = hf_fixtures.fast_tokenizer("llama", sentences=[s[::-1] for s in hf_fixtures.SENTENCES])
  out["other_draft"] = hf_fixtures.save_model(str(root / "other_draft"), "llama", other,
                                              num_hidden_layers=1)
  hf_fixtures.write_gsm8k(root, "So {i}!\n#### {i}")
  out["data_dir"] = str(root / "data")
  return out


def _config(own, kind, model_dir, **changes):
  fields = dict(model_dir=str(model_dir), mixture_or_task_name="gsm8k_files",
                task_feature_lengths=LENGTHS, batch_size=4, eval_examples=4,
                target_checkpoint_path=own[kind]["target"],
                draft_checkpoint_path=own[kind]["draft"], vocabulary=own[kind]["target"],
                data_dir=own["data_dir"], grid=DecodingGrid(gammas=(2,), temperatures=(0.0,)),
                speed=SpeedConfig(examples=0), progress_bar=False)
  fields.update(changes)
  return eval_lib.EvalConfig(**fields)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_eval_binary_reports_tau_with_the_models_tokenizer(own, kind, tmp_path):
  metrics = eval_lib.evaluate(_config(own, kind, tmp_path / "run"))
  (row,) = metrics["rows"]
  assert 1.0 <= row["tau"] <= 3.0  # gamma 2: at most 3 tokens a target call
  with open(tmp_path / "run" / "inferences" / "gsm8k_files.jsonl") as f:
    lines = [json.loads(l) for l in f]
  assert [l["decoder"] for l in lines].count("speculative") == 4
  assert lines[0]["input"].startswith("Q: Natalia sold clips")


def test_a_draft_with_another_tokenizer_is_refused_before_work(own, tmp_path):
  with pytest.raises(ValueError, match=r"DRAFT_CHECKPOINT_PATH=.*other_draft.* carries another "
                                       r"tokenizer than VOCABULARY"):
    eval_lib.evaluate(_config(own, "llama", tmp_path / "run",
                              draft_checkpoint_path=own["other_draft"]))
  assert not os.path.exists(tmp_path / "run")


def test_a_file_that_is_not_a_tokenizer_is_a_user_error_naming_it(own, tmp_path):
  bad = tmp_path / "tokenizer.json"
  bad.write_bytes(b"\x0a\x05hello protobuf")
  model_dir = tmp_path / "run"
  command = [sys.executable, "-m", "distillspec_jax.eval", "--gin_file=gin/runs/eval_demo.gin",
             f"--gin.MODEL_DIR='{model_dir}'",
             f"--gin.TARGET_CHECKPOINT_PATH='{own['llama']['target']}'",
             f"--gin.DRAFT_CHECKPOINT_PATH='{own['llama']['draft']}'",
             f"--gin.VOCABULARY='{bad}'", f"--gin.DATA_DIR='{own['data_dir']}'",
             "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'"]
  done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                        env={**os.environ, "PYTHONPATH": REPO})
  assert done.returncode == 1, done.stderr[-2000:]  # the binaries' user-error status
  assert f"VOCABULARY='{bad}'" in done.stderr and "is not a Hugging Face tokenizer.json" in (
      done.stderr)
  assert "Traceback" not in done.stderr and "DecodeError" not in done.stderr
  assert not os.path.exists(model_dir)


def test_convert_round_trips_a_non_preset_model_without_model(own, tmp_path):
  import numpy as np
  import torch
  import transformers
  from distillspec_jax import convert
  from distillspec_jax.interop import importer
  source = own["llama"]["target"]
  ours, back = str(tmp_path / "ours"), str(tmp_path / "hf")
  assert convert.main(["--from=hf", "--to=ours", f"--input={source}", f"--output={ours}"]) == 0
  stored = importer.ours_config(ours)
  assert (stored.rope_theta, stored.rope_scaling, stored.norm_epsilon) == (500000.0, "llama3", 1e-5)
  assert convert.main(["--from=ours", "--to=hf", f"--input={ours}", f"--output={back}",
                       f"--tokenizer_dir={source}"]) == 0
  original = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
  exported = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
  for key in ("rope_parameters", "max_position_embeddings", "bos_token_id", "eos_token_id",
              "pad_token_id", "rms_norm_eps"):
    assert getattr(exported.config, key) == getattr(original.config, key), key
  assert exported.config.rope_parameters["rope_type"] == "llama3"
  assert exported.config.max_position_embeddings == 4096  # not capped at our cache size
  assert exported.generation_config.eos_token_id == original.config.eos_token_id
  ids = transformers.AutoTokenizer.from_pretrained(back)("Betty has $100!", return_tensors="pt")
  with torch.no_grad():
    np.testing.assert_array_equal(exported(**ids).logits.numpy(), original(**ids).logits.numpy())
  # A configuration given beside the checkpoint is checked against the stored one.
  with pytest.raises(ValueError, match=r"rope_theta: checkpoint 500000.0 vs configured 10000.0"):
    importer.load_checkpoint(ours, stored.replace(rope_theta=10000.0))
  with pytest.raises(ValueError, match=r"rope_theta: checkpoint 500000.0"):
    importer.check_checkpoint(ours, stored.replace(rope_theta=10000.0))


def _job(own, kind, run_dir, **changes):
  from distillspec_jax.studies.pair_source import PairSource
  from distillspec_jax.studies.pipeline import PipelineConfig
  fields = dict(
      run_dir=str(run_dir), task="gsm8k_files", data_dir=own["data_dir"],
      task_feature_lengths={"inputs": 160, "targets": 16}, target_model=None, draft_model=None,
      target_checkpoint_path=own[kind]["target"], draft_checkpoint_path=own[kind]["draft"],
      pair=PairSource(vocabulary=own[kind]["target"]), recipes=("supervised_kd",),
      distill_steps=2, batch_size=2, warmup_steps=1, eval_examples=2,
      speed=SpeedConfig(examples=1, repeats=1, calls=1, cpus=0),
      grid=DecodingGrid(gammas=(2,), temperatures=(0.0,)),
      max_new_tokens=6, eval_every=1, max_decode_length=192, progress_bar=False)
  fields.update(changes)
  return PipelineConfig(**fields)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_main_job_from_a_pretrained_pair(own, kind, tmp_path):
  import jax
  import numpy as np
  import transformers
  from distillspec_jax import convert
  from distillspec_jax.interop import importer
  from distillspec_jax.studies import pipeline
  config = _job(own, kind, tmp_path / "run")
  config.check_inputs()
  outcome = pipeline.run_pipeline(config)
  assert outcome["target"] == "ran" and os.path.isfile(tmp_path / "run" / "report.json")
  # The ids trained on are the tokenizer's, with no start id 0 before them.
  tokenizer = transformers.AutoTokenizer.from_pretrained(own[kind]["target"])
  with np.load(tmp_path / "run" / "vocab" / "train.npz") as arrays:
    inputs = arrays["decoder_input_tokens"]
  rows = [json.loads(l) for l in open(os.path.join(own["data_dir"], "gsm8k", "train.jsonl"))]
  from distillspec_jax.data.tasks import preprocessors
  prompts = ["Q: " + r["question"] + " A: Let's think step by step." for r in rows]
  assert preprocessors.COT_PREFIX == "Q: "
  expected = [tokenizer(p)["input_ids"] for p in prompts]
  assert len(inputs) == len(expected)
  starts = sorted(tuple(row[:len(e)]) for row in inputs.tolist() for e in expected
                  if tuple(row[:len(e)]) == tuple(e))
  assert starts == sorted(tuple(e) for e in expected)  # each row begins with one prompt's ids
  # The target was loaded, not trained: bit for bit the checkpoint's weights.
  target, draft = pipeline.models(config)
  loaded = pipeline.load_params(config, "target", target)
  original, _ = importer.load_checkpoint(own[kind]["target"])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, original)
  raw = pipeline.load_params(config, "draft_raw", draft)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), raw,
               importer.load_checkpoint(own[kind]["draft"])[0])
  report = json.load(open(tmp_path / "run" / "report.json"))
  assert "supervised_kd" in json.dumps(report)
  # The distilled draft exports beside the target's tokenizer and loads in transformers.
  out = str(tmp_path / "export")
  assert convert.main(["--from=ours", "--to=hf", f"--input={tmp_path / 'run' / 'distill_supervised_kd'}",
                       f"--output={out}", f"--tokenizer_dir={own[kind]['target']}"]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(out)
  source = transformers.AutoConfig.from_pretrained(own[kind]["draft"])
  for key in ("rope_parameters", "max_position_embeddings", "rms_norm_eps", "eos_token_id",
              "bos_token_id", "vocab_size", "num_hidden_layers"):
    assert getattr(exported.config, key) == getattr(source, key), key
  assert transformers.AutoTokenizer.from_pretrained(out)("Hi!")["input_ids"] == tokenizer(
      "Hi!")["input_ids"]


def test_main_job_refuses_bad_pairs_before_work(own, tmp_path):
  from distillspec_jax.studies.pair_source import PairSource
  with pytest.raises(ValueError, match=r"DRAFT_CHECKPOINT_PATH=.*other_draft.* carries another "
                                       r"tokenizer"):
    _job(own, "llama", tmp_path / "a", draft_checkpoint_path=own["other_draft"]).check_inputs()
  with pytest.raises(ValueError, match=r"carry different tokenizers"):
    _job(own, "llama", tmp_path / "b", draft_checkpoint_path=own["other_draft"],
         pair=PairSource()).check_inputs()
  with pytest.raises(ValueError, match=r"TARGET_CHECKPOINT_PATH=.*does not hold the target "
                                       r"preset 'tiny_llama'"):
    _job(own, "llama", tmp_path / "c", target_model="tiny_llama").check_inputs()
  with pytest.raises(ValueError, match=r"TRAIN_VOCABULARY=True"):
    _job(own, "llama", tmp_path / "d", train_vocabulary=True).check_inputs()
  with pytest.raises(ValueError, match=r"TARGET_MODEL=None needs TARGET_CHECKPOINT_PATH"):
    _job(own, "llama", tmp_path / "e", target_checkpoint_path=None)
  assert not any(os.path.exists(tmp_path / n) for n in "abcde")


def test_train_binary_distils_on_a_file_task_with_the_models_tokenizer(own, tmp_path):
  tokenizer = hf_fixtures.fast_tokenizer("llama")
  target = hf_fixtures.save_model(str(tmp_path / "target"), "llama", tokenizer, vocab_size=336,
                                  hidden_size=128, intermediate_size=1024, head_dim=32,
                                  num_attention_heads=4, num_key_value_heads=2)
  preset = "llama_demo_target/model_by_name"
  flags = [f"--gin.{preset}.{k}={v}" for k, v in (
      ("vocab_size", 336), ("rope_theta", 500000.0), ("rope_scaling", "'llama3'"),
      ("rope_scaling_factor", 8.0), ("rope_original_max_length", 64))]
  data_dir = own["data_dir"]
  command = [sys.executable, "-m", "distillspec_jax.train",
             "--gin_file=gin/runs/distill_llama_demo.gin", f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
             "--gin.TRAIN_STEPS=2", "--gin.EVAL_EVERY=0", "--gin.BATCH_SIZE=2",
             "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'",
             "--gin.TASK_FEATURE_LENGTHS={'inputs': 160, 'targets': 16}",
             f"--gin.TARGET_CHECKPOINT_PATH='{target}'", f"--gin.DATA_DIR='{data_dir}'",
             f"--gin.VOCABULARY='{target}'", "--gin.llama_demo_draft/model_by_name.vocab_size=320",
             "--gin.DistillationConfig.max_new_tokens=8", *flags]
  env = {**os.environ, "PYTHONPATH": REPO}
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["loss"] > 0
  # The preset's RoPE left at the default: refused before MODEL_DIR is written.
  bad = [c for c in command if "rope_theta" not in c and "MODEL_DIR" not in c]
  done = subprocess.run(bad + [f"--gin.MODEL_DIR='{tmp_path / 'bad'}'"], capture_output=True,
                        text=True, timeout=600, cwd=REPO, env=env)
  assert done.returncode == 1 and "rope_theta" in done.stderr and "Traceback" not in done.stderr
  assert not os.path.exists(tmp_path / "bad")
