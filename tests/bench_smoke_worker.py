"""Several bench scripts' `--smoke` runs in one process (tests/test_bench_smoke.py): one
interpreter start and one import of JAX and the package for all of them, instead of one each.

  python tests/bench_smoke_worker.py '[["latency.py", ["--smoke", "--out=..."]], ...]'

Each script is loaded from bench/ as `python bench/<script>` would load it (bench/ on
sys.path, `sys.argv` set) and its `main(argv)` called, with gin's configuration cleared
before it. A script that raises or exits non-zero does not stop the others. Prints
`BENCH_BEGIN <script>` before each script's own output and `BENCH_END {json}` after it:
the script, its exit code (0, the code it exited with, or 1 for an exception) and the
traceback of an exception.
"""

import importlib.util
import json
import os
import sys
import traceback

from collector import freeze_long_lived

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _exit_code(value) -> int:
  """What `sys.exit(value)` would exit with (None: 0; a message: 1)."""
  if value is None or isinstance(value, int):
    return value or 0
  return 1


def run_script(script: str, argv: list) -> dict:
  """`python bench/<script> *argv`, in this process: {"script", "code", "traceback"}."""
  import gin
  gin.clear_config()
  path = os.path.join(BENCH, script)
  sys.argv = [path, *argv]
  name = os.path.splitext(script)[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # a later script importing it as a helper gets this one
  error = None
  try:
    spec.loader.exec_module(module)
    returned = module.main(argv)
    # `sys.exit(main())` scripts exit with what main returns; `main()` ones with 0.
    code = _exit_code(returned) if isinstance(returned, int) else 0
  except SystemExit as done:
    code = _exit_code(done.code)
  except Exception:  # pylint: disable=broad-except  (reported; the next script still runs)
    code, error = 1, traceback.format_exc()
  return {"script": script, "code": code, "traceback": error}


def main(runs: list) -> None:
  # One stream, in order: each script's errors between its markers.
  sys.stdout.reconfigure(line_buffering=True)
  os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
  sys.path[:0] = [BENCH, ROOT]
  for script, argv in runs:
    freeze_long_lived()  # what the scripts before imported (collector.py)
    print(f"BENCH_BEGIN {script}", flush=True)
    result = run_script(script, argv)
    sys.stderr.flush()
    print("\nBENCH_END " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
