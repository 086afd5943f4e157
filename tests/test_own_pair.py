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
    # Weights wide enough that greedy outputs differ from prompt to prompt (at 0.02 every
    # prompt, all ending "step by step.", gives one output).
    target = hf_fixtures.save_model(str(root / kind / "target"), kind, tokenizer,
                                    vocab_size=len(tokenizer) + 36, initializer_range=0.1)
    if kind == "llama":  # agrees with the target on some greedy tokens: tau neither 1 nor 3
      draft = hf_fixtures.save_near_copy(str(root / kind / "draft"), target, noise=0.1)
    else:  # one tokenizer, fewer embedding rows than the target's
      draft = hf_fixtures.save_model(str(root / kind / "draft"), kind, tokenizer,
                                     vocab_size=len(tokenizer) + 20, seed=1,
                                     num_hidden_layers=1)
    out[kind] = {"target": target, "draft": draft}
  other = hf_fixtures.fast_tokenizer("llama", sentences=[s[::-1] for s in hf_fixtures.SENTENCES])
  out["other_draft"] = hf_fixtures.save_model(str(root / "other_draft"), "llama", other,
                                              num_hidden_layers=1)
  hf_fixtures.write_gsm8k(root, "So {i}!\n#### {i}",
                          hf_fixtures.SENTENCES[:4] + hf_fixtures.MORE_QUESTIONS)
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


def test_a_file_that_is_not_a_tokenizer_is_a_user_error_naming_it(own, tmp_path, capsys):
  bad = tmp_path / "tokenizer.json"
  bad.write_bytes(b"\x0a\x05hello protobuf")
  model_dir = tmp_path / "run"
  argv = ["--gin_file=gin/runs/eval_demo.gin", f"--gin.MODEL_DIR='{model_dir}'",
          f"--gin.TARGET_CHECKPOINT_PATH='{own['llama']['target']}'",
          f"--gin.DRAFT_CHECKPOINT_PATH='{own['llama']['draft']}'",
          f"--gin.VOCABULARY='{bad}'", f"--gin.DATA_DIR='{own['data_dir']}'",
          "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'"]
  # The binary's command line in this process (test_bad_inputs.py runs it as a process).
  code, err = _cli(eval_lib.cli, argv, capsys)
  assert code == 1, err[-2000:]  # the binaries' user-error status
  assert f"VOCABULARY='{bad}'" in err and "is not a Hugging Face tokenizer.json" in err
  assert "Traceback" not in err and "DecodeError" not in err
  assert not os.path.exists(model_dir)


def _cli(cli, argv: list, capsys) -> tuple:
  """(exit status, stderr) of a binary's `cli(argv)`, as `python -m` runs it, in this process."""
  import gin
  gin.clear_config()
  try:
    code = cli(argv)
  finally:
    gin.clear_config()
  return code, capsys.readouterr().err


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
      distill_steps=2, batch_size=2, warmup_steps=1, eval_examples=8,
      speed=SpeedConfig(examples=1, repeats=1, calls=1, cpus=0),
      grid=DecodingGrid(gammas=(2,), temperatures=(0.0,)),
      max_new_tokens=6, eval_every=1, max_decode_length=192, progress_bar=False)
  fields.update(changes)
  return PipelineConfig(**fields)


@pytest.fixture(scope="module")
def jobs(own, tmp_path_factory):
  """kind -> the main job run once from that pair (8 test prompts), its distilled draft
  exported to an HF folder beside the target's tokenizer: {"config", "outcome", "run",
  "export", "export_status"}. Every test of a job reads this one run."""
  from distillspec_jax import convert
  from distillspec_jax.studies import pipeline
  done = {}

  def run(kind):
    if kind not in done:
      root = tmp_path_factory.mktemp(f"job_{kind}")
      config = _job(own, kind, root / "run")
      config.check_inputs()
      outcome = pipeline.run_pipeline(config)
      export = str(root / "export")
      status = convert.main(["--from=ours", "--to=hf",
                             f"--input={root / 'run' / 'distill_supervised_kd'}",
                             f"--output={export}", f"--tokenizer_dir={own[kind]['target']}"])
      done[kind] = {"config": config, "outcome": outcome, "run": str(root / "run"),
                    "export": export, "export_status": status}
    return done[kind]

  return run


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_main_job_from_a_pretrained_pair(own, jobs, kind):
  import jax
  import numpy as np
  import transformers
  from distillspec_jax.interop import importer
  from distillspec_jax.studies import pipeline
  job = jobs(kind)
  config, run_dir = job["config"], job["run"]
  assert job["outcome"]["target"] == "ran" and os.path.isfile(os.path.join(run_dir,
                                                                           "report.json"))
  # The ids trained on are the tokenizer's, with no start id 0 before them.
  tokenizer = transformers.AutoTokenizer.from_pretrained(own[kind]["target"])
  with np.load(os.path.join(run_dir, "vocab", "train.npz")) as arrays:
    inputs = arrays["decoder_input_tokens"]
  from distillspec_jax.data.tasks import preprocessors
  assert preprocessors.COT_PREFIX == "Q: "
  expected = [tokenizer(p)["input_ids"] for p in _prompt_texts(own)]
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
  report = json.load(open(os.path.join(run_dir, "report.json")))
  assert "supervised_kd" in json.dumps(report)
  # The distilled draft exports beside the target's tokenizer and loads in transformers.
  assert job["export_status"] == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(job["export"])
  source = transformers.AutoConfig.from_pretrained(own[kind]["draft"])
  for key in ("rope_parameters", "max_position_embeddings", "rms_norm_eps", "eos_token_id",
              "bos_token_id", "vocab_size", "num_hidden_layers"):
    assert getattr(exported.config, key) == getattr(source, key), key
  assert transformers.AutoTokenizer.from_pretrained(job["export"])("Hi!")["input_ids"] == (
      tokenizer("Hi!")["input_ids"])
  # Without --tokenizer_dir the export would say our ids (eos 1): refused, exit 1, naming it.
  from distillspec_jax import convert
  bare = os.path.join(os.path.dirname(job["export"]), "export_without_tokenizer")
  with pytest.raises(SystemExit) as exit_info:
    convert.main(["--from=ours", "--to=hf", f"--output={bare}",
                  f"--input={os.path.join(run_dir, 'distill_supervised_kd')}"])
  assert exit_info.value.code == 1 and not os.path.exists(bare)


def _prompt_texts(own) -> list:
  """The job's prompts (train and test splits hold the same rows), as the task writes them."""
  rows = [json.loads(l) for l in open(os.path.join(own["data_dir"], "gsm8k", "test.jsonl"))]
  return ["Q: " + r["question"] + " A: Let's think step by step." for r in rows]


def _hf_pair(own, job, kind="llama"):
  import transformers
  target = transformers.AutoModelForCausalLM.from_pretrained(own[kind]["target"]).eval()
  draft = transformers.AutoModelForCausalLM.from_pretrained(job["export"]).eval()
  return target, draft, transformers.AutoTokenizer.from_pretrained(own[kind]["target"])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_assisted_generation_with_the_exported_draft_gives_the_targets_greedy_output(
    own, jobs, kind):
  import torch
  job = jobs(kind)
  target, draft, tokenizer = _hf_pair(own, job, kind)
  if kind == "llama":
    assert tokenizer.pad_token is None
    assert tokenizer("Hi")["input_ids"][0] == tokenizer.bos_token_id
  prompts = _prompt_texts(own)
  assert len(prompts) == 8
  settings = dict(do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
  if draft.config.vocab_size != target.config.vocab_size:
    # transformers reads other row counts as another tokenizer: without both tokenizers it
    # refuses the draft; with them it runs its universal assisted decoding (text round trip).
    settings.update(tokenizer=tokenizer, assistant_tokenizer=tokenizer)
  outputs, agreed = set(), 0
  for text in prompts:
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad(), hf_fixtures.one_torch_thread():
      alone = target.generate(**ids, **{k: v for k, v in settings.items()
                                        if "tokenizer" not in k})
      assisted = target.generate(**ids, assistant_model=draft, **settings)
      # How often the draft's greedy token is the target's along the output.
      scored = [m(alone).logits[0, ids["input_ids"].shape[1] - 1:-1, :len(tokenizer)].argmax(-1)
                for m in (target, draft)]
    assert assisted.tolist() == alone.tolist(), text
    outputs.add(tuple(alone[0, ids["input_ids"].shape[1]:].tolist()))
    agreed += int((scored[0] == scored[1]).sum())
  assert len(outputs) > 1  # the prompts lead to different outputs
  if kind == "llama":  # its draft is a near copy: some tokens proposed are accepted, not all
    assert 0 < agreed < 8 * 12


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_job_tau_at_t0_equals_a_greedy_speculative_decode_by_hand(own, jobs, kind):
  """report.json's tau at T = 0 of the raw draft (the user's HF draft folder) and of the
  distilled one (its export) equals the tau of hf_fixtures.greedy_speculative in transformers
  on the job's 8 test prompts, encoded as the tokenizer encodes them (Llama: its BOS first;
  Qwen2: none). Convention (decoding/speculative.py): tau = tokens produced by verification
  rounds / verification calls; the first token, from the target's call on the prompt, counts
  in neither."""
  import transformers
  from distillspec_jax.studies import pipeline
  job = jobs(kind)
  config = job["config"]
  target, exported, tokenizer = _hf_pair(own, job, kind)
  raw = transformers.AutoModelForCausalLM.from_pretrained(own[kind]["draft"]).eval()
  # The prompts the job decoded are the tokenizer's ids for the prompt texts, nothing added.
  examples = pipeline.test_examples(config)[0]
  encoded = [tokenizer(t)["input_ids"] for t in examples.prompt_texts]
  assert examples.prompt_texts == _prompt_texts(own)
  assert [list(row[:n]) for row, n in zip(examples.prompts.tolist(),
                                          examples.prompt_lengths)] == encoded
  report = json.load(open(os.path.join(job["run"], "report.json")))
  rows = {r["draft"]: r for r in report["draft_rows"]
          if r["temperature"] == 0.0 and r["gamma"] == 2}
  assert set(rows) == {"raw", "supervised_kd"}
  (gamma,) = config.grid.gammas
  cuts = 0
  for name, draft in (("raw", raw), ("supervised_kd", exported)):
    tau, runs = _hand_tau(target, draft, encoded, tokenizer, gamma, config.max_new_tokens)
    assert rows[name]["tau"] == tau, name
    if kind == "llama":  # a near-copy draft: some rounds accept, some reject
      assert 1.0 < tau < gamma + 1, name
    cuts += sum(r["length_cut"] for r in runs)
  assert cuts or kind != "llama"  # some last rounds lost tokens to the length limit


def _hand_tau(target, draft, encoded, tokenizer, gamma, max_new_tokens) -> tuple:
  """(tau, runs) of hf_fixtures.greedy_speculative over the prompts `encoded`."""
  with hf_fixtures.one_torch_thread():
    runs = [hf_fixtures.greedy_speculative(target, draft, ids, gamma=gamma,
                                           eos_id=tokenizer.eos_token_id,
                                           max_new_tokens=max_new_tokens,
                                           num_tokens=len(tokenizer)) for ids in encoded]
  produced = sum(r["produced"] for r in runs)
  return float(produced / sum(r["target_calls"] for r in runs)), runs


def test_eval_binary_tau_with_eos_cuts_equals_the_hand_run(own, tmp_path):
  """The eval binary's evaluation (eval.evaluate, VOCABULARY = the HF folder) at T = 0 with
  a target that ends its outputs early: EOS accepted inside rounds and the length limit cut
  rounds, counted as the hand-run in transformers counts them."""
  import transformers
  tokenizer = transformers.AutoTokenizer.from_pretrained(own["llama"]["target"])
  source = transformers.AutoModelForCausalLM.from_pretrained(own["llama"]["target"]).eval()
  encoded = [tokenizer(t)["input_ids"] for t in _prompt_texts(own)]
  with hf_fixtures.one_torch_thread():  # the target's greedy outputs (their own draft)
    outputs = [hf_fixtures.greedy_speculative(source, source, ids, gamma=1, eos_id=-1,
                                              max_new_tokens=8, num_tokens=len(tokenizer))
               for ids in encoded]
  # Its most frequent later token becomes EOS: rows end at different positions.
  later = [t for o in outputs for t in o["tokens"][1:]]
  target_dir = hf_fixtures.save_with_eos_for(str(tmp_path / "target"), own["llama"]["target"],
                                             max(set(later), key=later.count))
  draft_dir = hf_fixtures.save_near_copy(str(tmp_path / "draft"), target_dir, noise=0.1)
  target, draft = (transformers.AutoModelForCausalLM.from_pretrained(d).eval()
                   for d in (target_dir, draft_dir))
  gamma, new_tokens = 3, LENGTHS["targets"]
  tau, runs = _hand_tau(target, draft, encoded, tokenizer, gamma, new_tokens)
  ends = [r["tokens"][-1] == tokenizer.eos_token_id for r in runs]
  assert any(ends) and not all(ends)  # EOS ends some rows, the length limit others
  assert 1.0 < tau < gamma + 1
  metrics = eval_lib.evaluate(_config(own, "llama", tmp_path / "run", eval_examples=8,
                                      target_checkpoint_path=target_dir,
                                      draft_checkpoint_path=draft_dir, vocabulary=target_dir,
                                      grid=DecodingGrid(gammas=(gamma,),
                                                        temperatures=(0.0,))))
  (row,) = metrics["rows"]
  assert row["tau"] == tau


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


def test_a_folder_that_does_not_describe_its_model_is_refused_before_work(own, tmp_path):
  """Draft folders whose model the checks used to take on trust, each refused by the main
  job's and the eval binary's checks naming DRAFT_CHECKPOINT_PATH and the fix (before: a
  config.json whose vocab_size is not the tensors' failed at the main job's draft_raw stage,
  after the target stage, and in the eval binary after MODEL_DIR was written; a folder without
  config.json named macros that do not exist, TARGET_MODEL / DRAFT_MODEL, or convert's
  --model); so is a VOCABULARY path that does not exist (the main job named a SentencePiece
  .model as the fix)."""
  import shutil
  tokenizer = hf_fixtures.fast_tokenizer("llama")
  folders = {name: str(tmp_path / name) for name in ("no_config", "wrong_rows")}
  for folder in folders.values():
    shutil.copytree(own["llama"]["draft"], folder)
  os.remove(os.path.join(folders["no_config"], "config.json"))
  with open(os.path.join(folders["wrong_rows"], "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(folders["wrong_rows"], "config.json"), "w") as f:
    json.dump(dict(hf, vocab_size=hf["vocab_size"] + 3), f)
  folders["few_rows"] = hf_fixtures.save_model(str(tmp_path / "few_rows"), "llama", tokenizer,
                                               vocab_size=len(tokenizer) - 10,
                                               num_hidden_layers=1)
  named = {"no_config": r"has no config.json beside its safetensors.*put the config.json",
           "wrong_rows": r"its config.json and its safetensors disagree.*embed_tokens",
           "few_rows": rf"does not fit VOCABULARY: .*has {len(tokenizer)} ids but the models "
                       rf"only {len(tokenizer) - 10} embedding rows"}
  for name, folder in folders.items():
    match = rf"DRAFT_CHECKPOINT_PATH='{folder}'.*{named[name]}"
    with pytest.raises(ValueError, match=match):
      _job(own, "llama", tmp_path / f"job_{name}", draft_checkpoint_path=folder).check_inputs()
    with pytest.raises(ValueError, match=match):
      eval_lib.evaluate(_config(own, "llama", tmp_path / f"eval_{name}",
                                draft_checkpoint_path=folder))
  with pytest.raises(ValueError, match=r"PipelineConfig.draft_model"):
    _job(own, "llama", tmp_path / "job", draft_checkpoint_path=folders["no_config"]).check_inputs()
  from distillspec_jax.studies.pair_source import PairSource
  with pytest.raises(ValueError, match=r"VOCABULARY='.*nope' does not exist; pass the "
                                       r"checkpoints' tokenizer: a Hugging Face model folder"):
    _job(own, "llama", tmp_path / "job_vocab",
         pair=PairSource(vocabulary=str(tmp_path / "nope"))).check_inputs()
  assert not [n for n in os.listdir(tmp_path) if n.startswith(("job", "eval"))]


def test_a_llama2_folder_with_only_tokenizer_model_is_refused_before_work(own, tmp_path):
  """A Llama-2-style folder whose tokenizer is only a SentencePiece tokenizer.model (read
  with T5's conventions: pad 0, EOS 1) while its config.json says EOS 2: refused by the main
  job and the eval binary, with VOCABULARY the folder or unset, naming the fix (a
  tokenizer.json). Before, the job ran the vocab, target and draft_raw stages with EOS 1 (the
  model's BOS) and pad 0 (its unk), and failed at the first tau curve on an unk in a prompt
  ('prompt_tokens row 0 has padding (id 0) ... followed by a real id'), or ran on."""
  import shutil
  from distillspec_jax.data import vocabularies
  from distillspec_jax.studies.pair_source import PairSource
  folder = str(tmp_path / "llama2")
  shutil.copytree(own["llama"]["target"], folder)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    os.remove(os.path.join(folder, name))
  vocabularies.train_sentencepiece(hf_fixtures.SENTENCES * 4, os.path.join(folder,
                                                                           "tokenizer.model"),
                                   vocab_size=120)
  with open(os.path.join(folder, "config.json")) as f:
    eos = json.load(f)["eos_token_id"]
  assert eos != 1
  match = rf"TARGET_CHECKPOINT_PATH='{folder}': its config.json says eos_token_id={eos}.*T5's "
  match += r"conventions \(pad 0, EOS 1\).*Give the folder a tokenizer.json"
  for pair in (PairSource(vocabulary=folder), PairSource()):
    with pytest.raises(ValueError, match=match):
      _job(own, "llama", tmp_path / "job", target_checkpoint_path=folder,
           draft_checkpoint_path=folder, pair=pair).check_inputs()
  for vocabulary in (folder, None):
    with pytest.raises(ValueError, match=match):
      eval_lib.evaluate(_config(own, "llama", tmp_path / "eval", target_checkpoint_path=folder,
                                draft_checkpoint_path=folder, vocabulary=vocabulary))
  assert not os.path.exists(tmp_path / "job") and not os.path.exists(tmp_path / "eval")


def test_eval_binary_refuses_a_decoding_cache_too_small_before_model_dir(own, tmp_path):
  """EvalConfig.max_decode_length below 1 + the prompt length (160) + the new tokens (8) +
  gamma - 1 (1) is refused by check_inputs naming the 170 to set; it used to fail in the
  decoder after MODEL_DIR/config.gin and inferences/ were written."""
  with pytest.raises(ValueError, match=r"EvalConfig.max_decode_length=169 is smaller than the "
                                       r"170 decoding-cache positions.*max_decode_length=170"):
    eval_lib.evaluate(_config(own, "llama", tmp_path / "run", max_decode_length=169))
  assert not os.path.exists(tmp_path / "run")


def test_a_pretrained_pair_without_vocabulary_is_refused_before_work(own, tmp_path, capsys):
  """VOCABULARY left unset (own_pair_gsm8k.gin's default None) with an HF Llama/Qwen folder
  that carries its tokenizer: the main job, the eval and the train binaries each refuse it,
  naming the folder to set. Before, the main job wrote MODEL_DIR and tokenized GSM8K with
  T5's SentencePiece (offline: a gs:// traceback; online: another tokenizer's ids into the
  pair), and the eval and train binaries used the task's own vocabulary."""
  from distillspec_jax import train as train_lib
  from distillspec_jax.studies.pair_source import PairSource
  target = own["llama"]["target"]
  named = rf"TARGET_CHECKPOINT_PATH='{target}' carries its own tokenizer .* VOCABULARY is not set"
  with pytest.raises(ValueError, match=named):
    _job(own, "llama", tmp_path / "job", pair=PairSource()).check_inputs()
  with pytest.raises(ValueError, match=named):
    eval_lib.evaluate(_config(own, "llama", tmp_path / "eval", vocabulary=None,
                              mixture_or_task_name="embedded_arithmetic", data_dir=None))
  code, err = _cli(train_lib.cli, ["--gin_file=gin/runs/distill_llama_demo.gin",
                                   f"--gin.MODEL_DIR='{tmp_path / 'train'}'",
                                   "--gin.TRAIN_STEPS=2",
                                   f"--gin.TARGET_CHECKPOINT_PATH='{target}'"], capsys)
  assert code == 1 and "VOCABULARY is not set" in err and f"VOCABULARY=\"'{target}'\"" in err
  assert not [n for n in os.listdir(tmp_path) if n in ("job", "eval", "train")]


def test_train_binary_distils_on_a_file_task_with_the_models_tokenizer(own, tmp_path,
                                                                      capsys):
  """gin/runs/distill_own_pair.gin: target and draft built from their own config.json
  (model_from_checkpoint), no preset to match; a preset that does not describe the
  checkpoint, and a path that carries no configuration, are refused before MODEL_DIR."""
  tokenizer = hf_fixtures.fast_tokenizer("llama")
  target = hf_fixtures.save_model(str(tmp_path / "target"), "llama", tokenizer, vocab_size=336,
                                  hidden_size=128, intermediate_size=1024, head_dim=32,
                                  num_attention_heads=4, num_key_value_heads=2)
  draft = hf_fixtures.save_model(str(tmp_path / "draft"), "llama", tokenizer, vocab_size=320,
                                 seed=1, num_hidden_layers=1)
  data_dir = own["data_dir"]
  common = ["--gin.TRAIN_STEPS=2", "--gin.EVAL_EVERY=0", "--gin.BATCH_SIZE=2",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 160, 'targets': 16}",
            f"--gin.TARGET_CHECKPOINT_PATH='{target}'", f"--gin.DATA_DIR='{data_dir}'",
            f"--gin.VOCABULARY='{target}'", "--gin.DistillationConfig.max_new_tokens=8",
            "--gin.TrainConfig.warmup_steps=1"]
  command = [sys.executable, "-m", "distillspec_jax.train",
             "--gin_file=gin/runs/distill_own_pair.gin", f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
             f"--gin.INITIAL_CHECKPOINT_PATH='{draft}'", *common]
  env = {**os.environ, "PYTHONPATH": REPO}
  done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["loss"] > 0
  # A preset instead (its RoPE is not the checkpoint's): refused before MODEL_DIR is written
  # (through the binary's command line in this process; the run above is the process).
  from distillspec_jax import train as train_lib
  bad = ["--gin_file=gin/runs/distill_llama_demo.gin", "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'",
         "--gin.llama_demo_target/model_by_name.vocab_size=336",
         "--gin.llama_demo_draft/model_by_name.vocab_size=320", *common]
  code, err = _cli(train_lib.cli, bad + [f"--gin.MODEL_DIR='{tmp_path / 'bad'}'"], capsys)
  assert code == 1 and "rope_theta" in err and "Traceback" not in err, err
  assert not os.path.exists(tmp_path / "bad")
  (tmp_path / "empty").mkdir()
  code, err = _cli(train_lib.cli, command[3:4] + common + [
      f"--gin.INITIAL_CHECKPOINT_PATH='{tmp_path / 'empty'}'",
      f"--gin.MODEL_DIR='{tmp_path / 'bad'}'"], capsys)
  assert code == 1 and f"model_from_checkpoint.path='{tmp_path / 'empty'}'" in err, err
  assert "Traceback" not in err and not os.path.exists(tmp_path / "bad")


def test_train_binary_distils_on_chat_conversations(tmp_path, capsys):
  import shutil
  import gin
  from distillspec_jax import train as train_lib
  target = hf_fixtures.save_model(str(tmp_path / "target"), "llama", hf_fixtures.chat_tokenizer(),
                                  vocab_size=336, hidden_size=128, intermediate_size=1024,
                                  head_dim=32, num_attention_heads=4, num_key_value_heads=2)
  preset = "llama_demo_target/model_by_name"
  argv = ["--gin_file=gin/runs/distill_llama_demo.gin", "--gin_file=gin/recipes/supervised_kd.gin",
          "--gin.TRAIN_STEPS=2", "--gin.EVAL_EVERY=0", "--gin.BATCH_SIZE=2",
          "--gin.MIXTURE_OR_TASK_NAME='chat_files'", "--gin.CHAT_TEMPLATE=True",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 192, 'targets': 32}",
          f"--gin.TARGET_CHECKPOINT_PATH='{target}'",
          f"--gin.DATA_DIR='{hf_fixtures.write_chat(tmp_path)}'",
          "--gin.llama_demo_draft/model_by_name.vocab_size=320",
          *[f"--gin.{preset}.{k}={v}" for k, v in (
              ("vocab_size", 336), ("rope_theta", 500000.0), ("rope_scaling", "'llama3'"),
              ("rope_scaling_factor", 8.0), ("rope_original_max_length", 64))]]
  # The same tokenizer without its chat template: refused before MODEL_DIR is written.
  plain = tmp_path / "plain"
  plain.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(target, name), plain / name)
  try:
    assert train_lib.cli(argv + [f"--gin.MODEL_DIR='{tmp_path / 'bad'}'",
                                 f"--gin.VOCABULARY='{plain}'"]) == 1
    assert f"'{plain}' has no chat template" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")
    gin.clear_config()
    assert train_lib.cli(argv + [f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
                                 f"--gin.VOCABULARY='{target}'"]) == 0
  finally:
    gin.clear_config()
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"] > 0


def _deliver_6_cases(own, bad_tokenizer) -> list:
  """(binary, flags, text the message must hold): each mismatch that would otherwise give a
  wrong result or a late traceback."""
  llama, other = own["llama"], own["other_draft"]
  job = ["--gin_file=gin/runs/own_pair_gsm8k.gin", f"--gin.DATA_DIR='{own['data_dir']}'",
         f"--gin.TARGET_CHECKPOINT_PATH='{llama['target']}'",
         f"--gin.VOCABULARY='{llama['target']}'"]
  evaluation = ["--gin_file=gin/runs/eval_demo.gin", f"--gin.DATA_DIR='{own['data_dir']}'",
                "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'",
                f"--gin.TARGET_CHECKPOINT_PATH='{llama['target']}'",
                "--gin.EvalConfig.progress_bar=False"]
  return [
      # a draft with another tokenizer (the same size) than the target's
      ("main", job + [f"--gin.DRAFT_CHECKPOINT_PATH='{other}'"], "carries another tokenizer"),
      ("eval", evaluation + [f"--gin.DRAFT_CHECKPOINT_PATH='{other}'",
                             f"--gin.VOCABULARY='{llama['target']}'"],
       "carries another tokenizer"),
      # a checkpoint that is not the preset it is said to be
      ("main", job + [f"--gin.DRAFT_CHECKPOINT_PATH='{llama['draft']}'",
                      "--gin.PipelineConfig.target_model='tiny_llama'"], "preset 'tiny_llama'"),
      ("eval", evaluation + [f"--gin.DRAFT_CHECKPOINT_PATH='{llama['draft']}'",
                             f"--gin.VOCABULARY='{llama['target']}'",
                             "--gin.EvalConfig.target_model='tiny_llama'"], "tiny_llama"),
      # a tokenizer.json that is not one
      ("eval", evaluation + [f"--gin.DRAFT_CHECKPOINT_PATH='{llama['draft']}'",
                             f"--gin.VOCABULARY='{bad_tokenizer}'"],
       "is not a Hugging Face tokenizer.json"),
      # a setting the chosen run file does not read
      ("main", job + [f"--gin.DRAFT_CHECKPOINT_PATH='{llama['draft']}'",
                      "--gin.LENIENCE_KINDS=('exp',)"], "LENIENCE_KINDS"),
  ]


def test_each_mismatch_exits_1_naming_it_before_any_work(own, tmp_path, capsys):
  """Issue 47's Deliver 6 through the binaries' command-line path (`cli`, as `python -m`
  runs it): exit status 1, the value named, no traceback, no MODEL_DIR."""
  import testing
  from distillspec_jax import main as main_lib
  bad = tmp_path / "tokenizer.json"
  bad.write_bytes(b"\x0a\x05hello protobuf")
  clis = {"main": main_lib.cli, "eval": eval_lib.cli}
  for index, (binary, flags, named) in enumerate(_deliver_6_cases(own, bad)):
    model_dir = tmp_path / f"out_{index}"
    testing.assert_refused_before_work(clis[binary], flags + [f"--gin.MODEL_DIR='{model_dir}'"],
                                       named, model_dir, capsys)


def test_a_special_token_past_the_models_rows_is_cut_and_refused_in_an_example(own, tmp_path):
  """Gemma 3's layout (270M / 1B: config.json vocab_size 262144, its tokenizer's added
  special token <image_soft_token> at id 262144) on a tiny Qwen3 pair: the eval binary runs
  with logits over the rows only (before: refused, 'has 300 embedding rows but VOCABULARY has
  301 tokens'), the main job's checks pass; an example whose text spells the token is refused
  naming the id, the token and the example; rows that leave out EOS/pad or an ordinary token
  stay refused, naming them."""
  from distillspec_jax.data import vocabularies
  tokenizer = hf_fixtures.fast_tokenizer("qwen2")
  rows = len(tokenizer)
  tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
  assert len(tokenizer) == rows + 1
  target = hf_fixtures.save_model(str(tmp_path / "target"), "qwen3", tokenizer,
                                  vocab_size=rows, initializer_range=0.1)
  draft = hf_fixtures.save_model(str(tmp_path / "draft"), "qwen3", tokenizer, vocab_size=rows,
                                 seed=1, num_hidden_layers=1)
  pair = dict(target_checkpoint_path=target, draft_checkpoint_path=draft, vocabulary=target)
  metrics = eval_lib.evaluate(_config(own, "qwen2", tmp_path / "run", **pair))
  (row,) = metrics["rows"]
  assert 1.0 <= row["tau"] <= 3.0
  assert vocabularies.token_ids(target, rows=rows).num_tokens == rows
  from distillspec_jax.studies.pair_source import PairSource
  _job(own, "qwen2", tmp_path / "job", target_checkpoint_path=target,
       draft_checkpoint_path=draft, pair=PairSource(vocabulary=target)).check_inputs()
  spelled = tmp_path / "spelled"
  hf_fixtures.write_gsm8k(spelled, "So {i}!\n#### {i}", list(hf_fixtures.SENTENCES[:3])
                          + ["How many <image_soft_token> are there?"])
  with pytest.raises(ValueError, match=rf"Example 3 of task 'gsm8k_files' \(prompt .Q: How many "
                                       rf"<image_soft_token>.*encodes to id {rows} "
                                       r"\('<image_soft_token>'\), past the"):
    eval_lib.evaluate(_config(own, "qwen2", tmp_path / "run_spelled",
                              data_dir=str(spelled / "data"), **pair))
  cases = {rows - 3: rf"EOS/pad {rows - 3} '<\|endoftext\|>'",  # Qwen2's EOS is its pad
           rows - 4: rf"1 of them are not added special tokens .*: {rows - 4} "}
  for few, named in cases.items():
    folder = hf_fixtures.save_model(str(tmp_path / f"rows_{few}"), "qwen3", tokenizer,
                                    vocab_size=few, num_hidden_layers=1)
    match = (rf"DRAFT_CHECKPOINT_PATH='{folder}' does not fit VOCABULARY: .*has {rows + 1} "
             rf"ids but the models only {few} embedding rows.*{named}")
    with pytest.raises(ValueError, match=match):
      _config(own, "qwen2", tmp_path / "refused", target_checkpoint_path=target,
              draft_checkpoint_path=folder, vocabulary=target).check_inputs()
    with pytest.raises(ValueError, match=match):
      _job(own, "qwen2", tmp_path / "refused_job", target_checkpoint_path=target,
           draft_checkpoint_path=folder, pair=PairSource(vocabulary=target)).check_inputs()
  assert not os.path.exists(tmp_path / "refused") and not os.path.exists(tmp_path / "refused_job")
