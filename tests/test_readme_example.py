"""The README's Python example runs as printed: distil a draft, decode speculatively, read tau."""

import math
import pathlib
import re
import tempfile

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list:
  return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_the_readme_has_one_python_example():
  blocks = python_blocks(README.read_text())
  assert len(blocks) == 1, f"README.md has {len(blocks)} python blocks; the test runs exactly one"
  assert "speculative_decode(" in blocks[0] and "block_efficiency_stats(" in blocks[0]


@pytest.mark.slow
def test_the_readme_example_runs_and_reads_tau(tmp_path, monkeypatch):
  (code,) = python_blocks(README.read_text())
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's model_dir lands here
  namespace = {"__name__": "readme_example"}
  exec(compile(code, str(README), "exec"), namespace)  # pylint: disable=exec-used
  tau = namespace["tau"]
  assert isinstance(tau, float) and math.isfinite(tau)
  # A round yields between 1 and gamma + 1 tokens, so tau lies in [1, gamma + 1].
  assert 1.0 <= tau <= 6.0
  assert namespace["result"].tokens.shape == (16, 8)
  assert any(tmp_path.iterdir()), "the example's distillation wrote no checkpoint directory"
