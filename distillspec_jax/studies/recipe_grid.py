"""The recipe grid: every data source x every objective, from one raw draft, one budget.

DistillSpec's two design rules come from such a grid (the paper's Knowl 6-7):
  1. model-generated data (SeqKD, f-Distill, GKD; ImitKD half) beats the fixed dataset
     (SupervisedKD);
  2. the divergence should fit the decoding: FKL or JSD at T = 0, RKL at T = 1.

Stages (run_pipeline's bookkeeping, so an interrupted grid resumes run by run):
  vocab, target, draft_raw   the main job's (or copied from `reuse_run_dir`, e.g. runs/demo)
  distill_<recipe>-<objective>-s<seed>
                             one run of a cell: the raw draft distilled with that recipe and
                             objective (a divergence, or "block_acceptance": TVD weighted by
                             the chance of reaching each position) with `seed` (data order,
                             the steps' sampling keys, the evaluation's keys) for the cell's
                             steps, tau over the steps (gamma=5, T=0, 32 validation prompts),
                             then tau / acceptance at every gamma in `gammas` and T in
                             `temperatures` on `eval_examples` test prompts; in its DONE.json
  report                     report.json, report.md, grid_heatmap.png, grid_tau_curves.png

AdaSPEC (the recipe "adaspec", beside its `adaspec_reference` recipe): each of its cells is
the reference recipe's data source and objective with AdaSPEC token selection, its reference
model the reference recipe's cell of the same objective and seed (a stage it depends on), so
AdaSPEC and DistillSpec are compared over the same seeds at the same target compute (the
reference's own forward pass is a draft-sized one, not counted); the report adds a verdict on
AdaSPEC's claim (it beats its reference) per temperature.

Seeds and compute: every cell runs once per seed in `seeds`, and the report gives each
cell's mean over seeds with its standard error over seeds beside the one over prompts. With
`compute_budget` set, every cell gets the same budget of target forward tokens (the target is
the expensive model and its tokens do not depend on the machine; the draft's own passes are
not counted), and its steps follow from its recipe's cost per step (`step_cost`): a recipe
that samples from the target pays for those samples, so it trains fewer steps.

Run: python -m distillspec_jax.main --gin_file=gin/runs/recipe_grid.gin
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Optional

import numpy as np

from distillspec_jax.core.validation import check_field_types, check_finite, check_int
from distillspec_jax.evaluation import evaluate
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import common as common_lib
from distillspec_jax.distill.objectives import RECIPES, DistillationConfig
from distillspec_jax.distill.divergences import DIVERGENCES
from distillspec_jax.core.files import read_json, write_json_atomic, write_text_atomic
from distillspec_jax.studies.pipeline import PipelineConfig

# The paper's labels; fixed data only (SupervisedKD) against model-generated data (the rest).
RECIPE_LABELS = {"supervised_kd": "SupervisedKD", "seqkd": "SeqKD", "imitkd": "ImitKD",
                 "fdistill": "f-Distill", "gkd": "GKD"}
DIVERGENCE_LABELS = {"fkl": "FKL", "rkl": "RKL", "jsd": "JSD(0.5)", "tvd": "TVD",
                     "lk_alpha": "LK-alpha", "lk_lambda": "LK-lambda",
                     "block_acceptance": "block acceptance"}
# The grid's objectives: the divergences, and TVD weighted by block acceptance.
OBJECTIVES = DIVERGENCES + ("block_acceptance",)
GRID_DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")
FIXED_DATA_RECIPES = ("supervised_kd",)
ADASPEC = "adaspec"
LABELS = dict(RECIPE_LABELS, adaspec="AdaSPEC")
# The paper's rule 2: the divergences it finds best at each temperature.
PAPER_BEST_DIVERGENCES = {0.0: ("fkl", "jsd"), 1.0: ("rkl",)}
CELL_SEPARATOR = "-"


@dataclasses.dataclass(frozen=True)
class RecipeGridConfig(PipelineConfig):
  """A PipelineConfig whose distillation stages are the cells recipes x divergences.

  Attributes (besides PipelineConfig's; `divergence` must stay None):
    recipes: data sources (objectives.RECIPES names), and "adaspec" (AdaSPEC selection on
      the `adaspec_reference` recipe, which must be listed too).
    divergences: the objectives, OBJECTIVES names: divergences.DIVERGENCES ("jsd" is
      JSD(beta) with the recipes' beta = 0.5) or "block_acceptance" (TVD weighted by the
      detached chance of reaching each position in blocks of gammas[0]).
    grid: the evaluation points (DecodingGrid; the paper's grid: gamma 5, T 0 and 1).
    reuse_run_dir: a finished main job whose vocab / target / draft_raw are copied (None =
      train them here).
    seeds: the seeds each cell runs with (distinct ints >= 0); () = (seed,). The shared
      stages (vocab, target, raw draft) use `seed` alone.
    compute_budget: target forward tokens each cell may spend (`step_cost`); None = every
      cell trains `distill_steps` steps.
  """

  run_dir: str = "runs/recipe_grid"
  recipes: tuple = tuple(RECIPE_LABELS)
  divergences: tuple = GRID_DIVERGENCES
  grid: DecodingGrid = DecodingGrid(gammas=(5,))
  reuse_run_dir: Optional[str] = None
  seeds: tuple = ()
  compute_budget: Optional[int] = None

  def __post_init__(self):
    check_field_types(self)
    if not len(self.recipes) or not len(self.divergences):
      raise ValueError(f"The recipe grid is empty: recipes={tuple(self.recipes)!r}, "
                       f"divergences={tuple(self.divergences)!r}; name at least one of "
                       f"{sorted(RECIPES)} and one of {DIVERGENCES}.")
    if self.divergence is not None:
      raise ValueError(f"divergence={self.divergence!r} is set, but the grid's divergences "
                       "come from `divergences`; leave divergence=None.")
    if ADASPEC in self.recipes and self.adaspec_reference not in self.recipes:
      raise ValueError(f"recipes={tuple(self.recipes)!r} includes 'adaspec' but not its "
                       f"reference recipe adaspec_reference={self.adaspec_reference!r}; add "
                       "it (AdaSPEC's reference model is that recipe's cell).")
    for name, values in (("recipes", self.recipes), ("divergences", self.divergences)):
      if len(set(values)) != len(values):
        raise ValueError(f"{name}={tuple(values)!r} repeats a name; list each once.")
    super().__post_init__()  # recipe names, the grid, budgets
    for divergence in self.divergences:
      if divergence not in OBJECTIVES:
        raise ValueError(f"Unknown divergence {divergence!r} in divergences="
                         f"{tuple(self.divergences)!r}; use names from {OBJECTIVES}.")
    self._check_seeds_and_budget()

  def _check_seeds_and_budget(self) -> None:
    for index, seed in enumerate(self.seeds):
      check_int(seed, f"seeds[{index}]", 0)
    repeated = sorted({s for s in self.seeds if list(self.seeds).count(s) > 1})
    if repeated:
      raise ValueError(f"seeds={tuple(self.seeds)!r} repeats seed {repeated[0]}; list each "
                       "seed once (a repeated seed is the same run, not another sample).")
    if self.compute_budget is None:
      return
    check_int(self.compute_budget, "compute_budget (target forward tokens per cell)", 1)
    recipe = max(self.recipes, key=self.step_cost)
    if self.compute_budget < self.step_cost(recipe):
      raise ValueError(
          f"compute_budget={self.compute_budget} target forward tokens is smaller than one "
          f"step of {recipe!r} ({self.step_cost(recipe)} tokens: batch {self.batch_size} x "
          f"{self._tokens_per_row} tokens x {1 + self._target_sample_share(recipe):g}); "
          f"raise it to at least {self.step_cost(recipe)}.")

  @property
  def _tokens_per_row(self) -> int:
    """Target forward tokens per row of a teacher-forced pass, and of a target sample
    (encoding or prefilling the inputs, then one token per generated target)."""
    return sum(int(v) for v in self.task_feature_lengths.values())

  def _target_sample_share(self, recipe: str) -> float:
    """The probability that a step of `recipe` samples from the target (Knowl 4); AdaSPEC
    draws its reference recipe's data."""
    lambda1, lambda2, _ = RECIPES[self.adaspec_reference if recipe == ADASPEC else recipe]
    return (1.0 - lambda1) * (1.0 - lambda2)

  def step_cost(self, recipe: str) -> int:
    """Expected target forward tokens of one distillation step of `recipe`: the loss's
    teacher-forced pass over the batch, plus the target's samples on the steps that draw
    them."""
    share = self._target_sample_share(recipe)
    return int(round(self.batch_size * self._tokens_per_row * (1.0 + share)))

  def steps_of(self, recipe: str) -> int:
    """A cell's distillation steps: the budget over the recipe's step cost (at least one,
    checked), or distill_steps without a budget."""
    if self.compute_budget is None:
      return int(self.distill_steps)
    return self.compute_budget // self.step_cost(recipe)

  @property
  def run_seeds(self) -> tuple:
    return tuple(self.seeds) or (int(self.seed),)

  def check_inputs(self) -> None:
    super().check_inputs()
    common_lib.check_reuse_run_dir(self.reuse_run_dir)

  @property
  def cells(self) -> tuple:
    """((recipe, divergence), ...) in row-major order (recipe first), AdaSPEC's last: its
    cells read their reference's."""
    recipes = sorted(self.recipes, key=lambda r: r == ADASPEC)  # stable
    return tuple((r, d) for r in recipes for d in self.divergences)

  @property
  def runs(self) -> tuple:
    """((recipe, divergence, seed), ...): every cell once per seed, seeds innermost."""
    return tuple((r, d, s) for r, d in self.cells for s in self.run_seeds)

  @property
  def distill_stages(self) -> tuple:
    return tuple(cell_stage(r, d, s) for r, d, s in self.runs)

  @property
  def stages(self) -> tuple:
    return ("vocab", "target", "draft_raw") + self.distill_stages + ("report",)

  def dependencies(self, stage: str) -> tuple:
    if stage == "report":
      return self.distill_stages
    if stage in self.distill_stages:
      recipe, objective, seed = parse_cell_stage(stage)
      reference = ((cell_stage(self.adaspec_reference, objective, seed),)
                   if recipe == ADASPEC else ())
      return ("target", "draft_raw") + reference
    return super().dependencies(stage)

  def stage_functions(self) -> dict:
    reuse = lambda fn: common_lib.reusing(fn, self.reuse_run_dir)
    return {"vocab": reuse(pipeline.stage_vocab), "target": reuse(pipeline.stage_finetune),
            "draft_raw": reuse(pipeline.stage_finetune), "distill": stage_cell,
            "report": stage_report}


def cell_stage(recipe: str, divergence: str, seed: int) -> str:
  return f"distill_{recipe}{CELL_SEPARATOR}{divergence}{CELL_SEPARATOR}s{seed}"


def parse_cell_stage(stage: str) -> tuple:
  """'distill_gkd-rkl-s3' -> ('gkd', 'rkl', 3)."""
  recipe, divergence, seed = stage[len("distill_"):].rsplit(CELL_SEPARATOR, 2)
  return recipe, divergence, int(seed[1:])


def objective_settings(objective: str, block_size: int) -> dict:
  """DistillationConfig fields of a grid objective name (OBJECTIVES)."""
  if objective == "block_acceptance":
    return dict(divergence="tvd", position_weighting="block_acceptance",
                block_size=block_size)
  return dict(divergence=objective)


def _done_cells(config: RecipeGridConfig) -> list:
  return [read_json(os.path.join(config.stage_dir(s), pipeline.DONE))
          for s in config.distill_stages
          if os.path.exists(os.path.join(config.stage_dir(s), pipeline.DONE))]


def _print_grid_progress(config: RecipeGridConfig, stage: str) -> None:
  """One line per cell: how many are done and the ETA from their mean wall clock (the
  trainer's own tqdm bar shows the cell's steps)."""
  done = _done_cells(config)
  left = len(config.runs) - len(done)
  eta = ""
  if done:
    mean = statistics.mean(c.get("wall_clock_s") or 0.0 for c in done)
    eta = f", ETA ~{mean * left / 60:.1f} min at {mean:.0f} s per cell"
  print(f"[recipe grid] run {len(done) + 1}/{len(config.runs)} {stage}{eta}", flush=True)


def stage_cell(config: RecipeGridConfig, stage: str) -> dict:
  """One run of a cell: the raw draft distilled with the cell's recipe and objective under
  the run's seed for the cell's steps, then tau and the acceptance rates at every
  (gamma, temperature) of the grid on the test prompts."""
  _print_grid_progress(config, stage)
  recipe, objective, seed = parse_cell_stage(stage)
  settings = dict(max_new_tokens=config.task_feature_lengths["targets"],
                  **objective_settings(objective, int(config.grid.gammas[0])))
  target, draft = pipeline.models(config)
  reference = {}
  if recipe == ADASPEC:
    settings.update(top_k_fraction=config.adaspec_top_k,
                    selection_normalization=config.adaspec_normalization)
    reference = dict(reference=draft, reference_params=pipeline.load_params(
        config, cell_stage(config.adaspec_reference, objective, seed), draft))
  distillation = DistillationConfig.from_recipe(
      config.adaspec_reference if recipe == ADASPEC else recipe, **settings)
  steps = config.steps_of(recipe)
  run = dataclasses.replace(config, seed=seed, distill_steps=steps)
  target_params = pipeline.load_params(config, "target", target)
  summary = common_lib.distill_toward(run, stage, target, target_params, draft,
                                   pipeline.load_params(config, "draft_raw", draft),
                                   distillation, **reference)
  params = pipeline.load_params(config, stage, draft)
  summary.update(recipe=recipe, divergence=objective, seed=seed, steps=steps,
                 target_tokens=steps * config.step_cost(recipe),
                 evaluation=grid_statistics(run, target, target_params, draft, params))
  return summary


def grid_statistics(config: RecipeGridConfig, target, target_params, draft, draft_params) -> list:
  """[{gamma, temperature, and the quality.Acceptance keys (tau, tau_stderr,
  draft_acceptance_rate, ...)}] of one draft on the first
  `eval_examples` test prompts (fixed seed: every cell sees the same prompts and keys)."""
  examples = pipeline.heldout_prompts(config, config.eval_examples, split="test")
  rows = evaluate.speculative_grid(
      target, target_params, {"draft": (draft, draft_params)}, examples, None,
      gammas=config.grid.gammas, temperatures=config.grid.temperatures,
      max_new_tokens=config.max_new_tokens, seed=config.seed)
  return [dict(gamma=row.point.gamma, temperature=row.point.temperature,
               **row.acceptance.to_json()) for row in rows]


# --- report --------------------------------------------------------------------------------------


def build_runs(config: RecipeGridConfig, markers: dict) -> list:
  """report.json's runs [{recipe, divergence, seed, temperature, gamma, tau, tau_stderr,
  draft_acceptance_rate, steps, target_tokens, final_loss, wall_clock_s}] from
  {stage: DONE.json summary}."""
  runs = []
  for recipe, divergence, seed in config.runs:
    marker = markers[cell_stage(recipe, divergence, seed)]
    for row in marker["evaluation"]:
      runs.append(dict(recipe=recipe, divergence=divergence, seed=seed, **row,
                       steps=marker["steps"], target_tokens=marker["target_tokens"],
                       final_loss=marker["final_loss"], wall_clock_s=marker["wall_clock_s"]))
  return runs


def over_seeds(taus, prompt_stderrs) -> dict:
  """A cell's tau over its seeds' runs: the mean, its standard error over seeds (None for one
  seed), the standard error over prompts (the mean of the runs': the runs share the prompts,
  so it does not shrink with more seeds) and `tau_stderr`, the two combined as independent
  (the verdicts' error)."""
  taus = np.asarray(taus, np.float64)
  seeds = float(np.std(taus, ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None
  prompts = float(np.mean(prompt_stderrs))
  return {"tau": float(np.mean(taus)), "tau_stderr_seeds": seeds,
          "tau_stderr_prompts": prompts, "tau_stderr": float(np.hypot(seeds or 0.0, prompts))}


def build_cells(config: RecipeGridConfig, runs: list) -> list:
  """report.json's cells [{recipe, divergence, temperature, gamma, seeds, taus, tau and its
  errors (`over_seeds`), draft_acceptance_rate (the mean), steps, target_tokens,
  final_loss (the mean), wall_clock_s (the sum)}], one per cell and evaluation point."""
  groups = {}
  for run in runs:
    key = (run["recipe"], run["divergence"], run["temperature"], run["gamma"])
    groups.setdefault(key, []).append(run)
  cells = []
  for (recipe, divergence, temperature, gamma), rows in groups.items():
    cells.append(dict(
        recipe=recipe, divergence=divergence, temperature=temperature, gamma=gamma,
        seeds=[r["seed"] for r in rows], taus=[r["tau"] for r in rows],
        **over_seeds([r["tau"] for r in rows], [r["tau_stderr"] for r in rows]),
        draft_acceptance_rate=float(np.mean([r["draft_acceptance_rate"] for r in rows])),
        steps=rows[0]["steps"],
        target_tokens=rows[0]["target_tokens"],
        final_loss=float(np.mean([r["final_loss"] for r in rows])),
        wall_clock_s=float(sum(r["wall_clock_s"] or 0.0 for r in rows))))
  return cells


def build_curves(config: RecipeGridConfig, markers: dict) -> dict:
  """{"<recipe>-<objective>": [{step, target_tokens, tau, tau_stderr}]}: each cell's tau over
  its steps, the mean over seeds with its standard error over seeds (over prompts for one
  seed)."""
  curves = {}
  for recipe, divergence in config.cells:
    per_seed = [markers[cell_stage(recipe, divergence, s)]["tau_curve"]
                for s in config.run_seeds]
    points = []
    for index, point in enumerate(per_seed[0]):
      at = [curve[index] for curve in per_seed if index < len(curve)]
      stats = over_seeds([p["tau"] for p in at], [p.get("tau_stderr") or 0.0 for p in at])
      points.append({"step": point["step"],
                     "target_tokens": point["step"] * config.step_cost(recipe),
                     "tau": stats["tau"],
                     "tau_stderr": stats["tau_stderr_seeds"]
                     if stats["tau_stderr_seeds"] is not None else stats["tau_stderr"]})
    curves[f"{recipe}{CELL_SEPARATOR}{divergence}"] = points
  return curves


def _mean_with_stderr(rows: list) -> tuple:
  """(mean tau, its standard error treating the rows' errors as independent)."""
  taus = [r["tau"] for r in rows]
  return (float(np.mean(taus)),
          float(np.sqrt(sum(r["tau_stderr"] ** 2 for r in rows)) / len(rows)))


def rules(cells: list, gamma: int, reference: str = "supervised_kd") -> list:
  """The measured answer to the paper's two rules at `gamma`, one entry per temperature.

  Rule 1: mean tau of the model-generated-data recipes against SupervisedKD's (over the
  divergences). Rule 2: mean tau of each divergence over the recipes, and whether the
  paper's best divergence(s) at that temperature is the measured best within two standard
  errors. AdaSPEC (cells of the recipe "adaspec", left out of rules 1 and 2): its mean tau
  over the objectives against its reference recipe's over the same objectives. Errors are
  treated as independent although every cell shares prompts and keys (paired differences
  would be tighter).
  """
  answers = []
  for temperature in sorted({c["temperature"] for c in cells}):
    every = [c for c in cells if c["temperature"] == temperature and c["gamma"] == gamma]
    rows = [c for c in every if c["recipe"] != ADASPEC]
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
    adaspec = _adaspec_answer(every, reference)
    if adaspec:
      answer["adaspec"] = adaspec
    answers.append(answer)
  return answers


def _adaspec_answer(rows: list, reference: str) -> Optional[dict]:
  """AdaSPEC against its reference recipe over the objectives both ran (None without
  AdaSPEC cells)."""
  ada = {c["divergence"]: c for c in rows if c["recipe"] == ADASPEC}
  ref = {c["divergence"]: c for c in rows if c["recipe"] == reference}
  shared = [d for d in ada if d in ref]
  if not shared:
    return None
  (a_mean, a_err) = _mean_with_stderr([ada[d] for d in shared])
  (r_mean, r_err) = _mean_with_stderr([ref[d] for d in shared])
  difference, error = a_mean - r_mean, float(np.hypot(a_err, r_err))
  return {"claim": f"AdaSPEC beats its reference recipe ({LABELS.get(reference, reference)})",
          "objectives": shared, "adaspec_tau": a_mean, "reference_tau": r_mean,
          "difference": difference, "difference_stderr": error,
          "verdict": ("holds" if difference > 2 * error else
                      "reversed" if difference < -2 * error else "within noise")}


def build_report(config: RecipeGridConfig, markers: dict, raw_draft: list) -> dict:
  runs = build_runs(config, markers)
  cells = build_cells(config, runs)
  check_finite(runs + raw_draft, "recipe grid report")
  budget = ("the same budget of target forward tokens"
            if config.compute_budget is not None else f"{config.distill_steps} steps")
  return {"cells": cells, "runs": runs, "raw_draft": raw_draft,
          "rules": rules(cells, int(config.grid.gammas[0]), config.adaspec_reference),
          "tau_curves": build_curves(config, markers),
          "budget": {"compute_budget": config.compute_budget,
                     "unit": "target forward tokens",
                     "steps": {r: config.steps_of(r) for r in config.recipes},
                     "step_cost": {r: config.step_cost(r) for r in config.recipes},
                     "seeds": list(config.run_seeds), "batch_size": config.batch_size,
                     "learning_rate": config.distill_learning_rate,
                     "eval_examples": config.eval_examples},
          "wall_clock_s": {s: markers[s].get("wall_clock_s") for s in config.distill_stages},
          "measurement": (
              f"tau = tokens per target call of speculative decoding (the engine run on the "
              f"first {config.eval_examples} test prompts, one batch; every cell sees the "
              "same prompts, each seed its own keys); each cell is the raw draft distilled "
              f"with its recipe and objective for {budget} (batch {config.batch_size}), once "
              f"per seed {list(config.run_seeds)}: the mean over seeds +- the standard error "
              "over seeds and over prompts combined (each also in report.json).")}


def _cell_text(row: Optional[dict]) -> str:
  if row is None:
    return "-"
  text = f"{row['tau']:.2f} ± {row['tau_stderr']:.2f}"
  if row.get("tau_stderr_seeds") is not None:
    text += f" (seeds {row['tau_stderr_seeds']:.2f}, prompts {row['tau_stderr_prompts']:.2f})"
  return text


def render_markdown(config: RecipeGridConfig, report: dict) -> str:
  lines = ["# Recipe grid: data source x divergence", "", report["measurement"], ""]
  index = {(c["recipe"], c["divergence"], c["temperature"], c["gamma"]): c
           for c in report["cells"]}
  for temperature in config.grid.temperatures:
    for gamma in config.grid.gammas:
      key = (float(temperature), int(gamma))
      raw = next((r for r in report["raw_draft"]
                  if (r["temperature"], r["gamma"]) == key), None)
      lines += [f"## tau at gamma = {gamma}, T = {temperature:g} (raw draft: "
                f"{_cell_text(raw)})", "",
                "| recipe | " + " | ".join(DIVERGENCE_LABELS.get(d, d)
                                         for d in config.divergences) + " |",
                "|---" * (len(config.divergences) + 1) + "|"]
      for recipe in config.recipes:
        lines.append(f"| {LABELS.get(recipe, recipe)} | " + " | ".join(
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
    if "adaspec" in answer:
      r = answer["adaspec"]
      lines.append(f"- T = {t:g}, {r['claim']}: mean tau over "
                   f"{', '.join(DIVERGENCE_LABELS.get(d, d) for d in r['objectives'])} "
                   f"{r['adaspec_tau']:.2f} vs {r['reference_tau']:.2f}: difference "
                   f"{r['difference']:+.2f} ± {r['difference_stderr']:.2f} -> "
                   f"**{r['verdict']}**.")
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

  gamma, paths = int(config.grid.gammas[0]), []
  index = {(c["recipe"], c["divergence"], c["temperature"]): c for c in report["cells"]
           if c["gamma"] == gamma}
  temperatures = list(config.grid.temperatures)
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
                  [LABELS.get(r, r) for r in config.recipes])
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
      curve = report["tau_curves"][f"{recipe}{CELL_SEPARATOR}{divergence}"]
      x = [p["target_tokens" if config.compute_budget else "step"] for p in curve]
      tau, err = np.array([p["tau"] for p in curve]), np.array([p["tau_stderr"] for p in curve])
      line, = ax.plot(x, tau, marker="o", ms=3,
                      label=DIVERGENCE_LABELS.get(divergence, divergence))
      ax.fill_between(x, tau - err, tau + err, color=line.get_color(), alpha=0.2)
    ax.set_title(LABELS.get(recipe, recipe))
    ax.set_xlabel("target forward tokens" if config.compute_budget else "distillation step")
  axes[0][0].set_ylabel("tau (gamma=5, T=0, 32 val. prompts; band: ± s.e.)")
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
