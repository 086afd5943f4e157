"""One process of tests/test_multihost.py: a few distillation steps of the tiny pair.

  python tests/multihost_worker.py OUT_DIR MODEL_DIR STEPS [--coordinator_address=... \
      --process_count=2 --process_index=I]
  python tests/multihost_worker.py kill --coordinator_address=... ...   (the kill test)

Without the multi-host flags it is the single-process reference (run it with 8 CPU devices).
The flags go through `multihost.initialize_from_flags`, the binaries' parser. The data source
records which rows this process asked for; the global batches are fixed arrays, so every
process (and the reference) sees the same global batch at each step. Writes OUT_DIR/<index>.npz
(losses, gathered final params) and OUT_DIR/rows_<index>.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.training import multihost

REST = multihost.initialize_from_flags(sys.argv[1:])

import jax  # noqa: E402
from collector import freeze_long_lived  # noqa: E402
from compilation import set_fast_compilation  # noqa: E402

# Tiny programs: compiling them costs more than running them (compilation.py). Every run this
# script compares is compiled the same way.
set_fast_compilation(True)
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from distillspec_jax.distill import objectives
from distillspec_jax.training import partitioning
from distillspec_jax.training import trainer
import testing  # noqa: E402  (tests/testing.py: the tiny pair)

BATCH = 8


class RecordingData:
  """Indexed global batches of the synthetic task; remembers the rows each call read."""

  def __init__(self, path):
    self.source = trainer.SyntheticData(BATCH, vocab_size=64, seed=3)
    self.path, self.rows = path, []

  def local_batch_at(self, step, shard):
    self.rows.append([step, shard.rows.start, shard.rows.stop])
    with open(self.path, "w") as f:
      json.dump(self.rows, f)
    return {k: v[shard.rows] for k, v in self.source.batch_at(step).items()}

  def batch_at(self, step):
    raise AssertionError("the trainer read the whole global batch")


def collective_until_killed():
  """Both processes run a cross-process reduction in a loop; process 1 kills itself (SIGKILL)
  after the first one. The survivor must end with an error, not hang."""
  import signal
  import time
  import jax.numpy as jnp
  mesh = partitioning.make_mesh(data=4, model=2)
  shard = multihost.data_shard(mesh, BATCH)
  total = jax.jit(jnp.sum, out_shardings=partitioning.replicated(mesh))
  x = multihost.global_batch({"x": np.ones((shard.local_batch_size, 3), np.float32)}, mesh,
                             shard)["x"]
  # One write per line: the output is one pipe shared with the C++ runtime's logging threads,
  # and print's separate writes of its pieces (unbuffered) let their lines fall in between.
  sys.stdout.write(f"SUM {float(total(x))}\n")
  sys.stdout.flush()
  multihost.barrier("before_kill")
  if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  # The survivor ends one of two ways, whichever comes first (it depends on the machine's
  # load): jax.distributed's heartbeat check aborts the process with its fatal error ("...
  # another task died ..."), or the collective in flight fails in Python (gloo: "Connection
  # closed by peer"). The second is printed as one SURVIVOR_ERROR line and the process exits
  # at once (os._exit: the atexit jax.distributed shutdown would wait for the dead peer).
  try:
    for _ in range(3000):  # ~10 minutes if nothing stopped it
      float(total(x))
      time.sleep(0.2)
  except Exception as error:  # noqa: BLE001 -- any failure of the collective is the result
    first = (str(error).strip().splitlines() or [""])[0][:500]
    sys.stdout.write(f"SURVIVOR_ERROR {type(error).__name__}: {first}\n")
    sys.stdout.flush()
    os._exit(3)
  print("SURVIVOR_NEVER_STOPPED", flush=True)


def main():
  if REST[0] == "kill":
    return collective_until_killed()
  out_dir, model_dir, steps = REST[0], REST[1], int(REST[2])
  index = jax.process_index()
  target, draft = testing.tiny_pair(vocab_size=64)
  mesh = partitioning.make_mesh(data=4, model=2)
  config = trainer.TrainConfig(
      model_dir=model_dir, train_steps=steps, batch_size=BATCH, optimizer="adafactor",
      learning_rate=1e-2, warmup_steps=0, decay_steps=10, save_every=steps, keep_checkpoints=1,
      log_every=1, progress_bar=False,
      mesh=partitioning.MeshConfig(data_parallel=4, model_parallel=2))
  target_params = jax.jit(target.init, out_shardings=partitioning.param_shardings(
      target, mesh))(jax.random.PRNGKey(1))
  data = RecordingData(os.path.join(out_dir, f"rows_{index}.json"))
  result = trainer.distill(config, target, target_params, draft, data,
                           objectives.DistillationConfig(lambda1=1.0, lambda2=0.5), mesh=mesh)
  losses = [r["loss"] for r in result.history if "loss" in r]
  kernel = result.state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  params = multihost_utils.process_allgather(result.state.params, tiled=True)
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  np.savez(os.path.join(out_dir, f"{index}.npz"), losses=np.asarray(losses),
           process_count=jax.process_count(), **{"param:" + k: v for k, v in flat.items()})
  print("WORKER_OK", index, jax.process_count(), kernel.sharding.spec, losses, flush=True)


if __name__ == "__main__":
  freeze_long_lived()  # the imports are done (collector.py)
  main()
