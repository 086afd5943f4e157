"""A process of tests/test_pipeline_mesh.py's multi-device arms: the shortened main job
(testing.PIPELINE) on a (4, 2) mesh, its first stages already in RUN_DIR (the job runs the
others).

  python tests/pipeline_multihost_worker.py RUN_DIR SETTINGS_JSON [--coordinator_address=...
      --process_count=2 --process_index=I]

The multi-host flags go through `multihost.initialize_from_flags`, the binaries' parser.
Without them it is the one-process 8-device arm (run it with 8 CPU devices). Prints one line
`RESULT {json}`: testing.pipeline_outcome of the finished run, this process's index and the
evaluation examples it read (`reads`).
With WORKER_KILL_AT=<stage> in the environment, process 1 kills itself (SIGKILL) as that
stage starts.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _record_reads() -> list:
  """Wraps the data layer's reader of evaluation examples in this process (not in the timing
  process it spawns); the returned list gets [num_examples, the split positions read (None:
  all)] of every call."""
  from distillspec_jax.data import batches
  read, reads = batches.get_prompts_and_targets, []

  def recording(*args, **kwargs):
    examples = read(*args, **kwargs)
    reads.append([kwargs.get("num_examples"), None if kwargs.get("rows") is None
                  else examples.positions.tolist()])
    return examples

  batches.get_prompts_and_targets = recording
  return reads


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
  from collector import freeze_long_lived
  from distillspec_jax.studies.pipeline import run_pipeline
  freeze_long_lived()  # the imports are done (collector.py)
  run_dir, settings = rest[0], json.loads(rest[1])
  for name in ("recipes", "teacher_cache_recipes"):
    if name in settings:
      settings[name] = tuple(settings[name])
  config = testing.pipeline_config(run_dir, mesh=(4, 2), **settings)
  stage_fns = None
  kill_at = os.environ.get("WORKER_KILL_AT")
  if kill_at and jax.process_index() == 1:  # tests/test_killed_process.py
    from distillspec_jax.studies.pipeline import default_stage_functions
    stage_fns = default_stage_functions()
    stage_fns[kill_at] = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
  reads = _record_reads()
  outcome = run_pipeline(config, stage_fns=stage_fns)
  result = dict(testing.pipeline_outcome(config), process=jax.process_index(),
                processes=jax.process_count(), reads=reads,
                ran=sorted(s for s, v in outcome.items() if v == "ran"))
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
