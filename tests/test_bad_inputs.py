"""Bad input to each binary: exit status 1, the bad value named on stderr, no traceback and no
work started (no MODEL_DIR, no checkpoint, no metrics file).

The binaries' command-line path (`cli(argv)`: gin_utils.run_binary around `main`) runs here
in this process; two cases run as real subprocesses (`integration`) to prove the status and the
absence of a traceback where the interpreter exits.
"""

import json
import os
import subprocess
import sys

import pytest

import testing

from distillspec_jax import eval as eval_lib
from distillspec_jax import main as main_lib
from distillspec_jax import train as train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOWHERE = "/nonexistent/distillspec_bad_input"

# (flag, text the message must hold: the bad value as the user wrote it)
EVAL_CASES = [
    ("--gin.BATCH_SIZE='32'", "'32'"),                      # wrong type (a string)
    ("--gin.BATCH_SIZE=0", "batch_size=0"),                 # out of range
    ("--gin.EVAL_EXAMPLES=True", "True"),                   # a bool is not a count
    ("--gin.EVAL_EXAMPLES=4.0", "4.0"),                     # a float is not a count
    ("--gin.GAMMAS=(0,)", "0"),                             # a gamma grid with 0
    ("--gin.GAMMAS=()", "()"),                              # an empty grid
    ("--gin.TEMPERATURES=(-1.0,)", "-1.0"),                 # negative temperature
    ("--gin.LENIENCE_KINDS=('cubic',)", "'cubic'"),         # unknown choice
    ("--gin.EPSILONS=(0.0,)", "0.0"),                       # out of (0, 1]
    ("--gin.DRAFT_LENGTH_RULE='sometimes'", "'sometimes'"),  # unknown choice
    ("--gin.DraftLength.threshold=1.5", "DraftLength.threshold=1.5"),  # out of [0, 1]
    ("--gin.SpeedConfig.calls=0", "SpeedConfig.calls=0"),  # a sub-config's field, by name
    ("--gin.TARGET_PARAM_DTYPE='float8'", "PrecisionConfig.target_param_dtype='float8'"),
    ("--gin.PrecisionConfig.activation_dtype='bf16'", "PrecisionConfig.activation_dtype='bf16'"),
    ("--gin.SPEED_BUDGET_S=-1", "-1"),                      # out of range
    ("--gin.SPEED_EXAMPLES=500", "500"),                    # more timed than evaluated
    (f"--gin.VOCABULARY='{NOWHERE}.model'", f"{NOWHERE}.model"),  # missing file
    (f"--gin.TARGET_CHECKPOINT_PATH='{NOWHERE}'", NOWHERE),  # missing checkpoint
    ("--gin.MODEL_PARALLEL=3", "3"),                        # does not divide the devices
    ("--gin.EvalConfig.seed=%UNDEFINED_SEED", "UNDEFINED_SEED"),  # undefined macro
    # A binding the run never reads (it would be ignored): the macro and its readers named.
    ("--gin.TRAIN_STEPS=3", "%TRAIN_STEPS; read by distillspec_jax.main"),
    ("--gin.TrainConfig.batch_size=4", "never calls TrainConfig"),
    # Held-out cases (issue: a repeated grid entry ran, and reported, twice).
    ("--gin.GAMMAS=(3,3)", "DecodingGrid.gammas=(3, 3) lists 3 twice"),
    ("--gin.LENIENCE_KINDS=('lin','lin')", "lenience_kinds=('lin', 'lin') lists 'lin' twice"),
    ("--gin.TEMPERATURES=(nan,)", "temperatures='(nan,)' is not a tuple"),  # read as a string
    ("--gin.TASK_FEATURE_LENGTHS={'inputz':40,'targets':44}", "['inputz']"),
    ("--gin.evaluate_job.config=None", "evaluate_job.config=None is not a configuration"),
    ("--gin.SEED=-1", "seed (SEED)=-1 must be an integer >= 0"),
    # Held-out cases: an empty --gin_file (an unset shell variable) was dropped silently.
    ("--gin_file=", "--gin_file= names no gin file"),
    # A bad binding's message listed the train binary's configurables, not EvalConfig.
    ("--gin.=3", "EvalConfig"),
    # A budget running no verification round: tau and the rates came out 0.0 and 1.0.
    ("--gin.EvalConfig.max_new_tokens=1", "pass max_new_tokens >= 2 (one round needs a token"),
    ("--gin.TASK_FEATURE_LENGTHS={'inputs':40,'targets':1}",
     "TASK_FEATURE_LENGTHS['targets'] (the decoding budget when EvalConfig.max_new_tokens is "
     "None)=1 runs no verification round"),
]
MAIN_CASES = [
    ("--gin.SpeedConfig.calls='3'", "SpeedConfig.calls='3'"),
    ("--gin.SPEED_CALLS=True", "SpeedConfig.calls=True"),
    # More cores than this process has: refused before training, not when the timing starts.
    ("--gin.SPEED_CPUS=100000", "SpeedConfig.cpus (SPEED_CPUS)=100000"),
    ("--gin.SPEED_EXAMPLES=0", "SpeedConfig.examples"),  # the main job always times
    ("--gin.BATCH_SIZE=0", "0"),
    ("--gin.TRAIN_STEPS=-5", "-5"),
    ("--gin.DecodingGrid.gammas=(0,)", "DecodingGrid.gammas=(0,)"),
    ("--gin.TEMPERATURES=(-1.0,)", "DecodingGrid.temperatures=(-1.0,)"),
    ("--gin.DecodingGrid.epsilons=(0.5,) --gin.TEMPERATURES=(1.0,)",
     "epsilons=(0.5,)"),  # the main job decodes losslessly
    ("--gin.RECIPES=('nonsense',)", "'nonsense'"),
    ("--gin.DIVERGENCE='nonsense'", "'nonsense'"),
    ("--gin.DIVERGENCE=''", "divergence='' is not one of"),  # was the recipe's default
    ("--gin.TARGET_PARAM_DTYPE='float8'", "PrecisionConfig.target_param_dtype='float8'"),
    ("--gin.REMAT_POLICY='sometimes'", "PrecisionConfig.remat_policy='sometimes'"),
    ("--gin.ACTIVATION_DTYPE='bf16'", "PrecisionConfig.activation_dtype='bf16'"),
    ("--gin.PrecisionConfig.draft_remat_policy=True", "PrecisionConfig.draft_remat_policy=True"),
    (f"--gin.DRAFT_CHECKPOINT_PATH='{NOWHERE}'", NOWHERE),
    (f"--gin.PipelineConfig.data_dir='{NOWHERE}'", NOWHERE),
    ("--gin.MODEL_PARALLEL=3", "MeshConfig.model_parallel=3"),
    ("--gin.MeshConfig.data_parallel=0", "MeshConfig.data_parallel"),
    ("--gin.TRAIN_STEPS=%UNDEFINED_STEPS", "UNDEFINED_STEPS"),
    ("--gin.VOCABULARY='tokenizer.json'",
     "%VOCABULARY; read by distillspec_jax.main (gin/runs/own_pair_"),
    # The message depends on whether eval.py registered EvalConfig in this process (other
    # tests): "never calls EvalConfig" or gin's "No configurable matching"; both name it.
    ("--gin.EvalConfig.batch_size=4", "EvalConfig.batch_size"),
    ("--gin.PipelineConfig.acceptance_head=@AcceptanceHeadStage() "
     "--gin.AcceptanceHeadStage.weight=-1.0", "AcceptanceHeadStage.weight=-1.0"),
    ("--gin.PipelineConfig.acceptance_head=@AcceptanceHeadStage() "
     "--gin.AcceptanceHeadStage.width=0", "AcceptanceHeadStage.width=0"),
    # an adaptive rule on the acceptance head's signal, and no draft trained with one
    ("--gin.DecodingGrid.draft_length=@DraftLength() --gin.DraftLength.rule='confidence' "
     "--gin.DraftLength.signal='acceptance_head'", "acceptance_head=None"),
    # Held-out cases: each was accepted and failed mid-run (after MODEL_DIR or a stage was
    # written), ran a grid entry twice, or ended in a KeyError traceback ({}).
    ("--gin.GAMMAS=(3,3)", "DecodingGrid.gammas=(3, 3) lists 3 twice"),
    ("--gin.TEMPERATURES=(0.0,0.0)", "lists 0.0 twice"),
    ("--gin.TASK_FEATURE_LENGTHS={}", "TASK_FEATURE_LENGTHS={} lacks ['targets']"),
    ("--gin.PipelineConfig.optimizer='sgdd'", "PipelineConfig.optimizer='sgdd'"),
    ("--gin.PipelineConfig.learning_rate=0.0", "learning_rate=0.0 must be > 0"),
    ("--gin.main_job.stages=('nonexistent',)", "['nonexistent']"),
    ("--gin.main_job.stages=()", "main_job.stages=() is not a non-empty tuple"),  # ran all
    ("--gin.main_job.pipeline=None", "main_job.pipeline=None is not a configuration"),
    ("--gin.SEED=-1", "seed=-1 must be an integer >= 0"),  # numpy's batch order: mid-run
    # Refused only after the vocab stage had written MODEL_DIR/vocab.
    ("--gin.MIXTURE_OR_TASK_NAME='no_such_task'", "'no_such_task' is not registered"),
    # A recipe listed twice gave the job two distill_<recipe> stages of one folder (the
    # unknown stage keeps the old code, which accepted it, from running the job).
    ("--gin.RECIPES=('gkd','gkd') --gin.PipelineConfig.recipe_steps={} "
     "--gin.PipelineConfig.teacher_cache_recipes=() --gin.main_job.stages=('none',)",
     "recipes (RECIPES)=('gkd', 'gkd') lists 'gkd' twice"),
    ("--gin.PipelineConfig.teacher_cache_recipes=('supervised_kd','supervised_kd') "
     "--gin.main_job.stages=('none',)",
     "teacher_cache_recipes=('supervised_kd', 'supervised_kd') lists 'supervised_kd' twice"),
    # An empty --gin_file (an unset shell variable) was dropped silently: the job ran.
    ("--gin_file= --gin.main_job.stages=('none',)", "--gin_file= names no gin file"),
    # More examples than the split holds: cut silently to the split's 50,000.
    ("--gin.TRAIN_EXAMPLES=50001 --gin.main_job.stages=('none',)",
     "TRAIN_EXAMPLES (PipelineConfig.train_examples)=50001 exceeds the 50,000 examples of task "
     "'embedded_arithmetic''s train split"),
    # A top-k wider than the vocabulary: refused by the teacher_cache stage, after two others.
    ("--gin.PipelineConfig.teacher_cache_k=100000 --gin.main_job.stages=('none',)",
     "teacher_cache_k=100000 exceeds the vocabulary size 256"),
    # A budget running no verification round: tau and the rates came out 0.0 and 1.0.
    ("--gin.PipelineConfig.max_new_tokens=1", "PipelineConfig.max_new_tokens=1 runs no "
     "verification round"),
]
TRAIN_CASES = [
    ("--gin.TRAIN_STEPS=-1", "-1"),
    ("--gin.TRAIN_STEPS='2'", "'2'"),
    ("--gin.BATCH_SIZE=True", "True"),
    ("--gin.LAMBDA1='0.5'", "'0.5'"),
    ("--gin.LAMBDA1=1.5", "1.5"),
    ("--gin.BETA=2.0", "2.0"),
    ("--gin.DIVERGENCE='nonsense'", "'nonsense'"),
    ("--gin.SAMPLING_TEMPERATURE=-1.0", "-1.0"),
    ("--gin.run.mode='pretrain'", "'pretrain'"),
    ("--gin.TARGET_PARAM_DTYPE='float8'", "PrecisionConfig.target_param_dtype='float8'"),
    ("--gin.REMAT_POLICY='sometimes'", "PrecisionConfig.remat_policy='sometimes'"),
    ("--gin.ACTIVATION_DTYPE='Float32'", "PrecisionConfig.activation_dtype='Float32'"),
    (f"--gin.TARGET_CHECKPOINT_PATH='{NOWHERE}'", NOWHERE),
    ("--gin.MODEL_PARALLEL=3", "MeshConfig.model_parallel=3"),
    ("--gin.MeshConfig.data_parallel=True", "MeshConfig.data_parallel=True"),
    ("--gin.SAVE_EVERY=%UNDEFINED_EVERY", "UNDEFINED_EVERY"),
    ("--gin.RECIPES=('gkd',)", "%RECIPES; read by distillspec_jax.main"),
    ("--gin.t5_1_1_xl/model_by_name.dropout_rate=0.0", "in scope 't5_1_1_xl'"),
    # Precision is the run's PrecisionConfig's, not one model's.
    ("--gin.demo_draft/model_by_name.remat_policy='full'", "PrecisionConfig.remat_policy"),
    # Both models' scoped bindings of vocab_size win over an unscoped one.
    ("--gin.model_by_name.vocab_size=128", "another binding of model_by_name.vocab_size"),
    # Held-out cases: accepted, then failed after MODEL_DIR/config.gin was written.
    ("--gin.TrainConfig.optimizer='sgdd'", "TrainConfig.optimizer='sgdd'"),
    ("--gin.TASK_FEATURE_LENGTHS={'inputs':0,'targets':8}", "['inputs']=0"),
    ("--gin.TASK_FEATURE_LENGTHS={'inputz':8,'targets':8}", "['inputz']"),
    ("--gin.TrainConfig.seed=-1", "TrainConfig.seed=-1 must be an integer >= 0"),
    ("--gin_file=", "--gin_file= names no gin file"),
    # Held-out cases: no lengths, or a missing one, trained silently at 8 tokens each.
    ("--gin.TASK_FEATURE_LENGTHS=None", "TASK_FEATURE_LENGTHS=None is not a mapping"),
    ("--gin.TASK_FEATURE_LENGTHS={}", "TASK_FEATURE_LENGTHS={} lacks ['inputs', 'targets']"),
    ("--gin.TASK_FEATURE_LENGTHS={'targets':8}", "lacks ['inputs']"),
]

# The objectives study (a RecipeGridConfig through the main binary): issue 50's list.
STUDY_CASES = [
    ("--gin.DIVERGENCES=('fkl','lk_beta')", "'lk_beta'"),    # an unknown objective
    ("--gin.RECIPES=('supervised_kd','mixed')", "'mixed'"),  # an unknown data source
    ("--gin.LK_S=0.0", "s=0.0"),                             # s <= 0
    ("--gin.LK_S=-1.0", "s=-1.0"),
    ("--gin.LK_ETA=-0.5", "eta=-0.5"),                       # eta < 0
    ("--gin.SEEDS=(0,1,0)", "seeds=(0, 1, 0)"),              # a seed listed twice
    ("--gin.SEEDS=(0,-1)", "seeds[1]=-1"),
    # a budget smaller than one step (32 rows x 84 tokens of the target)
    ("--gin.COMPUTE_UNIT='target_tokens' --gin.COMPUTE_BUDGET=1000", "compute_budget=1000"),
    ("--gin.COMPUTE_BUDGET=0", "=0"),
    ("--gin.COMPUTE_UNIT='joules'", "'joules'"),
]


def _eval_argv(model_dir) -> list:
  return ["--gin_file=gin/runs/eval_demo.gin", f"--gin.MODEL_DIR='{model_dir}'",
          "--gin.EvalConfig.progress_bar=False", "--gin.VOCABULARY=None"]


def _main_argv(model_dir) -> list:
  return ["--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR='{model_dir}'"]


def _train_argv(model_dir) -> list:
  return ["--gin_file=gin/runs/distill_tiny.gin", f"--gin.MODEL_DIR='{model_dir}'",
          "--gin.TRAIN_STEPS=2"]


BINARIES = {"eval": (eval_lib.cli, _eval_argv, EVAL_CASES),
            "main": (main_lib.cli, _main_argv, MAIN_CASES),
            "train": (train_lib.cli, _train_argv, TRAIN_CASES)}
CASES = [(binary, index) for binary, (_, _, cases) in BINARIES.items()
         for index in range(len(cases))]


@pytest.mark.parametrize("binary,index", CASES,
                         ids=[f"{b}-{BINARIES[b][2][i][0]}" for b, i in CASES])
def test_bad_value_exits_1_naming_it_before_work_starts(binary, index, tmp_path, capsys):
  cli, argv_of, cases = BINARIES[binary]
  flags, named = cases[index]
  model_dir = tmp_path / "out"
  testing.assert_refused_before_work(cli, argv_of(model_dir) + flags.split(" "), named,
                                     model_dir, capsys)


def test_a_malformed_data_file_is_refused_before_work_starts(tmp_path, capsys):
  """A GSM8K line without "answer" in DATA_DIR: refused naming its file and line before the
  vocab stage writes MODEL_DIR/vocab (it was refused only once that stage read the rows)."""
  folder = tmp_path / "data" / "gsm8k"
  folder.mkdir(parents=True)
  good = json.dumps({"question": "1+1?", "answer": "2 #### 2"})
  (folder / "train.jsonl").write_text(good + "\n" + json.dumps({"question": "2+2?"}) + "\n")
  (folder / "test.jsonl").write_text(good + "\n")
  model_dir = tmp_path / "out"
  testing.assert_refused_before_work(
      main_lib.cli, _main_argv(model_dir) + [
          "--gin.MIXTURE_OR_TASK_NAME='gsm8k_files'",
          f"--gin.PipelineConfig.data_dir='{tmp_path / 'data'}'"],
      f"{folder / 'train.jsonl'}:2", model_dir, capsys)


@pytest.mark.parametrize("flags,named", STUDY_CASES, ids=[c[0] for c in STUDY_CASES])
def test_study_bad_value_exits_1_naming_it_before_work_starts(flags, named, tmp_path, capsys):
  model_dir = tmp_path / "out"
  argv = ["--gin_file=gin/runs/objectives_study.gin", f"--gin.MODEL_DIR='{model_dir}'"]
  testing.assert_refused_before_work(main_lib.cli, argv + flags.split(" "), named, model_dir,
                                     capsys)


def test_each_binary_has_at_least_12_bad_values():
  assert all(len(cases) >= 12 for _, _, cases in BINARIES.values())


@pytest.mark.integration
@pytest.mark.parametrize("binary,flag,named", [
    ("eval", "--gin.GAMMAS=(0,)", "DecodingGrid.gammas=(0,)"),
    ("train", "--gin.LAMBDA1='0.5'", "'0.5'"),
    ("main", "--gin.VOCABULARY='tokenizer.json'", "gin/runs/own_pair_")])
def test_bad_value_as_a_process_exits_1_without_a_traceback(binary, flag, named, tmp_path):
  argv = BINARIES[binary][1](tmp_path / "out") + [flag]
  done = subprocess.run([sys.executable, "-m", f"distillspec_jax.{binary}"] + argv,
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert done.returncode == 1, done.stderr[-2000:]
  assert named in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert "Event loop is closed" not in done.stderr
  assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory):
  """Random tiny checkpoints in our format (no training): the eval pair (vocabulary 256) and
  distill_tiny.gin's target (vocabulary 64), so that a refusal after the checkpoint checks is
  reached."""
  import jax
  from distillspec_jax.models.config import model_config
  from distillspec_jax.models.model import Model
  from distillspec_jax.training import checkpoints
  root = tmp_path_factory.mktemp("bad_input_checkpoints")
  for name, vocab_size, layers in (("target", 256, 2), ("draft", 256, 1), ("tiny", 64, 2)):
    model = Model(model_config("tiny_encoder_decoder", vocab_size=vocab_size,
                               num_decoder_layers=layers))
    checkpoints.save_params(str(root / name), model.init(jax.random.PRNGKey(0)))
  return root


# (binary, flags, text the message must hold): refusals after the checkpoints are read, each
# of which used to write MODEL_DIR first (config.gin) or end in a traceback (a MODEL_DIR that
# is a file or lies under one: FileExistsError / NotADirectoryError).
LATE_CASES = [
    ("eval", "--gin.MIXTURE_OR_TASK_NAME='no_such_task'", "'no_such_task' is not registered"),
    ("eval", "--gin.EVAL_SPLIT='nonsense'", "no split 'nonsense'"),
    ("eval", "--gin.MODEL_DIR='{file}'", "is a file, not a directory"),
    ("eval", "--gin.MODEL_DIR='{file}/sub'", "is a file, not a directory"),
    ("train", "--gin.MIXTURE_OR_TASK_NAME='no_such_task'", "'no_such_task' is not registered"),
    ("train", "--gin.MIXTURE_OR_TASK_NAME='embedded_arithmetic' --gin.run.split='dev'",
     "run.split='dev'"),
    # The synthetic task read any split but "train" as its held-out stream.
    ("train", "--gin.run.split='dev'", "run.split='dev'"),
    ("train", "--gin.run.eval_split='test'", "run.eval_split='test'"),
    ("train", "--gin.MODEL_DIR='{file}'", "is a file, not a directory"),
    ("train", "--gin.MODEL_DIR='{file}/sub'", "is a file, not a directory"),
]


@pytest.mark.slow
@pytest.mark.parametrize("binary,flags,named", LATE_CASES, ids=[f"{b}-{f}" for b, f, _ in
                                                                LATE_CASES])
def test_late_bad_value_exits_1_before_model_dir_is_written(binary, flags, named, tmp_path,
                                                            capsys, checkpoints_dir):
  cli, argv_of, _ = BINARIES[binary]
  model_dir, afile = tmp_path / "out", tmp_path / "a_file"
  afile.write_text("kept")
  argv = argv_of(model_dir)
  if binary == "eval":
    argv += [f"--gin.TARGET_CHECKPOINT_PATH='{checkpoints_dir / 'target'}'",
             f"--gin.DRAFT_CHECKPOINT_PATH='{checkpoints_dir / 'draft'}'"]
  else:
    argv += [f"--gin.TARGET_CHECKPOINT_PATH='{checkpoints_dir / 'tiny'}'"]
  testing.assert_refused_before_work(cli, argv + flags.format(file=afile).split(" "), named,
                                     model_dir, capsys)
  assert afile.read_text() == "kept"


@pytest.mark.slow
def test_eval_of_a_task_without_inputs_needs_lm_prompt_length(tmp_path, capsys, checkpoints_dir):
  """lm1b_files (text lines, 'targets' only) through the eval binary: refused before MODEL_DIR
  is written, naming the task and EvalConfig.lm_prompt_length. It was refused by the example
  reader only after MODEL_DIR/config.gin and inferences/ were written, naming an
  `lm_prompt_length` the binary had no setting for."""
  data = tmp_path / "data"
  (data / "lm1b").mkdir(parents=True)
  (data / "lm1b" / "test.txt").write_text("the cat sat on the mat .\na dog ran .\n")
  model_dir = tmp_path / "out"
  argv = _eval_argv(model_dir) + [
      f"--gin.TARGET_CHECKPOINT_PATH='{checkpoints_dir / 'target'}'",
      f"--gin.DRAFT_CHECKPOINT_PATH='{checkpoints_dir / 'draft'}'",
      f"--gin.DATA_DIR='{data}'", "--gin.MIXTURE_OR_TASK_NAME='lm1b_files'"]
  testing.assert_refused_before_work(
      eval_lib.cli, argv, "task 'lm1b_files' has no 'inputs' (a language-modelling task), so "
      "its held-out rows hold no prompt; set --gin.EvalConfig.lm_prompt_length=K", model_dir,
      capsys)
  testing.assert_refused_before_work(
      eval_lib.cli, argv + ["--gin.EvalConfig.lm_prompt_length=0"],
      "EvalConfig.lm_prompt_length=0 must be an integer >= 1", model_dir, capsys)


def test_train_rerun_of_another_model_in_a_model_dir_is_refused_before_config_gin(tmp_path,
                                                                                  capsys):
  """The train binary rerun in a MODEL_DIR whose checkpoints hold another model shape (here
  vocabulary 128 against finetune_tiny.gin's 64): exit 1 naming MODEL_DIR and the mismatch,
  and MODEL_DIR as it was. The trainer refused it only at its restore, after the refused
  configuration had replaced the config.gin of the run that wrote the checkpoints."""
  import gin
  import jax
  from distillspec_jax.models.config import model_config
  from distillspec_jax.models.model import Model
  from distillspec_jax.training import checkpoints
  model_dir = tmp_path / "out"
  other = Model(model_config("tiny_encoder_decoder", vocab_size=128))
  checkpoints.save_params(str(model_dir / "4"), other.init(jax.random.PRNGKey(0)))
  (model_dir / "config.gin").write_text("# the run that wrote step 4\n")
  before = sorted(os.listdir(model_dir))
  gin.clear_config()
  try:
    code = train_lib.cli(["--gin_file=gin/runs/finetune_tiny.gin", f"--gin.MODEL_DIR='{model_dir}'",
                          "--gin.TRAIN_STEPS=6"])
  finally:
    gin.clear_config()
  err = capsys.readouterr().err
  assert code == 1, err[-2000:]
  assert err.startswith("Error: ") and "Traceback" not in err, err[-2000:]
  assert f"MODEL_DIR='{model_dir}'" in err and "token_embedder/embedding" in err, err[-2000:]
  assert sorted(os.listdir(model_dir)) == before
  assert (model_dir / "config.gin").read_text() == "# the run that wrote step 4\n"


@pytest.mark.slow
def test_train_rerun_with_train_steps_below_model_dirs_checkpoint_is_refused(tmp_path, capsys):
  """finetune_tiny.gin trained to step 4, then rerun in its MODEL_DIR with TRAIN_STEPS=2:
  exit 1 naming the step and the fix, MODEL_DIR as it was (the run trained nothing and
  exited 0 with the step-4 model, saying nothing); rerun with TRAIN_STEPS=4 it says that
  there is nothing to train."""
  import gin
  model_dir = tmp_path / "out"

  def run(steps):
    gin.clear_config()
    try:
      return train_lib.cli(["--gin_file=gin/runs/finetune_tiny.gin",
                            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}",
                            "--gin.SAVE_EVERY=4", "--gin.TrainConfig.progress_bar=False"])
    finally:
      gin.clear_config()

  assert run(4) == 0
  capsys.readouterr()
  before = {name: os.path.getmtime(model_dir / name) for name in os.listdir(model_dir)}
  code = run(2)
  err = capsys.readouterr().err
  assert code == 1, err[-2000:]
  assert err.startswith("Error: ") and "Traceback" not in err, err[-2000:]
  assert "holds a checkpoint at step 4, past TRAIN_STEPS=2" in err, err[-2000:]
  assert "--gin.TRAIN_STEPS=4 or more" in err, err[-2000:]
  assert {name: os.path.getmtime(model_dir / name) for name in os.listdir(model_dir)} == before
  assert run(4) == 0
  assert "step 4 of 4: already trained, nothing to do." in capsys.readouterr().out


@pytest.mark.slow
def test_an_interrupted_eval_rerun_leaves_the_finished_runs_files(tmp_path, checkpoints_dir,
                                                                   monkeypatch):
  """Ctrl-C during an eval binary's run in the MODEL_DIR of a finished one (here while the
  checkpoints load): its config.gin and metrics.json are left as they were. The binary wrote
  the new config.gin first, so it described a run that never finished, beside the old
  metrics.json."""
  import gin
  model_dir = tmp_path / "out"
  model_dir.mkdir()
  (model_dir / "config.gin").write_text("# the finished run\n")
  (model_dir / "metrics.json").write_text('{"rows": [], "target_alone": {}}\n')

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(eval_lib, "_load_pair", interrupted)
  gin.clear_config()
  try:
    with pytest.raises(KeyboardInterrupt):
      eval_lib.cli(_eval_argv(model_dir) + [
          f"--gin.TARGET_CHECKPOINT_PATH='{checkpoints_dir / 'target'}'",
          f"--gin.DRAFT_CHECKPOINT_PATH='{checkpoints_dir / 'draft'}'"])
  finally:
    gin.clear_config()
  assert (model_dir / "config.gin").read_text() == "# the finished run\n"
  assert (model_dir / "metrics.json").read_text() == '{"rows": [], "target_alone": {}}\n'
