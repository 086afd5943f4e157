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
from typing import Literal, Optional

import numpy as np

from distillspec_jax.core.validation import check_field_types, check_finite, check_int
from distillspec_jax.evaluation import evaluate
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import common as common_lib
from distillspec_jax.distill.objectives import RECIPES, DistillationConfig
from distillspec_jax.distill.divergences import DIVERGENCES, LK_ETA, LK_S, validate_lk_schedule
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
# The objectives aimed at acceptance itself rather than a divergence (issue: LK, block).
ACCEPTANCE_OBJECTIVES = ("lk_alpha", "lk_lambda", "block_acceptance")
FIXED_DATA_RECIPES = ("supervised_kd",)
ADASPEC = "adaspec"
LABELS = dict(RECIPE_LABELS, adaspec="AdaSPEC")
# The paper's rule 2: the divergences it finds best at each temperature.
PAPER_BEST_DIVERGENCES = {0.0: ("fkl", "jsd"), 1.0: ("rkl",)}
CELL_SEPARATOR = "-"
UNIT_LABELS = {"target_tokens": "target forward tokens", "flops": "training FLOPs"}


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
    compute_budget: the compute each cell may spend, in `compute_unit` (`step_cost`); None =
      every cell trains `distill_steps` steps.
    compute_unit: "target_tokens" (the target's forward tokens: teacher-forced passes and
      target samples; the draft's passes are free) or "flops" (training FLOPs, 2 x parameters
      per forward token and 6 x per trained token: the target's passes, the draft's forward
      and backward passes, its own samples and AdaSPEC's reference; parameter counts from the
      target / draft_raw stages' markers).
    lk_s / lk_eta: lk_lambda's schedule lambda = lk_s exp(-lk_eta alpha), 0 < lk_s <= 1,
      lk_eta >= 0 (1 and 3: vLLM speculators' exp(-3 alpha); SpecForge sets both).
  """

  run_dir: str = "runs/recipe_grid"
  recipes: tuple = tuple(RECIPE_LABELS)
  divergences: tuple = GRID_DIVERGENCES
  grid: DecodingGrid = DecodingGrid(gammas=(5,))
  reuse_run_dir: Optional[str] = None
  seeds: tuple = ()
  compute_budget: Optional[int] = None
  compute_unit: Literal["target_tokens", "flops"] = "target_tokens"
  lk_s: float = LK_S
  lk_eta: float = LK_ETA

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
    validate_lk_schedule(self.lk_s, self.lk_eta)
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
    check_int(self.compute_budget,
              f"compute_budget ({UNIT_LABELS[self.compute_unit]} per cell)", 1)
    if self.compute_unit == "target_tokens":
      self._check_budget_covers_a_step()
    # "flops": the parameter counts come from the stages' markers, checked in check_inputs.

  def _check_budget_covers_a_step(self) -> None:
    recipe = max(self.recipes, key=self.step_cost)
    if self.compute_budget < self.step_cost(recipe):
      raise ValueError(
          f"compute_budget={self.compute_budget} {UNIT_LABELS[self.compute_unit]} is smaller "
          f"than one step of {recipe!r} ({self.step_cost(recipe)}: batch "
          f"{self.batch_size} x {self._tokens_per_row} tokens); raise it to at least "
          f"{self.step_cost(recipe)}, or lower BATCH_SIZE.")

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

  def _draft_sample_share(self, recipe: str) -> float:
    """The probability that a step of `recipe` samples from the draft (Knowl 4)."""
    lambda1, lambda2, _ = RECIPES[self.adaspec_reference if recipe == ADASPEC else recipe]
    return (1.0 - lambda1) * lambda2

  def target_token_cost(self, recipe: str) -> int:
    """Expected target forward tokens of one step of `recipe`: the loss's teacher-forced pass
    over the batch, plus the target's samples on the steps that draw them."""
    share = self._target_sample_share(recipe)
    return int(round(self.batch_size * self._tokens_per_row * (1.0 + share)))

  def step_cost(self, recipe: str) -> int:
    """Expected compute of one distillation step of `recipe` in `compute_unit`.

    target_tokens: `target_token_cost`. flops: 2 N_target per token of those, plus 6 N_draft per token
    (the draft's forward and backward pass), 2 N_draft per token of the draft's own samples on
    the steps that draw them and of AdaSPEC's reference pass (N: parameter counts; attention
    and sampling overheads are not counted).
    """
    if self.compute_unit == "target_tokens":
      return self.target_token_cost(recipe)
    tokens = self.batch_size * self._tokens_per_row
    target_passes = 1.0 + self._target_sample_share(recipe)
    n_target, n_draft = self.param_counts
    draft_passes = 3.0 + self._draft_sample_share(recipe) + (recipe == ADASPEC)
    return int(round(2.0 * tokens * (n_target * target_passes + n_draft * draft_passes)))

  @property
  def param_counts(self) -> tuple:
    """(target, draft) parameter counts from the target / draft_raw stages' markers (this
    run's, else `reuse_run_dir`'s)."""
    counts = []
    for stage in ("target", "draft_raw"):
      paths = [os.path.join(self.stage_dir(stage), pipeline.DONE)]
      if self.reuse_run_dir:
        paths.append(os.path.join(self.reuse_run_dir, stage, pipeline.DONE))
      marker = next((read_json(p) for p in paths if os.path.exists(p)), {})
      if not isinstance(marker.get("num_params"), int):
        raise ValueError(f"compute_unit='flops' needs the {stage} stage's parameter count, but "
                         f"none of {paths} records num_params; set reuse_run_dir to a finished "
                         "run, or use compute_unit='target_tokens'.")
      counts.append(marker["num_params"])
    return tuple(counts)

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
    if self.compute_budget is not None and self.compute_unit == "flops":
      self._check_budget_covers_a_step()

  @property
  def cells(self) -> tuple:
    """((recipe, divergence), ...) in row-major order (recipe first), AdaSPEC's last: its
    cells read their reference's."""
    recipes = sorted(self.recipes, key=lambda r: r == ADASPEC)  # stable
    return tuple((r, d) for r in recipes for d in self.divergences)

  @property
  def runs(self) -> tuple:
    """((recipe, divergence, seed), ...): every cell once per seed, seeds outermost, so that
    a grid stopped early has every cell at its first seeds."""
    return tuple((r, d, s) for s in self.run_seeds for r, d in self.cells)

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
                  lk_s=config.lk_s, lk_eta=config.lk_eta,
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
                 target_tokens=steps * config.target_token_cost(recipe),
                 compute=steps * config.step_cost(recipe), compute_unit=config.compute_unit,
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
                       compute=marker.get("compute", marker["target_tokens"]),
                       final_loss=marker["final_loss"], wall_clock_s=marker["wall_clock_s"]))
  return runs


def over_seeds(taus, prompt_stderrs) -> dict:
  """A cell's tau over its seeds' runs: the mean, its standard error over seeds (None for one
  seed), the standard error over prompts (the mean of the runs': the runs share the prompts,
  so it does not shrink with more seeds) and `tau_stderr`, the two combined as independent
  (the verdicts' error). Refuses an undefined tau or standard error (None: a run whose
  evaluation ran no target call), which numpy would read as NaN."""
  for name, values in (("taus", taus), ("tau_stderr", prompt_stderrs)):
    if any(v is None for v in values):
      raise ValueError(f"{name}={list(values)} holds None: a run's evaluation ran no "
                       "verification round (every prompt's first token was EOS), so its tau "
                       "is undefined; check the task's prompts and targets, then rerun.")
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
        target_tokens=rows[0]["target_tokens"], compute=rows[0]["compute"],
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
                     "target_tokens": point["step"] * config.target_token_cost(recipe),
                     "compute": point["step"] * config.step_cost(recipe),
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


# Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1); more than ten
# take ten's, slightly conservative.
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23}


def compare(cells: list, runs: Optional[list], a, b) -> dict:
  """Mean tau of the cells where `a` holds minus that where `b` holds, with its error and a
  verdict (holds: above `threshold` errors, reversed: below minus that, else within noise).

  With runs of two or more seeds, the error is the standard error over seeds of the seed-
  paired difference (the runs of one seed share the data order, the evaluation's prompts and
  keys, so the prompts' error is common to both sides and cancels) and the threshold is
  Student's t at 95% for seeds - 1 degrees of freedom; with one seed, the two sides' errors
  combined as independent and the threshold 2 (conservative: it counts the shared prompts'
  error twice).
  """
  mean_of = lambda rows, keep: float(np.mean([r["tau"] for r in rows if keep(r)]))
  difference = mean_of(cells, a) - mean_of(cells, b)
  seeds = sorted({r["seed"] for r in runs or ()})
  if len(seeds) >= 2:
    paired = [mean_of([r for r in runs if r["seed"] == s], a)
              - mean_of([r for r in runs if r["seed"] == s], b) for s in seeds]
    error = float(np.std(paired, ddof=1) / np.sqrt(len(seeds)))
    threshold, kind = T_975[min(len(seeds) - 1, 10)], f"paired over {len(seeds)} seeds"
  else:
    error = float(np.hypot(_mean_with_stderr([c for c in cells if a(c)])[1],
                           _mean_with_stderr([c for c in cells if b(c)])[1]))
    threshold, kind = 2.0, "independent"
  return {"difference": difference, "difference_stderr": error, "threshold": threshold,
          "error": kind,
          "verdict": ("holds" if difference > threshold * error else
                      "reversed" if difference < -threshold * error else "within noise")}


def rules(cells: list, gamma: int, reference: str = "supervised_kd",
          runs: Optional[list] = None) -> list:
  """The measured answer to the paper's two rules at `gamma`, one entry per temperature.

  Rule 1: mean tau of the model-generated-data recipes against SupervisedKD's (over the
  objectives). Rule 2: mean tau of each of the paper's four divergences over the recipes, and
  the paper's best divergence(s) at that temperature against the best other one. The
  acceptance objectives: the best of them against the best of the four divergences. AdaSPEC
  (cells of the recipe "adaspec", left out of the other claims): its mean tau over the
  objectives against its reference recipe's over the same objectives. Each difference's error
  and verdict: `compare` (seed-paired over `runs`, report.json's runs, when they hold two or
  more seeds).
  """
  answers = []
  for temperature in sorted({c["temperature"] for c in cells}):
    here = lambda r: r["temperature"] == temperature and r["gamma"] == gamma
    every = [c for c in cells if here(c)]
    at = [r for r in runs if here(r)] if runs else None
    versus = lambda a, b: compare(every, at, a, b)
    rows = [c for c in every if c["recipe"] != ADASPEC]
    fixed = lambda r: r["recipe"] in FIXED_DATA_RECIPES
    generated = lambda r: r["recipe"] not in FIXED_DATA_RECIPES and r["recipe"] != ADASPEC
    answer = {"temperature": temperature, "gamma": gamma}
    if any(map(fixed, rows)) and any(map(generated, rows)):
      answer["rule1"] = {"claim": "model-generated data beats fixed data",
                         "generated_tau": _mean_with_stderr(list(filter(generated, rows)))[0],
                         "fixed_tau": _mean_with_stderr(list(filter(fixed, rows)))[0],
                         **versus(generated, fixed)}
    by_objective = {}
    for divergence in dict.fromkeys(c["divergence"] for c in rows):
      mean, err = _mean_with_stderr([c for c in rows if c["divergence"] == divergence])
      by_objective[divergence] = {"tau": mean, "tau_stderr": err}
    objective = lambda name: (lambda r: r["divergence"] == name and r["recipe"] != ADASPEC)
    # Rule 2 is about the paper's four divergences; the acceptance objectives get their own.
    by_divergence = {d: v for d, v in by_objective.items() if d in GRID_DIVERGENCES}
    claimed = [d for d in PAPER_BEST_DIVERGENCES.get(temperature, ()) if d in by_divergence]
    if by_divergence and claimed:
      answer["rule2"] = _rule2_answer(by_divergence, claimed, temperature,
                                      lambda x, y: versus(objective(x), objective(y)))
    acceptance = _acceptance_answer(by_objective,
                                    lambda x, y: versus(objective(x), objective(y)))
    if acceptance:
      answer["acceptance_objectives"] = acceptance
    adaspec = _adaspec_answer(every, reference, versus)
    if adaspec:
      answer["adaspec"] = adaspec
    answers.append(answer)
  return answers


def _rule2_answer(by_divergence: dict, claimed: list, temperature: float, versus) -> dict:
  """The paper's best divergence(s) at `temperature` against the others: holds when the best
  claimed one beats the best other (`versus`), does not hold when the best other beats it,
  within noise otherwise (and when no other divergence ran)."""
  tau = lambda d: by_divergence[d]["tau"]
  best, top = max(by_divergence, key=tau), max(claimed, key=tau)
  others = [d for d in by_divergence if d not in claimed]
  answer = {"claim": f"{'/'.join(DIVERGENCE_LABELS.get(d, d) for d in claimed)} best at "
                     f"T={temperature:g}",
            "by_divergence": by_divergence, "measured_best": best, "claimed_best": top,
            "verdict": "within noise"}
  if others:
    runner = max(others, key=tau)
    margin = versus(top, runner)
    answer.update(best_other=runner, margin=margin["difference"],
                  margin_stderr=margin["difference_stderr"], threshold=margin["threshold"],
                  error=margin["error"],
                  verdict={"reversed": "does not hold"}.get(margin["verdict"],
                                                            margin["verdict"]))
  return answer


def _acceptance_answer(by_objective: dict, versus) -> Optional[dict]:
  """The best acceptance-targeted objective (ACCEPTANCE_OBJECTIVES) against the best of the
  paper's four divergences, each the mean over recipes, compared by `versus` (None without
  both kinds)."""
  ours = [d for d in by_objective if d in ACCEPTANCE_OBJECTIVES]
  theirs = [d for d in by_objective if d in GRID_DIVERGENCES]
  if not ours or not theirs:
    return None
  best = max(ours, key=lambda d: by_objective[d]["tau"])
  bar = max(theirs, key=lambda d: by_objective[d]["tau"])
  return {"claim": "an acceptance-targeted objective beats the best of the four divergences",
          "by_objective": {d: by_objective[d] for d in ours}, "best": best,
          "best_divergence": bar, **versus(best, bar)}


# A verdict's words in the report's sentences.
VERDICT_WORDS = {"holds": "reproduced", "reversed": "refuted (the opposite order)",
                 "does not hold": "refuted", "within noise": "not distinguishable at this size"}


def _label(name: str) -> str:
  return DIVERGENCE_LABELS.get(name, LABELS.get(name, name))


def verdict_sentences(answers: list) -> list:
  """One sentence for each of DistillSpec's two rules and the acceptance objectives' claim
  (AdaSPEC's too where the grid has it), each with both temperatures' numbers, from `rules`'s
  answers."""
  def clause(answer: dict, key: str, text) -> str:
    part = answer[key]
    return (f"at T = {answer['temperature']:g} {text(part)} -> "
            f"{VERDICT_WORDS[part['verdict']]}")

  claims = (
      ("rule1", "Rule 1 (model-generated data beats the fixed dataset)",
       lambda r: (f"generated-data recipes {r['generated_tau']:.2f} vs SupervisedKD "
                  f"{r['fixed_tau']:.2f} (difference {r['difference']:+.2f} ± "
                  f"{r['difference_stderr']:.2f})")),
      ("rule2", "Rule 2 (FKL or JSD best at T = 0, RKL at T = 1)",
       lambda r: (f"the claimed {_label(r['claimed_best'])} vs the best other, "
                  f"{_label(r['best_other'])}: {r['margin']:+.2f} ± {r['margin_stderr']:.2f}"
                  if "margin" in r else f"only {_label(r['claimed_best'])} ran")),
      ("acceptance_objectives", "Acceptance-targeted objectives beat the four divergences",
       lambda r: (f"best {_label(r['best'])} vs best divergence {_label(r['best_divergence'])}: "
                  f"{r['difference']:+.2f} ± {r['difference_stderr']:.2f}")),
      ("adaspec", "AdaSPEC beats its reference recipe",
       lambda r: (f"AdaSPEC {r['adaspec_tau']:.2f} vs {r['reference_tau']:.2f} (difference "
                  f"{r['difference']:+.2f} ± {r['difference_stderr']:.2f})")))
  sentences = []
  for key, claim, text in claims:
    clauses = [clause(a, key, text) for a in answers if key in a]
    if clauses:
      sentences.append(f"{claim}: " + "; ".join(clauses) + ".")
  return sentences


def _adaspec_answer(rows: list, reference: str, versus) -> Optional[dict]:
  """AdaSPEC against its reference recipe over the objectives both ran, compared by `versus`
  (None without AdaSPEC cells)."""
  ada = {c["divergence"] for c in rows if c["recipe"] == ADASPEC}
  shared = [d for d in dict.fromkeys(c["divergence"] for c in rows if c["recipe"] == reference)
            if d in ada]
  if not shared:
    return None
  a = lambda r: r["recipe"] == ADASPEC and r["divergence"] in shared
  b = lambda r: r["recipe"] == reference and r["divergence"] in shared
  return {"claim": f"AdaSPEC beats its reference recipe ({LABELS.get(reference, reference)})",
          "objectives": shared, "adaspec_tau": _mean_with_stderr(list(filter(a, rows)))[0],
          "reference_tau": _mean_with_stderr(list(filter(b, rows)))[0], **versus(a, b)}


def build_report(config: RecipeGridConfig, markers: dict, raw_draft: list) -> dict:
  runs = build_runs(config, markers)
  cells = build_cells(config, runs)
  check_finite(runs + raw_draft, "recipe grid report")
  unit = UNIT_LABELS[config.compute_unit]
  budget = (f"the same budget of {unit}"
            if config.compute_budget is not None else f"{config.distill_steps} steps")
  used = [c["compute"] for c in cells]
  answers = rules(cells, int(config.grid.gammas[0]), config.adaspec_reference, runs)
  return {"cells": cells, "runs": runs, "raw_draft": raw_draft,
          "rules": answers, "verdicts": verdict_sentences(answers),
          "tau_curves": build_curves(config, markers),
          "budget": {"compute_budget": config.compute_budget,
                     "unit": unit, "compute_unit": config.compute_unit,
                     "compute_max_over_min": max(used) / min(used),
                     "steps": {r: config.steps_of(r) for r in config.recipes},
                     "compute": {r: config.steps_of(r) * config.step_cost(r)
                                 for r in config.recipes},
                     "target_tokens": {r: config.steps_of(r) * config.target_token_cost(r)
                                       for r in config.recipes},
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
  budget = report["budget"]
  lines += [f"## Compute per cell ({budget['unit']})", "",
            "| recipe | steps | per step | per cell | target forward tokens |",
            "|---|---:|---:|---:|---:|"]
  for recipe in config.recipes:
    lines.append(f"| {LABELS.get(recipe, recipe)} | {budget['steps'][recipe]} | "
                 f"{budget['step_cost'][recipe]:.4g} | {budget['compute'][recipe]:.4g} | "
                 f"{budget['target_tokens'][recipe]:,} |")
  lines += ["", f"Largest over smallest compute per cell: "
            f"{budget['compute_max_over_min']:.3f}.", ""]
  lines += ["## Verdicts", ""] + [f"- {v}" for v in report.get("verdicts", [])]
  lines += ["", "A difference is reproduced or refuted beyond t standard errors: the standard "
            "error over seeds of the seed-paired difference (the runs of one seed share the "
            "data order, the prompts and the evaluation's keys) with Student's t at 95% for "
            "seeds - 1 degrees of freedom (4.30 for three seeds); with one seed, the cells' "
            "errors combined as independent and t = 2. Anything closer: not distinguishable "
            "at this size.", ""]
  objectives = {}
  for answer in report["rules"]:
    for name, value in {**answer.get("rule2", {}).get("by_divergence", {}),
                        **answer.get("acceptance_objectives", {}).get("by_objective", {})
                        }.items():
      objectives.setdefault(name, {})[answer["temperature"]] = value
  if objectives:
    temperatures = [a["temperature"] for a in report["rules"]]
    lines += ["## Mean tau over recipes per objective", "",
              "| objective | " + " | ".join(f"T = {t:g}" for t in temperatures) + " |",
              "|---" * (len(temperatures) + 1) + "|"]
    for name, by_t in objectives.items():
      lines.append(f"| {_label(name)} | " + " | ".join(
          f"{by_t[t]['tau']:.2f} ± {by_t[t]['tau_stderr']:.2f}" if t in by_t else "-"
          for t in temperatures) + " |")
    lines.append("")
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
        spread = (f"±{cell['tau_stderr_seeds']:.2f} seeds" if cell.get("tau_stderr_seeds")
                  is not None else f"±{cell['tau_stderr']:.2f}")
        ax.text(j, i, f"{cell['tau']:.2f}\n{spread}", ha="center",
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
      x = [p["compute" if config.compute_budget else "step"] for p in curve]
      tau, err = np.array([p["tau"] for p in curve]), np.array([p["tau_stderr"] for p in curve])
      line, = ax.plot(x, tau, marker="o", ms=3,
                      label=DIVERGENCE_LABELS.get(divergence, divergence))
      ax.fill_between(x, tau - err, tau + err, color=line.get_color(), alpha=0.2)
    ax.set_title(LABELS.get(recipe, recipe))
    ax.set_xlabel(UNIT_LABELS[config.compute_unit] if config.compute_budget
                  else "distillation step")
  axes[0][0].set_ylabel("tau (gamma 5, T 0, 32 val. prompts)")
  fig.suptitle("band: ± one standard error over seeds (over prompts for one seed)", fontsize=8)
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
