"""The lossy trade-off: task quality against latency over a lenience grid (DistillSpec Fig. 6).

Reads the evaluation binary's metrics.json object ({"rows", "target_alone"}) and nothing
else. Latency is relative to plain decoding with the target (the largest model), end to end
as a request sees it: a row's relative latency is 1 / its end-to-end speedup
(`end_to_end_speedup`: speculative over plain target tokens/s, each prompt's setup
included, in the same timing turns), and the target alone is at 1.0 by construction. Rows
without an end-to-end figure (a metrics.json measured before it existed) fall back to the
decoding phase's `speedup`, and the table says so.
"""

from __future__ import annotations

import os
from typing import Optional

from distillspec_jax.core.files import write_json_atomic


def _fmt(value, digits: int = 3) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.{digits}f}"
  return str(value)


def primary_metric(metrics: dict, task: str) -> str:
  """The task's first metric name (sorted), e.g. 'accuracy' or 'rouge1'."""
  names = sorted(metrics["target_alone"][task])
  if not names:
    raise ValueError(f"Task {task!r} has no quality metric in target_alone.")
  return names[0]


def _end_to_end(row: dict) -> tuple:
  """(speedup, [min, max] or None, phase) of a metrics.json row: end to end, or the decoding
  phase's for a row written before the end-to-end figures."""
  if row["end_to_end_speedup"] is not None:
    return row["end_to_end_speedup"], row["end_to_end_speedup_range"], "end to end"
  return row["speedup"], row["speedup_range"], "decoding phase"


def tradeoff_table(metrics: dict, task: Optional[str] = None,
                   metric: Optional[str] = None) -> list:
  """Rows {task, temperature, gamma, decoder, lenience, epsilon, quality, relative_latency,
  relative_latency_range ([min, max] over timing repeats: 1 / the speedup's range),
  latency_phase ("end to end", or "decoding phase" for an earlier metrics.json), speedup
  (the end-to-end one it is 1 / of), speedup_decode (the decoding phase's), tau,
  draft_acceptance_rate, alpha_distillspec} for one task (default: the last task of the
  rows, the mixture when there is one): first the target alone (relative latency 1.0), then
  every speculative row, per (temperature, gamma), sorted by lenience kind and decreasing
  epsilon."""
  tasks = list(dict.fromkeys(r["task"] for r in metrics["rows"]))
  if not tasks:
    raise ValueError("metrics.json has no rows.")
  task = task or tasks[-1]
  metric = metric or primary_metric(metrics, task)
  rows = [r for r in metrics["rows"] if r["task"] == task]
  out = []
  for temperature, gamma in dict.fromkeys((r["temperature"], r["gamma"]) for r in rows):
    out.append(dict(task=task, temperature=temperature, gamma=gamma, decoder="target alone",
                    lenience=None, epsilon=None,
                    quality=metrics["target_alone"][task].get(metric), relative_latency=1.0,
                    relative_latency_range=None, latency_phase=None, speedup=1.0,
                    speedup_decode=1.0, tau=None, draft_acceptance_rate=None,
                    alpha_distillspec=None))
    group = [r for r in rows if r["temperature"] == temperature and r["gamma"] == gamma]
    for r in sorted(group, key=lambda r: (r["lenience"], -r["epsilon"])):
      speedup, timed, phase = _end_to_end(r)
      latency_range = [1.0 / timed[1], 1.0 / timed[0]] if timed else None
      out.append(dict(task=task, temperature=temperature, gamma=gamma, decoder="speculative",
                      lenience=r["lenience"], epsilon=r["epsilon"],
                      quality=r["quality"].get(metric),
                      relative_latency=(1.0 / speedup) if speedup else None,
                      relative_latency_range=latency_range, latency_phase=phase,
                      speedup=speedup, speedup_decode=r["speedup"], tau=r["tau"],
                      draft_acceptance_rate=r["draft_acceptance_rate"],
                      alpha_distillspec=r["alpha_distillspec"]))
  return out


def table_markdown(table: list, metric: str) -> str:
  lines = [f"| T | gamma | decoder | lenience | epsilon | {metric} | relative latency, end to "
           "end [range] | speedup end to end | speedup decoding phase | tau | draft acceptance "
           "rate | alpha (DistillSpec) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in table:
    timed = r.get("relative_latency_range")
    latency = _fmt(r["relative_latency"]) + (
        f" [{_fmt(timed[0])}, {_fmt(timed[1])}]" if timed else "")
    if r.get("latency_phase") == "decoding phase":
      latency += " (decoding phase only: an earlier metrics.json)"
    lines.append(f"| {_fmt(r['temperature'], 1)} | {r['gamma']} | {r['decoder']} | "
                 f"{_fmt(r['lenience'])} | {_fmt(r['epsilon'], 2)} | {_fmt(r['quality'], 2)} | "
                 f"{latency} | {_fmt(r['speedup'], 2)} | {_fmt(r.get('speedup_decode'), 2)} | "
                 f"{_fmt(r['tau'], 2)} | {_fmt(r.get('draft_acceptance_rate'))} | "
                 f"{_fmt(r.get('alpha_distillspec'))} |")
  return "\n".join(lines)


def _with_range(value, value_range, digits: int = 2) -> str:
  """'1.23 [1.20, 1.30]', '1.23' without a range, '-' without a value."""
  if value is None:
    return "-"
  if not value_range:
    return _fmt(value, digits)
  return f"{_fmt(value, digits)} [{_fmt(value_range[0], digits)}, {_fmt(value_range[1], digits)}]"


def rows_markdown(metrics: dict) -> str:
  """Every metrics.json row as one Markdown table (the binary prints it)."""
  lines = ["| task | T | gamma | lenience | eps | quality | tau | mean acceptance length | "
           "draft acceptance rate | alpha (DistillSpec) | predicted alpha | speedup, "
           "decoding phase [range] | end to end [range] | typical, end to end [range] | "
           "end to end, 95% over prompts | cost model |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in metrics["rows"]:
    quality = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["quality"].items()))
    flag = " (unreliable: spread > 10%)" if r["speedup_unreliable"] else ""
    interval = r["end_to_end_speedup_prompt_interval"]
    interval = f"{_fmt(interval[0], 2)}-{_fmt(interval[1], 2)}" if interval else "-"
    typical = _with_range(r["typical_end_to_end_speedup"], r["typical_end_to_end_speedup_range"])
    lines.append(f"| {r['task']} | {_fmt(r['temperature'], 1)} | {r['gamma']} | "
                 f"{r['lenience']} | {_fmt(r['epsilon'], 2)} | {quality} | "
                 f"{_fmt(r['tau'], 2)} ± {_fmt(r['tau_stderr'], 2)} | "
                 f"{_fmt(r['mean_acceptance_length'], 2)} | "
                 f"{_fmt(r['draft_acceptance_rate'])} | "
                 f"{_fmt(r['alpha_distillspec'])} | {_fmt(r['predicted_alpha'])} | "
                 f"{_with_range(r['speedup'], r['speedup_range'])}{flag} | "
                 f"{_with_range(r['end_to_end_speedup'], r['end_to_end_speedup_range'])} | "
                 f"{typical} | {interval} | "
                 f"{_fmt(r['cost_model_speedup'], 2)} |")
  target = ", ".join(f"{task}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(m.items()))
                     for task, m in metrics["target_alone"].items())
  return "\n".join(lines) + f"\n\nTarget alone: {target}"


def plot_tradeoff(table: list, metric: str, path: str) -> None:
  """Quality against relative latency, one panel per (temperature, gamma), one line per
  lenience kind through its epsilons (labelled, with the latency's [min, max] over timing
  repeats as horizontal bars), the target alone as a star at 1.0."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = list(dict.fromkeys((r["temperature"], r["gamma"]) for r in table))
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
  for ax, (temperature, gamma) in zip(axes[0], panels):
    group = [r for r in table if (r["temperature"], r["gamma"]) == (temperature, gamma)]
    for kind in dict.fromkeys(r["lenience"] for r in group if r["lenience"]):
      points = [r for r in group if r["lenience"] == kind and r["relative_latency"]]
      points.sort(key=lambda r: r["epsilon"])
      latency = [r["relative_latency"] for r in points]
      # Horizontal bars: the latency's [min, max] over timing repeats, where there is one.
      ranges = [r["relative_latency_range"] or [x, x] for x, r in zip(latency, points)]
      errors = [[x - low for x, (low, _) in zip(latency, ranges)],
                [high - x for x, (_, high) in zip(latency, ranges)]]
      ax.errorbar(latency, [r["quality"] for r in points], xerr=errors, marker="o",
                  capsize=3, label=kind)
      for r in points:
        ax.annotate(f"{r['epsilon']:g}", (r["relative_latency"], r["quality"]),
                    textcoords="offset points", xytext=(3, 3), fontsize=7)
    alone = group[0]
    ax.plot([1.0], [alone["quality"]], marker="*", markersize=12, color="black",
            linestyle="none", label="target alone")
    ax.set_xlabel("latency relative to the target alone (end to end)")
    ax.set_ylabel(metric)
    ax.set_title(f"{alone['task']}, T={temperature:g}, gamma={gamma}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_tradeoff(metrics: dict, directory: str, task: Optional[str] = None,
                   metric: Optional[str] = None) -> dict:
  """Writes lossy_tradeoff.{json,md,png} in `directory` (the PNG only when the rows have
  speedups); returns {name: path}."""
  tasks = list(dict.fromkeys(r["task"] for r in metrics["rows"]))
  task = task or tasks[-1]
  metric = metric or primary_metric(metrics, task)
  table = tradeoff_table(metrics, task, metric)
  paths = {"json": os.path.join(directory, "lossy_tradeoff.json"),
           "md": os.path.join(directory, "lossy_tradeoff.md")}
  write_json_atomic(paths["json"], {"task": task, "metric": metric, "rows": table})
  with open(paths["md"], "w") as f:
    f.write(f"# Lossy trade-off: {task}, {metric} against latency\n\n"
            "Relative latency = 1 / the measured end-to-end speedup (each prompt's setup "
            "included; plain target decoding = 1.0).\n\n"
            + table_markdown(table, metric) + "\n")
  if any(r["relative_latency"] and r["decoder"] == "speculative" for r in table):
    paths["png"] = os.path.join(directory, "lossy_tradeoff.png")
    plot_tradeoff(table, metric, paths["png"])
  return paths
