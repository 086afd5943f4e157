"""JSON files written atomically (a temporary file, then a rename), and read back.

Every stage marker, evaluation result and report goes through `write_json_atomic`, so a crash
never leaves half a file where the next stage (or a resumed run) reads one.
"""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, payload: Any) -> None:
  """Writes `payload` as JSON to `path` through `path.tmp-<pid>` and a rename."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())  # the rename must not reach the disk before the data
  os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through `path.tmp-<pid>` and a rename."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)
