"""bench/memory_table.py's accounting: the per-device bytes it derives from abstract, sharded
ShapeDtypeStructs (no arrays) equal the bytes that device 0 really holds when arrays of the
same shapes are placed with the trainer's shardings (`trainer.make_train_step`). In a subprocess,
because the script sets XLA_FLAGS (16 simulated CPU devices) before JAX starts."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.integration

CHECK = r"""
import json, sys
sys.path.insert(0, "bench")
import memory_table as mt  # sets XLA_FLAGS before JAX starts
import jax
import numpy as np
from distillspec_jax.distill import objectives
from distillspec_jax.training import partitioning
from distillspec_jax.training import trainer
from distillspec_jax.models.model import Model

target = Model.from_name("tiny_encoder_decoder", vocab_size=64)
draft = Model.from_name("demo_draft", vocab_size=64)
optimizer = trainer.TrainConfig(model_dir="unused", train_steps=1).optimizer_spec.make()
out = {}
for shape in ((4, 2), (2, 4)):
  row = mt.measure("tiny_encoder_decoder", "demo_draft", shape, 8, recipe="gkd",
                   batch_size=8, lengths={"inputs": 8, "targets": 8}, method="eval_shape",
                   overrides={"vocab_size": 64})
  mesh = partitioning.make_mesh(*shape, devices=jax.devices()[:8])
  _, state_sh, frozen_sh = trainer.make_train_step(
      objectives.DistillationObjective(
          target, draft, objectives.DistillationConfig(max_new_tokens=8)),
      trainer.TrainConfig(model_dir="unused", train_steps=1).optimizer_spec, mesh)
  # Real arrays (zeros; no compile) placed with the trainer's shardings.
  put = lambda shapes, shardings: jax.tree.map(
      lambda s, sh: jax.device_put(np.zeros(s.shape, s.dtype), sh), shapes, shardings)
  params = put(draft.param_shapes(), state_sh.params)
  opt_state = put(jax.eval_shape(optimizer.init, draft.param_shapes()), state_sh.opt_state)
  target_params = put(target.param_shapes(), frozen_sh["target"])
  first = mesh.devices.flat[0]
  held = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                          for s in x.addressable_shards if s.device == first)
  full = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  out[str(shape)] = dict(row=row, params=held(params), optimizer=held(opt_state),
                         target=held(target_params), params_full=full(params),
                         target_full=full(target_params),
                         opt_leaves=len(jax.tree.leaves(opt_state)),
                         draft_opt_leaves=len(jax.tree.leaves(
                             jax.eval_shape(optimizer.init, draft.param_shapes()))))
print("RESULT " + json.dumps(out))
"""


def test_per_device_bytes_equal_the_shards_device_zero_holds():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  run = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-4000:]
  result = json.loads(run.stdout.split("RESULT ", 1)[1])
  for shape, got in result.items():
    row = got["row"]
    assert row["params_bytes"] == got["params"], shape
    assert row["optimizer_bytes"] == got["optimizer"], shape
    assert row["target_bytes"] == got["target"], shape
    # A model axis of size 2 or 4 splits the wide weights: a device holds less than the whole.
    assert row["params_bytes"] < got["params_full"] and row["target_bytes"] < got["target_full"]
    # The optimizer state is the draft's alone (the frozen target has none).
    assert got["opt_leaves"] == got["draft_opt_leaves"]
    # Batch: 8 rows over the data axis; int32 tokens and fp32 weights, 3 + 1 features of 8.
    data = int(shape.strip("()").split(",")[0])
    assert row["batch_bytes"] == 8 // data * 8 * 4 * 4, shape
    assert row["arguments_bytes"] == sum(row[f"{k}_bytes"] for k in
                                         ("params", "optimizer", "target", "batch", "other"))
    # eval_shape counts the arguments only: whether the step fits is not known from them.
    assert row["peak_bytes"] is None and row["fits_v4_hbm"] is None
