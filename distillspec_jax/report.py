"""The main job's report: report.json, report.md (the paper's table form) and PNG plots.

report.json: {"rows": [{"task", "temperature", "gamma", "recipe", "tau_raw", "tau_distilled",
"speedup_raw", "speedup_distilled", ...}], "target_quality": {...}, "wall_clock_s": {...}}; for
an AdaSPEC comparison "rows" is [{"task", "temperature", "gamma", "recipe", "alpha", "tau"}]
with recipe in {"raw", "distillspec", "adaspec"}.
"""

from __future__ import annotations

import math
import os

from distillspec_jax import pipeline


def build_rows(config, evaluation: dict) -> list:
  """One row per (recipe, temperature, gamma): raw draft versus distilled draft."""
  by_key = {(r["draft"], r["temperature"], r["gamma"]): r for r in evaluation["speculative"]}
  rows = []
  for stage in config.distill_stages:
    recipe = stage[len("distill_"):]
    for temperature in config.temperatures:
      for gamma in config.gammas:
        raw = by_key[("draft_raw", temperature, gamma)]
        distilled = by_key[(stage, temperature, gamma)]
        rows.append(dict(
            task=config.task, temperature=temperature, gamma=gamma, recipe=recipe,
            tau_raw=raw["tau"], tau_distilled=distilled["tau"],
            speedup_raw=raw["speedup"], speedup_distilled=distilled["speedup"],
            delta_speedup=distilled["speedup"] - raw["speedup"],
            alpha_raw=raw["alpha"], alpha_distilled=distilled["alpha"],
            tau_gain=distilled["tau"] / raw["tau"] - 1.0))
  return rows


def draft_names(config) -> dict:
  """Evaluation draft name -> report recipe name. In an AdaSPEC comparison the reference
  recipe's draft is "distillspec" (AdaSPEC's baseline) and the raw draft is "raw"."""
  names = {"draft_raw": "raw"}
  for stage in config.distill_stages:
    names[stage] = stage[len("distill_"):]
  if "adaspec" in config.recipes:
    names[f"distill_{config.adaspec_reference}"] = "distillspec"
  return names


def build_draft_rows(config, evaluation: dict) -> list:
  """One row per (draft, temperature, gamma): {task, temperature, gamma, recipe, alpha, tau,
  speedup}."""
  names = draft_names(config)
  return [dict(task=config.task, temperature=r["temperature"], gamma=r["gamma"],
               recipe=names[r["draft"]], alpha=r["alpha"], tau=r["tau"], speedup=r["speedup"])
          for r in evaluation["speculative"]]


def wall_clock(config) -> dict:
  times = {}
  for stage in config.stages:
    marker = os.path.join(config.stage_dir(stage), pipeline.DONE)
    if os.path.exists(marker):
      times[stage] = pipeline.read_json(marker).get("wall_clock_s")
  return times


def render_markdown(config, report: dict) -> str:
  quality = report["target_quality"]
  lines = [f"# DistillSpec demo report: {config.task}", "",
           f"Target `{config.target_model}`, draft `{config.draft_model}`; "
           f"{config.eval_examples} test prompts for quality and tau, "
           f"{config.speed_examples} prompts timed at batch 1 for the speedup.", "",
           "## Quality (greedy decoding, test split)", "",
           "| model | accuracy | per-token loss |", "|---|---|---|"]
  for name, q in quality.items():
    lines.append(f"| {name} | {q.get('accuracy', float('nan')):.3f} | "
                 f"{q['per_token_loss']:.4f} |")
  target_accuracy = quality["target"].get("accuracy", float("nan"))
  lines += ["", "## Speculative decoding (tau = tokens per target call; speedup = wall clock "
            "over plain target decoding)", "",
            "| task | T | gamma | tau w/o distill | speedup w/o | tau DistillSpec | speedup "
            "DistillSpec | delta speedup | recipe | target accuracy |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["paired_rows"]:
    lines.append(
        f"| {r['task']} | {r['temperature']:g} | {r['gamma']} | {r['tau_raw']:.2f} | "
        f"{r['speedup_raw']:.2f}x | {r['tau_distilled']:.2f} | {r['speedup_distilled']:.2f}x | "
        f"{r['delta_speedup']:+.2f}x | {r['recipe']} | {target_accuracy:.3f} |")
  lines += ["", "## Every draft", "", "| T | gamma | recipe | alpha | tau | speedup |",
            "|---|---|---|---|---|---|"]
  for r in report["draft_rows"]:
    lines.append(f"| {r['temperature']:g} | {r['gamma']} | {r['recipe']} | {r['alpha']:.3f} | "
                 f"{r['tau']:.2f} | {r['speedup']:.2f}x |")
  lines += ["", "## Wall clock per stage (s)", "", "| stage | seconds |", "|---|---|"]
  for stage, seconds in report["wall_clock_s"].items():
    lines.append(f"| {stage} | {seconds:.0f} |")
  lines += ["", "Plots: `tau_over_steps.png`, `speedup_vs_gamma.png`.", ""]
  return "\n".join(lines)


def plot(config, report: dict, curves: dict, out_dir: str) -> list:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  fig, ax = plt.subplots(figsize=(6, 4))
  for recipe, curve in curves.items():
    ax.plot([p["step"] for p in curve], [p["tau"] for p in curve], marker="o", label=recipe)
  ax.set_xlabel("distillation step")
  ax.set_ylabel("tau (gamma=5, T=0, held-out prompts)")
  ax.set_title("Block efficiency during distillation")
  ax.legend()
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "tau_over_steps.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  temperatures = sorted({r["temperature"] for r in report["paired_rows"]})
  fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 4),
                           squeeze=False)
  for ax, temperature in zip(axes[0], temperatures):
    rows = [r for r in report["paired_rows"] if r["temperature"] == temperature]
    first_recipe = rows[0]["recipe"]
    raw = [r for r in rows if r["recipe"] == first_recipe]
    ax.plot([r["gamma"] for r in raw], [r["speedup_raw"] for r in raw], marker="o",
            label="raw draft")
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
      mine = [r for r in rows if r["recipe"] == recipe]
      ax.plot([r["gamma"] for r in mine], [r["speedup_distilled"] for r in mine], marker="o",
              label=f"distilled ({recipe})")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("gamma")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"T = {temperature:g}")
    ax.legend()
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "speedup_vs_gamma.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  return paths


def _check_finite(report: dict) -> None:
  for row in report["paired_rows"] + report["draft_rows"]:
    for key, value in row.items():
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"report row {row} has a non-finite {key}.")


def stage_report(config, stage: str) -> dict:
  evaluation = pipeline.read_json(os.path.join(config.stage_dir("evaluate"), "eval.json"))
  quality = {name: {k: v for k, v in q.items() if k != "example_prediction"}
             for name, q in evaluation["quality"].items()}
  paired, per_draft = build_rows(config, evaluation), build_draft_rows(config, evaluation)
  # "rows" is the paper-table form for DistillSpec jobs, the per-draft form for AdaSPEC
  # comparisons (recipe in raw / distillspec / adaspec); both forms are always present.
  report = {"rows": per_draft if "adaspec" in config.recipes else paired,
            "paired_rows": paired, "draft_rows": per_draft, "target_quality": quality,
            "plain_tokens_per_s": evaluation["plain_tokens_per_s"],
            "wall_clock_s": wall_clock(config)}
  _check_finite(report)
  curves = {}
  for name in config.distill_stages:
    marker = pipeline.read_json(os.path.join(config.stage_dir(name), pipeline.DONE))
    curves[name[len("distill_"):]] = marker.get("tau_curve", [])
  report["tau_curves"] = curves
  out_dir = config.run_dir
  pipeline.write_json_atomic(os.path.join(out_dir, "report.json"), report)
  markdown = render_markdown(config, report)
  with open(os.path.join(out_dir, "report.md.tmp"), "w") as f:
    f.write(markdown)
  os.replace(os.path.join(out_dir, "report.md.tmp"), os.path.join(out_dir, "report.md"))
  plots = plot(config, report, curves, out_dir)
  print(markdown)
  return {"plots": plots}
