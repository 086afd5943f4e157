"""One process of tests/test_eval_multihost.py's main-job test: the shortened main job
(testing.PIPELINE) on a (4, 2) mesh, its vocab, target and raw draft already in RUN_DIR.

  python tests/pipeline_multihost_worker.py RUN_DIR SETTINGS_JSON [--coordinator_address=...
      --process_count=2 --process_index=I]

The multi-host flags go through `multihost.initialize_from_flags`, the binaries' parser.
Without them it is the one-process reference (run it with 8 CPU devices). Prints one line
`RESULT {json}`: testing.pipeline_outcome of the finished run and this process's index.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def main(argv):
  """Runs the job; the timing process (spawned, it re-imports this file) must not."""
  from distillspec_jax.training import multihost
  rest = multihost.initialize_from_flags(argv)
  import jax
  from compilation import set_fast_compilation
  # Tiny programs: compiling them costs more than running them (compilation.py). Every run
  # the test compares is compiled the same way.
  set_fast_compilation(True)
  import testing
  from distillspec_jax.studies.pipeline import run_pipeline
  run_dir, settings = rest[0], json.loads(rest[1])
  for name in ("temperatures", "gammas", "recipes"):
    settings[name] = tuple(settings[name])
  config = testing.pipeline_config(run_dir, data_parallel=4, model_parallel=2, **settings)
  outcome = run_pipeline(config)
  result = dict(testing.pipeline_outcome(config), process=jax.process_index(),
                processes=jax.process_count(),
                ran=sorted(s for s, v in outcome.items() if v == "ran"))
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
