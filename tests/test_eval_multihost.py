"""The eval binary on a (data, model) mesh (DATA_PARALLEL / MODEL_PARALLEL), in one process and
across two. One process of 8 simulated CPU devices: a tiny target restored straight into its
'model' shards (a preset names its shapes) on (4, 2) gives the rows of the same evaluation
on (8, 1), and each device holds less than the whole target. Two processes (jax.distributed
on localhost, 4 CPU devices each, a (4, 2) mesh spanning both) against that 8-device (4, 2)
run: the same metrics.json rows and target-alone quality at T = 0 and T = 1 (fixed seed), one
metrics.json written (by process 0), each process handing the decoders only its rows of
every evaluation batch, and the whole run bounded in time.

Then, in the same three processes (the binary's checks and run again, WORKER_THEN), without
presets, 5 prompts at T = 0: the one-process rows again (the second test).

The processes are tests/eval_multihost_worker.py: the binary's `main` with its own flags,
started once per test run for both tests (`processes`, testing.once).
The main job across two processes is tested in tests/test_pipeline_mesh.py.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import testing
from distillspec_jax.models.model import Model
from distillspec_jax.training import checkpoints
from test_multihost import _env, _finish, _flags, _free_port

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "eval_multihost_worker.py")
PRESET = "tiny_encoder_decoder"
EXAMPLES, BATCH = 6, 4  # two batches, the second padded: 2 real rows and 2 EOS prompts


def _eval_flags(root, model_dir) -> list:
  return ["--gin_file=gin/runs/eval_demo.gin", f"--gin.MODEL_DIR='{model_dir}'",
          f"--gin.TARGET_CHECKPOINT_PATH='{root / 'target'}'",
          f"--gin.DRAFT_CHECKPOINT_PATH='{root / 'draft'}'",
          f"--gin.VOCABULARY='{root / 'vocab' / 'embedded_arithmetic_v2_bpe256.model'}'",
          f"--gin.EvalConfig.target_model='{PRESET}'", f"--gin.EvalConfig.draft_model='{PRESET}'",
          f"--gin.EVAL_EXAMPLES={EXAMPLES}", f"--gin.BATCH_SIZE={BATCH}", "--gin.GAMMAS=(2,)",
          "--gin.TEMPERATURES=(0.0, 1.0)", "--gin.SPEED_EXAMPLES=0",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 48, 'targets': 6}",
          "--gin.DATA_PARALLEL=4", "--gin.MODEL_PARALLEL=2",
          "--gin.EvalConfig.progress_bar=False"]


def _host_loaded_flags(root, model_dir) -> list:
  """The second evaluation's: no presets (each process loads the whole checkpoints on the
  host, then keeps its shards), 5 prompts in batches of 4, T = 0."""
  return [f for f in _eval_flags(root, model_dir) if "_model=" not in f
          and "EVAL_EXAMPLES" not in f and "TEMPERATURES" not in f] + [
      "--gin.EVAL_EXAMPLES=5", "--gin.TEMPERATURES=(0.0,)"]


def _start(folder) -> dict:
  """The three processes, both evaluations; {"codes", "outs"}. Files under `folder`."""
  from distillspec_jax.data.tasks import embedded
  tmp_path = pathlib.Path(folder)
  vocabulary = embedded.build_embedded_vocabulary(str(tmp_path / "vocab"))
  assert vocabulary.endswith("embedded_arithmetic_v2_bpe256.model"), vocabulary
  # Preset shapes, restored into shards (first evaluation) or loaded whole on the host
  # (second); saved from one device of this process.
  for name, seed in (("target", 0), ("draft", 1)):
    params = Model.from_name(PRESET).init(jax.random.PRNGKey(seed))
    checkpoints.save_params(str(tmp_path / name), jax.device_put(params, jax.devices()[-1]))
  then = lambda name: json.dumps([str(tmp_path / f"rows_{name}.json"),
                                  _host_loaded_flags(tmp_path, tmp_path / name)])
  single, multi = tmp_path / "single", tmp_path / "multi"
  data_parallel = tmp_path / "single_8x1"
  # The reference, then the pair: run at the same time, the three processes contend for the
  # cores and the pair's collectives (gloo, polling) take about 10 CPU-seconds more.
  procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path / "rows_single.json")]
                            + _eval_flags(tmp_path, single),
                            env=dict(_env(8), WORKER_ALSO_DATA_PARALLEL=str(data_parallel),
                                     WORKER_THEN=then("host_single")),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)]
  outs = _finish(procs, timeout=600)
  port = _free_port()
  for index in (0, 1):
    procs.append(subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path / f"rows_{index}.json")]
        + _eval_flags(tmp_path, multi) + _flags(port, index),
        env=dict(_env(4), WORKER_THEN=then("host_multi")), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs += _finish(procs[1:], timeout=600)
  return {"codes": [p.returncode for p in procs], "outs": outs}


@pytest.fixture(scope="module")
def processes(request, tmp_path_factory) -> tuple:
  """(folder, {"codes", "outs"}) of the one run of the three processes in this test run."""
  root = testing.run_root(request.config, tmp_path_factory)
  run = testing.once(root, "eval_multihost", _start)
  for code, out in zip(run["codes"], run["outs"]):
    assert code == 0, out[-4000:]
  return root / "run_once" / "eval_multihost", run["outs"]


def test_eval_binary_on_two_processes_gives_one_process_rows(processes):
  tmp_path, outs = processes
  single, multi = tmp_path / "single", tmp_path / "multi"
  data_parallel = tmp_path / "single_8x1"
  assert "WORKER_OK process 0 of 1" in outs[0]
  assert "WORKER_OK process 0 of 2" in outs[1] and "WORKER_OK process 1 of 2" in outs[2]
  reference = json.loads((single / "metrics.json").read_text())
  got = json.loads((multi / "metrics.json").read_text())
  assert len(reference["rows"]) == 2  # T = 0 and T = 1 at gamma 2
  assert got == reference  # every row's tau, alpha, quality, predicted_alpha; target alone
  # One writer: process 0's outputs only (one metrics.json, one inferences file per task).
  assert sorted(os.listdir(multi / "inferences")) == ["embedded_arithmetic.jsonl"]
  assert (multi / "inferences" / "embedded_arithmetic.jsonl").read_text() == (
      single / "inferences" / "embedded_arithmetic.jsonl").read_text()
  _check_model_sharded_equals_data_parallel(single, data_parallel, tmp_path)
  # Rows handed to the decoders: the reference every row of each batch; process 0 rows 0-1
  # and process 1 rows 2-3 (the (4, 2) mesh's data axis spans both, 2 rows per process).
  calls = json.loads((tmp_path / "rows_single.json").read_text())
  assert calls and all(c == [0, BATCH, BATCH] for c in calls)
  for index, rows in enumerate(([0, 2, BATCH], [2, 4, BATCH])):
    mine = json.loads((tmp_path / f"rows_{index}.json").read_text())
    assert len(mine) == len(calls) and all(c == rows for c in mine), mine
  # Read and tokenized: the reference the whole split; each process only the examples of
  # its rows (positions 0-1 and 4-5 of the six, 2-3).
  assert json.loads((tmp_path / "rows_single.json.read.json").read_text()) == [None]
  for index, positions in enumerate(([0, 1, 4, 5], [2, 3])):
    assert json.loads((tmp_path / f"rows_{index}.json.read.json").read_text()) == [positions]


def _check_model_sharded_equals_data_parallel(sharded_dir, data_parallel_dir, tmp_path):
  """The 8-device process's (4, 2) run against its (8, 1) run: the same tau, alpha and
  quality; each device holds the whole target on (8, 1) and a share of it on (4, 2)."""
  held = json.loads((tmp_path / "rows_single.json.held.json").read_text())
  assert [h["mesh"] for h in held] == [[4, 2], [8, 1]]
  sharded, replicated = held
  # Vocabulary, MLP and heads split in two; norms and relative position biases whole.
  assert sharded["held"] < 0.6 * sharded["whole"]
  assert replicated["held"] == replicated["whole"] == sharded["whole"]
  got = json.loads((sharded_dir / "metrics.json").read_text())
  want = json.loads((data_parallel_dir / "metrics.json").read_text())
  assert len(got["rows"]) == len(want["rows"]) == 2
  for a, b in zip(got["rows"], want["rows"]):
    assert (a["temperature"], a["gamma"]) == (b["temperature"], b["gamma"])
    assert (a["tau"], a["draft_acceptance_rate"], a["quality"]) == (b["tau"], b["draft_acceptance_rate"], b["quality"]), (a, b)
  assert got["target_alone"] == want["target_alone"]
  # On (8, 1) the data axis (8) does not divide the batch (4): every device decodes it whole.
  calls = json.loads((tmp_path / "rows_single.json.data_parallel.json").read_text())
  assert calls and all(c == [0, BATCH, BATCH] for c in calls)


@pytest.mark.integration
def test_eval_binary_on_two_processes_with_uneven_prompts_and_host_loaded_checkpoints(
    processes):
  """No presets (each process loads the whole checkpoints on the host, then keeps its
  shards), checkpoints saved from one device of this process, 5 prompts in batches of 4 (the
  second batch's only real row is process 0's: process 1 holds none of that batch), prompts
  of different lengths on the two processes: the one-process rows, and no traceback."""
  folder, outs = processes
  for out in outs:
    assert "Traceback" not in out and "Event loop is closed" not in out, out[-4000:]
  reference = json.loads((folder / "host_single" / "metrics.json").read_text())
  assert len(reference["rows"]) == 1
  assert json.loads((folder / "host_multi" / "metrics.json").read_text()) == reference
  lines = [json.loads(line) for line in
           (folder / "host_multi" / "inferences" / "embedded_arithmetic.jsonl").open()]
  inputs = [line["input"] for line in lines if line["decoder"] == "target"]
  assert len(inputs) == 5
  # Rows 0-1 and 4 are process 0's, rows 2-3 process 1's: their prompts differ in length.
  assert {len(inputs[i]) for i in (0, 1, 4)} != {len(inputs[i]) for i in (2, 3)}
