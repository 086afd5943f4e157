"""The recipe grid: every data source x every divergence, from one raw draft, one budget.

DistillSpec's two design rules come from such a grid (the paper's Knowl 6-7):
  1. model-generated data (SeqKD, f-Distill, GKD; ImitKD half) beats the fixed dataset
     (SupervisedKD);
  2. the divergence should fit the decoding: FKL or JSD at T = 0, RKL at T = 1.

Stages (run_pipeline's bookkeeping, so an interrupted grid resumes cell by cell):
  vocab, target, draft_raw       the main job's (or copied from `reuse_run_dir`, e.g. runs/demo)
  distill_<recipe>-<divergence>  one cell: the raw draft distilled with that recipe and
                                 divergence for `distill_steps`, tau over the steps (gamma=5,
                                 T=0, 32 validation prompts), then tau and the acceptance
                                 rates at every gamma in `gammas` and T in `temperatures` on
                                 `eval_examples` test prompts; all of it in the cell's DONE.json
  report                         report.json, report.md, grid_heatmap.png, grid_tau_curves.png

Run: python -m distillspec_jax.main --gin_file=gin/runs/recipe_grid.gin
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Optional

import numpy as np

from distillspec_jax.core.validation import check_field_types, check_finite
from distillspec_jax.evaluation import evaluate
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import common as common_lib
from distillspec_jax.distill.objectives import RECIPES, DistillationConfig
from distillspec_jax.distill.divergences import DIVERGENCES
from distillspec_jax.core.files import read_json, write_json_atomic, write_text_atomic
from distillspec_jax.studies.pipeline import PipelineConfig

# The paper's labels; fixed data only (SupervisedKD) against model-generated data (the rest).
RECIPE_LABELS = {"supervised_kd": "SupervisedKD", "seqkd": "SeqKD", "imitkd": "ImitKD",
                 "fdistill": "f-Distill", "gkd": "GKD"}
DIVERGENCE_LABELS = {"fkl": "FKL", "rkl": "RKL", "jsd": "JSD(0.5)", "tvd": "TVD"}
FIXED_DATA_RECIPES = ("supervised_kd",)
# The paper's rule 2: the divergences it finds best at each temperature.
PAPER_BEST_DIVERGENCES = {0.0: ("fkl", "jsd"), 1.0: ("rkl",)}
CELL_SEPARATOR = "-"


@dataclasses.dataclass(frozen=True)
class RecipeGridConfig(PipelineConfig):
  """A PipelineConfig whose distillation stages are the cells recipes x divergences.

  Attributes (besides PipelineConfig's; `divergence` must stay None):
    recipes: data sources (objectives.RECIPES names).
    divergences: divergences.DIVERGENCES names; "jsd" is JSD(beta) with the recipes'
      beta = 0.5.
    gammas / temperatures: the grid's evaluation points (the paper's grid: gamma 5, T 0 and 1).
    reuse_run_dir: a finished main job whose vocab / target / draft_raw are copied (None =
      train them here).
  """

  run_dir: str = "runs/recipe_grid"
  recipes: tuple = tuple(RECIPE_LABELS)
  divergences: tuple = tuple(DIVERGENCE_LABELS)
  gammas: tuple = (5,)
  reuse_run_dir: Optional[str] = None

  def __post_init__(self):
    check_field_types(self)
    if not len(self.recipes) or not len(self.divergences):
      raise ValueError(f"The recipe grid is empty: recipes={tuple(self.recipes)!r}, "
                       f"divergences={tuple(self.divergences)!r}; name at least one of "
                       f"{sorted(RECIPES)} and one of {DIVERGENCES}.")
    if self.divergence is not None:
      raise ValueError(f"divergence={self.divergence!r} is set, but the grid's divergences "
                       "come from `divergences`; leave divergence=None.")
    if "adaspec" in self.recipes:
      raise ValueError("recipes includes 'adaspec'; the grid's cells are the paper's data "
                       f"sources {sorted(RECIPES)} (AdaSPEC has its own job, "
                       "gin/runs/adaspec_compare.gin).")
    for name, values in (("recipes", self.recipes), ("divergences", self.divergences)):
      if len(set(values)) != len(values):
        raise ValueError(f"{name}={tuple(values)!r} repeats a name; list each once.")
    super().__post_init__()  # recipe names, gammas, temperatures, budgets
    for divergence in self.divergences:
      if divergence not in DIVERGENCES:
        raise ValueError(f"Unknown divergence {divergence!r} in divergences="
                         f"{tuple(self.divergences)!r}; use names from {DIVERGENCES}.")

  def check_inputs(self) -> None:
    super().check_inputs()
    common_lib.check_reuse_run_dir(self.reuse_run_dir)

  @property
  def cells(self) -> tuple:
    """((recipe, divergence), ...) in row-major order (recipe first)."""
    return tuple((r, d) for r in self.recipes for d in self.divergences)

  @property
  def distill_stages(self) -> tuple:
    return tuple(cell_stage(r, d) for r, d in self.cells)

  @property
  def stages(self) -> tuple:
    return ("vocab", "target", "draft_raw") + self.distill_stages + ("report",)

  def dependencies(self, stage: str) -> tuple:
    if stage == "report":
      return self.distill_stages
    return super().dependencies(stage)

  def stage_functions(self) -> dict:
    reuse = lambda fn: common_lib.reusing(fn, self.reuse_run_dir)
    return {"vocab": reuse(pipeline.stage_vocab), "target": reuse(pipeline.stage_finetune),
            "draft_raw": reuse(pipeline.stage_finetune), "distill": stage_cell,
            "report": stage_report}


def cell_stage(recipe: str, divergence: str) -> str:
  return f"distill_{recipe}{CELL_SEPARATOR}{divergence}"


def parse_cell_stage(stage: str) -> tuple:
  """'distill_gkd-rkl' -> ('gkd', 'rkl')."""
  recipe, _, divergence = stage[len("distill_"):].rpartition(CELL_SEPARATOR)
  return recipe, divergence


def _done_cells(config: RecipeGridConfig) -> list:
  return [read_json(os.path.join(config.stage_dir(s), pipeline.DONE))
          for s in config.distill_stages
          if os.path.exists(os.path.join(config.stage_dir(s), pipeline.DONE))]


def _print_grid_progress(config: RecipeGridConfig, stage: str) -> None:
  """One line per cell: how many are done and the ETA from their mean wall clock (the
  trainer's own tqdm bar shows the cell's steps)."""
  done = _done_cells(config)
  left = len(config.cells) - len(done)
  eta = ""
  if done:
    mean = statistics.mean(c.get("wall_clock_s") or 0.0 for c in done)
    eta = f", ETA ~{mean * left / 60:.1f} min at {mean:.0f} s per cell"
  print(f"[recipe grid] cell {len(done) + 1}/{len(config.cells)} {stage}{eta}", flush=True)


def stage_cell(config: RecipeGridConfig, stage: str) -> dict:
  """One cell: the raw draft distilled with the cell's recipe and divergence, then tau and
  the acceptance rates at every (gamma, temperature) of the grid on the test prompts."""
  _print_grid_progress(config, stage)
  recipe, divergence = parse_cell_stage(stage)
  distillation = DistillationConfig.from_recipe(
      recipe, divergence=divergence, max_new_tokens=config.task_feature_lengths["targets"])
  target, draft = pipeline.models(config)
  target_params = pipeline.load_params(config, "target", target)
  summary = common_lib.distill_toward(config, stage, target, target_params, draft,
                                   pipeline.load_params(config, "draft_raw", draft),
                                   distillation)
  params = pipeline.load_params(config, stage, draft)
  summary.update(recipe=recipe, evaluation=grid_statistics(config, target, target_params,
                                                           draft, params))
  return summary


def grid_statistics(config: RecipeGridConfig, target, target_params, draft, draft_params) -> list:
  """[{gamma, temperature, and the quality.Acceptance keys (tau, tau_stderr,
  draft_acceptance_rate, ...)}] of one draft on the first `eval_examples` test prompts
  (fixed seed: every cell sees the same prompts and keys)."""
  examples = pipeline.heldout_prompts(config, config.eval_examples, split="test")
  rows = evaluate.speculative_grid(
      target, target_params, {"draft": (draft, draft_params)}, examples, None,
      gammas=config.gammas, temperatures=config.temperatures,
      max_new_tokens=config.max_new_tokens, seed=config.seed)
  return [dict(gamma=row.point.gamma, temperature=row.point.temperature,
               **row.acceptance.to_json()) for row in rows]


# --- report --------------------------------------------------------------------------------------


def build_cells(config: RecipeGridConfig, markers: dict) -> list:
  """report.json's cells [{recipe, divergence, temperature, gamma, tau, tau_stderr, ...,
  final_loss, wall_clock_s}] from {stage: DONE.json summary}."""
  cells = []
  for recipe, divergence in config.cells:
    marker = markers[cell_stage(recipe, divergence)]
    for row in marker["evaluation"]:
      cells.append(dict(recipe=recipe, divergence=divergence, **row,
                        final_loss=marker["final_loss"], wall_clock_s=marker["wall_clock_s"]))
  return cells


def _mean_with_stderr(rows: list) -> tuple:
  """(mean tau, its standard error treating the rows' errors as independent)."""
  taus = [r["tau"] for r in rows]
  return (float(np.mean(taus)),
          float(np.sqrt(sum(r["tau_stderr"] ** 2 for r in rows)) / len(rows)))


def rules(cells: list, gamma: int) -> list:
  """The measured answer to the paper's two rules at `gamma`, one entry per temperature.

  Rule 1: mean tau of the model-generated-data recipes against SupervisedKD's (over the
  divergences). Rule 2: mean tau of each divergence over the recipes, and whether the
  paper's best divergence(s) at that temperature is the measured best within two standard
  errors. Errors are treated as independent although every cell shares prompts and keys
  (paired differences would be tighter).
  """
  answers = []
  for temperature in sorted({c["temperature"] for c in cells}):
    rows = [c for c in cells if c["temperature"] == temperature and c["gamma"] == gamma]
    fixed = [c for c in rows if c["recipe"] in FIXED_DATA_RECIPES]
    generated = [c for c in rows if c["recipe"] not in FIXED_DATA_RECIPES]
    answer = {"temperature": temperature, "gamma": gamma}
    if fixed and generated:
      (g_mean, g_err), (f_mean, f_err) = _mean_with_stderr(generated), _mean_with_stderr(fixed)
      difference, error = g_mean - f_mean, float(np.hypot(g_err, f_err))
      answer["rule1"] = {
          "claim": "model-generated data beats fixed data",
          "generated_tau": g_mean, "fixed_tau": f_mean, "difference": difference,
          "difference_stderr": error,
          "verdict": ("holds" if difference > 2 * error else
                      "reversed" if difference < -2 * error else "within noise")}
    by_divergence = {}
    for divergence in dict.fromkeys(c["divergence"] for c in rows):
      mean, err = _mean_with_stderr([c for c in rows if c["divergence"] == divergence])
      by_divergence[divergence] = {"tau": mean, "tau_stderr": err}
    claimed = [d for d in PAPER_BEST_DIVERGENCES.get(temperature, ()) if d in by_divergence]
    if by_divergence and claimed:
      best = max(by_divergence, key=lambda d: by_divergence[d]["tau"])
      top = max(claimed, key=lambda d: by_divergence[d]["tau"])
      gap = by_divergence[best]["tau"] - by_divergence[top]["tau"]
      gap_err = float(np.hypot(by_divergence[best]["tau_stderr"],
                               by_divergence[top]["tau_stderr"]))
      answer["rule2"] = {
          "claim": f"{'/'.join(DIVERGENCE_LABELS.get(d, d) for d in claimed)} best at "
                   f"T={temperature:g}",
          "by_divergence": by_divergence, "measured_best": best, "gap_to_claimed": gap,
          "gap_stderr": gap_err,
          "verdict": ("holds" if best in claimed else
                      "within noise" if gap <= 2 * gap_err else "does not hold")}
    answers.append(answer)
  return answers


def build_report(config: RecipeGridConfig, markers: dict, raw_draft: list) -> dict:
  cells = build_cells(config, markers)
  check_finite(cells + raw_draft, "recipe grid report")
  curves = {stage: markers[stage]["tau_curve"] for stage in config.distill_stages}
  return {"cells": cells, "raw_draft": raw_draft,
          "rules": rules(cells, int(config.gammas[0])), "tau_curves": curves,
          "budget": {"distill_steps": config.distill_steps, "batch_size": config.batch_size,
                     "learning_rate": config.distill_learning_rate,
                     "eval_examples": config.eval_examples},
          "wall_clock_s": {s: markers[s].get("wall_clock_s") for s in config.distill_stages},
          "measurement": (
              f"tau = tokens per target call of speculative decoding (the engine run on the "
              f"first {config.eval_examples} test prompts, one batch, seed {config.seed}; the "
              "same prompts and keys for every cell), +- its standard error over prompts; "
              f"each cell is the raw draft distilled for {config.distill_steps} steps "
              f"(batch {config.batch_size}) with its recipe and divergence.")}


def _cell_text(row: Optional[dict]) -> str:
  return "-" if row is None else f"{row['tau']:.2f} ± {row['tau_stderr']:.2f}"


def render_markdown(config: RecipeGridConfig, report: dict) -> str:
  lines = ["# Recipe grid: data source x divergence", "", report["measurement"], ""]
  index = {(c["recipe"], c["divergence"], c["temperature"], c["gamma"]): c
           for c in report["cells"]}
  for temperature in config.temperatures:
    for gamma in config.gammas:
      key = (float(temperature), int(gamma))
      raw = next((r for r in report["raw_draft"]
                  if (r["temperature"], r["gamma"]) == key), None)
      lines += [f"## tau at gamma = {gamma}, T = {temperature:g} (raw draft: "
                f"{_cell_text(raw)})", "",
                "| recipe | " + " | ".join(DIVERGENCE_LABELS.get(d, d)
                                         for d in config.divergences) + " |",
                "|---" * (len(config.divergences) + 1) + "|"]
      for recipe in config.recipes:
        lines.append(f"| {RECIPE_LABELS.get(recipe, recipe)} | " + " | ".join(
            _cell_text(index.get((recipe, d) + key)) for d in config.divergences) + " |")
      lines.append("")
  lines += ["## The paper's rules, measured", ""]
  for answer in report["rules"]:
    t = answer["temperature"]
    if "rule1" in answer:
      r = answer["rule1"]
      lines.append(f"- T = {t:g}, rule 1 ({r['claim']}): generated-data recipes' mean tau "
                   f"{r['generated_tau']:.2f} vs SupervisedKD {r['fixed_tau']:.2f}: "
                   f"difference {r['difference']:+.2f} ± {r['difference_stderr']:.2f} -> "
                   f"**{r['verdict']}**.")
    if "rule2" in answer:
      r = answer["rule2"]
      means = ", ".join(f"{DIVERGENCE_LABELS.get(d, d)} {v['tau']:.2f} ± {v['tau_stderr']:.2f}"
                        for d, v in r["by_divergence"].items())
      lines.append(f"- T = {t:g}, rule 2 ({r['claim']}): mean tau over recipes {means}; "
                   f"measured best {DIVERGENCE_LABELS.get(r['measured_best'])} "
                   f"(gap to the claimed {r['gap_to_claimed']:.2f} ± {r['gap_stderr']:.2f}) "
                   f"-> **{r['verdict']}**.")
  lines += ["", "Verdicts: a difference beyond two standard errors counts; errors are "
            "combined as independent although the cells share prompts and keys.", ""]
  return "\n".join(lines)


def plot(config: RecipeGridConfig, report: dict, out_dir: str) -> list:
  """grid_heatmap.png (tau per cell, one panel per temperature at the first gamma, each cell
  annotated with tau ± stderr) and grid_tau_curves.png (tau over steps, one panel per
  recipe, a line per divergence with stderr bars)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  gamma, paths = int(config.gammas[0]), []
  index = {(c["recipe"], c["divergence"], c["temperature"]): c for c in report["cells"]
           if c["gamma"] == gamma}
  temperatures = list(config.temperatures)
  fig, axes = plt.subplots(1, len(temperatures), squeeze=False,
                           figsize=(1.6 * len(config.divergences) * len(temperatures) + 2,
                                    0.55 * len(config.recipes) + 1.8))
  for ax, temperature in zip(axes[0], temperatures):
    grid = np.array([[index[(r, d, float(temperature))]["tau"] for d in config.divergences]
                     for r in config.recipes])
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    for i, r in enumerate(config.recipes):
      for j, d in enumerate(config.divergences):
        cell = index[(r, d, float(temperature))]
        ax.text(j, i, f"{cell['tau']:.2f}\n±{cell['tau_stderr']:.2f}", ha="center",
                va="center", fontsize=7,
                color="white" if cell["tau"] < grid.mean() else "black")
    ax.set_xticks(range(len(config.divergences)),
                  [DIVERGENCE_LABELS.get(d, d) for d in config.divergences])
    ax.set_yticks(range(len(config.recipes)),
                  [RECIPE_LABELS.get(r, r) for r in config.recipes])
    ax.set_title(f"tau at gamma={gamma}, T={temperature:g}")
    fig.colorbar(image, ax=ax, shrink=0.8)
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "grid_heatmap.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(config.recipes), squeeze=False, sharey=True,
                           figsize=(3.2 * len(config.recipes), 3.2))
  for ax, recipe in zip(axes[0], config.recipes):
    for divergence in config.divergences:
      curve = report["tau_curves"][cell_stage(recipe, divergence)]
      ax.errorbar([p["step"] for p in curve], [p["tau"] for p in curve],
                  yerr=[p.get("tau_stderr") or 0.0 for p in curve], marker="o", ms=3,
                  capsize=2, label=DIVERGENCE_LABELS.get(divergence, divergence))
    ax.set_title(RECIPE_LABELS.get(recipe, recipe))
    ax.set_xlabel("distillation step")
  axes[0][0].set_ylabel("tau (gamma=5, T=0, 32 val. prompts, ± s.e.)")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "grid_tau_curves.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  return paths


def stage_report(config: RecipeGridConfig, stage: str) -> dict:
  """report.json, report.md and the PNGs in `run_dir` from the cells' markers, with the raw
  draft's tau at the same points (the cells' common starting point)."""
  markers = {s: read_json(os.path.join(config.stage_dir(s), pipeline.DONE))
             for s in config.distill_stages}
  target, draft = pipeline.models(config)
  raw_draft = grid_statistics(config, target, pipeline.load_params(config, "target", target),
                              draft, pipeline.load_params(config, "draft_raw", draft))
  report = build_report(config, markers, raw_draft)
  write_json_atomic(os.path.join(config.run_dir, "report.json"), report)
  markdown = render_markdown(config, report)
  write_text_atomic(os.path.join(config.run_dir, "report.md"), markdown)
  print(markdown)
  return {"plots": plot(config, report, config.run_dir)}
