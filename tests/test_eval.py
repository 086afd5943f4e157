"""The evaluation binary (distillspec_jax/eval.py) and its library (quality_lib.py, lossy.py)
on tiny random models: outputs, the lossless limit of lenience, mixtures, BBH files, errors."""

import json
import math
import os

import jax
import numpy as np
import pytest

from distillspec_jax.decoding import stats
from distillspec_jax.training import checkpoints
from distillspec_jax.evaluation import evaluate
from distillspec_jax.evaluation import quality as quality_lib
from distillspec_jax import gin_utils
from distillspec_jax.evaluation import lossy
from distillspec_jax import eval as eval_lib
from distillspec_jax.models.config import model_config
from distillspec_jax.decoding.plain import SamplingConfig, prompt_inputs
from distillspec_jax.models.model import Model
from distillspec_jax.decoding.speculative import DraftLength, Lenience, speculative_decode
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.evaluate import SpeedConfig


LENGTHS = {"inputs": 48, "targets": 6}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """The embedded vocabulary and tiny target/draft checkpoints in our format."""
  from distillspec_jax.data.tasks import embedded
  root = tmp_path_factory.mktemp("eval")
  vocabulary = embedded.build_embedded_vocabulary(str(root / "vocab"))
  paths = {}
  for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
    model = Model(model_config("tiny_encoder_decoder", num_decoder_layers=layers,
                               vocab_size=256, max_decode_length=32))
    paths[name] = str(root / name)
    checkpoints.save_params(paths[name], model.init(jax.random.PRNGKey(seed)))
  wide = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=320))
  paths["wide_draft"] = str(root / "wide_draft")
  checkpoints.save_params(paths["wide_draft"], wide.init(jax.random.PRNGKey(2)))
  return dict(root=root, vocabulary=vocabulary, **paths)


def _config(setup, model_dir, grid=(), speed=(), **changes):
  """The tests' EvalConfig; `grid` / `speed`: changes to its DecodingGrid (gamma 2, T = 0
  and 1) and SpeedConfig (one timed prompt, one repeat, in this process)."""
  fields = dict(model_dir=str(model_dir), mixture_or_task_name="embedded_arithmetic",
                task_feature_lengths=LENGTHS, batch_size=3, eval_examples=4,
                target_checkpoint_path=setup["target"], draft_checkpoint_path=setup["draft"],
                vocabulary=setup["vocabulary"],
                grid=DecodingGrid(**{"gammas": (2,), "temperatures": (0.0, 1.0), **dict(grid)}),
                speed=SpeedConfig(**{"examples": 1, "repeats": 1, "cpus": 0, **dict(speed)}),
                progress_bar=False)
  fields.update(changes)
  return eval_lib.EvalConfig(**fields)


def _numbers(value):
  if isinstance(value, dict):
    for v in value.values():
      yield from _numbers(v)
  elif isinstance(value, list):
    for v in value:
      yield from _numbers(v)
  elif isinstance(value, (int, float)) and not isinstance(value, bool):
    yield value


@pytest.mark.integration
def test_the_binary_writes_every_output_with_finite_numbers(setup, tmp_path, capsys):
  """The binary's command line (`cli`, as `python -m distillspec_jax.eval` runs it, in this
  process; test_eval_multihost.py and test_bad_inputs.py run it as a process) on
  eval_demo.gin: exit 0, metrics.json (the interface, finite numbers), inferences,
  TensorBoard events and the lossy trade-off table; bad input exits 1."""
  import gin
  model_dir = tmp_path / "run"
  argv = ["--gin_file=gin/runs/eval_demo.gin",
          f"--gin.MODEL_DIR={model_dir}", f"--gin.TARGET_CHECKPOINT_PATH={setup['target']}",
          f"--gin.DRAFT_CHECKPOINT_PATH={setup['draft']}",
          f"--gin.VOCABULARY={setup['vocabulary']}", "--gin.EVAL_EXAMPLES=4",
          "--gin.BATCH_SIZE=3", "--gin.GAMMAS=(2,)", "--gin.TEMPERATURES=(1.0,)",
          "--gin.LENIENCE_KINDS=('lin',)", "--gin.EPSILONS=(1.0, 0.5)",
          "--gin.SPEED_EXAMPLES=1", "--gin.SPEED_REPEATS=1", "--gin.SPEED_CPUS=0",
          f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}", "--gin.EvalConfig.progress_bar=False"]
  gin.clear_config()
  try:
    code = eval_lib.cli(argv)
  finally:
    gin.clear_config()
  out = capsys.readouterr()
  assert code == 0, out.err[-3000:]
  assert "| embedded_arithmetic | 1.0 | 2 |" in out.out
  on_disk = json.load(open(model_dir / "metrics.json"))
  assert set(on_disk) == {"rows", "target_alone"}
  assert len(on_disk["rows"]) == 1 * 1 * 2  # temperatures x gammas x leniences
  for row in on_disk["rows"]:
    assert tuple(row) == evaluate.EvaluationRow.json_keys()  # the interface, in its order
    assert row["task"] == "embedded_arithmetic" and row["lenience"] == "lin"
    for key in ("tau", "tau_stderr", "draft_acceptance_rate", "predicted_alpha", "speedup",
                "cost_model_speedup"):
      assert math.isfinite(row[key]), (key, row)
    assert 1.0 <= row["tau"] <= row["gamma"] + 1
    assert 0.0 <= row["predicted_alpha"] <= 1.0
    assert len(row["acceptance_by_position"]) == row["gamma"]
    assert row["speedup_range"][0] <= row["speedup"] <= row["speedup_range"][1]
    # The serving engines' statistics beside the paper's (decoding/stats.py).
    assert row["mean_acceptance_length"] == pytest.approx(
        1 + row["gamma"] * row["draft_acceptance_rate"])
    assert len(row["draft_acceptance_rate_by_position"]) == row["gamma"]
    assert (row["alpha_distillspec"] is None
            or row["alpha_distillspec"] >= row["draft_acceptance_rate"])
    for name in ("end_to_end_speedup", "typical_speedup", "typical_end_to_end_speedup"):
      low, high = row[f"{name}_range"]
      assert low <= row[name] <= high, name
    assert isinstance(row["speedup_unreliable"], bool)
    assert "accuracy" in row["quality"]
  assert [r["epsilon"] for r in on_disk["rows"]] == [1.0, 0.5]
  assert all(math.isfinite(x) for x in _numbers(on_disk))
  assert set(on_disk["target_alone"]["embedded_arithmetic"]) == {"accuracy"}

  lines = [json.loads(l) for l in open(model_dir / "inferences" / "embedded_arithmetic.jsonl")]
  speculative = [l for l in lines if l["decoder"] == "speculative"]
  assert len(speculative) == 2 * 4 and len(lines) == 2 * 4 + 1 * 4
  for line in speculative:
    assert {"input", "reference", "prediction", "accepted_per_round"} <= set(line)
    assert line["input"].startswith(("Tom", "Sam", "Ben", "Max", "Leo", "Ann", "Mia", "Zoe",
                                     "Lily", "Emma"))
    assert all(0 <= n <= line["gamma"] for n in line["accepted_per_round"])
  events = os.listdir(model_dir / "tensorboard")
  assert events and os.path.getsize(model_dir / "tensorboard" / events[0]) > 0
  for name in ("lossy_tradeoff.md", "lossy_tradeoff.json", "lossy_tradeoff.png", "config.gin"):
    assert os.path.getsize(model_dir / name) > 0
  table = json.load(open(model_dir / "lossy_tradeoff.json"))["rows"]
  assert all(math.isfinite(r["relative_latency"]) for r in table)
  # Relative latency is end to end, as a request sees it.
  for line, row in zip([r for r in table if r["decoder"] == "speculative"], on_disk["rows"]):
    assert line["relative_latency"] == pytest.approx(1 / row["end_to_end_speedup"])

  # Bad input: exit status 1 and the message, no traceback, nothing written.
  import testing
  testing.assert_refused_before_work(
      eval_lib.cli, argv + [f"--gin.MODEL_DIR={tmp_path / 'bad'}",
                            "--gin.DRAFT_CHECKPOINT_PATH=/nonexistent/draft"],
      "DRAFT_CHECKPOINT_PATH='/nonexistent/draft' does not exist", tmp_path / "bad", capsys)


def test_relative_latency_of_the_target_alone_is_one():
  metrics = {"target_alone": {"t": {"accuracy": 50.0}},
             "rows": [_metrics_row(task="t", temperature=1.0, gamma=3, lenience=k, epsilon=e,
                                   quality={"accuracy": q}, tau=2.0, tau_stderr=0.1,
                                   draft_acceptance_rate=0.5, predicted_alpha=0.5,
                                   acceptance_by_position=[0.5] * 3, speedup=s,
                                   speedup_range=[s - 0.1, s + 0.4], cost_model_speedup=s)
                      for k, e, q, s in (("lin", 1.0, 50.0, 1.6), ("lin", 0.3, 40.0, 2.0))]}
  table = lossy.tradeoff_table(metrics)
  assert table[0]["decoder"] == "target alone" and table[0]["relative_latency"] == 1.0
  assert table[0]["quality"] == 50.0 and table[0]["relative_latency_range"] is None
  assert [r["relative_latency"] for r in table[1:]] == [1 / 1.6, 1 / 2.0]
  # The latency's range over repeats is 1 / the speedup's: the fastest repeat is the lowest.
  assert table[1]["relative_latency_range"] == pytest.approx([1 / 2.0, 1 / 1.5])
  # A row without an end-to-end figure (measured before it existed): the decoding phase's,
  # said so.
  assert table[1]["latency_phase"] == "decoding phase"
  markdown = lossy.table_markdown(table, "accuracy")
  assert "0.625 [0.500, 0.667] (decoding phase only: an earlier metrics.json)" in markdown


def test_relative_latency_is_end_to_end():
  row = _metrics_row(task="t", temperature=1.0, gamma=3, lenience="lin", epsilon=1.0,
                     quality={"accuracy": 50.0}, tau=2.0, tau_stderr=0.1,
                     draft_acceptance_rate=0.4, alpha_distillspec=0.6, predicted_alpha=0.6,
                     speedup=1.6, speedup_range=[1.5, 1.7], end_to_end_speedup=1.25,
                     end_to_end_speedup_range=[1.2, 1.3])
  table = lossy.tradeoff_table({"target_alone": {"t": {"accuracy": 50.0}}, "rows": [row]})
  assert table[1]["relative_latency"] == pytest.approx(1 / 1.25)
  assert table[1]["relative_latency_range"] == pytest.approx([1 / 1.3, 1 / 1.2])
  assert (table[1]["speedup"], table[1]["speedup_decode"]) == (1.25, 1.6)
  assert table[1]["latency_phase"] == "end to end"
  assert table[1]["alpha_distillspec"] == 0.6 and table[1]["draft_acceptance_rate"] == 0.4
  assert "0.800 [0.769, 0.833] | 1.25 | 1.60 |" in lossy.table_markdown(table, "accuracy")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lin", "sq", "exp"])
def test_epsilon_one_equals_lossless_decoding_exactly(setup, kind):
  target = Model(model_config("tiny_encoder_decoder", vocab_size=256, max_decode_length=32))
  draft = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=256,
                             max_decode_length=32))
  target_params = checkpoints.restore_params(setup["target"], target.param_shapes())
  draft_params = checkpoints.restore_params(setup["draft"], draft.param_shapes())
  prompts = np.random.default_rng(0).integers(2, 256, (6, 10)).astype(np.int32)
  key = jax.random.PRNGKey(7)
  run = lambda lenience: jax.device_get(speculative_decode(
      target, target_params, draft, draft_params, max_new_tokens=12, gamma=3,
      sampling=SamplingConfig(1.0), lenience=lenience, rng=key,
      **prompt_inputs(target, prompts)))
  lossless, lenient = run(Lenience()), run(Lenience(kind, 1.0))
  for field in ("tokens", "lengths", "accepted", "target_calls", "accepted_per_round"):
    np.testing.assert_array_equal(getattr(lenient, field), getattr(lossless, field))
  # A smaller epsilon does change the decode (the test can fail).
  loose = run(Lenience(kind, 0.05))
  assert int(np.sum(loose.accepted)) > int(np.sum(lossless.accepted))


@pytest.mark.integration
def test_epsilon_one_rows_of_the_binary_equal_the_lossless_row(setup, tmp_path):
  config = _config(setup, tmp_path / "run", grid=dict(
      temperatures=(1.0,), lenience_kinds=("lin", "sq", "exp"), epsilons=(1.0,)),
                   speed=dict(examples=0))
  rows = eval_lib.evaluate(config)["rows"]
  assert [r["lenience"] for r in rows] == ["lin", "sq", "exp"]
  drop = lambda r: {k: v for k, v in r.items() if k != "lenience"}
  assert drop(rows[0]) == drop(rows[1]) == drop(rows[2])
  assert rows[0]["speedup"] is None  # SpeedConfig.examples=0: not timed
  lines = [json.loads(l) for l in open(tmp_path / "run" / "inferences" /
                                       "embedded_arithmetic.jsonl")]
  by_kind = {k: [l["prediction"] for l in lines if l.get("lenience") == k]
             for k in ("lin", "sq", "exp")}
  assert by_kind["lin"] == by_kind["sq"] == by_kind["exp"]


def _bbh_dir(root, subtasks=("date_understanding", "boolean_expressions")):
  os.makedirs(root, exist_ok=True)
  for i, name in enumerate(subtasks):
    examples = [{"input": f"Tom has {j + i} apples. He buys {j} more. How many apples?",
                 "target": str(2 * j + i)} for j in range(2 + i)]
    with open(os.path.join(root, f"{name}.json"), "w") as f:
      json.dump({"examples": examples}, f, indent=1)
  return str(root)


@pytest.mark.integration
def test_bbh_mixture_reads_public_layout_and_reports_the_mean_of_its_tasks(setup, tmp_path):
  bbh = _bbh_dir(tmp_path / "bbh")
  config = _config(setup, tmp_path / "run", mixture_or_task_name="bbh", bbh_dir=bbh,
                   task_feature_lengths={"inputs": 48, "targets": 6},
                   grid=dict(gammas=(2, 3), temperatures=(1.0,)), speed=dict(examples=0))
  metrics = eval_lib.evaluate(config)
  tasks = ["bbh_boolean_expressions", "bbh_date_understanding"]
  assert {r["task"] for r in metrics["rows"]} == set(tasks) | {"bbh"}
  for name, count in zip(tasks, (3, 2)):
    lines = [json.loads(l) for l in open(tmp_path / "run" / "inferences" / f"{name}.jsonl")]
    target_lines = [l for l in lines if l["decoder"] == "target"]
    assert len(target_lines) == count  # every fixture example, from the public layout
    assert all(l["input"].startswith("Q: Tom has") and l["input"].endswith(
        "A: Let's think step by step.") for l in target_lines)
  for gamma in (2, 3):
    per_task = [r for r in metrics["rows"] if r["gamma"] == gamma and r["task"] in tasks]
    mixture = [r for r in metrics["rows"] if r["gamma"] == gamma and r["task"] == "bbh"]
    assert len(per_task) == 2 and len(mixture) == 1
    mixture = mixture[0]
    for key in ("tau", "draft_acceptance_rate", "predicted_alpha"):
      assert mixture[key] == pytest.approx(np.mean([r[key] for r in per_task]))
    for metric in mixture["quality"]:
      assert mixture["quality"][metric] == pytest.approx(
          np.mean([r["quality"][metric] for r in per_task]))
    se = [r["tau_stderr"] for r in per_task]
    assert mixture["tau_stderr"] == pytest.approx(np.sqrt(np.sum(np.square(se))) / 2)
  alone = metrics["target_alone"]
  for metric in alone["bbh"]:
    assert alone["bbh"][metric] == pytest.approx(np.mean([alone[t][metric] for t in tasks]))


@pytest.mark.integration
def test_eval_examples_above_a_tasks_split_are_recorded_and_warned(setup, tmp_path, caplog):
  # EVAL_EXAMPLES=4 over file tasks of 3 and 2 examples: each is evaluated on all it has
  # (not refused: a mixture gives up to N per task), with a WARNING naming the task and both
  # counts, and metrics.json's rows record how many (the mixture's: the sum).
  bbh = _bbh_dir(tmp_path / "bbh")
  config = _config(setup, tmp_path / "run", mixture_or_task_name="bbh", bbh_dir=bbh,
                   grid=dict(gammas=(2,), temperatures=(0.0,)), speed=dict(examples=0))
  caplog.set_level("WARNING")
  eval_lib.evaluate(config)
  rows = json.load(open(tmp_path / "run" / "metrics.json"))["rows"]
  counts = {"bbh_boolean_expressions": 3, "bbh_date_understanding": 2, "bbh": 5}
  assert {r["task"]: r["num_examples"] for r in rows} == counts
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
              and "EVAL_EXAMPLES" in r.getMessage()]
  for task, count in list(counts.items())[:2]:
    assert any(repr(task) in w and "EVAL_EXAMPLES=4" in w and f"has {count} examples" in w
               for w in warnings), warnings
  assert len(warnings) == 2


def _metrics_row(**fields) -> dict:
  """A metrics.json row: every EvaluationRow key, null where `fields` does not set it."""
  return dict(dict.fromkeys(evaluate.EvaluationRow.json_keys()), draft="draft", **fields)


def test_mixture_mean_is_the_mean_of_speed_numbers_too():
  def row(task, tau, speedup, **more):
    return evaluate.EvaluationRow.from_json(_metrics_row(
        task=task, temperature=0.0, gamma=2, lenience="lin", epsilon=1.0, draft_length="fixed",
        threshold=0.0, quality={"m": tau * 10}, tau=tau, tau_stderr=0.1,
        draft_acceptance_rate=tau / 3, predicted_alpha=0.5, acceptance_by_position=[0.5, None],
        speedup=speedup, speedup_range=[speedup - 0.1, speedup + 0.1],
        cost_model_speedup=speedup, **more))
  rows, alone = evaluate.mixture_mean("mix", {"a": [row("a", 1.5, 1.2)],
                                             "b": [row("b", 2.5, 1.6)]},
                                      {"a": {"m": 10.0}, "b": {"m": 30.0}})
  mixed = rows[0].to_json()
  assert mixed["task"] == "mix" and mixed["speedup"] == pytest.approx(1.4)
  assert mixed["speedup_range"] == pytest.approx([1.3, 1.5])
  assert mixed["acceptance_by_position"] == [0.5, None]
  assert mixed["quality"] == {"m": pytest.approx(20.0)} and alone == {"m": 20.0}
  # Quantities no task has stay None; flags are any task's.
  assert mixed["end_to_end_speedup"] is None
  newer = lambda task, tau, speedup, flag: row(
      task, tau, speedup, end_to_end_speedup=speedup - 0.2,
      end_to_end_speedup_range=[speedup - 0.3, speedup - 0.1], speedup_unreliable=flag,
      alpha_distillspec=tau / 4)
  rows, _ = evaluate.mixture_mean("mix", {"a": [newer("a", 1.5, 1.2, False)],
                                         "b": [newer("b", 2.5, 1.6, True)]},
                                  {"a": {"m": 10.0}, "b": {"m": 30.0}})
  mixed = rows[0].to_json()
  assert mixed["end_to_end_speedup"] == pytest.approx(1.2)
  assert mixed["end_to_end_speedup_range"] == pytest.approx([1.1, 1.3])
  assert mixed["speedup_unreliable"] is True
  assert mixed["alpha_distillspec"] == pytest.approx(0.5)


@pytest.mark.slow
def test_acceptance_by_position_and_predicted_alpha(setup):
  rates = stats.acceptance_by_position(np.array([[2, 0, -1], [1, 2, -1]]), 2)
  # Rounds accepting 2, 0, 1, 2: position 1 accepted in 3 of 4, position 2 in 2 of those 3.
  assert rates == [0.75, pytest.approx(2 / 3)]
  assert stats.acceptance_by_position(np.array([[0, -1]]), 2) == [0.0, None]
  target = Model(model_config("tiny_encoder_decoder", vocab_size=256, max_decode_length=32))
  params = checkpoints.restore_params(setup["target"], target.param_shapes())
  prompts = np.random.default_rng(1).integers(2, 256, (3, 8)).astype(np.int32)
  samples = np.random.default_rng(2).integers(2, 256, (3, 5)).astype(np.int32)
  # A draft identical to the target is predicted to be always accepted, at T = 0 and T = 1.
  for temperature in (0.0, 1.0):
    assert quality_lib.predicted_alpha(target, params, target, params, prompts, samples,
                                      temperature) == pytest.approx(1.0)
  draft = Model(model_config("tiny_encoder_decoder", num_decoder_layers=1, vocab_size=256,
                             max_decode_length=32))
  draft_params = checkpoints.restore_params(setup["draft"], draft.param_shapes())
  assert quality_lib.predicted_alpha(target, params, draft, draft_params, prompts, samples,
                                    1.0) < 1.0


@pytest.mark.integration
def test_only_process_zero_writes_and_every_process_waits_for_it(setup, tmp_path,
                                                                 monkeypatch):
  """A process other than 0 evaluates the same grid but writes no file; all processes meet at
  the barrier after process 0's writes (multihost.barrier is a no-op in one process, so it
  is recorded here)."""
  from distillspec_jax.training import multihost
  met = []
  monkeypatch.setattr(multihost, "is_primary", lambda: False)
  monkeypatch.setattr(multihost, "barrier", lambda name, *a, **k: met.append(name))
  run_dir = tmp_path / "not_primary"
  config = _config(setup, run_dir, grid=dict(epsilons=(1.0, 0.5), temperatures=(1.0,)),
                   speed=dict(examples=0))
  metrics = eval_lib.evaluate(config)
  assert len(metrics["rows"]) == 2  # it evaluated: gammas x leniences
  assert not run_dir.exists() or not any(run_dir.iterdir()), list(run_dir.rglob("*"))
  assert met == ["eval_outputs_written"]


@pytest.mark.parametrize("changes, message", [
    (dict(epsilons=()), r"DecodingGrid.epsilons=\(\) must be a non-empty tuple"),
    (dict(gammas=()), r"DecodingGrid.gammas=\(\) is empty; pass at least one gamma"),
    (dict(gammas=(2, 0)), r"DecodingGrid.gammas=\(2, 0\) has a gamma: gamma=0 must be an "
                          "integer >= 1"),
    (dict(gammas=(3.0,)), r"DecodingGrid.gammas=\(3.0,\) has a gamma: gamma=3.0 must be an "
                          "integer"),
    (dict(temperatures=()), r"DecodingGrid.temperatures=\(\) is empty; pass e.g."),
    (dict(epsilons=(1.5,)), r"DecodingGrid.epsilons has 1.5: lenience epsilon=1.5 must lie in "
                            r"\(0, 1\]"),
    (dict(epsilons=(True,)), r"DecodingGrid.epsilons has True: Lenience.epsilon=True is of "
                             "type bool"),
    (dict(lenience_kinds=("cube",)), "DecodingGrid.lenience_kinds has 'cube': Lenience.kind="
                                     "'cube' is not one of 'lin', 'sq', 'exp'"),
    (dict(epsilons=(1.0, 0.5), temperatures=(0.0, 1.0)),
     r"DecodingGrid.epsilons=\(1.0, 0.5\) with DecodingGrid.temperatures=\(0.0, 1.0\): "
     r"Lenience\('lin', epsilon=0.5\) at temperature 0"),
    (dict(temperatures=(-1.0,)), r"DecodingGrid.temperatures=\(-1.0,\) has a temperature: "
                                 "temperature=-1.0 must be >= 0"),
    (dict(draft_length=DraftLength("cost", costs=(1.0, 1.2))),
     "costs has 2 entries but gamma_max=2"),
])
def test_empty_or_bad_grids_are_refused(changes, message):
  with pytest.raises(ValueError, match=message):
    DecodingGrid(**{"gammas": (2,), "temperatures": (0.0, 1.0), **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(calls=0), "SpeedConfig.calls=0 must be an integer >= 1"),
    (dict(budget_s=-1), "SpeedConfig.budget_s=-1: pass the seconds"),
    (dict(examples=5), "SpeedConfig.examples=5 exceeds EvalConfig.eval_examples=4"),
])
def test_bad_speed_settings_are_refused(setup, tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    _config(setup, tmp_path, speed=changes)


def test_bad_inputs_name_the_value_and_the_fix(setup, tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=r"TARGET_CHECKPOINT_PATH=.*nowhere.*does not exist"):
    eval_lib.evaluate(_config(setup, tmp_path / "a", target_checkpoint_path=missing))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match=r"DRAFT_CHECKPOINT_PATH=.*empty.*Cannot tell the "
                                       r"checkpoint format.*Point DRAFT_CHECKPOINT_PATH"):
    eval_lib.evaluate(_config(setup, tmp_path / "b",
                              draft_checkpoint_path=str(tmp_path / "empty")))
  with pytest.raises(ValueError, match=r"vocab_size=320 .*vocab_size=256.*one vocabulary"):
    eval_lib.evaluate(_config(setup, tmp_path / "c",
                              draft_checkpoint_path=setup["wide_draft"]))
  with pytest.raises(ValueError, match=r"has no split 'dev' .*EVAL_SPLIT"):
    eval_lib.evaluate(_config(setup, tmp_path / "d", split="dev"))
  empty_bbh = tmp_path / "bbh_checkout"
  os.makedirs(empty_bbh / "bbh")
  with pytest.raises(ValueError, match=r"BBH_DIR=.*bbh_checkout.* holds no BBH files.*"
                                       r"pass BBH_DIR=.*bbh_checkout/bbh"):
    eval_lib.evaluate(_config(setup, tmp_path / "e", mixture_or_task_name="bbh",
                              bbh_dir=str(empty_bbh)))


def test_task_without_an_evaluation_split_is_refused(tmp_path):
  from distillspec_jax.data.tasks import file_tasks
  os.makedirs(tmp_path / "gsm8k")
  with open(tmp_path / "gsm8k" / "train.jsonl", "w") as f:
    f.write(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
  file_tasks.register_gsm8k_files(str(tmp_path / "gsm8k"), name="gsm8k_train_only")
  with pytest.raises(ValueError, match=r"'gsm8k_train_only' has no evaluation split: its "
                                       r"splits are \['train'\].*EVAL_SPLIT"):
    eval_lib.eval_split("gsm8k_train_only", None)


def test_gin_run_files_build(setup):
  for name in ("eval_demo", "eval_lenience_lin", "eval_lenience_sq", "eval_lenience_exp",
               "eval_transfer_gsm8k_bbh", "eval_transfer_gsm8k_mbpp",
               "eval_transfer_cross_scale"):
    gin_utils.clear()
    config = eval_lib.load_config([f"--gin_file=gin/runs/{name}.gin"])
    assert config.model_dir.startswith("runs/")
    if "lenience" in name:
      assert config.grid.temperatures == (1.0,) and 1.0 in config.grid.epsilons
      assert len(config.grid.epsilons) >= 4
  gin_utils.clear()
  adaptive = eval_lib.load_config(["--gin_file=gin/runs/eval_adaptive_demo.gin"])
  draft_length = adaptive.grid.draft_length
  assert draft_length.rule == "confidence" and adaptive.grid.gammas == (9,)
  assert 0 < draft_length.threshold < 1
  gin_utils.clear()
  priced = eval_lib.load_config(["--gin_file=gin/runs/eval_adaptive_demo.gin",
                                 "--gin.DRAFT_LENGTH_RULE='cost'",
                                 "--gin.DRAFT_LENGTH_COSTS=(1.0, 1.3, 1.3, 1.5, 1.6, 2.2, 2.3, "
                                 "2.3, 2.6, 2.6)", "--gin.DRAFT_LENGTH_DRAFT_COST=0.07"])
  assert priced.grid.draft_length.rule == "cost" and len(priced.grid.draft_length.costs) == 10
  for flag, message in (("--gin.DRAFT_LENGTH_THRESHOLD=1.5", "DraftLength.threshold=1.5"),
                        ("--gin.DRAFT_LENGTH_RULE='entropy'", "'entropy'"),
                        ("--gin.DRAFT_LENGTH_RULE='cost'", "The 'cost' rule needs costs"),
                        ("--gin.GAMMAS=(0,)", "DecodingGrid.gammas=\\(0,\\)")):
    gin_utils.clear()
    with pytest.raises(gin_utils.GinConfigError, match=message):
      eval_lib.load_config(["--gin_file=gin/runs/eval_adaptive_demo.gin", flag])
  gin_utils.clear()
  with pytest.raises(gin_utils.GinConfigError, match="DecodingGrid.epsilons=\\(\\) must be"):
    eval_lib.load_config(["--gin_file=gin/runs/eval_demo.gin", "--gin.EPSILONS=()"])
  gin_utils.clear()


@pytest.mark.integration
def test_the_adaptive_draft_length_rule_runs_through_the_binary(setup, tmp_path):
  """DRAFT_LENGTH_RULE='confidence': the rows are the rule's and so are their timings. At a
  threshold no random draft reaches, every round proposes one token: accepted / rounds
  (mean acceptance length - 1) equals accepted / proposed (the draft acceptance rate)."""
  config = _config(setup, tmp_path / "run", grid=dict(
      gammas=(3,), temperatures=(1.0,), draft_length=DraftLength("confidence", 0.99)))
  metrics = eval_lib.evaluate(config)
  (row,) = metrics["rows"]
  assert row["mean_acceptance_length"] == pytest.approx(1 + row["draft_acceptance_rate"])
  assert row["end_to_end_speedup"] is not None and row["speedup"] is not None
