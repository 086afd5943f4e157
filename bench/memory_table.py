"""Per-device memory of the paper's distillation step on TPU v4 meshes (issue 16, item 5).

  nice -n 10 python bench/memory_table.py --out /tmp/memory_table.json --proxy_data 2
  python bench/memory_table.py --pairs xl --slices v4-8 --method eval_shape ...   # quick
  python bench/memory_table.py --merge a.json b.json --out all.json   # one table of runs
  python bench/memory_table.py --smoke --out /tmp/memory_table.json   # the smoke pair, seconds

The accounting and the compile are the library's dry run (`distillspec_jax/training/dry_run.py`,
what `--dry_run` on the binaries uses); this script is its grid over pairs, slices and meshes.
For each (target, draft) pair, TPU slice and (data, model) mesh candidate, it builds the
trainer's real jitted distillation step (`trainer.make_train_step`: the DistillSpec objective
of `--recipe`, the paper's Adafactor optimizer from `TrainConfig`'s defaults, shardings from
`partitioning`'s logical-axis rules, the state donated) and reports bytes per device of:

  params     the draft's parameters (trained; fp32), from their shardings' shard shapes;
  optimizer  the draft's Adafactor state (the frozen target has none), likewise;
  target     the frozen target's parameters (fp32, or bf16 with --target_param_dtype),
             likewise;
  batch      the step's input batch [batch, length] (int32 tokens, fp32 weights), likewise;
  temp       activations and every other temporary of the step (gradients, logits, the
             on-policy sampler's cache): XLA's `memory_analysis().temp_size_in_bytes` of the
             step compiled for the mesh (method "compile"), or nothing (method
             "eval_shape": only the exact arguments are counted);
  peak       arguments + outputs - donated (aliased) + temp: the compiled program's
             per-device live bytes as XLA accounts them.

No weights are materialised: parameters are `jax.ShapeDtypeStruct`s (`Model.param_shapes`, an
`eval_shape` of the init) carrying their shardings, and the step is lowered on them. The
devices are simulated CPU devices (the script sets `dry_run.simulation_xla_flags(32)` before
JAX starts: 32 devices and XLA:CPU's memory-optimised scheduler): a v4 chip is one JAX device
(megacore), so v4-8 = 4 devices, v4-32 = 16, v4-64 = 32. The CPU compiler's buffer
assignment is not the TPU's (no TPU fusion), so `temp` is XLA's CPU figure for the same
partitioned program, an estimate of the TPU's; the argument bytes are exact for any backend.
`--remat_policy full` rematerialises the models' layers (only the trained draft has a
backward pass); `--target_param_dtype bfloat16` halves the frozen target's bytes exactly.
It also checks that XLA's argument bytes equal the sum of the parts.
`--dtype bfloat16` compiles, but the CPU backend computes bf16 in f32 with added converts, so
its temp comes out larger than fp32's: CPU figures cannot show bf16's saving on TPU.

`--proxy_data 2` compiles a mesh (d, m) as (2, m) at batch 2 * batch / d (`proxy_shape`): the
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

DEVICES = 32  # the largest slice below (v4-64)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from distillspec_jax.training import dry_run  # noqa: E402  (imports jax; no backend yet)

# The dry run's simulation: 16 CPU devices and XLA:CPU's memory-optimised scheduler (without
# it the CPU compiler hoists rematerialised layers' recomputation and remat saves nothing).
os.environ["XLA_FLAGS"] = dry_run.simulation_xla_flags(DEVICES, os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from distillspec_jax.core import files  # noqa: E402
from distillspec_jax.distill import objectives  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training import partitioning  # noqa: E402
from distillspec_jax.training import trainer  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

GIB = dry_run.GIB
HBM_PER_CHIP_GIB = dry_run.CHIPS["v4"].hbm_gib  # TPU v4: 32 GiB per chip (one JAX device)
SLICES = {"v4-8": 4, "v4-32": 16, "v4-64": 32}  # chips = JAX devices
# (data, model) candidates per slice: all data (plain data parallelism), then growing model
# axes; the rules split vocab (32128), mlp and heads over 'model' where the axis divides them
# (T5 1.1 Small's 6 heads stay whole on a model axis of 4 or 8: the binaries refuse those
# meshes, partitioning.check_model_axis; they are measured here to show what they would give).
CANDIDATES = {"v4-8": ((4, 1), (2, 2), (1, 4)), "v4-32": ((16, 1), (8, 2), (4, 4), (2, 8)),
              "v4-64": ((32, 1), (16, 2), (8, 4))}
PAIRS = {"xl": ("t5_1_1_xl", "t5_1_1_small"), "xxl": ("t5_1_1_xxl", "t5_1_1_small"),
         "smoke": ("smoke_target", "demo_draft")}
# The paper's batch and the longest of its task lengths (gin/runs/paper_cnn_dailymail.gin:
# inputs 2048, targets 256): per-device activations only shrink for the other tasks.
BATCH_SIZE = 32
LENGTHS = {"inputs": 2048, "targets": 256}
local_bytes = dry_run.local_bytes  # the per-device accounting (training/dry_run.py)
# --smoke: the smoke pair compiled on v4-8's all-data mesh at batch 4 on short rows.
SMOKE = dict(pairs="smoke", slices="v4-8", meshes="4x1", batch_size=4, inputs_length=16,
             targets_length=8)


def step_program(target: Model, draft: Model, recipe: str, mesh, batch_size: int,
                 lengths: dict, target_param_dtype=None) -> dry_run.Program:
  """The trainer's distillation step of `recipe` with the paper's Adafactor (TrainConfig's
  defaults) on abstract sharded inputs (dry_run.train_step_program)."""
  config = trainer.TrainConfig(model_dir="unused", train_steps=1, batch_size=batch_size)
  objective = objectives.DistillationObjective(
      target, draft, objectives.DistillationConfig.from_recipe(
          recipe, max_new_tokens=lengths["targets"]))  # as pipeline.distillation_config
  return dry_run.train_step_program(objective, config.optimizer_spec, mesh, batch_size,
                                    lengths, frozen_param_dtype=target_param_dtype)


def _parts(program: dry_run.Program) -> dict:
  """The table's columns: the frozen target apart from the other frozen models (none)."""
  parts = dict(program.parts)
  frozen = parts.pop("frozen")
  return {"params": parts["params"], "optimizer": parts["optimizer"],
          "target": frozen["target"], "batch": parts["batch"], "other": parts["other"]}


def measure(target_name: str, draft_name: str, mesh_shape, devices: int, *, recipe: str,
            batch_size: int, lengths: dict, method: str, overrides=None,
            proxy_data: Optional[int] = None, target_param_dtype=None) -> dict:
  """One row: per-device bytes of each part (and XLA's figures when method == "compile").

  proxy_data: compile on `dry_run.proxy_shape(mesh_shape, batch_size, proxy_data)` instead
  (the arguments are still counted on the real mesh and must agree)."""
  overrides = overrides or {}
  target = Model.from_name(target_name, **overrides)
  draft = Model.from_name(draft_name, **overrides)
  mesh = partitioning.make_mesh(*mesh_shape, devices=jax.devices()[:devices])
  build = lambda on, batch: step_program(target, draft, recipe, on, batch, lengths,
                                         target_param_dtype)
  program = build(mesh, batch_size)
  compile_on, shape, batch = None, tuple(mesh_shape), batch_size
  if proxy_data and method == "compile":
    shape, batch = dry_run.proxy_shape(mesh_shape, batch_size, proxy_data)
    if shape != tuple(mesh_shape):
      compile_on = build(partitioning.make_mesh(
          *shape, devices=jax.devices()[:int(np.prod(shape))]), batch)
  row = {"target": target_name, "draft": draft_name, "devices": devices,
         "mesh": list(mesh_shape), "recipe": recipe, "batch_size": batch_size,
         "lengths": dict(lengths), "method": method, "dtype": target.config.dtype,
         "remat_policy": draft.config.remat_policy,
         "target_param_dtype": target_param_dtype or "float32",
         "target_params": target.num_params(), "draft_params": draft.num_params()}
  parts = _parts(program)
  row.update({f"{name}_bytes": local_bytes(tree) for name, tree in parts.items()})
  arguments = row["arguments_bytes"] = sum(row[f"{name}_bytes"] for name in parts)
  if method != "compile" or arguments >= HBM_PER_CHIP_GIB * GIB:
    if method == "compile":
      row["method"] = "eval_shape (arguments alone exceed HBM: not compiled)"
    row.update(temp_bytes=None, peak_bytes=None,
               fits_v4_hbm=False if arguments >= HBM_PER_CHIP_GIB * GIB else None)
    return row
  measured = dry_run.measure("distill", program, dry_run.CHIPS["v4"], mesh_shape=mesh_shape,
                             devices=devices, compile_on=compile_on, compiled_mesh=shape)
  row.update({k: measured[k] for k in ("compile_s", "xla_argument_bytes", "xla_output_bytes",
                                       "xla_alias_bytes", "temp_bytes", "peak_bytes", "flops")})
  if compile_on is not None:
    row["method"] = (f"compile on proxy mesh {shape}, batch {batch} (same per-device "
                     "shapes)")
    row["compiled_on"] = {"mesh": list(shape), "batch_size": batch}
  # jit drops inputs the step never reads (GKD's on-policy step reads only the shape of
  # decoder_target_tokens): XLA's argument bytes omit them.
  unused = arguments - row["xla_argument_bytes"]
  row["arguments_match_xla"] = unused in (0, local_bytes(
      program.parts["batch"]["decoder_target_tokens"]))
  row["fits_v4_hbm"] = bool(row["peak_bytes"] < HBM_PER_CHIP_GIB * GIB)
  return row


FITS = {True: "yes", False: "**no**", None: "? (activations not counted)"}


def _gib(value) -> str:
  return "n/a" if value is None else f"{value / GIB:.3f}"


def markdown(rows) -> str:
  lines = ["| pair | activations | draft remat | target params | slice | mesh (data, model) | "
           "draft params | optimizer | target | batch | temp (activations, grads) | peak | "
           "fits 32 GiB | method |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  slice_of = {n: s for s, n in SLICES.items()}
  for r in rows:
    pair = f"{r['target'].replace('t5_1_1_', 'T5 1.1 ').upper()} / {r['draft'].replace('t5_1_1_', '').capitalize()}"
    lines.append(
        f"| {pair} | {r['dtype']} | {r.get('remat_policy', 'none')} | "
        f"{r.get('target_param_dtype', 'float32')} | "
        f"{slice_of.get(r['devices'], r['devices'])} | ({r['mesh'][0]}, "
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
  parser.add_argument("--recipe", default="gkd", choices=sorted(objectives.RECIPES))
  parser.add_argument("--method", default="compile", choices=("compile", "eval_shape"))
  parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
  parser.add_argument("--inputs_length", type=int, default=LENGTHS["inputs"])
  parser.add_argument("--targets_length", type=int, default=LENGTHS["targets"])
  parser.add_argument("--dtype", default=None, help="activation dtype override (bfloat16)")
  parser.add_argument("--remat_policy", default="none", choices=("none", "minimal", "full"),
                      help="both models' remat_policy (only the draft's backward uses it)")
  parser.add_argument("--target_param_dtype", default=None, choices=("float32", "bfloat16"),
                      help="the frozen target's parameter dtype (default: float32)")
  parser.add_argument("--proxy_data", type=int, default=None,
                      help="compile each mesh (d, m) as (proxy_data, m) at batch "
                           "batch * proxy_data / d: the same per-device shapes, far fewer "
                           "simulated devices (dry_run.proxy_shape)")
  parser.add_argument("--merge", nargs="+", default=None,
                      help="JSON files of earlier runs: write their rows to --out as one table "
                           "and print it (nothing is compiled)")
  args = smoke.parse(parser, argv, SMOKE)
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
  overrides["remat_policy"] = args.remat_policy
  rows = []
  settings = dict(recipe=args.recipe, batch_size=args.batch_size, lengths=lengths,
                  method=args.method, optimizer="adafactor (TrainConfig defaults: paper)",
                  dtype=args.dtype or "model preset (float32)", remat_policy=args.remat_policy,
                  target_param_dtype=args.target_param_dtype or "float32",
                  xla_flags=os.environ["XLA_FLAGS"],
                  jax=jax.__version__, backend=jax.default_backend())
  for pair in pairs:
    for slice_name in slices:
      for shape in meshes or CANDIDATES[slice_name]:
        if int(np.prod(shape)) != SLICES[slice_name]:
          continue
        row = measure(*PAIRS[pair], shape, SLICES[slice_name], recipe=args.recipe,
                      batch_size=args.batch_size, lengths=lengths, method=args.method,
                      overrides=overrides, proxy_data=args.proxy_data,
                      target_param_dtype=args.target_param_dtype)
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
