"""docs/results.md and the README's results table are the ones tools/results_page.py writes
from the committed JSON; the README and the concept pages carry no run log (no commit hash,
machine name or date)."""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import results_page  # noqa: E402

HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MACHINE_OR_DATE = re.compile(r"\bvm\s?\d+\b|_vm\d|\b(first|second|third|fourth|fifth|sixth|"
                             r"seventh) VM\b|\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b", re.I)


def pages() -> list:
  paths = [ROOT / "README.md", ROOT / "tests" / "README.md"]
  paths += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "gin").rglob("*.gin"))
  return paths


def test_the_committed_page_and_readme_table_are_current():
  assert results_page.main(["--check"]) == 0, "run: python tools/results_page.py"


def test_every_quantity_the_page_reads_is_in_every_row_of_the_report():
  report = json.loads((ROOT / results_page.REPORT).read_text())
  for row in report["draft_rows"]:
    for name in results_page._KEYS:
      results_page.quantity(row, name)


def test_the_scan_finds_a_hash_a_machine_and_a_date():
  assert HASH.search("the run of b8817d0") and not HASH.search("deadline 1234567")
  assert MACHINE_OR_DATE.search("on the sixth VM") and MACHINE_OR_DATE.search("2026-12-04")
  assert not MACHINE_OR_DATE.search("a Cloud TPU VM")


def test_no_commit_hash_machine_name_or_date():
  found = {}
  for path in pages():
    text = path.read_text()
    hits = [m.group(0) for m in HASH.finditer(text)] + [
        m.group(0) for m in MACHINE_OR_DATE.finditer(text)]
    if hits:
      found[str(path.relative_to(ROOT))] = hits
  assert not found, found


def test_readme_is_short():
  assert len((ROOT / "README.md").read_text().splitlines()) <= 150
