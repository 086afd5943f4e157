"""The paper's studies as runs (recipe_grid.py, garden.py) on tiny budgets: tables, plots and
finite numbers, cell-by-cell resume, the garden's latency reference and Pareto set, bad input."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import testing

from distillspec_jax.studies import garden
from distillspec_jax import main
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import recipe_grid
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.studies.garden import GardenConfig, pareto
from distillspec_jax.studies.pipeline import run_pipeline
from distillspec_jax.studies.recipe_grid import RecipeGridConfig
from distillspec_jax.core.files import write_json_atomic


# The whole-pipeline tests' settings (testing.PIPELINE; the same decoding budget, so the
# studies' programs are the smoke tests' where they can be), one timing repeat; each test
# names its target.
TINY = {k: v for k, v in testing.PIPELINE.items() if k != "target_model"} | dict(
    speed=dataclasses.replace(testing.PIPELINE["speed"], repeats=1))


@pytest.fixture
def base_run(shared_stages):
  """A main job's vocab, target (smoke_target) and raw draft (demo_draft), trained once per
  test run (conftest.py) and reused by both studies (as the real runs reuse runs/demo)."""
  return shared_stages[0]


def _grid(run_dir, base, **changes):
  settings = dict(TINY, recipes=("supervised_kd", "gkd"), divergences=("fkl",),
                  grid=DecodingGrid(gammas=(5,), temperatures=(0.0, 1.0)))
  return RecipeGridConfig(run_dir=str(run_dir), reuse_run_dir=base, target_model="smoke_target",
                          **dict(settings, **changes))


@pytest.mark.integration
@pytest.mark.pipeline
def test_recipe_grid_report_and_cell_by_cell_resume(tmp_path, base_run):
  config = _grid(tmp_path / "grid", base_run, recipes=("supervised_kd", "gkd", "adaspec"))
  # An interrupted grid: the first cell done, then the run stops.
  done = config.distill_stages[:1]
  outcome = run_pipeline(config, config.stage_functions(), stages=done)
  assert outcome == {"vocab": "ran", "target": "ran", "draft_raw": "ran", done[0]: "ran"}
  marker = json.load(open(os.path.join(config.stage_dir("target"), pipeline.DONE)))
  assert marker["copied_from"] == os.path.join(base_run, "target")
  mtimes = {s: os.path.getmtime(os.path.join(config.stage_dir(s), pipeline.DONE)) for s in done}

  # Resumed: the finished cells are skipped, the rest run, then the report.
  outcome = run_pipeline(config, config.stage_functions())
  assert [s for s, v in outcome.items() if v == "ran"] == list(config.distill_stages[1:]) + [
      "report"]
  assert all(outcome[s] == "skipped" for s in ("vocab", "target", "draft_raw") + done)
  assert mtimes == {s: os.path.getmtime(os.path.join(config.stage_dir(s), pipeline.DONE))
                    for s in done}

  report = json.load(open(tmp_path / "grid" / "report.json"))
  cells = report["cells"]
  assert len(cells) == 3 * 1 * 2  # recipes x divergences x temperatures at one gamma
  assert {(c["recipe"], c["divergence"]) for c in cells} == set(config.cells)
  for cell in cells:
    assert set(cell) >= {"recipe", "divergence", "temperature", "gamma", "tau", "tau_stderr",
                         "draft_acceptance_rate"}
    assert cell["gamma"] == 5
    assert 1.0 <= cell["tau"] <= 6.0 and math.isfinite(cell["tau_stderr"])
    assert 0.0 <= cell["draft_acceptance_rate"] <= 1.0
  for curve in report["tau_curves"].values():
    assert [p["step"] for p in curve] == [0, 1, 2]
  assert {a["temperature"] for a in report["rules"]} == {0.0, 1.0}
  for answer in report["rules"]:
    assert answer["rule1"]["verdict"] in ("holds", "reversed", "within noise")
    assert answer["adaspec"]["verdict"] in ("holds", "reversed", "within noise")
  assert report["rules"][0]["rule2"]["by_divergence"].keys() == {"fkl"}  # claimed at T = 0
  markdown = open(tmp_path / "grid" / "report.md").read()
  assert "| SupervisedKD |" in markdown and "Rule 1" in markdown
  for name in ("grid_heatmap.png", "grid_tau_curves.png"):
    assert (tmp_path / "grid" / name).stat().st_size > 0


def test_rules_on_a_hand_made_grid():
  def cell(recipe, divergence, temperature, tau):
    return dict(recipe=recipe, divergence=divergence, temperature=temperature, gamma=5,
                tau=tau, tau_stderr=0.01, draft_acceptance_rate=0.5)

  cells = [cell("supervised_kd", "fkl", 0.0, 3.0), cell("supervised_kd", "rkl", 0.0, 2.0),
           cell("gkd", "fkl", 0.0, 4.0), cell("gkd", "rkl", 0.0, 3.0),
           cell("supervised_kd", "fkl", 1.0, 3.0), cell("supervised_kd", "rkl", 1.0, 3.0),
           cell("gkd", "fkl", 1.0, 2.0), cell("gkd", "rkl", 1.0, 2.0)]
  t0, t1 = recipe_grid.rules(cells, 5)
  assert t0["rule1"]["verdict"] == "holds" and t0["rule1"]["difference"] == pytest.approx(1.0)
  assert t0["rule2"]["measured_best"] == "fkl" and t0["rule2"]["verdict"] == "holds"
  assert t1["rule1"]["verdict"] == "reversed"
  # FKL and RKL tie at T = 1 (2.5 each): within noise of the claimed RKL.
  assert t1["rule2"]["verdict"] in ("holds", "within noise")


@pytest.mark.integration
@pytest.mark.pipeline
def test_garden_report_frontier_and_reference(tmp_path, base_run):
  config = GardenConfig(run_dir=str(tmp_path / "garden"), reuse_run_dir=base_run,
                        sizes=("demo_draft", "smoke_target"), target_model="smoke_target",
                        draft_model="demo_draft", middle_steps=2, **TINY)
  outcome = run_pipeline(config, config.stage_functions())
  assert set(outcome.values()) == {"ran"}
  report = json.load(open(tmp_path / "garden" / "report.json"))
  points = report["points"]
  assert {p["strategy"] for p in points} == set(garden.STRATEGIES)
  for point in points:
    assert set(point) >= {"strategy", "target", "draft", "quality", "relative_latency",
                          "pareto"}
    assert math.isfinite(point["quality"]) and point["relative_latency"] > 0
    low, high = point["relative_latency_range"]
    assert low <= point["relative_latency"] <= high
  largest = [p for p in points if p["strategy"] == "raw" and p["target"] == "target"]
  assert len(largest) == 1 and largest[0]["relative_latency"] == 1.0
  assert [p["pareto"] for p in points] == pareto([p["quality"] for p in points],
                                                 [p["relative_latency"] for p in points])
  assert any(p["pareto"] for p in points)
  assert "| distillspec |" in open(tmp_path / "garden" / "report.md").read()
  assert (tmp_path / "garden" / "garden_frontier.png").stat().st_size > 0


def test_garden_stages_with_a_middle_size(tmp_path):
  config = GardenConfig(run_dir=str(tmp_path), **TINY)  # demo_draft < smoke_target < demo_target
  assert config.stages == ("vocab", "target", "draft_raw", "raw_smoke_target",
                           "kd_demo_draft", "kd_smoke_target",
                           "kd_demo_draft_for_kd_smoke_target", "evaluate", "report")
  assert config.dependencies("kd_smoke_target") == ("target", "raw_smoke_target")
  assert config.dependencies("kd_demo_draft_for_kd_smoke_target") == (
      "kd_smoke_target", "draft_raw")
  assert ("distillspec", "kd_smoke_target", "kd_demo_draft_for_kd_smoke_target") in \
      config.points()
  assert ("speculative", "raw_smoke_target", "draft_raw") in config.points()
  assert len(config.points()) == 3 + 2 + 3 + 2


def test_pareto_on_a_hand_made_example():
  #            A     B     C     D     E (= B)  F
  quality = [50.0, 40.0, 30.0, 35.0, 40.0, 50.0]
  latency = [1.0, 0.5, 0.2, 0.6, 0.5, 0.9]
  # A is beaten by F (same quality, faster); D by B (better and faster); B and E tie.
  assert pareto(quality, latency) == [False, True, True, False, True, True]
  assert pareto([1.0], [1.0]) == [True]
  with pytest.raises(ValueError, match="one quality per latency"):
    pareto([1.0, 2.0], [1.0])
  with pytest.raises(ValueError, match="non-finite"):
    pareto([float("nan")], [1.0])


@pytest.mark.parametrize("changes, message", [
    (dict(recipes=()), r"recipe grid is empty: recipes=\(\)"),
    (dict(divergences=()), r"divergences=\(\)"),
    (dict(divergences=("fkl", "kl")), "Unknown divergence 'kl'"),
    (dict(recipes=("gkd", "gkd")), "repeats a name"),
    (dict(divergence="fkl"), "divergence='fkl' is set"),
    (dict(recipes=("gkd", "adaspec")),
     r"includes 'adaspec' but not its reference recipe adaspec_reference='supervised_kd'"),
    (dict(seeds=(0, 1, 0)), r"seeds=\(0, 1, 0\) repeats seed 0"),
    (dict(seeds=(1, -2)), r"seeds\[1\]=-2 must be an integer >= 0"),
    (dict(seeds=(True,)), r"seeds\[0\]=True is a bool"),
    (dict(compute_budget=0), "compute_budget .*=0 must be an integer >= 1"),
    # SeqKD samples from the target every step: 32 rows x (40 + 44) tokens x 2.
    (dict(recipes=("gkd", "seqkd"), batch_size=32, compute_budget=5000,
          task_feature_lengths={"inputs": 40, "targets": 44}),
     r"compute_budget=5000 target forward tokens is smaller than one step of 'seqkd' \(5376: "
     "batch 32 x 84 tokens"),
    (dict(divergences=("fkl", "block")), "Unknown divergence 'block'"),
    (dict(divergences=("lk_lambda",), lk_s=0.0), "s=0.0 must lie in"),
    (dict(divergences=("lk_lambda",), lk_s=-1.0), "s=-1.0 must lie in"),
    (dict(divergences=("lk_lambda",), lk_eta=-0.5), "eta=-0.5 must be finite and >= 0"),
    (dict(compute_unit="joules"), "'joules'"),
])
def test_recipe_grid_bad_input(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    RecipeGridConfig(run_dir=str(tmp_path), **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(sizes=("demo_target",)), r"sizes=\('demo_target',\): a garden needs at least two"),
    (dict(sizes=()), "at least two"),
    (dict(sizes=("demo_draft", "tiny_encoder_decoder"), target_model="tiny_encoder_decoder"),
     r"different vocabularies .*'demo_draft': 256, 'tiny_encoder_decoder': 512"),
    (dict(sizes=("demo_target", "demo_draft"), target_model="demo_draft",
          draft_model="demo_target"), "not smallest first"),
    (dict(sizes=("demo_draft", "smoke_target")), "target_model='demo_target'"),
    (dict(recipes=("gkd", "seqkd")), "one recipe"),
    (dict(grid=DecodingGrid(gammas=(5,), temperatures=(0.0, 1.0))), "T = 0"),
    (dict(sizes=("demo_draft", "no_such_model")), "no_such_model"),
])
def test_garden_bad_input(tmp_path, changes, message):
  with pytest.raises((ValueError, KeyError), match=message):
    GardenConfig(run_dir=str(tmp_path), **changes)


def test_binary_builds_the_study_configs(tmp_path):
  for name, cls in (("recipe_grid", RecipeGridConfig), ("garden", GardenConfig)):
    config = main.load_pipeline([f"--gin_file=gin/runs/{name}.gin",
                                 f"--gin.MODEL_DIR='{tmp_path / name}'"])
    assert isinstance(config, cls) and config.run_dir == str(tmp_path / name)
    assert set(config.stage_functions()) >= {"vocab", "report"}


def test_recipe_grid_seeds_and_matched_compute():
  config = RecipeGridConfig(run_dir="unused", recipes=("supervised_kd", "seqkd", "fdistill"),
                            divergences=("lk_lambda", "block_acceptance"), seeds=(3, 7),
                            batch_size=4, task_feature_lengths={"inputs": 6, "targets": 4},
                            compute_budget=1000)
  # Target forward tokens per step: 4 rows x 10 tokens, plus the target's samples on the
  # share of steps that draw them (SeqKD every step, f-Distill half of them).
  assert [config.step_cost(r) for r in config.recipes] == [40, 80, 60]
  assert [config.steps_of(r) for r in config.recipes] == [25, 12, 16]
  used = [config.steps_of(r) * config.step_cost(r) for r in config.recipes]
  assert max(used) <= 1000 and min(used) >= 0.95 * 1000  # equal within 5% here
  assert config.distill_stages[:2] == ("distill_supervised_kd-lk_lambda-s3",
                                       "distill_supervised_kd-block_acceptance-s3")
  assert recipe_grid.parse_cell_stage("distill_fdistill-block_acceptance-s7") == (
      "fdistill", "block_acceptance", 7)
  assert recipe_grid.objective_settings("block_acceptance", 5) == dict(
      divergence="tvd", position_weighting="block_acceptance", block_size=5)
  # Without seeds or a budget: one run per cell with `seed`, distill_steps each.
  plain = RecipeGridConfig(run_dir="unused", recipes=("gkd",), divergences=("fkl",), seed=4,
                           distill_steps=9)
  assert plain.distill_stages == ("distill_gkd-fkl-s4",) and plain.steps_of("gkd") == 9


def test_a_cell_over_seeds_on_hand_made_runs():
  out = recipe_grid.over_seeds([3.0, 3.4, 3.2], [0.05, 0.07, 0.06])
  assert out["tau"] == pytest.approx(3.2)
  assert out["tau_stderr_seeds"] == pytest.approx(0.2 / np.sqrt(3))  # sample std 0.2
  assert out["tau_stderr_prompts"] == pytest.approx(0.06)
  assert out["tau_stderr"] == pytest.approx(np.hypot(0.2 / np.sqrt(3), 0.06))
  one = recipe_grid.over_seeds([3.0], [0.05])
  assert one["tau_stderr_seeds"] is None and one["tau_stderr"] == pytest.approx(0.05)
  config = RecipeGridConfig(run_dir="unused", recipes=("gkd",), divergences=("fkl",),
                            seeds=(0, 1))
  markers = {recipe_grid.cell_stage("gkd", "fkl", seed): dict(
      steps=5, target_tokens=100, final_loss=loss, wall_clock_s=2.0,
      evaluation=[dict(gamma=5, temperature=0.0, tau=tau, tau_stderr=0.1,
                       draft_acceptance_rate=0.5)],
      tau_curve=[dict(step=0, tau=2.0, tau_stderr=0.1), dict(step=5, tau=tau,
                                                             tau_stderr=0.1)])
      for seed, tau, loss in ((0, 3.0, 1.0), (1, 3.4, 0.5))}
  (cell,) = recipe_grid.build_cells(config, recipe_grid.build_runs(config, markers))
  assert cell["seeds"] == [0, 1] and cell["taus"] == [3.0, 3.4]
  assert cell["tau"] == pytest.approx(3.2) and cell["final_loss"] == pytest.approx(0.75)
  assert cell["tau_stderr_seeds"] == pytest.approx(0.2)  # |3.4 - 3.0| / 2
  curve = recipe_grid.build_curves(config, markers)["gkd-fkl"]
  assert [p["tau"] for p in curve] == [pytest.approx(2.0), pytest.approx(3.2)]
  assert curve[1]["tau_stderr"] == pytest.approx(0.2)


def test_recipe_grid_adaspec_over_seeds_at_its_reference_compute():
  """AdaSPEC cells: after and depending on the reference recipe's cell of the same objective
  and seed, at the reference's target compute per step."""
  config = RecipeGridConfig(run_dir="unused", recipes=("adaspec", "supervised_kd"),
                            divergences=("fkl", "tvd"), seeds=(0, 1), batch_size=4,
                            task_feature_lengths={"inputs": 6, "targets": 4},
                            compute_budget=400)
  assert config.step_cost("adaspec") == config.step_cost("supervised_kd") == 40
  assert config.steps_of("adaspec") == config.steps_of("supervised_kd") == 10
  stages = config.distill_stages
  assert stages[:4] == tuple(recipe_grid.cell_stage(r, d, 0)
                             for r in ("supervised_kd", "adaspec") for d in ("fkl", "tvd"))
  assert config.dependencies("distill_adaspec-tvd-s1") == (
      "target", "draft_raw", "distill_supervised_kd-tvd-s1")
  assert config.dependencies("distill_supervised_kd-tvd-s1") == ("target", "draft_raw")


def test_adaspec_verdict_on_a_hand_made_grid():
  def cell(recipe, divergence, tau):
    return dict(recipe=recipe, divergence=divergence, temperature=0.0, gamma=5, tau=tau,
                tau_stderr=0.05, draft_acceptance_rate=0.5)

  cells = [cell("supervised_kd", "fkl", 3.0), cell("supervised_kd", "tvd", 3.2),
           cell("adaspec", "fkl", 3.5), cell("adaspec", "tvd", 3.7)]
  (answer,) = recipe_grid.rules(cells, 5)
  assert answer["adaspec"]["difference"] == pytest.approx(0.5)
  assert answer["adaspec"]["verdict"] == "holds"
  # AdaSPEC's cells stay out of the paper's rules: rule 2 reads the reference's alone.
  assert answer["rule2"]["by_divergence"]["fkl"]["tau"] == pytest.approx(3.0)
  close = [dict(c, tau=c["tau"] - 0.45) if c["recipe"] == "adaspec" else c for c in cells]
  assert recipe_grid.rules(close, 5)[0]["adaspec"]["verdict"] == "within noise"


def _markers(run_dir, n_target, n_draft):
  for stage, count in (("target", n_target), ("draft_raw", n_draft)):
    os.makedirs(os.path.join(run_dir, stage))
    write_json_atomic(os.path.join(run_dir, stage, "DONE.json"), {"num_params": count})


def test_recipe_grid_matched_flops(tmp_path):
  """Training FLOPs per step: 2 N_target per teacher-forced token, 6 N_draft per trained token,
  2 N_draft per token of the draft's own samples (GKD every step, ImitKD half of them)."""
  _markers(str(tmp_path), 1000, 100)
  config = RecipeGridConfig(run_dir=str(tmp_path), recipes=("supervised_kd", "imitkd", "gkd"),
                            divergences=("fkl",), batch_size=2,
                            task_feature_lengths={"inputs": 3, "targets": 2},
                            compute_budget=10**6, compute_unit="flops")
  assert config.param_counts == (1000, 100)
  assert [config.step_cost(r) for r in config.recipes] == [
      2 * 10 * (1000 + 3 * 100), 2 * 10 * (1000 + 3.5 * 100), 2 * 10 * (1000 + 4 * 100)]
  assert [config.target_token_cost(r) for r in config.recipes] == [10, 10, 10]
  assert [config.steps_of(r) for r in config.recipes] == [38, 37, 35]
  used = [config.steps_of(r) * config.step_cost(r) for r in config.recipes]
  assert max(used) / min(used) < 1.05
  config.check_inputs()
  small = dataclasses.replace(config, compute_budget=27_000)
  with pytest.raises(ValueError, match=r"compute_budget=27000 training FLOPs is smaller than "
                                       r"one step of 'gkd' \(28000: "):
    small.check_inputs()
  with pytest.raises(ValueError, match="needs the target stage's parameter count"):
    dataclasses.replace(config, run_dir=str(tmp_path / "elsewhere")).step_cost("gkd")


def test_acceptance_objectives_and_verdict_sentences_on_a_hand_made_grid():
  def cell(recipe, objective, temperature, tau, err=0.01):
    return dict(recipe=recipe, divergence=objective, temperature=temperature, gamma=5,
                tau=tau, tau_stderr=err, draft_acceptance_rate=0.5)

  taus = {"fkl": 3.0, "rkl": 2.8, "lk_lambda": 3.4, "block_acceptance": 3.1}
  cells = [cell(r, d, t, tau + (0.2 if r == "gkd" else 0.0))
           for r in ("supervised_kd", "gkd") for d, tau in taus.items() for t in (0.0, 1.0)]
  t0, _ = recipe_grid.rules(cells, 5)
  # Rule 2 reads the paper's divergences alone; the acceptance objectives get their answer.
  assert t0["rule2"]["by_divergence"].keys() == {"fkl", "rkl"}
  answer = t0["acceptance_objectives"]
  assert (answer["best"], answer["best_divergence"]) == ("lk_lambda", "fkl")
  assert answer["difference"] == pytest.approx(0.4) and answer["verdict"] == "holds"
  sentences = recipe_grid.verdict_sentences(recipe_grid.rules(cells, 5))
  assert len(sentences) == 3
  assert sentences[0].startswith("Rule 1") and "-> reproduced" in sentences[0]
  assert "LK-lambda vs best divergence FKL: +0.40" in sentences[2]
  # Rule 2 at T = 1: the claimed RKL trails FKL by 0.2, twenty standard errors.
  assert "at T = 1 the claimed RKL vs the best other, FKL: -0.20" in sentences[1]
  assert sentences[1].endswith("-> refuted.")
  noisy = [dict(c, tau_stderr=0.5) for c in cells]
  for sentence in recipe_grid.verdict_sentences(recipe_grid.rules(noisy, 5)):
    assert sentence.count("not distinguishable at this size") == 2  # both temperatures


def test_verdicts_pair_the_runs_of_each_seed():
  """The prompts' error is common to the runs of one seed, so a difference that every seed
  shows is a verdict even where the cells' own errors overlap; a difference that changes
  sign over seeds is not."""
  def run(recipe, seed, tau):
    return dict(recipe=recipe, divergence="fkl", temperature=0.0, gamma=5, seed=seed, tau=tau,
                tau_stderr=0.3, draft_acceptance_rate=0.5)

  base = {0: 3.0, 1: 3.4, 2: 3.2}
  runs = [run("supervised_kd", s, t) for s, t in base.items()] + [
      run("gkd", s, t + d) for (s, t), d in zip(base.items(), (0.10, 0.12, 0.11))]
  config = RecipeGridConfig(run_dir="unused", recipes=("supervised_kd", "gkd"),
                            divergences=("fkl",), seeds=(0, 1, 2))
  cells = recipe_grid.build_cells(config, [dict(r, steps=1, target_tokens=1, compute=1,
                                                final_loss=0.0, wall_clock_s=1.0) for r in runs])
  (answer,) = recipe_grid.rules(cells, 5, runs=runs)
  rule1 = answer["rule1"]
  assert rule1["difference"] == pytest.approx(0.11)
  assert rule1["difference_stderr"] == pytest.approx(0.01 / np.sqrt(3))  # paired: std 0.01
  assert rule1["threshold"] == 4.30 and rule1["error"] == "paired over 3 seeds"
  assert rule1["verdict"] == "holds"
  (alone,) = recipe_grid.rules(cells, 5)  # the cells' errors as independent: within noise
  assert alone["rule1"]["verdict"] == "within noise"
  flipped = [dict(r, tau=r["tau"] - 0.22) if r["recipe"] == "gkd" and r["seed"] == 1 else r
             for r in runs]  # differences +0.10, -0.10, +0.11
  (answer,) = recipe_grid.rules(cells, 5, runs=flipped)
  assert answer["rule1"]["verdict"] == "within noise"


def test_a_cells_tau_over_seeds_refuses_an_undefined_tau():
  """A run whose evaluation ran no target call has tau None (decoding/stats.py); the mean over
  seeds read it as NaN (np.asarray(..., float64)) and the cell reported tau nan."""
  with pytest.raises(ValueError, match=r"taus=\[None, 2.0\].*no verification round"):
    recipe_grid.over_seeds([None, 2.0], [0.1, 0.1])
  with pytest.raises(ValueError, match="tau_stderr"):
    recipe_grid.over_seeds([2.0], [None])
