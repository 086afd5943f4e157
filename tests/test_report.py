"""The report's rows, measurement sentence and plots from a hand-made evaluation."""

import math

import pytest

from distillspec_jax.evaluation import evaluate
from distillspec_jax.evaluation import quality
from distillspec_jax.evaluation import report as report_lib
from distillspec_jax.evaluation import speed
from distillspec_jax.evaluation.decoding_grid import DecodingGrid
from distillspec_jax.evaluation.grid_point import GridPoint
from distillspec_jax.studies.pipeline import PipelineConfig


def _row(draft, temperature, gamma, tau, speedup, unreliable=False):
  """An eval.json row (an EvaluationRow's JSON) with made-up numbers."""
  speedups = speed.Speedups(
      speedup=speedup, speedup_range=[speedup - 0.02, speedup + 0.03], speedup_spread=0.03,
      speedup_repeats=[speedup - 0.02, speedup + 0.03], end_to_end_speedup=speedup - 0.1,
      end_to_end_speedup_range=[speedup - 0.12, speedup - 0.08],
      end_to_end_speedup_spread=0.2 if unreliable else 0.04, typical_speedup=speedup - 0.2,
      typical_speedup_range=[speedup - 0.3, speedup], typical_speedup_spread=0.25,
      typical_end_to_end_speedup=speedup - 0.25,
      typical_end_to_end_speedup_range=[speedup - 0.3, speedup - 0.2],
      typical_end_to_end_speedup_spread=0.08,
      speedup_prompt_interval=[speedup - 0.2, speedup + 0.2],
      end_to_end_speedup_prompt_interval=[speedup - 0.3, speedup + 0.1],
      speedup_unreliable=unreliable)
  figures = speed.SpeedFigures(
      speedups=speedups, cost_model_speedup=speedup + 0.05,
      cost_model_end_to_end_speedup=speedup - 0.05, tokens_per_s=100.0 * speedup,
      plain_tokens_per_s=100.0, setup_s=0.01, call_overhead_s=0.002, timed_tau=tau)
  acceptance = quality.Acceptance(
      tau=tau, tau_stderr=0.05, mean_acceptance_length=1 + gamma * 0.5,
      draft_acceptance_rate=0.5, alpha_proposed=0.55, alpha_distillspec=0.7,
      acceptance_by_position=[0.7] * gamma, draft_acceptance_rate_by_position=[0.5] * gamma)
  return evaluate.EvaluationRow(task="t", draft=draft, point=GridPoint(gamma, temperature),
                                acceptance=acceptance, quality={"accuracy": 0.5},
                                speed=figures).to_json()


def _evaluation(config):
  rows = []
  for temperature in config.grid.temperatures:
    for gamma in config.grid.gammas:
      rows.append(_row("draft_raw", temperature, gamma, 3.0, 1.2))
      rows.append(_row("distill_gkd", temperature, gamma, 3.6, 1.4))
      rows.append(_row("distill_supervised_kd", temperature, gamma, 3.8, 1.5))
  return {"quality": {"target": {"accuracy": 0.6, "per_token_loss": 0.2,
                                 "example_prediction": "x"}},
          "speculative": rows, "plain": {"0.0": {"tokens_per_s": 100.0}},
          "per_call_s": {"target_step": 1e-4, "verification_3": 2e-4, "verification_5": 3.5e-4},
          "machine": {"cpus": 2, "pinned": [1]},
          "interference": {"target_step": 0.25, "verification_5": 0.8},
          "quiet_timeline": {"plain": [0.09, 0.0, 0.164], "verification_5": [0.12, 0.0, 0.0]},
          "speed_protocol": {"num_prompts": 16, "repeats": 5, "max_new_tokens": 44,
                             "timed_per_repeat": 17, "plain_calls_per_cycle": 3,
                             "budget_s": 200.0}}


def test_report_rows_sentence_and_plots(tmp_path):
  config = PipelineConfig(run_dir=str(tmp_path), grid=DecodingGrid(gammas=(3, 5),
                                                                   temperatures=(0.0, 1.0)))
  report = report_lib.build_report(config, _evaluation(config), {"target": 10.0, "vocab": 2.0},
                                   {"gkd": [{"step": 0, "tau": 3.0, "tau_stderr": 0.1}]})
  assert len(report["paired_rows"]) == 2 * 2 * 2
  row = report["paired_rows"][0]
  assert row["recipe"] == "gkd" and row["tau_gain"] == pytest.approx(3.6 / 3.0 - 1)
  assert row["speedup_range_distilled"] == [1.38, 1.43]
  assert row["cost_model_speedup_raw"] == pytest.approx(1.25)
  assert row["tau_stderr_raw"] == 0.05
  # Every draft row has the keys of the eval binary's metrics.json rows.
  assert all(tuple(r) == evaluate.EvaluationRow.json_keys() for r in report["draft_rows"])
  assert {r["draft"] for r in report["draft_rows"]} == {"raw", "gkd", "supervised_kd"}
  assert report["wall_clock_total_s"] == 12.0
  assert "pinned to core 1" in report["measurement"] and "2-core" in report["measurement"]
  assert "ran 25% (target step) and 80% (verification 5) slower" in report["measurement"]
  assert ("among 17 calls (as many as fit in 200 s of timing), 51 for plain decoding (the "
          "denominator of every row: 3 calls per cycle)") in report["measurement"]
  assert "The verification of 6 tokens cost 3.50 target steps" in report["measurement"]
  assert ("by tenth of the timing (the quiet moments the minima come from): plain decoding "
          "9 0 16%; verification 5 12 0 0%.") in report["measurement"]
  assert report["quiet_timeline"]["plain"] == [0.09, 0.0, 0.164]
  assert "example_prediction" not in report["target_quality"]["target"]
  paths = report_lib.write_report(config, report, str(tmp_path))
  for path in paths + [str(tmp_path / "report.md"), str(tmp_path / "report.json")]:
    assert (tmp_path / path).stat().st_size > 0
  assert "| **total** | **12** |" in (tmp_path / "report.md").read_text()


def test_report_refuses_non_finite_numbers(tmp_path):
  config = PipelineConfig(run_dir=str(tmp_path),
                          grid=DecodingGrid(gammas=(3,), temperatures=(0.0,)))
  evaluation = _evaluation(config)
  evaluation["speculative"][1]["speedup_range"] = [math.nan, 1.4]
  with pytest.raises(ValueError, match="non-finite speedup_range"):
    report_lib.build_report(config, evaluation, {}, {})


def test_report_carries_the_engines_statistics_and_a_requests_speedups(tmp_path):
  config = PipelineConfig(run_dir=str(tmp_path),
                          grid=DecodingGrid(gammas=(3,), temperatures=(1.0,)))
  evaluation = _evaluation(config)
  evaluation["speculative"] = [_row(r["draft"], r["temperature"], r["gamma"], r["tau"],
                                    r["speedup"], unreliable=r["draft"] == "draft_raw")
                               for r in evaluation["speculative"]]
  report = report_lib.build_report(config, evaluation, {}, {})
  row = report["rows"][0]
  assert row["end_to_end_speedup_distilled"] == pytest.approx(1.4 - 0.1)
  assert row["end_to_end_speedup_range_distilled"] == pytest.approx([1.4 - 0.12, 1.4 - 0.08])
  assert row["typical_end_to_end_speedup_distilled"] == pytest.approx(1.4 - 0.25)
  assert row["typical_end_to_end_speedup_range_distilled"] == pytest.approx([1.1, 1.2])
  assert row["end_to_end_speedup_prompt_interval_raw"] == pytest.approx([0.9, 1.3])
  assert row["mean_acceptance_length_raw"] == 2.5 and row["alpha_distillspec_distilled"] == 0.7
  assert row["acceptance_by_position_distilled"] == [0.7] * 3
  assert row["speedup_unreliable_raw"] and not row["speedup_unreliable_distilled"]
  markdown = report_lib.render_markdown(config, report)
  # The raw draft's spread exceeds 10%: its speedups are flagged, the distilled ones not.
  assert "| 1 | 3 | raw | 1.20x [1.18, 1.23] unreliable |" in markdown
  assert "| 1 | 3 | gkd | 1.40x [1.38, 1.43] | 1.30x [1.28, 1.32] (1.35x) | 1.15x [1.10, " \
         "1.20] | [1.10, 1.50] | 10.00 |" in markdown
  assert "| 1 | 3 | gkd | 3.60 ± 0.05 | 0.700 | 0.500 | 2.50 | 0.70 0.70 0.70 |" in markdown
  assert "- end to end: the setup added back" in markdown


def test_report_of_an_untimed_evaluation_and_of_one_missing_a_quantity(tmp_path):
  config = PipelineConfig(run_dir=str(tmp_path),
                          grid=DecodingGrid(gammas=(3,), temperatures=(0.0,)))
  evaluation = _evaluation(config)
  untimed = [dict(r, **dict.fromkeys(speed.SpeedFigures.json_keys()))
             for r in evaluation["speculative"]]
  rows = report_lib.evaluation_rows({"speculative": untimed})
  assert all(r.speed is None for r in rows) and rows[0].acceptance.tau == 3.0
  del evaluation["speculative"][0]["tau"]
  with pytest.raises(KeyError, match="Acceptance needs 'tau'"):
    report_lib.build_report(config, evaluation, {}, {})


def test_grid_point_keeps_the_stop_signal():
  """Rows of one adaptive rule on the top probability and on the calibrated acceptance head
  stay apart; a row written before the field reads back as the top probability."""
  from distillspec_jax.decoding.speculative import DraftLength
  head = GridPoint.of(5, 1.0, draft_length=DraftLength("confidence", 0.4,
                                                       signal="acceptance_head"))
  top = GridPoint.of(5, 1.0, draft_length=DraftLength("confidence", 0.4))
  assert (head.signal, top.signal) == ("acceptance_head", "top_probability")
  assert head != top and head.to_json()["signal"] == "acceptance_head"
  assert GridPoint.from_json(head.to_json()) == head
  old = {k: v for k, v in top.to_json().items() if k != "signal"}
  assert GridPoint.from_json(old) == top
  row = _row("draft", 1.0, 5, 3.0, 1.2)
  assert row["signal"] == "top_probability"  # every evaluation row carries it


def test_report_of_a_draft_with_no_verification_round_reads_na(tmp_path):
  """A raw draft whose rows all ended at once (no target call): its tau is None, the tau gain
  over it None (it divided by tau) and the Markdown reads n/a."""
  config = PipelineConfig(run_dir=str(tmp_path),
                          grid=DecodingGrid(gammas=(3,), temperatures=(0.0,)))
  evaluation = _evaluation(config)
  for row in evaluation["speculative"]:
    if row["draft"] == "draft_raw":
      row.update(tau=None, tau_stderr=None, mean_acceptance_length=None,
                 draft_acceptance_rate=None, alpha_proposed=None, alpha_distillspec=None)
  report = report_lib.build_report(config, evaluation, {}, {})
  assert all(r["tau_gain"] is None for r in report["paired_rows"])
  assert report["paired_rows"][0]["tau_raw"] is None
  markdown = report_lib.render_markdown(config, report)
  assert "| 0 | 3 | raw | n/a |" in markdown
