"""Writes docs/results.md, the one page of measurements, from the JSON committed under docs/,
and the README's results table (between its `results:begin` / `results:end` markers) from the
demo's committed report.

  python tools/results_page.py           # rewrites both
  python tools/results_page.py --check   # exit 1 if either differs from what it would write

tests/test_results_page.py runs the check, so the committed page is always the regenerated
one. To add a measurement: commit its JSON under docs/ and a section below that renders it
with the command that produced it. Report rows are read through `quantity`, the one place
that knows their key names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "results.md")
README = os.path.join(ROOT, "README.md")
REPORT = "docs/demo/current/report.json"
HEADS = "docs/heads/demo_head.json"
HEAD_RUNS = ((HEADS, "A draft head beside the separate drafts"),
             ("docs/heads/llama_gsm8k_head.json", "A draft head on the Llama-family pair, GSM8K text"))
BEGIN, END = "<!-- results:begin (tools/results_page.py) -->", "<!-- results:end -->"
RECIPES = {"raw": "raw draft", "gkd": "GKD", "supervised_kd": "SupervisedKD"}
STAGES = ("vocab", "target", "draft_raw", "teacher_cache", "distill_gkd", "distill_supervised_kd",
          "evaluate")

# Our names for a draft row's quantities -> the report's keys.
_KEYS = {"tau": "tau", "tau_stderr": "tau_stderr", "alpha": "draft_acceptance_rate",
         "decoding": "speedup", "decoding_range": "speedup_range",
         "end_to_end": "end_to_end_speedup", "end_to_end_range": "end_to_end_speedup_range",
         "cost_model_end_to_end": "cost_model_end_to_end_speedup",
         "typical_end_to_end": "typical_end_to_end_speedup", "unreliable": "speedup_unreliable",
         "draft": "draft", "gamma": "gamma", "temperature": "temperature"}


def quantity(row: dict, name: str):
  """A report row's value of `name` (a key of _KEYS): the one mapping of key names."""
  return row[_KEYS[name]]


def load(path: str) -> dict:
  with open(os.path.join(ROOT, path)) as f:
    return json.load(f)


def table(header: list, rows: list) -> list:
  aligns = ["---" if i < 2 else "---:" for i in range(len(header))]
  return (["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
          + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def x(value) -> str:
  return f"{value:.2f}x"


def span(value, bounds) -> str:
  return f"{value:.2f}x [{bounds[0]:.2f}, {bounds[1]:.2f}]"


def draft_rows(report: dict) -> list:
  rows = report["draft_rows"]
  return sorted(rows, key=lambda r: (quantity(r, "temperature"), list(RECIPES).index(
      quantity(r, "draft")), quantity(r, "gamma")))


def readme_table(report: dict, heads: dict) -> list:
  """tau and the measured speedups of the raw and the SupervisedKD draft, per (T, gamma), and
  the distilled head's tau where it was measured (`heads`: docs/heads/demo_head.json)."""
  by = {(quantity(r, "draft"), quantity(r, "temperature"), quantity(r, "gamma")): r
        for r in report["draft_rows"]}
  head = {(r["temperature"], r["gamma"]): r for r in heads["rows"]
          if r["draft"] == heads.get("head")}
  rows = []
  for (draft, temperature, gamma), raw in sorted(by.items(), key=lambda i: (i[0][1], i[0][2])):
    if draft != "raw":
      continue
    best = by[("supervised_kd", temperature, gamma)]
    gain = quantity(best, "tau") / quantity(raw, "tau") - 1
    h = head.get((temperature, gamma))
    rows.append([f"{temperature:g}", gamma,
                 f"{quantity(raw, 'tau'):.2f} ± {quantity(raw, 'tau_stderr'):.2f}",
                 f"{quantity(best, 'tau'):.2f} ± {quantity(best, 'tau_stderr'):.2f}",
                 f"{gain:+.1%}", span(quantity(raw, "end_to_end"), quantity(raw, "end_to_end_range")),
                 span(quantity(best, "end_to_end"), quantity(best, "end_to_end_range")),
                 "" if h is None else f"{h['tau']:.2f} ± {h['tau_stderr']:.2f}"])
  return table(["T", "gamma", "tau, raw draft", "tau, SupervisedKD", "tau gain",
                "end to end, raw", "end to end, SupervisedKD", "tau, head"], rows)


def main_job_section(report: dict) -> list:
  stages = report["wall_clock_s"]
  lines = ["## The main job on the embedded task", "",
           f"`python -m distillspec_jax.main --gin_file=gin/runs/demo.gin` on a 2-core CPU; "
           "the committed report: [demo/current/report.md](demo/current/report.md) (and "
           f"`report.json`). The job took {report['wall_clock_total_s'] / 60:.1f} minutes; "
           "stages (s): " + ", ".join(
               f"{name} {stages[name]:.0f}"
               for name in sorted(stages, key=lambda n: (STAGES + (n,)).index(n))) + ".", "",
           "Greedy quality on the test split:", ""]
  lines += table(["model", "accuracy (%)", "per-token loss"],
                 [[name, f"{q['accuracy']:.1f}", f"{q['per_token_loss']:.4f}"]
                  for name, q in sorted(report["target_quality"].items())])
  lines += ["", "Every draft with the target (tau on the test prompts with its standard error; "
            "speedups over plain decoding, median [min, max] over timing repeats, cost model "
            "in parentheses; [speed.md](speed.md) says how they are measured). The host's "
            "contention during the timing: "
            + ", ".join(f"{k} {v:.0%}" for k, v in report["interference"].items()) + ".", ""]
  rows = [[f"{quantity(r, 'temperature'):g}", RECIPES[quantity(r, "draft")], quantity(r, "gamma"),
           f"{quantity(r, 'tau'):.2f} ± {quantity(r, 'tau_stderr'):.2f}",
           f"{quantity(r, 'alpha'):.3f}",
           span(quantity(r, "decoding"), quantity(r, "decoding_range")),
           span(quantity(r, "end_to_end"), quantity(r, "end_to_end_range"))
           + f" ({x(quantity(r, 'cost_model_end_to_end'))})",
           x(quantity(r, "typical_end_to_end")) + (" unreliable" if quantity(r, "unreliable")
                                                   else "")]
          for r in draft_rows(report)]
  return lines + table(["T", "draft", "gamma", "tau", "alpha", "decoding phase", "end to end",
                        "typical, end to end"], rows) + [""]


def repeatability_section() -> list:
  """The same plan's fresh clone and its evaluate stage rerun on the same checkpoints."""
  clone, rerun = load("docs/demo/fresh_clone/report.json"), load(
      "docs/demo/evaluate_rerun/report.json")
  pairs = zip(draft_rows(clone), draft_rows(rerun))
  rows = [[f"{quantity(a, 'temperature'):g}", RECIPES[quantity(a, "draft")], quantity(a, "gamma"),
           span(quantity(a, "decoding"), quantity(a, "decoding_range")),
           span(quantity(b, "decoding"), quantity(b, "decoding_range")),
           f"{quantity(b, 'decoding') / quantity(a, 'decoding') - 1:+.1%}"] for a, b in pairs]
  return (["## Repeatability of the speed measurement", "",
           "A fresh clone's main job ([demo/fresh_clone](demo/fresh_clone/report.md), an earlier "
           "code of the same plan) and its evaluate stage rerun on the same checkpoints "
           "([demo/evaluate_rerun](demo/evaluate_rerun/report.md); delete "
           "`runs/demo/evaluate` and rerun the main command): decoding-phase speedups.", ""]
          + table(["T", "draft", "gamma", "clone", "rerun", "change"], rows) + [""])


def verification_section() -> list:
  data = load("docs/benchmarks/verification_cost.json")
  rows = [[k, f"{v['median_s'] * 1e6:.1f}", f"{v['steps']:.2f}",
           x(data["perfect_draft_ceiling"][str(int(k) - 1)]) if k != "1" else ""]
          for k, v in data["target"].items()]
  return (["## What a verification costs", "",
           "`python bench/verification_cost.py --max_width 10 --out "
           "docs/benchmarks/verification_cost.json` ([benchmarks.md](benchmarks.md)): a k-token "
           "call of the demo target in single-token steps, and the perfect-draft ceiling at "
           "gamma = k - 1.", ""]
          + table(["k", "median (us)", "steps", "ceiling"], rows) + [""])


def latency_section() -> list:
  data = load("docs/benchmarks/latency.json")
  rows = []
  for temperature, decoders in data["by_temperature"].items():
    for name, row in decoders.items():
      rows.append([temperature, name, f"{row['median_s'] * 1e3:.2f}",
                   f"{row['p90_s'] * 1e3:.2f}",
                   "" if name == "plain" else f"{row['tau']:.2f}",
                   "" if name == "plain" else x(row["median_request_speedup"])])
  return (["## Request latency at batch 1", "",
           f"`python bench/latency.py --out docs/benchmarks/latency.json` on the demo's "
           f"checkpoints ({data['prompts']} prompts x {data['passes']} passes, dispatch "
           "included; [benchmarks.md](benchmarks.md)).", ""]
          + table(["T", "decoder", "median (ms)", "p90 (ms)", "tau", "median request speedup"],
                  rows) + [""])


def _on_signal(row: dict) -> str:
  """The label's suffix for a rule reading the calibrated signal (" on acceptance head");
  rows written before GridPoint had `signal` read the top probability."""
  signal = row.get("signal", "top_probability")
  return "" if signal == "top_probability" else f" on {signal.replace('_', ' ')}"


def adaptive_section() -> list:
  data = load("docs/benchmarks/adaptive_gamma.json")
  def label(r):
    if r["draft_length"] == "fixed":
      return f"fixed gamma {r['gamma']}"
    if r["draft_length"] == "cost":
      return f"cost rule (gamma_max {r['gamma']})"
    return (f"{r['draft_length']} >= {r['threshold']:g}{_on_signal(r)} "
            f"(gamma_max {r['gamma']})")
  rows = [[f"{r['temperature']:g}", label(r),
           span(r["end_to_end_speedup"], r["end_to_end_speedup_range"]), f"{r['timed_tau']:.2f}",
           f"{r['drafted'] / max(r['rounds'], 1):.2f}"] for r in data["rows"]]
  return (["## Adaptive draft length", "",
           "`python bench/adaptive_gamma.py --out docs/benchmarks/adaptive_gamma.json` on the "
           "demo's checkpoints ([benchmarks.md](benchmarks.md)).", ""]
          + table(["T", "rule", "end to end", "tau", "mean proposal"], rows) + [""])


def calibrated_signal_section() -> list:
  """The acceptance head's signal against the top probability and fixed gamma, per T."""
  data = load("docs/benchmarks/calibrated_signal.json")
  def label(r):
    if r["draft_length"] == "fixed":
      return f"fixed gamma {r['gamma']}"
    return f"confidence >= {r['threshold']:g}{_on_signal(r)} (gamma_max {r['gamma']})"
  rows, verdicts = [], []
  for temperature, entry in data["temperatures"].items():
    ece = entry["ece"]
    rows += [[temperature, label(r), span(r["end_to_end_speedup"], r["end_to_end_speedup_range"]),
              f"{r['timed_tau']:.2f}", f"{r['mean_proposal']:.2f}"] for r in entry["rows"]]
    v = entry["verdict"]
    verdicts.append(
        f"- T = {temperature}: ECE head {ece['acceptance_head']:.3f} vs top probability "
        f"{ece['top_probability']:.3f}; best head rule, {label(v['best_head_rule'])}, "
        f"{x(v['best_head_rule']['end_to_end_speedup'])}, vs the best fixed rule, "
        f"{label(v['best_fixed'])}, {x(v['best_fixed']['end_to_end_speedup'])}: "
        + ("reaches it" if v["head_reaches_fixed"] else
           f"short by {-v['head_minus_fixed']:.2f}x")
        + (f"; the preset threshold {data['preset_threshold']:g}: "
           f"{v['preset_minus_fixed']:+.2f}x" if "preset_minus_fixed" in v else "") + ".")
  host = data["host"]
  return (["## Adaptive draft length on the calibrated signal", "",
           f"`python bench/calibrated_signal.py` on the demo's {data['draft_stage']} draft with "
           f"an acceptance head ({data['head_steps']} steps per temperature), one timing "
           f"session per temperature, load average {host['load_average_before'][0]:.1f} -> "
           f"{host['load_average_after'][0]:.1f} on {host['cpus']} cores "
           "([benchmarks.md](benchmarks.md)).", ""] + verdicts + [""]
          + table(["T", "rule", "end to end", "tau", "mean proposal"], rows) + [""])


STUDIES = (("docs/studies/objectives.json", "Objectives x data sources at matched compute",
            "objectives_study.gin"),
           ("docs/studies/adaspec_seeds.json", "AdaSPEC against its reference at matched compute",
            "adaspec_seeds.gin"))
STUDY_LABELS = {"supervised_kd": "fixed (SupervisedKD)", "adaspec": "AdaSPEC (SupervisedKD's data)", "imitkd": "mixture (ImitKD)",
                "gkd": "draft-generated (GKD)", "fkl": "FKL", "rkl": "RKL", "jsd": "JSD(0.5)",
                "tvd": "TVD", "lk_alpha": "LK-alpha", "lk_lambda": "LK-lambda",
                "block_acceptance": "block acceptance"}


def studies_section() -> list:
  """Each seeded study of STUDIES (path, title, run file)."""
  return [line for study in STUDIES for line in study_section(*study)]


def study_section(path: str, title: str, gin_file: str) -> list:
  """A seeded recipe-grid study: tau per recipe x objective, mean ± standard error over
  seeds, and its verdicts."""
  data = load(path)
  budget = data["budget"]
  recipes = list(dict.fromkeys(c["recipe"] for c in data["cells"]))
  objectives = list(dict.fromkeys(c["divergence"] for c in data["cells"]))
  index = {(c["recipe"], c["divergence"], c["temperature"]): c for c in data["cells"]}
  seeds = ", ".join(str(s) for s in budget["seeds"])
  lines = [f"## {title}", "",
           f"`python -m distillspec_jax.main --gin_file=gin/runs/{gin_file}` "
           f"(`{path}`; [studies.md](studies.md)): the demo's raw draft distilled toward its "
           f"target, seeds {seeds}, {budget['compute_budget']:.3g} {budget['unit']} per cell "
           f"(largest / smallest cell: {budget['compute_max_over_min']:.3f}), tau at gamma "
           f"{data['cells'][0]['gamma']} on {budget['eval_examples']} test prompts: the mean "
           "over seeds ± its standard error over seeds; the raw draft: " + ", ".join(
               f"{r['tau']:.2f} ± {r['tau_stderr']:.2f} at T = {r['temperature']:g}"
               for r in data["raw_draft"]) + ". Verdicts: the seed-paired difference beyond "
           "Student's t (95%) standard errors, else not distinguishable at this size.", ""]
  if data.get("partial"):
    lines += [f"**Partial**: {data['partial']}", ""]
  for temperature in sorted({c["temperature"] for c in data["cells"]}):
    rows = [[STUDY_LABELS.get(r, r)] + [
        f"{index[(r, d, temperature)]['tau']:.2f} ± "
        f"{index[(r, d, temperature)]['tau_stderr_seeds'] or 0.0:.2f}"
        if (r, d, temperature) in index else "-" for d in objectives] for r in recipes]
    lines += table([f"T = {temperature:g}"] + [STUDY_LABELS.get(d, d) for d in objectives],
                   rows) + [""]
  return lines + [f"- {v}" for v in data.get("verdicts", [])] + [""]


def teacher_cache_section() -> list:
  study = load("docs/teacher_cache/study.json")
  temps = sorted({k for row in study["variants"].values() for k in row if k.startswith("T")})
  rows = [[name] + [f"{row[t]['tau']:.3f} ± {row[t]['tau_stderr']:.3f}" for t in temps]
          + [f"{row['distill_wall_clock_s']:.0f}",
             f"{row.get('cache_bytes', 0) / 2 ** 20:.0f}"]
          for name, row in study["variants"].items()]
  lines = ["## Teacher cache", "",
           f"`python bench/teacher_cache_study.py --steps {study['steps']} --out "
           "docs/teacher_cache/study.json` ([teacher_cache.md](teacher_cache.md)): SupervisedKD "
           f"drafts from the live target and from top-k caches, tau at gamma {study['gamma']}.",
           ""]
  lines += table(["variant"] + [f"tau {t}" for t in temps] + ["distill (s)", "cache (MB)"],
                 rows)
  lines += ["", "`python bench/distill_throughput.py --teacher_cache 32 --out ...`: SupervisedKD "
            "tokens per second with the live target and from the cache.", ""]
  rows = []
  for name in ("throughput_demo", "throughput_10x"):
    data = load(f"docs/teacher_cache/{name}.json")
    rows.append([f"{data['models']['target']} {data['models']['target_overrides'] or ''}".strip(),
                 f"{data['tokens_per_s']['live_target']:,.0f}",
                 f"{data['tokens_per_s']['teacher_cache']:,.0f}", x(data["cache_speedup"])])
  return lines + table(["target", "live (tokens/s)", "cache (tokens/s)", "cache speedup"],
                       rows) + [""]


def vs_trl_section() -> list:
  rows = []
  for name in ("llama_threads1", "llama_threads1_quiet"):
    data = load(f"docs/vs_trl/{name}.json")
    rows.append([name, data["threads"], f"{data['ours_tokens_per_s']:,.0f}",
                 f"{data['trl_tokens_per_s']:,.0f}", x(data["speedup"])])
  return (["## Against TRL's GKDTrainer", "",
           "`python bench/vs_trl.py --threads 1 --out docs/vs_trl/<name>.json`: the same "
           "on-policy distillation step of one Llama architecture on both sides "
           "([distillation.md](distillation.md)).", ""]
          + table(["run", "threads", "ours (tokens/s)", "TRL (tokens/s)", "ours / TRL"], rows)
          + [""])


def memory_section() -> list:
  lines = ["## Per-device memory of the paper's distillation step", "",
           "`python bench/memory_table.py --out docs/scale_out/<table>.json --proxy_data 2 "
           "--remat_policy minimal --target_param_dtype bfloat16 ...` (simulated TPU v4 devices; "
           "[scale_out.md](scale_out.md) gives the commands and says how to read it). GiB per "
           "device.", ""]
  for name in ("memory_cnndm_minimal_bf16_target", "memory_xsum_minimal_bf16_target"):
    data = load(f"docs/scale_out/{name}.json")
    gib = lambda v: "n/a" if v is None else f"{v / 2 ** 30:.2f}"
    rows = [[f"{r['target']} / {r['draft']}", r.get("slice", r["devices"]),
             f"({r['mesh'][0]}, {r['mesh'][1]})", r["dtype"], r.get("remat_policy", "none"),
             r.get("target_param_dtype", "float32"), gib(r["arguments_bytes"]),
             gib(r["peak_bytes"]), {True: "yes", False: "no", None: "?"}[r["fits_v4_hbm"]]]
            for r in data["rows"]]
    lines += [f"`docs/scale_out/{name}.json`:", ""]
    lines += table(["pair", "slice", "mesh", "activations", "remat", "target params",
                    "arguments", "peak", "fits"], rows) + [""]
  return lines


def checks_section() -> list:
  """The behaviour checks: the demo's tau before and after a change, the two-process eval."""
  tau = load("docs/checks/demo_tau_before_after.json")
  rows = [[r["draft"], f"{r['temperature']:g}", r["gamma"],
           f"{r['tau_before']:.6f} ± {r['tau_stderr_before']:.4f}",
           f"{r['tau_after']:.6f} ± {r['tau_stderr_after']:.4f}",
           "yes" if r["identical"] else "**no**"] for r in tau["rows"]]
  two = load("docs/checks/eval_two_processes_demo.json")
  two_rows = [[f"{r['temperature']:g}", r["gamma"], f"{r['tau']:.3f} ± {r['tau_stderr']:.3f}",
               f"{r['draft_acceptance_rate']:.3f}"] for r in two["rows"]]
  return (["## Behaviour checks", "", tau["what"], "",
           f"Before: `{tau['command_before']}`; after: `{tau['command_after']}` "
           "(`docs/checks/demo_tau_before_after.json`).", ""]
          + table(["draft", "T", "gamma", "tau before", "tau after", "identical"], rows)
          + [""]
          + [line for later in (tau["final_tree"], *tau.get("later_trees", ())) for line in (
              f"{later['what']} `{later['command']}`: "
              f"{sum(r['identical'] for r in later['rows'])} of {len(later['rows'])} rows "
              "identical to the earlier tree's tau.", "")]
          + [two["what"], "",
             f"`{two['command']}` "
             f"(`docs/checks/eval_two_processes_demo.json`): rows equal to the one-process "
             f"run: {'yes' if two['rows_equal'] else '**no**'}.", ""]
          + table(["T", "gamma", "tau", "draft acceptance rate"], two_rows) + [""])


def heads_section() -> list:
  """Each head run of HEAD_RUNS."""
  return [line for path, title in HEAD_RUNS for line in head_run_section(path, title)]


def head_run_section(path: str, title: str) -> list:
  """One main job's head beside its separate drafts: tau, acceptance, speed, per-call costs."""
  data = load(path)
  rows = [[r["draft"], f"{r['temperature']:g}", r["gamma"],
           f"{r['tau']:.2f} ± {r['tau_stderr']:.2f}",
           " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]),
           span(r["end_to_end_speedup"], r["end_to_end_speedup_range"])] for r in data["rows"]]
  lines = ([f"## {title}", "", data["what"], "",
            f"`{data['command']}` (`{path}`; [heads.md](heads.md)).", ""]
           + table(["draft", "T", "gamma", "tau", "acceptance by position", "end to end"], rows))
  if "per_call_s" not in data:
    return lines + [""]
  costs = [[name, d["kind"], f"{d['num_params']:,}", f"{d['step_s'] * 1e6:.1f}"]
           + [f"{d['first_call_s'][g] * 1e6:.1f}" for g in sorted(d["first_call_s"], key=int)]
           for name, d in data["drafts"].items()]
  gammas = sorted(next(iter(data["drafts"].values()))["first_call_s"], key=int)
  lines += ["", "Per-call costs in the same timing (us, median; a target step: "
            f"{data['per_call_s']['target_step'] * 1e6:.1f}):", ""]
  lines += table(["draft", "kind", "parameters", "draft step"]
                 + [f"first call, gamma {g}" for g in gammas], costs)
  before = data.get("before")
  if before:
    after = {(r["draft"], r["temperature"], r["gamma"]): r for r in data["rows"]}
    pairs = [[f"{r['temperature']:g}", r["gamma"], f"{r['tau']:.2f} ± {r['tau_stderr']:.2f}",
              " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]),
              f"{new['tau']:.2f} ± {new['tau_stderr']:.2f}",
              " ".join(f"{a:.2f}" for a in new["acceptance_by_position"])]
             for r in before["rows"]
             for new in [after[(before["after"], r["temperature"], r["gamma"])]]]
    lines += ["", before["what"], "", f"Before: `{before['command']}`.", ""]
    lines += table(["T", "gamma", f"tau, {before['draft']}", "acceptance by position",
                    f"tau, {before['after']}", "acceptance by position"], pairs)
  return lines + [""]


SECTIONS = (checks_section, heads_section, verification_section, latency_section, adaptive_section,
            calibrated_signal_section,
            studies_section, teacher_cache_section, vs_trl_section, memory_section)


def page() -> str:
  report = load(REPORT)
  lines = ["# Results", "",
           "<!-- Generated by tools/results_page.py from the JSON under docs/; edit that, not "
           "this page. -->", "",
           "Measurements of real runs on a 2-core CPU without an accelerator, each from the "
           "committed JSON beside it and the command that wrote it. The pages that explain "
           "them: [speed.md](speed.md) (how speed is measured), [main_job.md](main_job.md) "
           "(the stages and columns), [benchmarks.md](benchmarks.md) (the bench scripts).", ""]
  lines += main_job_section(report) + repeatability_section()
  for section in SECTIONS:
    lines += section()
  return "\n".join(lines).rstrip() + "\n"


def readme(text: str) -> str:
  """`text` with the block between the markers replaced by the demo report's table."""
  if BEGIN not in text or END not in text:
    raise ValueError(f"README.md lacks the markers {BEGIN!r} and {END!r}.")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return head + BEGIN + "\n" + "\n".join(readme_table(load(REPORT), load(HEADS))) + "\n" + END + tail


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if docs/results.md or the README's table is not current")
  args = parser.parse_args(argv)
  with open(README) as f:
    current = f.read()
  wanted = {PAGE: page(), README: readme(current)}
  stale = []
  for path, text in wanted.items():
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
      stale.append(os.path.relpath(path, ROOT))
      if not args.check:
        with open(path, "w") as f:
          f.write(text)
  if args.check and stale:
    print(f"not current: {stale}; run python tools/results_page.py", file=sys.stderr)
    return 1
  print(("rewrote " + ", ".join(stale)) if stale else "current")
  return 0


if __name__ == "__main__":
  sys.exit(main())
