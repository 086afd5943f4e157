"""Every binary answers --help: exit 0, its flags, its run files and the macros they set
(read from gin/runs and gin/recipes, not a hand-kept list)."""

import os
import subprocess
import sys

import pytest

from distillspec_jax import eval as eval_lib
from distillspec_jax import gin_utils
from distillspec_jax import main as main_lib
from distillspec_jax import train

FLAGS = ("--gin_file=FILE", "--gin.NAME=VALUE", "--gin_bindings", "--gin_search_paths",
         "--coordinator_address", "--help")
# binary: (its main, macros and run files its help must list, run files it must not list)
BINARIES = {
    "distillspec_jax.main": (main_lib.main, ("PipelineConfig", "\n  SpeedConfig\n",
                                             "\n  DecodingGrid\n", "\n  MeshConfig\n",
                                             "\n  PrecisionConfig\n", ".draft_remat_policy",
                                             ".precision = PrecisionConfig(activation_dtype="
                                             "'float32', remat_policy='none'",
                                             "REMAT_POLICY", "ACTIVATION_DTYPE",
                                             ".grid = DecodingGrid(gammas=(3, 5, 7)",
                                             ".calls = 6", ".data_parallel = -1",
                                             "SPEED_CALLS", "GAMMAS", "DATA_PARALLEL",
                                             "MODEL_DIR", "MIXTURE_OR_TASK_NAME", "TRAIN_STEPS",
                                             "DISTILL_TRAIN_STEPS", "RECIPES",
                                             "TARGET_CHECKPOINT_PATH", "DRAFT_CHECKPOINT_PATH",
                                             "TEACHER_CACHE_K", "gin/runs/demo.gin",
                                             "gin/runs/garden.gin"), ("gin/runs/eval_demo.gin",)),
    "distillspec_jax.train": (train.main, ("\n  run\n", "TrainConfig", "DistillationConfig",
                                           "\n  MeshConfig\n", ".model_parallel = 1",
                                           "\n  PrecisionConfig\n", ".target_param_dtype",
                                           ".precision = PrecisionConfig(", "REMAT_POLICY",
                                           ".mesh = MeshConfig(data_parallel=-1",
                                           ".divergence = 'fkl'", "MODEL_DIR", "TRAIN_STEPS",
                                           "BATCH_SIZE",
                                               "INITIAL_CHECKPOINT_PATH", "LAMBDA1",
                                               "gin/runs/distill_tiny.gin"), ("gin/runs/demo.gin",)),
    "distillspec_jax.eval": (eval_lib.main, ("EvalConfig", "\n  DecodingGrid\n",
                                             ".gammas = (3, 5, 7)", "\n  DraftLength\n",
                                             ".rule = 'fixed'", "\n  SpeedConfig\n",
                                             ".speed = SpeedConfig(examples=8", ".calls = 6",
                                             "\n  MeshConfig\n", "DRAFT_LENGTH_RULE",
                                             "\n  PrecisionConfig\n",
                                             ".precision = PrecisionConfig(",
                                             "TARGET_PARAM_DTYPE",
                                             "MODEL_DIR", "TARGET_CHECKPOINT_PATH",
                                             "VOCABULARY", "EPSILONS", "SPEED_CALLS",
                                             "gin/runs/eval_demo.gin"), ("gin/runs/distill_tiny.gin",)),
}


@pytest.mark.parametrize("binary", sorted(BINARIES))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_and_lists_flags_run_files_and_macros(binary, flag, capsys):
  main, listed, absent = BINARIES[binary]
  with pytest.raises(SystemExit) as exit_info:
    main(["--gin_file=gin/runs/never_read.gin", flag])  # help wins: nothing is parsed
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: python -m {binary} --gin_file=FILE")
  for text in FLAGS + listed:
    assert text in out, (binary, text)
  for text in absent:
    assert text not in out, (binary, text)


def test_the_macros_come_from_the_gin_files(tmp_path, monkeypatch):
  """A run file made for a binary (it binds the binary's configurable) adds its macros to
  that binary's help; a comment does not make a file the binary's."""
  os.makedirs(tmp_path / "gin" / "runs")
  os.makedirs(tmp_path / "gin" / "recipes")
  (tmp_path / "gin" / "runs" / "mine.gin").write_text(
      "BRAND_NEW_MACRO = 7  # a comment\nmain_job.pipeline = @PipelineConfig()\n")
  (tmp_path / "gin" / "runs" / "other.gin").write_text(
      "# main_job.pipeline in a comment only\nOTHER_MACRO = 1\n")
  monkeypatch.setattr(gin_utils, "REPO_ROOT", str(tmp_path))
  run_files, macros = gin_utils.binary_gin_files("distillspec_jax.main")
  assert run_files == ["gin/runs/mine.gin"]
  assert macros == {"BRAND_NEW_MACRO": ("7", "gin/runs/mine.gin")}
  text = gin_utils.binary_help("distillspec_jax.main", "doc")
  assert "BRAND_NEW_MACRO" in text and "OTHER_MACRO" not in text


@pytest.mark.integration
def test_main_help_as_a_module():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-m", "distillspec_jax.main", "--help"],
                        capture_output=True, text=True, timeout=300, cwd=repo)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "--gin_file=FILE" in done.stdout and "TRAIN_STEPS" in done.stdout
  assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_binaries_import_without_tensorflow():
  """TensorFlow (seqio's input pipeline, 2-3 s of import) loads when a task or a vocabulary
  is read, not with a binary: `--help`, a refused input and the workers that only run models
  do without it."""
  script = ("import sys; import distillspec_jax.main, distillspec_jax.eval, "
            "distillspec_jax.train, distillspec_jax.convert; "
            "from distillspec_jax.data import vocabularies, chat_template; "
            "from distillspec_jax.interop import importer; "
            "print(sorted(m for m in ('tensorflow', 'seqio', 'torch') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == "[]"


def test_device_smoke_script_answers_help(tmp_path):
  """`bash bench/device_smoke.sh --help` prints its usage and exits 0: it used to take
  --help for OUT_DIR (mkdir printed its own help, then the device probe failed)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(["bash", os.path.join(repo, "bench", "device_smoke.sh"), "--help"],
                        capture_output=True, text=True, timeout=60, cwd=tmp_path,
                        env=dict(os.environ, PYTHON="/nonexistent/python"))
  assert done.returncode == 0, done.stderr[-2000:]
  assert "bash bench/device_smoke.sh [OUT_DIR] [--smoke]" in done.stdout
  assert not os.path.exists(os.path.join(repo, "--help"))
