"""The main job's report: report.json, report.md (the paper's table form) and PNG plots.

report.json:
  draft_rows: one evaluate.EvaluationRow per (draft, temperature, gamma), the draft named by
    its recipe ("raw" for the raw draft): the same keys as the eval binary's metrics.json
    rows (docs/evaluation.md lists them).
  rows / paired_rows: one per (recipe, temperature, gamma), raw draft against distilled
    draft: task, temperature, gamma, recipe, every measured key of the EvaluationRow (its
    Acceptance and SpeedFigures) once as <key>_raw and once as <key>_distilled (tau_raw,
    tau_stderr_raw, end_to_end_speedup_distilled, ...), tau_gain and delta_speedup (of the
    decoding-phase speedup).
  drafts: {draft: kind ("model" or "head"), num_params, step_s, first_call_s {gamma: s}}:
    parameters and per-call costs (`draft_costs`).
  adaptive_rows: with an adaptive `DecodingGrid.draft_length`, one per (draft that ran it,
    temperature): its rule, signal, gamma_max, tau, draft acceptance rate and end-to-end
    speedup beside the best fixed gamma's (`adaptive_rows`); the draft_rows hold its full
    rows (draft_length, threshold, signal keys).
  acceptance_heads: with `PipelineConfig.acceptance_head`, {recipe: the distill stage's
    record}: the head's width, weight, label temperature, first and last cross-entropy, and
    "calibration" {"top_probability", "acceptance_head": reliability table with "ece"} on
    held-out rows at that temperature (evaluation/calibration.py).
  A draft head of the main job (stage distill_head_<recipe>) is the draft `head_<recipe>` in
  every table, paired with the raw draft as a distilled draft is.
  target_quality, plain_tokens_per_s, plain (speed.PlainSpeed per temperature), machine
  ({"cpus", "pinned"}), speed_protocol (speed.SpeedProtocol), wall_clock_s (per stage) and
  wall_clock_total_s, tau_curves.
For an AdaSPEC comparison "rows" is the per-draft form (draft in raw / distillspec /
adaspec). Pure functions of the evaluation results: the stage glue is pipeline.stage_report.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from distillspec_jax.core.files import write_json_atomic, write_text_atomic
from distillspec_jax.core.validation import check_finite
from distillspec_jax.evaluation.evaluate import EvaluationRow
from distillspec_jax.evaluation.speed import SpeedFigures


def _measured(row: EvaluationRow) -> dict:
  """{key: value} of a row's measured quantities: its Acceptance and its SpeedFigures (every
  key null when it was not timed)."""
  speed = row.speed.to_json() if row.speed else dict.fromkeys(SpeedFigures.json_keys())
  return {**row.acceptance.to_json(), **speed}


def _paired_row(task, recipe, raw: EvaluationRow, distilled: EvaluationRow) -> dict:
  row = dict(task=task, temperature=raw.point.temperature, gamma=raw.point.gamma,
             recipe=recipe)
  for kind, source in (("raw", raw), ("distilled", distilled)):
    row.update({f"{key}_{kind}": value for key, value in _measured(source).items()})
  taus = (distilled.acceptance.tau, raw.acceptance.tau)  # None: no target call ran
  row["tau_gain"] = None if None in taus else taus[0] / taus[1] - 1.0
  row["delta_speedup"] = distilled.speed.speedups.speedup - raw.speed.speedups.speedup
  return row


def evaluation_rows(evaluation: dict) -> list:
  """The EvaluationRows of an eval.json object (pipeline.evaluation_json)."""
  return [EvaluationRow.from_json(r) for r in evaluation["speculative"]]


def _head_stages(config) -> tuple:
  return tuple(getattr(config, "head_stages", ()))


def build_rows(config, evaluation: dict) -> list:
  """One row per (recipe, temperature, gamma): raw draft versus distilled draft (a draft
  head's recipe is its report name, `head_<recipe>`)."""
  by_key = {(r.draft, r.point.temperature, r.point.gamma): r
            for r in evaluation_rows(evaluation) if r.point.draft_length == "fixed"}
  names = draft_names(config)
  rows = []
  for stage in config.distill_stages + _head_stages(config):
    for temperature in config.grid.temperatures:
      for gamma in config.grid.gammas:
        recipe = names[stage] if stage in _head_stages(config) else stage[len("distill_"):]
        rows.append(_paired_row(config.task, recipe,
                                by_key[("draft_raw", temperature, gamma)],
                                by_key[(stage, temperature, gamma)]))
  return rows


def draft_names(config) -> dict:
  """Evaluation draft name -> report recipe name. In an AdaSPEC comparison the reference
  recipe's draft is "distillspec" (AdaSPEC's baseline) and the raw draft is "raw"."""
  names = {"draft_raw": "raw"}
  for stage in config.distill_stages:
    names[stage] = stage[len("distill_"):]
  if "adaspec" in config.recipes:
    names[f"distill_{config.adaspec_reference}"] = "distillspec"
  for stage in _head_stages(config):
    names[stage] = stage[len("distill_"):]  # head_<recipe>
  return names


def draft_costs(config, evaluation: dict) -> dict:
  """{report draft name: {"kind", "num_params", "step_s", "first_call_s"}}: each draft's
  parameters and per-call costs timed with the rows (a one-token draft step; a round's first
  call by gamma: 2 tokens for a draft model, gamma + 1 positions for a head). The per-call
  costs are timed once per architecture, under its first draft's name."""
  names, per_call = draft_names(config), evaluation.get("per_call_s") or {}
  summaries = evaluation.get("drafts") or {}
  timed = {summaries[name]["kind"]: name for name in summaries  # kind -> its timed name
           if f"{name}:draft_step_1" in per_call}
  out = {}
  for name, summary in summaries.items():
    owner = timed.get(summary["kind"], name)
    width = lambda gamma: gamma + 1 if summary["kind"] == "head" else 2
    out[names.get(name, name)] = dict(
        summary, step_s=per_call.get(f"{owner}:draft_step_1"),
        first_call_s={str(g): per_call.get(f"{owner}:draft_step_{width(g)}")
                      for g in config.grid.gammas})
  return out


def build_draft_rows(config, evaluation: dict) -> list:
  """One EvaluationRow (JSON) per (draft, temperature, gamma), the draft named by its
  recipe."""
  names = draft_names(config)
  return [dataclasses.replace(r, draft=names[r.draft]).to_json()
          for r in evaluation_rows(evaluation)]


def adaptive_rows(draft_rows: list) -> list:
  """One row per adaptive draft_rows entry (the grid's adaptive rule on one draft at one
  temperature): draft, temperature, rule, threshold, signal, gamma (its gamma_max), tau,
  tau_stderr, draft_acceptance_rate, end_to_end_speedup (and range), and the same draft's
  best fixed gamma at that temperature by end-to-end speedup: best_fixed_gamma,
  best_fixed_end_to_end_speedup (and range)."""
  out, every_fixed = [], _fixed(draft_rows)
  for r in draft_rows:
    if r in every_fixed:
      continue
    fixed = [f for f in every_fixed if f["draft"] == r["draft"]
             and f["temperature"] == r["temperature"] and f["end_to_end_speedup"] is not None]
    best = max(fixed, key=lambda f: f["end_to_end_speedup"]) if fixed else None
    out.append(dict(
        {k: r[k] for k in ("draft", "temperature", "draft_length", "threshold", "signal",
                           "gamma", "tau", "tau_stderr", "draft_acceptance_rate",
                           "end_to_end_speedup", "end_to_end_speedup_range")},
        best_fixed_gamma=best["gamma"] if best else None,
        best_fixed_end_to_end_speedup=best["end_to_end_speedup"] if best else None,
        best_fixed_end_to_end_speedup_range=(best["end_to_end_speedup_range"] if best
                                             else None)))
  return out


def measurement_sentence(report: dict) -> str:
  """One sentence saying what the speedups measure and on what machine."""
  machine, protocol = report["machine"], report["speed_protocol"]
  pinned = machine["pinned"]
  cores = (f"pinned to core{'s' if len(pinned) > 1 else ''} {', '.join(map(str, pinned))}"
           if len(pinned) < machine["cpus"] else "on all cores, unpinned")
  calls = protocol.get("timed_per_repeat")
  calls = f"{calls} calls" if calls else "its calls"
  if protocol.get("budget_s"):
    calls += f" (as many as fit in {protocol['budget_s']:g} s of timing)"
  plain_calls = protocol.get("plain_calls_per_cycle", 1)
  if plain_calls > 1 and protocol.get("timed_per_repeat"):
    calls += (f", {plain_calls * protocol['timed_per_repeat']} for plain decoding (the "
              f"denominator of every row: {plain_calls} calls per cycle)")
  return (f"Speedup: tokens per second of speculative over plain target decoding at batch 1, "
          f"{protocol['num_prompts']} test prompts each decoded alone (up to "
          f"{protocol['max_new_tokens']} new tokens) in one compiled loop per measurement "
          f"that reads the clock between prompts, compiled once and timed warm in "
          f"interleaved cycles; each of {protocol['repeats']} repeats sums each prompt's "
          f"fastest time among {calls} spread over the run; median and [min, max] over "
          f"the repeats, on a {machine['cpus']}-core CPU {cores}; each prompt's setup "
          f"(encoders and prefill) is timed apart from the decoding that follows it and "
          f"reported beside it, with the end-to-end speedup that adds it back; the cost "
          f"model predicts both times from per-call costs timed in the same cycles."
          + _interference_clause(report.get("interference"))
          + _quiet_clause(report.get("quiet_timeline"))
          + _verification_clause(report.get("per_call_s") or {}))


def _quiet_clause(timeline) -> str:
  """' Windows within 3% of their fastest, by tenth of the timing: plain decoding 9 0 16 ...%;
  ...': when the host was quiet enough for the minima (speed.quiet_timeline)."""
  if not timeline:
    return ""
  parts = [f"{'plain decoding' if name == 'plain' else name.replace('_', ' ')} "
           + " ".join(f"{100 * share:.0f}" for share in shares) + "%"
           for name, shares in timeline.items()]
  return (" Windows within 3% of their fastest time, by tenth of the timing (the quiet "
          f"moments the minima come from): {'; '.join(parts)}.")


def _verification_clause(per_call: dict) -> str:
  """' The verification of k tokens cost R target steps ...': the largest verification's
  cost in target steps. Contention slows the compute-bound verification more than the step, so for
  the same models a higher ratio marks a contended timing (docs/speed.md)."""
  widths = [int(name.split("_")[1]) for name in per_call if name.startswith("verification_")]
  if not widths or not per_call.get("target_step"):
    return ""
  gamma = max(widths)
  ratio = per_call[f"verification_{gamma}"] / per_call["target_step"]
  return (f" The verification of {gamma + 1} tokens cost {ratio:.2f} target steps (contention "
          "raises this ratio: it slows the compute-bound verification more than the step).")


def _interference_clause(interference) -> str:
  """' A typical call ran X% (step) and Y% (verification) slower than its fastest windows.'"""
  if not interference:
    return ""
  parts = [f"{value:.0%} ({name.replace('_', ' ')})" for name, value in interference.items()]
  return (" The host's contention during the timing: a typical call ran "
          f"{' and '.join(parts)} slower than its fastest windows.")


def build_report(config, evaluation: dict, wall_clock: dict, curves: dict,
                 acceptance_heads: Optional[dict] = None) -> dict:
  """report.json's object (module docstring); `acceptance_heads`: {report draft name: the
  distill stage marker's "acceptance_head" record} (None: no heads)."""
  quality = {name: {k: v for k, v in q.items() if k != "example_prediction"}
             for name, q in evaluation["quality"].items()}
  paired, per_draft = build_rows(config, evaluation), build_draft_rows(config, evaluation)
  report = {"rows": per_draft if "adaspec" in config.recipes else paired,
            "paired_rows": paired, "draft_rows": per_draft, "target_quality": quality,
            "plain_tokens_per_s": {t: p["tokens_per_s"] for t, p in evaluation["plain"].items()},
            "plain": evaluation["plain"], "per_call_s": evaluation["per_call_s"],
            "machine": evaluation["machine"], "speed_protocol": evaluation["speed_protocol"],
            "interference": evaluation.get("interference"),
            "quiet_timeline": evaluation.get("quiet_timeline"),
            "wall_clock_s": wall_clock,
            "wall_clock_total_s": sum(v for v in wall_clock.values() if v is not None),
            "tau_curves": curves, "drafts": draft_costs(config, evaluation),
            "adaptive_rows": adaptive_rows(per_draft),
            "acceptance_heads": acceptance_heads or {}}
  report["measurement"] = measurement_sentence(report)
  check_finite(report["paired_rows"] + report["draft_rows"], "report")
  return report


def _range(values) -> str:
  return f"[{values[0]:.2f}, {values[1]:.2f}]" if values else ""


def _speed(value, value_range, unreliable=None) -> str:
  """'1.23x [1.20, 1.30]', with ' unreliable' where the row's spread exceeds 10%; '-' when
  the evaluation has no such figure."""
  if value is None:
    return "-"
  return f"{value:.2f}x {_range(value_range)}".rstrip() + (" unreliable" if unreliable else "")


def _number(value, digits: int = 3) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def _tau(tau, stderr) -> str:
  """tau ± its standard error, or n/a where no target call ran (decoding/stats.py: None)."""
  return "n/a" if tau is None else f"{tau:.2f} ± {_number(stderr, 2)}"


def _times(value) -> str:
  """A cost model's speedup, or n/a where it has none (an adaptive rule, no target call)."""
  return "n/a" if value is None else f"{value:.2f}x"


def _plotted(values: list) -> list:
  """`values` for a plot: an undefined statistic (None) a gap, not a point."""
  return [float("nan") if v is None else v for v in values]


# What each speed figure includes, one line each (the report's results section).
FIGURE_LINES = (
    "- decoding phase: the rounds (speculative) or steps (plain) after each prompt's setup, "
    "each prompt's fastest window among a repeat's calls;",
    "- end to end: the setup added back (encoders, prefill, the draft's setup, the first "
    "token): what a request sees, less one call's dispatch (`call_overhead_s`; "
    "bench/latency.py times single requests with it);",
    "- typical: end to end from each repeat's median call instead of its fastest windows "
    "(the host as it was);",
    "- [min, max] over timing repeats (the host's noise); 95% over prompts: a bootstrap over "
    "the timed prompts (which prompts were timed); `unreliable`: a decode-phase or end-to-end "
    "spread over repeats above 10%, not a result.")


def _paired_table(report: dict) -> list:
  lines = ["## Speculative decoding (tau = tokens per target call; speedup = measured "
           "median [min, max] over repeats, cost model in parentheses)", "",
           "| T | gamma | recipe | tau w/o distill | tau DistillSpec | tau gain | speedup w/o | "
           "speedup DistillSpec | delta |", "|---|---|---|---|---|---|---|---|---|"]
  for r in report["paired_rows"]:
    raw, distilled = (_speed(r[f"speedup_{kind}"], r[f"speedup_range_{kind}"],
                             r[f"speedup_unreliable_{kind}"])
                      for kind in ("raw", "distilled"))
    lines.append(
        f"| {r['temperature']:g} | {r['gamma']} | {r['recipe']} | "
        f"{_tau(r['tau_raw'], r['tau_stderr_raw'])} | "
        f"{_tau(r['tau_distilled'], r['tau_stderr_distilled'])} | "
        f"{'n/a' if r['tau_gain'] is None else format(r['tau_gain'], '+.1%')} | "
        f"{raw} ({_times(r['cost_model_speedup_raw'])}) | "
        f"{distilled} ({_times(r['cost_model_speedup_distilled'])}) | "
        f"{r['delta_speedup']:+.2f}x |")
  return lines


def _request_table(report: dict) -> list:
  lines = ["## What a request sees: every draft's speedup three ways", "", *FIGURE_LINES, "",
           "| T | gamma | recipe | decoding phase | end to end (cost model) | typical, end to "
           "end | end to end, 95% over prompts | setup (ms) |",
           "|---|---|---|---|---|---|---|---|"]
  for r in _fixed(report["draft_rows"]):
    interval = r["end_to_end_speedup_prompt_interval"]
    lines.append(
        f"| {r['temperature']:g} | {r['gamma']} | {r['draft']} | "
        f"{_speed(r['speedup'], r['speedup_range'], r['speedup_unreliable'])} | "
        f"{_speed(r['end_to_end_speedup'], r['end_to_end_speedup_range'])} "
        f"({_times(r['cost_model_end_to_end_speedup'])}) | "
        f"{_speed(r['typical_end_to_end_speedup'], r['typical_end_to_end_speedup_range'])}"
        f" | {_range(interval) or '-'} | {1e3 * r['setup_s']:.2f} |")
  return lines


def _acceptance_table(report: dict) -> list:
  lines = ["## Acceptance, the paper's and the serving engines' definitions", "",
           "tau: tokens per target call; alpha (DistillSpec): accepted / acceptance tests run, "
           "the per-token acceptance probability 1 - E[TVD] predicts; draft acceptance rate: "
           "accepted / proposed (vLLM); mean acceptance length: 1 + accepted / rounds (vLLM, "
           "llama.cpp); by position: DistillSpec's conditional rate at draft positions 1..gamma "
           "(decoding/stats.py).", "",
           "| T | gamma | recipe | tau | alpha (DistillSpec) | draft acceptance rate | mean "
           "acceptance length | acceptance by position |", "|---|---|---|---|---|---|---|---|"]
  for r in _fixed(report["draft_rows"]):
    positions = r["acceptance_by_position"]
    positions = " ".join(_number(v, 2) for v in positions) if positions else "-"
    lines.append(f"| {r['temperature']:g} | {r['gamma']} | {r['draft']} | "
                 f"{_tau(r['tau'], r['tau_stderr'])} | "
                 f"{_number(r['alpha_distillspec'])} | "
                 f"{_number(r['draft_acceptance_rate'])} | "
                 f"{_number(r['mean_acceptance_length'], 2)} | {positions} |")
  return lines


def _fixed(draft_rows: list) -> list:
  """The draft rows of the fixed rule (the adaptive rule's have their own table)."""
  return [r for r in draft_rows if r.get("draft_length", "fixed") == "fixed"]


def _adaptive_table(report: dict) -> list:
  rows = report.get("adaptive_rows") or []
  if not rows:
    return []
  lines = ["## Adaptive draft length (the grid's rule at gamma_max against the same draft's "
           "best fixed gamma, end to end, same timing session)", "",
           "| T | draft | rule | signal | gamma_max | tau | draft acceptance rate | "
           "end to end | best fixed gamma | its end to end |", "|---" * 10 + "|"]
  for r in rows:
    best = _speed(r["best_fixed_end_to_end_speedup"], r["best_fixed_end_to_end_speedup_range"])
    rule = r["draft_length"] + (f" >= {r['threshold']:g}" if r["draft_length"] != "cost"
                                else "")
    lines.append(
        f"| {r['temperature']:g} | {r['draft']} | {rule} | {r['signal']} | {r['gamma']} | "
        f"{_tau(r['tau'], r['tau_stderr'])} | {_number(r['draft_acceptance_rate'])} | "
        f"{_speed(r['end_to_end_speedup'], r['end_to_end_speedup_range'])} | "
        f"{r['best_fixed_gamma'] if r['best_fixed_gamma'] is not None else '-'} | "
        f"{best} |")
  return lines


def _calibration_table(report: dict) -> list:
  heads = report.get("acceptance_heads") or {}
  if not heads:
    return []
  lines = ["## Stop signal calibration (the acceptance head against the top probability)", "",
           "Expected calibration error (10 equal bins; lower is better) of each signal as a "
           "prediction of the target's acceptance at the head's label temperature, on held-out "
           "teacher-forced rows (evaluation/calibration.py); reliability diagrams: "
           "`reliability_<recipe>.png`.", "",
           "| recipe | label T | positions | ECE acceptance head | ECE top probability | head "
           "cross-entropy first -> last |", "|---|---|---|---|---|---|"]
  for name, head in heads.items():
    tables = head["calibration"]
    lines.append(
        f"| {name} | {head['temperature']:g} | {tables['acceptance_head']['positions']} | "
        f"{tables['acceptance_head']['ece']:.3f} | {tables['top_probability']['ece']:.3f} | "
        f"{_number(head['bce_first'])} -> {_number(head['bce_last'])} |")
  return lines


def _drafts_table(report: dict) -> list:
  """Each draft's parameters and per-call costs beside the target's step and verification."""
  drafts, per_call = report.get("drafts") or {}, report.get("per_call_s") or {}
  if not drafts:
    return []
  gammas = sorted({int(g) for d in drafts.values() for g in d["first_call_s"]})
  us = lambda s: "-" if s is None else f"{1e6 * s:.1f}"
  lines = ["## Drafts: parameters and per-call cost (us, batch 1, timed with the rows)", "",
           f"Target step {us(per_call.get('target_step'))} us; verification of gamma + 1 "
           "tokens: " + ", ".join(f"gamma {g}: {us(per_call.get(f'verification_{g}'))}"
                                  for g in gammas) + " us. A round's first draft call is "
           "2 tokens for a draft model and gamma + 1 positions for a head (it rewrites the "
           "accepted positions with the target's features).", "",
           "| draft | kind | parameters | draft step | " + " | ".join(
               f"first call, gamma {g}" for g in gammas) + " |",
           "|---|---|---|---|" + "---|" * len(gammas)]
  for name, d in drafts.items():
    lines.append(f"| {name} | {d['kind']} | {d['num_params']:,} | {us(d['step_s'])} | "
                 + " | ".join(us(d["first_call_s"].get(str(g))) for g in gammas) + " |")
  return lines


def render_markdown(config, report: dict) -> str:
  quality = report["target_quality"]
  lines = [f"# DistillSpec demo report: {config.task}", "",
           f"Target `{config.target_model or config.target_checkpoint_path}`, draft "
           f"`{config.draft_model or config.draft_checkpoint_path}`; "
           f"{config.eval_examples} test prompts for quality and tau (with its standard error "
           f"over prompts).", "", report["measurement"], "",
           "## Quality (greedy decoding, test split)", "",
           "| model | accuracy | per-token loss |", "|---|---|---|"]
  for name, q in quality.items():
    lines.append(f"| {name} | {q.get('accuracy', float('nan')):.3f} | "
                 f"{q['per_token_loss']:.4f} |")
  lines += ["", *_paired_table(report), "", *_request_table(report), "",
            *_acceptance_table(report), "", *_drafts_table(report)]
  for extra in (_adaptive_table(report), _calibration_table(report)):
    lines += ["", *extra] if extra else []
  lines += ["", "## Wall clock per stage (s)", "", "| stage | seconds |", "|---|---|"]
  for stage, seconds in report["wall_clock_s"].items():
    lines.append(f"| {stage} | {seconds:.0f} |")
  lines += [f"| **total** | **{report['wall_clock_total_s']:.0f}** |", "",
            "Plots: `tau_over_steps.png`, `speedup_vs_gamma.png` (error bars: tau's standard "
            "error; speedup's [min, max] over timing repeats).", ""]
  return "\n".join(lines)


def _error_bar(value: float, value_range) -> list:
  return [value - value_range[0], value_range[1] - value]


def plot(config, report: dict, curves: dict, out_dir: str) -> list:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  fig, ax = plt.subplots(figsize=(6, 4))
  for recipe, curve in curves.items():
    ax.errorbar([p["step"] for p in curve], _plotted([p["tau"] for p in curve]),
                yerr=[p.get("tau_stderr") or 0.0 for p in curve], marker="o", capsize=3,
                label=recipe)
  ax.set_xlabel("distillation step")
  ax.set_ylabel("tau (gamma=5, T=0, held-out prompts)")
  ax.set_title("Block efficiency during distillation (± standard error)")
  ax.legend()
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "tau_over_steps.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  temperatures = sorted({r["temperature"] for r in report["paired_rows"]})
  fig, axes = plt.subplots(2, len(temperatures), figsize=(5 * len(temperatures), 7),
                           squeeze=False, sharex=True)
  for column, temperature in enumerate(temperatures):
    rows = [r for r in report["paired_rows"] if r["temperature"] == temperature]
    first_recipe = rows[0]["recipe"]
    series = [("raw draft", [r for r in rows if r["recipe"] == first_recipe], "raw")]
    series += [(f"distilled ({recipe})", [r for r in rows if r["recipe"] == recipe],
                "distilled") for recipe in dict.fromkeys(r["recipe"] for r in rows)]
    speed_ax, tau_ax = axes[0][column], axes[1][column]
    for label, mine, kind in series:
      gammas = [r["gamma"] for r in mine]
      speed_ax.errorbar(gammas, [r[f"speedup_{kind}"] for r in mine],
                        yerr=list(zip(*[_error_bar(r[f"speedup_{kind}"],
                                                   r[f"speedup_range_{kind}"])
                                        for r in mine])),
                        marker="o", capsize=3, label=label)
      tau_ax.errorbar(gammas, _plotted([r[f"tau_{kind}"] for r in mine]),
                      yerr=_plotted([r[f"tau_stderr_{kind}"] for r in mine]), marker="o",
                      capsize=3,
                      label=label)
    speed_ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    speed_ax.set_ylabel("measured speedup over plain decoding")
    speed_ax.set_title(f"T = {temperature:g} (bars: [min, max] over repeats)")
    speed_ax.legend()
    tau_ax.set_xlabel("gamma")
    tau_ax.set_ylabel("tau (± standard error)")
  fig.tight_layout()
  paths.append(os.path.join(out_dir, "speedup_vs_gamma.png"))
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  from distillspec_jax.evaluation import calibration
  for name, head in (report.get("acceptance_heads") or {}).items():
    paths.append(os.path.join(out_dir, f"reliability_{name}.png"))
    calibration.write_reliability_diagram(
        paths[-1], {signal: calibration.reliability_of_json(table)
                    for signal, table in head["calibration"].items()},
        title=f"{name}: acceptance at T = {head['temperature']:g}, held-out rows")
  return paths


def write_report(config, report: dict, out_dir: str) -> list:
  """Writes report.json, report.md and the plots into `out_dir`; returns the plot paths."""
  write_json_atomic(os.path.join(out_dir, "report.json"), report)
  markdown = render_markdown(config, report)
  write_text_atomic(os.path.join(out_dir, "report.md"), markdown)
  paths = plot(config, report, report["tau_curves"], out_dir)
  print(markdown)
  return paths
