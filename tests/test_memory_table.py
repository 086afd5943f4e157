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


FAMILIES_JSON = os.path.join(ROOT, "docs", "scale_out", "memory_families.json")


def test_the_committed_family_table_has_both_pairs_on_both_slices_blocked_and_not():
  """docs/scale_out.md's Qwen3 / Gemma 3 rows: each pair on a v5e-8 and a v4-8 at 2,048
  tokens, the distillation step with and without the blocked loss, arguments exact."""
  with open(FAMILIES_JSON) as f:
    rows = json.load(f)["rows"]
  want = {(pair, slice_name, block) for pair in ("qwen3", "gemma3")
          for slice_name in ("v5e-8", "v4-8") for block in ("none", "blocked")}
  got = set()
  for row in rows:
    assert row["length"] == 2048 and row["temp_is_estimate"]
    assert row["arguments_bytes"] == sum(row[f"{k}_bytes"] for k in
                                         ("params", "optimizer", "frozen", "batch", "other")
                                         if f"{k}_bytes" in row)
    if row.get("xla_argument_bytes") is not None:  # compiled: XLA's count is ours less the
      unused = row["arguments_bytes"] - row["xla_argument_bytes"]  # inputs jit drops unread
      assert 0 <= unused <= row["batch_bytes"] + row.get("other_bytes", 0), row["stage"]
    if row["stage"] == "distill":
      got.add((row["pair"], row["slice"],
               "none" if row["loss_block_size"] is None else "blocked"))
  assert want <= got, sorted(want - got)
  assert {r["target"] for r in rows} == {"qwen3_8b", "gemma3_12b"}


@pytest.mark.integration
def test_family_grid_smoke_compiles_both_loss_settings(tmp_path):
  """--families --smoke on tiny Qwen3 presets: one row per loss setting, arguments counted
  from the shard shapes equal XLA's."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = tmp_path / "families.json"
  run = subprocess.run([sys.executable, "bench/memory_table.py", "--families", "--smoke",
                        "--pairs", "qwen3", "--slices", "v4-8", "--stages", "distill",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-4000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["loss_block_size"] for r in rows] == [None, 16]
  for row in rows:
    assert row["mesh"] == [2, 2] and row["chip"] == "TPU v4" and row["length"] == 64
    # jit drops the batch features the step never reads (decoder_input_tokens here).
    assert row["arguments_bytes"] - row["xla_argument_bytes"] in (0, 8 // 2 * 64 * 4)
    assert row["temp_bytes"] > 0 and row["peak_bytes"] > row["arguments_bytes"]
  assert "| tiny_qwen3 / tiny_qwen3 | v4-8 | (2, 2) | distill | none | none |" in run.stdout
