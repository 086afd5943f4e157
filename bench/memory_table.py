"""Per-device memory of the paper's distillation step on TPU v4 meshes (issue 16, item 5).

  nice -n 10 python bench/memory_table.py --out /tmp/memory_table.json --proxy_data 2
  python bench/memory_table.py --pairs xl --slices v4-8 --method eval_shape ...   # quick
  python bench/memory_table.py --merge a.json b.json --out all.json   # one table of runs

For each (target, draft) pair, TPU slice and (data, model) mesh candidate, it builds the
trainer's real jitted distillation step (`trainer.make_train_step`: the DistillSpec objective
of `--recipe`, the paper's Adafactor optimizer from `TrainConfig`'s defaults, shardings from
`partitioning`'s logical-axis rules, the state donated) and reports bytes per device of:

  params     the draft's parameters (trained; fp32), from their shardings' shard shapes;
  optimizer  the draft's Adafactor state (the frozen target has none), likewise;
  target     the frozen target's parameters (fp32), likewise;
  batch      the step's input batch [batch, length] (int32 tokens, fp32 weights), likewise;
  temp       activations and every other temporary of the step (gradients, logits, the
             on-policy sampler's cache): XLA's `memory_analysis().temp_size_in_bytes` of the
             step compiled for the mesh (method "compile"), or nothing (method
             "eval_shape": only the exact arguments are counted);
  peak       arguments + outputs - donated (aliased) + temp: the compiled program's
             per-device live bytes as XLA accounts them.

No weights are materialised: parameters are `jax.ShapeDtypeStruct`s (`Model.param_shapes`, an
`eval_shape` of the init) carrying their shardings, and the step is lowered on them. The
devices are simulated CPU devices (the script sets
`XLA_FLAGS=--xla_force_host_platform_device_count=16` before JAX starts): a v4 chip is one
JAX device (megacore), so v4-8 = 4 devices and v4-32 = 16. The CPU compiler's buffer
assignment is not the TPU's (no TPU fusion or memory-aware scheduling), so `temp` is XLA's
CPU figure for the same partitioned program, an estimate of the TPU's; the argument bytes are
exact for any backend. It also checks that XLA's argument bytes equal the sum of the parts.
`--dtype bfloat16` compiles, but the CPU backend computes bf16 in f32 with added converts, so
its temp comes out larger than fp32's: CPU figures cannot show bf16's saving on TPU.

`--proxy_data 2` compiles a mesh (d, m) as (2, m) at batch 2 * batch / d (`proxy_mesh`): the
same per-device shapes on far fewer simulated devices. Checked once: T5 1.1 XL / Small on
(16, 1) compiled for 16 devices (596 s) and as the (2, 1) proxy at batch 4 (111 s) gave the
same argument, output and alias bytes and temp bytes 576 bytes apart (of 11.2 GB).

Writes JSON ({"rows": [...], "settings": {...}}) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

DEVICES = 16
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distillspec_jax.distill import objectives as distillation
from distillspec_jax.core import files
from distillspec_jax.training import partitioning
from distillspec_jax.training import trainer
from distillspec_jax.models.model import Model  # noqa: E402

GIB = 2 ** 30
HBM_PER_CHIP_GIB = 32  # TPU v4: 32 GiB of HBM per chip (one JAX device per chip)
SLICES = {"v4-8": 4, "v4-32": 16}  # chips = JAX devices
# (data, model) candidates per slice: all data (plain data parallelism), then growing model
# axes; the rules split vocab (32128), mlp and heads over 'model' where the axis divides them
# (T5 1.1 Small's 6 heads stay whole on a model axis of 4 or 8).
CANDIDATES = {"v4-8": ((4, 1), (2, 2), (1, 4)), "v4-32": ((16, 1), (8, 2), (4, 4), (2, 8))}
PAIRS = {"xl": ("t5_1_1_xl", "t5_1_1_small"), "xxl": ("t5_1_1_xxl", "t5_1_1_small")}
# The paper's batch and the longest of its task lengths (gin/runs/paper_cnn_dailymail.gin:
# inputs 2048, targets 256): per-device activations only shrink for the other tasks.
BATCH_SIZE = 32
LENGTHS = {"inputs": 2048, "targets": 256}


def local_bytes(tree) -> int:
  """Bytes one device holds of a tree of `ShapeDtypeStruct`s with shardings: each leaf's
  `sharding.shard_shape` (the largest shard; the rules only split evenly) times its itemsize."""
  return int(sum(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64) * x.dtype.itemsize
                 for x in jax.tree.leaves(tree)))


def abstract(shapes, shardings):
  """`ShapeDtypeStruct`s with shardings: the inputs the step is lowered on (no allocation)."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def abstract_batch(mesh, batch_size: int, lengths: dict, encoder_decoder: bool = True) -> dict:
  """The T5X features of one global batch: [batch_size, length], rows over 'data'."""
  sharding = partitioning.batch_sharding(mesh)
  spec = lambda length, dtype: jax.ShapeDtypeStruct((batch_size, length), dtype,
                                                    sharding=sharding)
  batch = {"decoder_input_tokens": spec(lengths["targets"], jnp.int32),
           "decoder_target_tokens": spec(lengths["targets"], jnp.int32),
           "decoder_loss_weights": spec(lengths["targets"], jnp.float32)}
  if encoder_decoder:
    batch["encoder_input_tokens"] = spec(lengths["inputs"], jnp.int32)
  return batch


def step_inputs(target: Model, draft: Model, recipe: str, mesh, batch_size: int,
                lengths: dict):
  """(step_fn, abstract (state, batch, rng, frozen), parts) of the trainer's distillation step.

  parts: {"params", "optimizer", "target", "batch"} trees of sharded ShapeDtypeStructs.
  """
  partitioning.check_batch_size(batch_size, mesh)
  config = trainer.TrainConfig(model_dir="unused", train_steps=1, batch_size=batch_size)
  objective = distillation.DistillationObjective(
      target, draft, distillation.DistillationConfig.from_recipe(
          recipe, max_new_tokens=lengths["targets"]))  # as pipeline.distillation_config
  step_fn, state_shardings, frozen_shardings = trainer.make_train_step(
      objective, config.optimizer_spec, mesh)
  params = abstract(draft.param_shapes(), state_shardings.params)
  opt_state = abstract(jax.eval_shape(config.optimizer_spec.make().init, draft.param_shapes()),
                       state_shardings.opt_state)
  frozen = {"target": abstract(target.param_shapes(), frozen_shardings["target"])}
  batch = abstract_batch(mesh, batch_size, lengths, draft.is_encoder_decoder)
  replicated = partitioning.replicated(mesh)
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
  state = trainer.TrainState(step=step, params=params, opt_state=opt_state)
  parts = {"params": params, "optimizer": opt_state, "target": frozen["target"],
           "batch": batch, "other": (step, rng)}
  return step_fn, (state, batch, rng, frozen), parts


def proxy_mesh(mesh_shape, batch_size: int, proxy_data: int):
  """(proxy mesh shape, proxy batch) with the same per-device shapes as `mesh_shape` at
  `batch_size`: the model axis is kept (same parameter shards), the data axis shrinks to
  `proxy_data` and the batch with it (same rows per device). Every per-device array of the
  step then has the same shape; only the data-axis collectives span fewer devices. Compiling
  for 16 simulated devices takes ~10 min on 2 loaded cores, for 2-4 devices 1-3 min."""
  data, model = mesh_shape
  if proxy_data >= data or data % proxy_data:
    return tuple(mesh_shape), batch_size
  return (proxy_data, model), batch_size * proxy_data // data


def measure(target_name: str, draft_name: str, mesh_shape, devices: int, *, recipe: str,
            batch_size: int, lengths: dict, method: str, overrides=None,
            proxy_data: Optional[int] = None) -> dict:
  """One row: per-device bytes of each part (and XLA's figures when method == "compile").

  proxy_data: compile on `proxy_mesh(mesh_shape, batch_size, proxy_data)` instead (the
  arguments are still counted on the real mesh and must agree)."""
  overrides = overrides or {}
  target = Model.from_name(target_name, **overrides)
  draft = Model.from_name(draft_name, **overrides)
  mesh = partitioning.make_mesh(*mesh_shape, devices=jax.devices()[:devices])
  step_fn, inputs, parts = step_inputs(target, draft, recipe, mesh, batch_size, lengths)
  compiled_on = None
  if proxy_data and method == "compile":
    shape, batch = proxy_mesh(mesh_shape, batch_size, proxy_data)
    if shape != tuple(mesh_shape):
      compiled_on = {"mesh": list(shape), "batch_size": batch}
      proxy = partitioning.make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
      step_fn, inputs, proxy_parts = step_inputs(target, draft, recipe, proxy, batch, lengths)
      same = {k: local_bytes(v) for k, v in proxy_parts.items()} == {
          k: local_bytes(v) for k, v in parts.items()}
      assert same, ("the proxy mesh's per-device arguments differ", shape, mesh_shape)
  row = {"target": target_name, "draft": draft_name, "devices": devices,
         "mesh": list(mesh_shape), "recipe": recipe, "batch_size": batch_size,
         "lengths": dict(lengths), "method": method, "dtype": target.config.dtype,
         "target_params": target.num_params(), "draft_params": draft.num_params()}
  row.update({f"{name}_bytes": local_bytes(tree) for name, tree in parts.items()})
  arguments = sum(row[f"{name}_bytes"] for name in parts)
  row["arguments_bytes"] = arguments
  if method == "compile" and arguments >= HBM_PER_CHIP_GIB * GIB:
    method = row["method"] = "eval_shape (arguments alone exceed HBM: not compiled)"
  if method == "compile":
    start = time.perf_counter()
    compiled = step_fn.lower(*inputs).compile()
    row["compile_s"] = round(time.perf_counter() - start, 1)
    if compiled_on:
      row["method"] = (f"compile on proxy mesh {tuple(compiled_on['mesh'])}, batch "
                       f"{compiled_on['batch_size']} (same per-device shapes)")
      row["compiled_on"] = compiled_on
    stats = compiled.memory_analysis()
    # jit drops inputs the step never reads (keep_unused=False; e.g. GKD's on-policy step
    # reads only the shape of decoder_target_tokens): XLA's argument bytes omit them.
    kept = getattr(compiled._executable, "_kept_var_idx", None)  # private: None if absent
    leaves = jax.tree_util.tree_flatten_with_path(inputs)[0]
    unused = [] if kept is None else [(jax.tree_util.keystr(p), x) for i, (p, x) in
                                      enumerate(leaves) if i not in kept]
    row["unused_inputs"] = [name for name, _ in unused]
    unused_bytes = local_bytes([x for _, x in unused])
    row.update(xla_argument_bytes=int(stats.argument_size_in_bytes),
               xla_output_bytes=int(stats.output_size_in_bytes),
               xla_alias_bytes=int(stats.alias_size_in_bytes),
               temp_bytes=int(stats.temp_size_in_bytes))
    row["peak_bytes"] = (row["xla_argument_bytes"] + row["xla_output_bytes"]
                         - row["xla_alias_bytes"] + row["temp_bytes"])
    # The compiled program's arguments are exactly the parts counted above (less unused ones).
    row["arguments_match_xla"] = row["xla_argument_bytes"] == arguments - unused_bytes
  else:
    row["temp_bytes"] = None
    row["peak_bytes"] = None
  # Without a compile only the arguments are known: too much already, or unknown (None).
  if row["peak_bytes"] is not None:
    row["fits_v4_hbm"] = bool(row["peak_bytes"] < HBM_PER_CHIP_GIB * GIB)
  else:
    row["fits_v4_hbm"] = False if arguments >= HBM_PER_CHIP_GIB * GIB else None
  return row


FITS = {True: "yes", False: "**no**", None: "? (activations not counted)"}


def _gib(value) -> str:
  return "n/a" if value is None else f"{value / GIB:.3f}"


def markdown(rows) -> str:
  lines = ["| pair | activations | slice | mesh (data, model) | draft params | optimizer | "
           "target | batch | temp (activations, grads) | peak | fits 32 GiB | method |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  slice_of = {n: s for s, n in SLICES.items()}
  for r in rows:
    pair = f"{r['target'].replace('t5_1_1_', 'T5 1.1 ').upper()} / {r['draft'].replace('t5_1_1_', '').capitalize()}"
    lines.append(
        f"| {pair} | {r['dtype']} | {slice_of.get(r['devices'], r['devices'])} | ({r['mesh'][0]}, "
        f"{r['mesh'][1]}) | {_gib(r['params_bytes'])} | {_gib(r['optimizer_bytes'])} | "
        f"{_gib(r['target_bytes'])} | {_gib(r['batch_bytes'])} | {_gib(r['temp_bytes'])} | "
        f"{_gib(r['peak_bytes'])} | {FITS[r['fits_v4_hbm']]} | "
        f"{r['method']} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write (rewritten per row)")
  parser.add_argument("--pairs", default="xl,xxl", help=f"comma list of {sorted(PAIRS)}")
  parser.add_argument("--slices", default="v4-8,v4-32", help=f"comma list of {sorted(SLICES)}")
  parser.add_argument("--meshes", default=None,
                      help="override the candidates: e.g. '2x2,1x4' (data x model)")
  parser.add_argument("--recipe", default="gkd", choices=sorted(distillation.RECIPES))
  parser.add_argument("--method", default="compile", choices=("compile", "eval_shape"))
  parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
  parser.add_argument("--inputs_length", type=int, default=LENGTHS["inputs"])
  parser.add_argument("--targets_length", type=int, default=LENGTHS["targets"])
  parser.add_argument("--dtype", default=None, help="activation dtype override (bfloat16)")
  parser.add_argument("--proxy_data", type=int, default=None,
                      help="compile each mesh (d, m) as (proxy_data, m) at batch "
                           "batch * proxy_data / d: the same per-device shapes, far fewer "
                           "simulated devices (see proxy_mesh)")
  parser.add_argument("--merge", nargs="+", default=None,
                      help="JSON files of earlier runs: write their rows to --out as one table "
                           "and print it (nothing is compiled)")
  args = parser.parse_args(argv)
  if args.merge:
    runs = [files.read_json(path) for path in args.merge]
    rows = [row for run in runs for row in run["rows"]]
    files.write_json_atomic(args.out, {"rows": rows, "settings": [r["settings"] for r in runs]})
    print(markdown(rows))
    return rows
  pairs = [p for p in args.pairs.split(",") if p]
  slices = [s for s in args.slices.split(",") if s]
  for name, known, flag in ((pairs, PAIRS, "--pairs"), (slices, SLICES, "--slices")):
    unknown = [n for n in name if n not in known]
    if unknown:
      parser.error(f"{flag}: unknown {unknown}; use a comma list of {sorted(known)}.")
  meshes = None
  if args.meshes:
    try:
      meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    except ValueError:
      parser.error(f"--meshes={args.meshes!r}: use e.g. '2x2,1x4' (data x model).")
  if jax.device_count() < max(SLICES[s] for s in slices):
    parser.error(f"{jax.device_count()} devices; set XLA_FLAGS="
                 f"--xla_force_host_platform_device_count={DEVICES} (or leave XLA_FLAGS unset).")
  lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
  overrides = {"dtype": args.dtype} if args.dtype else {}
  rows = []
  settings = dict(recipe=args.recipe, batch_size=args.batch_size, lengths=lengths,
                  method=args.method, optimizer="adafactor (TrainConfig defaults: paper)",
                  dtype=args.dtype or "model preset (float32)", xla_flags=os.environ["XLA_FLAGS"],
                  jax=jax.__version__, backend=jax.default_backend())
  for pair in pairs:
    for slice_name in slices:
      for shape in meshes or CANDIDATES[slice_name]:
        if int(np.prod(shape)) != SLICES[slice_name]:
          continue
        row = measure(*PAIRS[pair], shape, SLICES[slice_name], recipe=args.recipe,
                      batch_size=args.batch_size, lengths=lengths, method=args.method,
                      overrides=overrides, proxy_data=args.proxy_data)
        row["slice"] = slice_name
        rows.append(row)
        print(f"{pair} {slice_name} {shape}: peak {_gib(row['peak_bytes'])} GiB, arguments "
              f"{_gib(row['arguments_bytes'])} GiB, compile {row.get('compile_s')} s",
              flush=True)
        files.write_json_atomic(args.out, {"rows": rows, "settings": settings})
  print(f"batch {args.batch_size}, lengths {lengths}, recipe {args.recipe}, activations "
        f"{settings['dtype']}, GiB per device:")
  print(markdown(rows))
  return rows


if __name__ == "__main__":
  main()
