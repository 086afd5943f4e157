"""The model garden: quality against latency of the paper's four serving strategies.

With models of several sizes (`sizes`, smallest first; paper Knowl 9 / section C.3.2):
  raw          each size alone, fine-tuned with cross-entropy;
  distilled    each smaller size distilled from the largest, alone;
  speculative  a raw target with a smaller raw draft (every pair);
  distillspec  a target with a draft distilled toward it: the raw largest with the smallest
               distilled from it, and each distilled middle size (the "distilled target")
               with the smallest distilled toward that distilled target.

Stages (run_pipeline's bookkeeping: finished stages are skipped, interrupted ones resume):
  vocab, target (largest), draft_raw (smallest)   the main job's, or copied (`reuse_run_dir`)
  raw_<size>              fine-tune each middle size (`middle_steps`)
  kd_<size>               distil each smaller size from the raw largest
  kd_<smallest>_for_kd_<size>  distil the smallest toward the distilled middle size
  evaluate                quality of every point (greedy, T = 0; a pair's from its own
                          speculative outputs), tau of every pair, and wall-clock latency:
                          speed.measure_speed per target model, batch 1, in one process
                          pinned to `SpeedConfig.cpus` cores
  report                  report.json, report.md, garden_frontier.png

Relative latency = seconds per generated token, end to end (setup included), of the strategy
over plain decoding with the largest raw model (= 1.0). A pair's is its target's plain seconds
per token over the pair's end-to-end speedup (a median over interleaved turns, both timed in
one measure_speed call); models are compared across calls, so drift of the machine between
calls is part of the noise (bars: the per-turn range).

Run: python -m distillspec_jax.main --gin_file=gin/runs/garden.gin
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np

from distillspec_jax.core.validation import check_field_types, check_finite, check_positive_int
from distillspec_jax.studies import pipeline
from distillspec_jax.studies import common
from distillspec_jax.models.config import model_config
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.core.files import read_json, write_json_atomic, write_text_atomic
from distillspec_jax.evaluation import evaluate
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.models.model import Model
from distillspec_jax.studies.pipeline import PipelineConfig

STRATEGIES = ("raw", "distilled", "speculative", "distillspec")


def pareto(qualities: Sequence[float], latencies: Sequence[float]) -> list:
  """[bool] per point: True when no other point has quality >= and latency <= with one of
  them strictly better (higher quality and lower latency are better; equal points are all
  on the frontier)."""
  qualities, latencies = np.asarray(qualities, float), np.asarray(latencies, float)
  if qualities.shape != latencies.shape or qualities.ndim != 1:
    raise ValueError(f"pareto needs one quality per latency; got {qualities.shape[0]} "
                     f"qualities and {latencies.shape[0]} latencies.")
  if not (np.all(np.isfinite(qualities)) and np.all(np.isfinite(latencies))):
    raise ValueError(f"pareto got a non-finite value: qualities={qualities.tolist()}, "
                     f"latencies={latencies.tolist()}.")
  front = []
  for q, t in zip(qualities, latencies):
    dominated = np.any((qualities >= q) & (latencies <= t) & ((qualities > q) | (latencies < t)))
    front.append(not bool(dominated))
  return front


@dataclasses.dataclass(frozen=True)
class GardenConfig(PipelineConfig):
  """A PipelineConfig over a garden of model sizes.

  Attributes (besides PipelineConfig's):
    sizes: config.MODEL_CONFIGS preset names, smallest first (>= 2, one vocabulary);
      target_model must be the largest and draft_model the smallest.
    middle_steps: fine-tuning steps of the middle sizes (None = target_steps).
    quality_metric: the task metric plotted (a key of data.compute_metrics' result).
    recipes: one recipe, used for every distillation of the garden (its divergence, or
      `divergence`).
    grid: one gamma and T = 0 (quality is greedy quality; T = 0 speculative decoding gives
      the target's outputs).
    reuse_run_dir: a finished main job with the same largest and smallest presets whose
      vocab / target / draft_raw are copied (None = train them here).
  """

  run_dir: str = "runs/garden"
  sizes: tuple = ("demo_draft", "smoke_target", "demo_target")
  middle_steps: Optional[int] = None
  quality_metric: str = "accuracy"
  recipes: tuple = ("supervised_kd",)
  grid: DecodingGrid = DecodingGrid(gammas=(5,), temperatures=(0.0,))
  reuse_run_dir: Optional[str] = None

  def __post_init__(self):
    check_field_types(self)
    sizes = tuple(self.sizes)
    if len(sizes) < 2 or len(set(sizes)) != len(sizes):
      raise ValueError(f"sizes={sizes!r}: a garden needs at least two different model sizes "
                       "(preset names, smallest first), e.g. ('demo_draft', 'smoke_target', "
                       "'demo_target').")
    presets = {name: model_config(name) for name in sizes}  # raises on an unknown name
    vocabularies = {name: p.vocab_size for name, p in presets.items()}
    if len(set(vocabularies.values())) > 1:
      raise ValueError(f"The garden's sizes have different vocabularies (vocab_size per "
                       f"preset: {vocabularies}); speculative decoding and distillation "
                       "compare distributions token by token: pick presets with one "
                       "vocab_size.")
    counts = [Model(presets[name]).num_params() for name in sizes]
    if counts != sorted(counts):
      raise ValueError(f"sizes={sizes!r} are not smallest first (parameters: "
                       f"{dict(zip(sizes, counts))}); list them in increasing size.")
    if (self.target_model, self.draft_model) != (sizes[-1], sizes[0]):
      raise ValueError(f"target_model={self.target_model!r} and draft_model="
                       f"{self.draft_model!r} must be the largest and smallest sizes "
                       f"({sizes[-1]!r}, {sizes[0]!r}); set them so.")
    if len(self.recipes) != 1:
      raise ValueError(f"recipes={tuple(self.recipes)!r}: the garden distils with one recipe; "
                       "name exactly one.")
    grid = self.grid
    if isinstance(grid, DecodingGrid) and (len(grid.gammas) != 1
                                           or tuple(grid.temperatures) != (0.0,)):
      raise ValueError(f"DecodingGrid.gammas={tuple(grid.gammas)!r}, DecodingGrid."
                       f"temperatures={tuple(grid.temperatures)!r}: the garden is measured at "
                       "one gamma and T = 0 (greedy quality); pass e.g. gammas=(5,), "
                       "temperatures=(0.0,).")
    if self.middle_steps is not None:
      check_positive_int(self.middle_steps, "middle_steps")
    super().__post_init__()

  def check_inputs(self) -> None:
    super().check_inputs()
    common.check_reuse_run_dir(self.reuse_run_dir)

  @property
  def middle_sizes(self) -> tuple:
    return tuple(self.sizes[1:-1])

  def raw_stage(self, size: str) -> str:
    if size == self.sizes[-1]:
      return "target"
    return "draft_raw" if size == self.sizes[0] else f"raw_{size}"

  def kd_stage(self, size: str) -> str:
    return f"kd_{size}"

  def draft_for_stage(self, size: str) -> str:
    return f"kd_{self.sizes[0]}_for_kd_{size}"

  @property
  def distill_stages(self) -> tuple:
    """Every distillation stage (the teachers' before their students')."""
    return (tuple(self.kd_stage(s) for s in self.sizes[:-1])
            + tuple(self.draft_for_stage(s) for s in self.middle_sizes))

  @property
  def stages(self) -> tuple:
    return (("vocab", "target", "draft_raw") + tuple(self.raw_stage(s) for s in self.middle_sizes)
            + self.distill_stages + ("evaluate", "report"))

  def dependencies(self, stage: str) -> tuple:
    if stage.startswith("raw_"):
      return ("vocab",)
    for size in self.middle_sizes:
      if stage == self.draft_for_stage(size):
        return (self.kd_stage(size), "draft_raw")
    for size in self.sizes[:-1]:
      if stage == self.kd_stage(size):
        return ("target", self.raw_stage(size))
    if stage == "evaluate":
      return self.stages[1:self.stages.index("evaluate")]
    if stage == "report":
      return ("evaluate",)
    return super().dependencies(stage)

  def size_of(self, stage: str) -> str:
    """The preset a stage trains."""
    for size in self.sizes:
      if stage in (self.raw_stage(size), self.kd_stage(size)):
        return size
    if stage in self.distill_stages:
      return self.sizes[0]
    raise ValueError(f"{stage!r} trains no model; the garden's models: "
                     f"{self.stages[1:-2]}.")

  def points(self) -> list:
    """[(strategy, target stage, draft stage or None)] in the report's order."""
    sizes = self.sizes
    points = [("raw", self.raw_stage(s), None) for s in sizes]
    points += [("distilled", self.kd_stage(s), None) for s in sizes[:-1]]
    points += [("speculative", self.raw_stage(t), self.raw_stage(d))
               for j, t in enumerate(sizes) for d in sizes[:j]]
    points += [("distillspec", "target", self.kd_stage(sizes[0]))]
    points += [("distillspec", self.kd_stage(m), self.draft_for_stage(m))
               for m in self.middle_sizes]
    return points

  def stage_functions(self) -> dict:
    fns = {"vocab": pipeline.stage_vocab, "target": pipeline.stage_finetune,
           "draft_raw": pipeline.stage_finetune}
    fns = {k: common.reusing(fn, self.reuse_run_dir) for k, fn in fns.items()}
    fns.update({self.raw_stage(s): stage_middle_finetune for s in self.middle_sizes})
    fns.update({s: stage_garden_distill for s in self.distill_stages})
    fns.update(evaluate=stage_evaluate, report=stage_report)
    return fns


def model_of(config: GardenConfig, stage: str) -> Model:
  """The Model a stage trains, with the vocabulary's size (as pipeline.models)."""
  overrides = {"vocab_size": pipeline.vocab_size(config)}
  if config.max_decode_length:
    overrides["max_decode_length"] = config.max_decode_length
  return Model(model_config(config.size_of(stage), **overrides))


def _params(config: GardenConfig, stage: str):
  return pipeline.load_params(config, stage, model_of(config, stage))


def stage_middle_finetune(config: GardenConfig, stage: str) -> dict:
  """Cross-entropy fine-tuning of a middle size."""
  from distillspec_jax.training.trainer import finetune
  model = model_of(config, stage)
  steps = config.middle_steps or config.target_steps
  train_config = pipeline.stage_train_config(config, stage, steps, config.learning_rate)
  result = finetune(train_config, model, pipeline.train_data(config),
                    loss_block_size=config.loss_block_size)
  losses = [r["loss"] for r in result.history if "loss" in r]
  return {"final_loss": float(losses[-1]) if losses else float("nan"),
          "num_params": model.num_params()}


def stage_garden_distill(config: GardenConfig, stage: str) -> dict:
  """kd_<size>: the raw size toward the raw largest; kd_<smallest>_for_kd_<size>: the raw
  smallest toward the distilled size."""
  student_size = config.size_of(stage)
  if stage == config.kd_stage(student_size):
    teacher_stage = "target"
  else:
    teacher_stage = next(config.kd_stage(m) for m in config.middle_sizes
                         if stage == config.draft_for_stage(m))
  overrides = {"max_new_tokens": config.task_feature_lengths["targets"]}
  if config.divergence:
    overrides["divergence"] = config.divergence
  distillation = DistillationConfig.from_recipe(config.recipes[0], **overrides)
  teacher, student = model_of(config, teacher_stage), model_of(config, stage)
  summary = common.distill_toward(
      config, stage, teacher, _params(config, teacher_stage), student,
      _params(config, config.raw_stage(student_size)), distillation)
  return dict(summary, recipe=config.recipes[0], teacher=teacher_stage,
              num_params=student.num_params())


def measure_garden_speed(config: GardenConfig) -> dict:
  """{target stage: speed.measure_speed result} with that target's drafts of the garden's
  pairs (none for models only used alone). Loads what it needs, so it can run pinned."""
  from tqdm.auto import tqdm
  prompts = pipeline.heldout_prompts(config, config.speed.examples, split="test").prompts
  targets = list(dict.fromkeys(t for _, t, _ in config.points()))
  timing = {}
  for target_stage in tqdm(targets, desc="garden speed (models)", dynamic_ncols=True,
                           disable=not config.progress_bar):
    drafts = {d: (model_of(config, d), _params(config, d))
              for _, t, d in config.points() if t == target_stage and d}
    timing[target_stage] = speed.measure_speed(
        model_of(config, target_stage), _params(config, target_stage), drafts, prompts,
        speed.TimingPlan(gammas=config.grid.gammas, temperatures=(0.0,),
                         max_new_tokens=config.max_new_tokens, seed=config.seed,
                         **config.speed.measure_kwargs()), progress=False)
  return timing


def stage_evaluate(config: GardenConfig, stage: str) -> dict:
  """Quality of every model alone and of every pair's speculative outputs (T = 0), tau of
  every pair, and the timing; writes `<run_dir>/evaluate/eval.json`."""
  from tqdm.auto import tqdm
  from distillspec_jax.evaluation import pinning
  examples = pipeline.heldout_prompts(config, config.eval_examples, split="test")
  pipeline.check_speed_prompts(config, examples)
  scorer = evaluate.task_scorer(config.task, pipeline.register_task(
      config).output_features["targets"].vocabulary)
  results = {"alone": {}, "pairs": [], "num_params": {}}
  points = config.points()
  with tqdm(total=len(points), desc="garden quality", dynamic_ncols=True,
            disable=not config.progress_bar) as bar:
    for strategy, target_stage, draft_stage in points:
      target = model_of(config, target_stage)
      target_params = _params(config, target_stage)
      results["num_params"][target_stage] = target.num_params()
      if draft_stage is None:
        results["alone"].update(evaluate.quality_alone(
            {target_stage: (target, target_params)}, examples, scorer,
            max_new_tokens=config.max_new_tokens))
      else:
        row, = evaluate.speculative_grid(
            target, target_params, {draft_stage: (model_of(config, draft_stage),
                                                  _params(config, draft_stage))},
            examples, scorer, gammas=config.grid.gammas, temperatures=config.grid.temperatures,
            max_new_tokens=config.max_new_tokens, seed=config.seed)
        results["pairs"].append({"strategy": strategy, "target": target_stage,
                                 **evaluate.EvaluationRow.of(config.task, row).to_json()})
      bar.update(1)
  results["timing"] = {stage: timing.to_json() for stage, timing in pinning.run_pinned(
      config.speed.cpus, measure_garden_speed, config).items()}
  write_json_atomic(os.path.join(config.stage_dir(stage), "eval.json"), results)
  return {"num_test_prompts": int(len(examples))}


# --- report --------------------------------------------------------------------------------------


def _seconds_per_token(plain) -> tuple:
  """(median, [min, max]) end-to-end seconds per token of a speed.PlainSpeed."""
  return plain.seconds / plain.tokens, [s / plain.tokens for s in plain.seconds_range]


def build_points(config: GardenConfig, evaluation_result: dict) -> list:
  """report.json's points [{strategy, target, draft, quality, relative_latency,
  relative_latency_range, pareto, ...}] from the evaluate stage's eval.json."""
  timing = {stage: speed.SpeedMeasurement.from_json(measured)
            for stage, measured in evaluation_result["timing"].items()}
  reference, _ = _seconds_per_token(timing["target"].plain["0.0"])
  pairs = {(p["target"], p["draft"]): evaluate.EvaluationRow.from_json(p)
           for p in evaluation_result["pairs"]}
  points = []
  for strategy, target_stage, draft_stage in config.points():
    plain_spt, plain_range = _seconds_per_token(timing[target_stage].plain["0.0"])
    if draft_stage is None:
      metrics = evaluation_result["alone"][target_stage]
      latency, latency_range, extra = plain_spt, plain_range, {}
    else:
      pair = pairs[(target_stage, draft_stage)]
      metrics = pair.quality
      speedups = next(r for r in timing[target_stage].rows
                      if r.draft == draft_stage).figures.speedups
      low, high = speedups.end_to_end_speedup_range
      latency = plain_spt / speedups.end_to_end_speedup
      latency_range = [plain_spt / high, plain_spt / low]
      extra = {"tau": pair.acceptance.tau, "tau_stderr": pair.acceptance.tau_stderr,
               "end_to_end_speedup": speedups.end_to_end_speedup}
    if config.quality_metric not in metrics:
      raise ValueError(f"quality_metric={config.quality_metric!r} is not among the task's "
                       f"metrics {sorted(k for k in metrics if k != 'example_prediction')}; "
                       "set GardenConfig.quality_metric to one of them.")
    points.append(dict(
        strategy=strategy, target=target_stage, draft=draft_stage,
        target_model=config.size_of(target_stage),
        draft_model=config.size_of(draft_stage) if draft_stage else None,
        quality=float(metrics[config.quality_metric]),
        relative_latency=latency / reference,
        relative_latency_range=[v / reference for v in latency_range], **extra))
  check_finite(points, "garden report")
  front = pareto([p["quality"] for p in points], [p["relative_latency"] for p in points])
  for point, on_front in zip(points, front):
    point["pareto"] = bool(on_front)
  return points


def _label(point: dict) -> str:
  return point["target"] + (f" + {point['draft']}" if point["draft"] else "")


def render_markdown(config: GardenConfig, report: dict) -> str:
  lines = ["# Model garden: quality against relative latency", "", report["measurement"], "",
           f"| strategy | target | draft | {config.quality_metric} | relative latency "
           "[min, max] | tau ± s.e. | Pareto |", "|---|---|---|---|---|---|---|"]
  for p in report["points"]:
    low, high = p["relative_latency_range"]
    tau = ("-" if "tau" not in p else "n/a" if p["tau"] is None  # n/a: no target call ran
           else f"{p['tau']:.2f} ± {p['tau_stderr']:.2f}")
    lines.append(f"| {p['strategy']} | {p['target']} ({p['target_model']}) | "
                 f"{p['draft'] or '-'} | {p['quality']:.2f} | {p['relative_latency']:.3f} "
                 f"[{low:.3f}, {high:.3f}] | {tau} | {'yes' if p['pareto'] else ''} |")
  lines += ["", "Sizes (parameters): " + ", ".join(
      f"{s} {report['num_params'][config.raw_stage(s)]:,}" for s in config.sizes), ""]
  return "\n".join(lines)


def plot(config: GardenConfig, report: dict, out_dir: str) -> list:
  """garden_frontier.png: quality against relative latency (log x; bars: per-turn range),
  one marker per strategy, the Pareto frontier as a step line."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7.5, 5))
  markers = dict(zip(STRATEGIES, ("o", "s", "^", "*")))
  for strategy in STRATEGIES:
    mine = [p for p in report["points"] if p["strategy"] == strategy]
    if not mine:
      continue
    x = [p["relative_latency"] for p in mine]
    ax.errorbar(x, [p["quality"] for p in mine], xerr=[
        [p["relative_latency"] - p["relative_latency_range"][0] for p in mine],
        [p["relative_latency_range"][1] - p["relative_latency"] for p in mine]],
                fmt=markers[strategy], ms=9 if strategy == "distillspec" else 7, capsize=3,
                label=strategy)
    for i, p in enumerate(mine):  # staggered: points of one target share a quality
      ax.annotate(_label(p), (p["relative_latency"], p["quality"]), fontsize=6,
                  xytext=(4, 4 - 9 * (i % 3)), textcoords="offset points")
  front = sorted((p for p in report["points"] if p["pareto"]),
                 key=lambda p: p["relative_latency"])
  ax.step([p["relative_latency"] for p in front], [p["quality"] for p in front], where="post",
          color="gray", ls="--", lw=1, label="Pareto frontier")
  ax.set_xscale("log")
  ax.set_xlabel("relative latency (s per token; plain decoding with the largest model = 1)")
  ax.set_ylabel(f"{config.quality_metric} (greedy, {config.eval_examples} test prompts)")
  ax.set_title("Model garden")
  ax.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(out_dir, "garden_frontier.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return [path]


def stage_report(config: GardenConfig, stage: str) -> dict:
  evaluation_result = read_json(os.path.join(config.stage_dir("evaluate"), "eval.json"))
  timing = evaluation_result["timing"]["target"]
  pinned = timing["machine"]["pinned"]
  report = {
      "points": build_points(config, evaluation_result),
      "num_params": evaluation_result["num_params"],
      "wall_clock_s": {s: read_json(os.path.join(config.stage_dir(s), pipeline.DONE)).get(
          "wall_clock_s") for s in config.stages[:-1]},
      "measurement": (
          f"Quality: {config.quality_metric} of greedy outputs (T = 0) on "
          f"{config.eval_examples} test prompts; a pair's from its speculative outputs "
          f"(gamma = {config.grid.gammas[0]}). Latency: speed.measure_speed per target model "
          f"(batch 1, {config.speed.examples} test prompts, {config.max_new_tokens} new "
          f"tokens at most, {config.speed.repeats} interleaved turns, median; "
          f"{len(pinned)} pinned core(s) of {timing['machine']['cpus']}), end-to-end "
          "seconds per generated token over the largest raw model's plain decoding; a "
          "pair's = its target's plain seconds per token / the pair's end-to-end speedup. "
          "Ranges: per-turn [min, max].")}
  write_json_atomic(os.path.join(config.run_dir, "report.json"), report)
  markdown = render_markdown(config, report)
  write_text_atomic(os.path.join(config.run_dir, "report.md"), markdown)
  print(markdown)
  return {"plots": plot(config, report, config.run_dir)}
