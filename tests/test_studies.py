"""The paper's studies as runs (recipe_grid.py, garden.py) on tiny budgets: tables, plots and
finite numbers, cell-by-cell resume, the garden's latency reference and Pareto set, bad input."""

import json
import math
import os

import pytest
import testing

from distillspec_jax.studies import garden
from distillspec_jax import main
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import recipe_grid
from distillspec_jax.studies.garden import GardenConfig, pareto
from distillspec_jax.studies.pipeline import run_pipeline
from distillspec_jax.studies.recipe_grid import RecipeGridConfig


# The whole-pipeline tests' settings (testing.PIPELINE; the same decoding budget, so the
# studies' programs are the smoke tests' where they can be), one timing repeat; each test
# names its target.
TINY = {k: v for k, v in testing.PIPELINE.items() if k != "target_model"} | dict(
    speed_repeats=1)


@pytest.fixture
def base_run(shared_stages):
  """A main job's vocab, target (smoke_target) and raw draft (demo_draft), trained once per
  test run (conftest.py) and reused by both studies (as the real runs reuse runs/demo)."""
  return shared_stages[0]


def _grid(run_dir, base, **changes):
  return RecipeGridConfig(run_dir=str(run_dir), reuse_run_dir=base, target_model="smoke_target",
                          recipes=("supervised_kd", "gkd"), divergences=("fkl",),
                          temperatures=(0.0, 1.0), **dict(TINY, **changes))


@pytest.mark.integration
@pytest.mark.pipeline
def test_recipe_grid_report_and_cell_by_cell_resume(tmp_path, base_run):
  config = _grid(tmp_path / "grid", base_run)
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
  assert len(cells) == 2 * 1 * 2  # recipes x divergences x temperatures at one gamma
  assert {(c["recipe"], c["divergence"]) for c in cells} == set(config.cells)
  for cell in cells:
    assert set(cell) >= {"recipe", "divergence", "temperature", "gamma", "tau", "tau_stderr",
                         "alpha"}
    assert cell["gamma"] == 5
    assert 1.0 <= cell["tau"] <= 6.0 and math.isfinite(cell["tau_stderr"])
    assert 0.0 <= cell["alpha"] <= 1.0
  for curve in report["tau_curves"].values():
    assert [p["step"] for p in curve] == [0, 1, 2]
  assert {a["temperature"] for a in report["rules"]} == {0.0, 1.0}
  for answer in report["rules"]:
    assert answer["rule1"]["verdict"] in ("holds", "reversed", "within noise")
  assert report["rules"][0]["rule2"]["by_divergence"].keys() == {"fkl"}  # claimed at T = 0
  markdown = open(tmp_path / "grid" / "report.md").read()
  assert "| SupervisedKD |" in markdown and "rule 2" in markdown
  for name in ("grid_heatmap.png", "grid_tau_curves.png"):
    assert (tmp_path / "grid" / name).stat().st_size > 0


def test_rules_on_a_hand_made_grid():
  def cell(recipe, divergence, temperature, tau):
    return dict(recipe=recipe, divergence=divergence, temperature=temperature, gamma=5,
                tau=tau, tau_stderr=0.01, alpha=0.5)

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
    (dict(recipes=("gkd", "adaspec")), "adaspec"),
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
    (dict(temperatures=(0.0, 1.0)), "T = 0"),
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
