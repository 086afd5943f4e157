"""One process of tests/test_eval_multihost.py: the eval binary's `main`, recording the rows of
each evaluation batch this process hands to the decoders.

  python tests/eval_multihost_worker.py ROWS_JSON [eval binary flags] [--coordinator_address=...
      --process_count=2 --process_index=I]

The eval binary's own flags and parsing (`eval.main`: the multi-host flags first, then gin);
the only addition is a wrapper around `BatchPlacement.put` that appends [first row, last row
+ 1, batch rows] of every call to ROWS_JSON (one file per process), and around the data
layer's reader, which appends the split positions each call read (None: all) to
ROWS_JSON.read.json. With WORKER_KILL_AT=
first_batch in the environment, process 1 kills itself (SIGKILL) at its first batch. With
WORKER_ALSO_DATA_PARALLEL=DIR (one process), the same evaluation runs again on (all devices,
1) into DIR, its rows in ROWS_JSON.data_parallel.json; the bytes of the target that the first
device holds go to ROWS_JSON.held.json for each run. With WORKER_THEN='[ROWS_JSON_2, [eval
binary flags]]' (JSON; no multi-host flags: the processes stay as they are), a second
evaluation with those flags follows in the same processes, as `prepare` checks and `run`
runs one, recorded to ROWS_JSON_2 and its siblings.
"""

import dataclasses
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402
import jax  # noqa: E402  (the backend starts later, in eval.main's initialize)
from collector import freeze_long_lived  # noqa: E402
from compilation import set_fast_compilation  # noqa: E402

# Tiny programs: compiling them costs more than running them (compilation.py). Every run the
# test compares is compiled the same way.
set_fast_compilation(True)

from distillspec_jax import eval as eval_lib  # noqa: E402
from distillspec_jax.data import batches  # noqa: E402
from distillspec_jax.evaluation import placement  # noqa: E402
from distillspec_jax.training.partitioning import MeshConfig  # noqa: E402

ROWS_PATH = sys.argv[1]
HELD_PATH = ROWS_PATH + ".held.json"
# Process 1 kills itself (SIGKILL) as it hands over its first batch.
KILL_AT_FIRST_BATCH = os.environ.get("WORKER_KILL_AT") == "first_batch"
_put = placement.BatchPlacement.put
_seen = []


def _recording_put(self, array):
  if KILL_AT_FIRST_BATCH and jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # tests/test_killed_process.py
  rows = self.rows
  _seen.append([rows.start, rows.stop, int(len(array))])
  with open(ROWS_PATH, "w") as f:
    json.dump(_seen, f)
  return _put(self, array)


def _recording_load_pair(config, *args):
  """The binary's loader, recording the bytes of the target's parameters that this process's
  first device holds and the whole target's, per mesh, to ROWS_JSON's `.held.json`."""
  pair = _load_pair(config, *args)
  first = jax.local_devices()[0]
  leaves = jax.tree.leaves(pair[1])
  _held.append({"mesh": [config.mesh.data_parallel, config.mesh.model_parallel],
                "held": sum(s.data.nbytes for x in leaves for s in x.addressable_shards
                            if s.device == first),
                "whole": sum(x.nbytes for x in leaves)})
  with open(HELD_PATH, "w") as f:
    json.dump(_held, f)
  return pair


def _recording_read(*args, **kwargs):
  """The data layer's reader, recording the split positions each call read and tokenized
  (None: the whole split) to ROWS_JSON's `.read.json`."""
  examples = _read(*args, **kwargs)
  _reads.append(None if kwargs.get("rows") is None else examples.positions.tolist())
  with open(ROWS_PATH + ".read.json", "w") as f:
    json.dump(_reads, f)
  return examples


_load_pair, _held = eval_lib._load_pair, []
_read, _reads = batches.get_prompts_and_targets, []
placement.BatchPlacement.put = _recording_put
eval_lib._load_pair = _recording_load_pair
batches.get_prompts_and_targets = _recording_read

if __name__ == "__main__":
  freeze_long_lived()  # the imports are done (collector.py)
  config = eval_lib.prepare(sys.argv[2:])
  code = eval_lib.run(config)
  second = os.environ.get("WORKER_ALSO_DATA_PARALLEL")
  if second:  # the same evaluation again on (all devices, 1), written to that folder
    ROWS_PATH, _seen = ROWS_PATH + ".data_parallel.json", []
    eval_lib.evaluate(dataclasses.replace(config, model_dir=second,
                                          mesh=MeshConfig(jax.device_count(), 1)))
  then = os.environ.get("WORKER_THEN")
  if then and not code:  # another evaluation in these processes: prepare's checks, then run
    ROWS_PATH, flags = json.loads(then)
    HELD_PATH, _seen, _held, _reads = ROWS_PATH + ".held.json", [], [], []
    gin.clear_config()
    config = eval_lib.load_config(flags)
    config.mesh.make(jax.devices())
    config.check_inputs()
    code = eval_lib.run(config)
  print(f"WORKER_OK process {jax.process_index()} of {jax.process_count()}", flush=True)
  sys.exit(code)
