"""One process of tests/test_eval_multihost.py: the eval binary's `main`, recording the rows of
each evaluation batch this process hands to the decoders.

  python tests/eval_multihost_worker.py ROWS_JSON [eval binary flags] [--coordinator_address=...
      --process_count=2 --process_index=I]

The eval binary's own flags and parsing (`eval.main`: the multi-host flags first, then gin);
the only addition is a wrapper around `BatchPlacement.put` that appends [first row, last row
+ 1, batch rows] of every call to ROWS_JSON (one file per process).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  (the backend starts later, in eval.main's initialize)
from compilation import set_fast_compilation  # noqa: E402

# Tiny programs: compiling them costs more than running them (compilation.py). Every run the
# test compares is compiled the same way.
set_fast_compilation(True)

from distillspec_jax import eval as eval_lib  # noqa: E402
from distillspec_jax.evaluation import placement  # noqa: E402

ROWS_PATH = sys.argv[1]
_put = placement.BatchPlacement.put
_seen = []


def _recording_put(self, array):
  rows = self.rows
  _seen.append([rows.start, rows.stop, int(len(array))])
  with open(ROWS_PATH, "w") as f:
    json.dump(_seen, f)
  return _put(self, array)


placement.BatchPlacement.put = _recording_put

if __name__ == "__main__":
  code = eval_lib.main(sys.argv[2:])
  print(f"WORKER_OK process {jax.process_index()} of {jax.process_count()}", flush=True)
  sys.exit(code)
