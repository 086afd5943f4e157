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

--families: the decoder-only pairs of 2026 (FAMILY_PAIRS: Qwen3-8B / Qwen3-0.6B, Gemma 3 12B
/ 270M) at FAMILY_BATCH rows of 2,048 tokens on one mesh per slice (FAMILY_MESHES: v5e-8,
v4-8, v5p-8), per stage of the main job (FAMILY_STAGES: the draft's fine-tuning, the
distillation step of `--recipe`, default supervised_kd, the teacher cache's target forward)
and per `--loss_block_sizes` entry ('none' = the unblocked loss). Each row is the dry run's
own measurement (`dry_run.run`: the chip's HBM, arguments from the shard shapes, XLA's temp
and peak). Gemma 3 270M has 262,144 embedding rows and 12B 262,208 (the rows past 262,144
are beyond the text tokenizer): the table's Gemma draft takes the target's 262,208 rows
(FAMILY_PAIRS' vocab_size override), as the distillation step needs one vocabulary.

  nice -n 5 python bench/memory_table.py --families --remat_policy minimal \
      --target_param_dtype bfloat16 --out families.json
  python bench/memory_table.py --families --smoke --out /tmp/families_smoke.json  # seconds

Writes JSON ({"rows": [...], "settings": {...}}) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
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
from distillspec_jax.core import validation  # noqa: E402
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


# --- the 2026 families: decoder-only pairs per stage, with and without the blocked loss ----------


@dataclasses.dataclass(frozen=True)
class FamilyPair:
  """A (target, draft) pair of presets; `draft_overrides` change the draft's preset fields."""

  target: str
  draft: str
  draft_overrides: tuple = ()  # ((field, value), ...)


# Gemma 3 270M / 1B embed 262,144 rows, 12B / 27B 262,208: the 64 rows past 262,144 are the
# multimodal checkpoints' image tokens, beyond the text tokenizer. The table's Gemma draft
# takes the target's 262,208 rows (a vocab_size override of its preset, 64 x 640 weights more)
# so the pair shares one vocabulary as the distillation step requires.
FAMILY_PAIRS = {"qwen3": FamilyPair("qwen3_8b", "qwen3_0_6b"),
                "gemma3": FamilyPair("gemma3_12b", "gemma3_270m", (("vocab_size", 262208),))}
# --smoke: the same stages of tiny presets of both kinds (seconds; the suite runs it).
SMOKE_PAIRS = {"qwen3": FamilyPair("tiny_qwen3", "tiny_qwen3"),
               "gemma3": FamilyPair("tiny_gemma3", "tiny_gemma3")}
SMOKE_LENGTH = 64
# One mesh per slice: a model axis for the target's weights; Gemma 3 270M's 4 heads allow a
# model axis of at most 4 (partitioning.check_model_axis).
FAMILY_MESHES = {"v5e-8": (2, 4), "v4-8": (2, 2), "v5p-8": (2, 2)}
FAMILY_STAGES = ("draft_raw", "distill", "teacher_cache")
FAMILY_LENGTH = 2048
FAMILY_BATCH = 8
FAMILY_RECIPE = "supervised_kd"  # DistillSpec's fixed-data FKL: no sampler inside the step


def family_stages(pair: FamilyPair, block_size, *, recipe: str, length: int,
                  remat_policy: str, target_param_dtype: Optional[str], stages, k: int = 8,
                  overrides=None) -> list:
  """The main job's stages for a decoder-only pair (studies/pipeline_dry_run.py): the draft's
  fine-tuning step, the distillation step of `recipe` (frozen target in
  `target_param_dtype`) and the teacher cache's target forward with top-`k`, each as a
  dry_run.Stage at FAMILY_BATCH rows of `length` tokens with `block_size` for the loss."""
  overrides = dict(overrides or {}, remat_policy=remat_policy)
  target = Model.from_name(pair.target, **overrides)
  draft = Model.from_name(pair.draft, **dict(overrides, **dict(pair.draft_overrides)))
  spec = trainer.TrainConfig(model_dir="unused", train_steps=1).optimizer_spec
  lengths = {"inputs": length, "targets": length}
  both = {"target": target, "draft": draft}
  builders = {
      "draft_raw": lambda mesh, batch: dry_run.train_step_program(
          objectives.FinetuneObjective(draft, block_size), spec, mesh, batch, lengths),
      "distill": lambda mesh, batch: dry_run.train_step_program(
          objectives.DistillationObjective(target, draft, objectives.DistillationConfig
                                           .from_recipe(recipe, loss_block_size=block_size)),
          spec, mesh, batch, lengths, frozen_param_dtype=target_param_dtype),
      "teacher_cache": lambda mesh, batch: dry_run.teacher_cache_program(
          target, mesh, batch, lengths, k=k, target_param_dtype=target_param_dtype)}
  return [dry_run.Stage(name, builders[name], FAMILY_BATCH, both) for name in stages]


def family_rows(pair_name: str, slice_name: str, block_size, *, log=print, pairs=None,
                **kwargs) -> list:
  """The rows of one pair of `pairs` (FAMILY_PAIRS) on one slice (FAMILY_MESHES) for one
  loss block size."""
  pair = (pairs or FAMILY_PAIRS)[pair_name]
  name, chip, count = dry_run.parse_slice(slice_name)
  stages = family_stages(pair, block_size, **kwargs)
  rows = dry_run.run(stages, FAMILY_MESHES[name], dry_run.dry_run_devices(count), chip,
                     proxy_data=2, log=log)
  for row in rows:
    blocked = row["stage"] != "teacher_cache"  # the cache's forward has no loss
    row.update(pair=pair_name, target=pair.target, draft=pair.draft,
               draft_overrides=dict(pair.draft_overrides), slice=name,
               loss_block_size=block_size if blocked else "n/a", batch_size=FAMILY_BATCH,
               length=kwargs["length"], recipe=kwargs["recipe"],
               remat_policy=kwargs["remat_policy"],
               target_param_dtype=kwargs["target_param_dtype"] or "float32",
               temp_is_estimate=True)
  return rows


def family_markdown(rows) -> str:
  """GiB per device: arguments exact (shard shapes), temp and peak XLA:CPU's estimates."""
  lines = ["| pair (target / draft) | slice | mesh | stage | loss blocks | remat | draft "
           "params + optimizer | target | arguments (exact) | temp (estimate) | peak "
           "(estimate) | HBM | fits |", "|" + "---|" * 13]
  for r in rows:
    lines.append(
        f"| {r['target']} / {r['draft']} | {r['slice']} | ({r['mesh'][0]}, {r['mesh'][1]}) | "
        f"{r['stage']} | {r['loss_block_size'] if r['loss_block_size'] is not None else 'none'} | "
        f"{r['remat_policy']} | {_gib(r['params_bytes'] + r.get('optimizer_bytes', 0))} | "
        f"{_gib(r['frozen_bytes'])} | {_gib(r['arguments_bytes'])} | {_gib(r['temp_bytes'])} | "
        f"{_gib(r['peak_bytes'])} | {r['hbm_bytes'] / GIB:.0f} | "
        f"{'yes' if r['fits'] else '**no**'} |")
  return "\n".join(lines)


def families_main(args, argv) -> list:
  """--families: the grid over pairs x slices x loss block sizes, every stage per cell."""
  pairs = SMOKE_PAIRS if args.smoke else FAMILY_PAIRS
  if args.smoke:
    args.length, args.loss_block_sizes = SMOKE_LENGTH, "none,16"
  try:
    blocks = [None if b == "none" else (b if b == "auto" else int(b))
              for b in args.loss_block_sizes.split(",")]
  except ValueError:
    raise SystemExit(f"error: --loss_block_sizes={args.loss_block_sizes!r}: use a comma list "
                     "of 'none', 'auto' or ints >= 1.") from None
  stages = tuple(s for s in args.stages.split(",") if s)
  try:
    validation.check_positive_int(args.length, "--length")
  except ValueError as error:
    raise SystemExit(f"error: {error}") from None
  for value, known, flag in ((args.pairs, FAMILY_PAIRS, "--pairs"),
                             (args.slices, FAMILY_MESHES, "--slices"),
                             (args.stages, FAMILY_STAGES, "--stages")):
    unknown = [n for n in value.split(",") if n and n not in known]
    if unknown:
      raise SystemExit(f"error: {flag}: unknown {unknown}; use a comma list of {sorted(known)}.")
  settings = dict(recipe=args.recipe, batch_size=FAMILY_BATCH, length=args.length,
                  remat_policy=args.remat_policy, activations=args.dtype or "float32",
                  target_param_dtype=args.target_param_dtype or "float32",
                  optimizer="adafactor (TrainConfig defaults)", meshes=FAMILY_MESHES,
                  smoke=bool(args.smoke), xla_flags=os.environ["XLA_FLAGS"],
                  jax=jax.__version__,
                  command="python bench/memory_table.py " + " ".join(
                      sys.argv[1:] if argv is None else argv))
  rows = []
  for pair in args.pairs.split(","):
    for slice_name in args.slices.split(","):
      for block in blocks:
        stage_names = stages if block == blocks[0] else tuple(
            s for s in stages if s != "teacher_cache")  # the cache has no loss to block
        rows += family_rows(pair, slice_name, block, pairs=pairs, recipe=args.recipe,
                            length=args.length, remat_policy=args.remat_policy,
                            target_param_dtype=args.target_param_dtype, stages=stage_names,
                            overrides={"dtype": args.dtype} if args.dtype else None)
        files.write_json_atomic(args.out, {"rows": rows, "settings": settings})
  print(family_markdown(rows))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write (rewritten per row)")
  parser.add_argument("--pairs", default=None, help=f"comma list of {sorted(PAIRS)} (default "
                      f"xl,xxl), with --families of {sorted(FAMILY_PAIRS)} (default all)")
  parser.add_argument("--slices", default=None, help=f"comma list of {sorted(SLICES)} (default "
                      f"v4-8,v4-32), with --families of {sorted(FAMILY_MESHES)} (default "
                      "v5e-8,v4-8)")
  parser.add_argument("--meshes", default=None,
                      help="override the candidates: e.g. '2x2,1x4' (data x model)")
  parser.add_argument("--recipe", default=None, choices=sorted(objectives.RECIPES),
                      help=f"default gkd, with --families {FAMILY_RECIPE}")
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
  parser.add_argument("--families", action="store_true",
                      help="the decoder-only pairs of FAMILY_PAIRS per stage, with and without "
                           "the blocked loss (--pairs qwen3,gemma3 --slices v5e-8,v4-8)")
  parser.add_argument("--stages", default=",".join(FAMILY_STAGES),
                      help=f"--families: comma list of {FAMILY_STAGES}")
  parser.add_argument("--loss_block_sizes", default="none,auto",
                      help="--families: comma list of LOSS_BLOCK_SIZE values ('none' = "
                           "unblocked, 'auto', or an int)")
  parser.add_argument("--length", type=int, default=FAMILY_LENGTH,
                      help="--families: tokens per row")
  # --smoke (smoke.parse): the smoke pair, or with --families the tiny presets
  # (SMOKE_LENGTH tokens, blocks of 16); seconds either way.
  args = smoke.parse(parser, argv, SMOKE)
  if args.merge:
    runs = [files.read_json(path) for path in args.merge]
    rows = [row for run in runs for row in run["rows"]]
    files.write_json_atomic(args.out, {"rows": rows, "settings": [r["settings"] for r in runs]})
    print(family_markdown(rows) if args.families else markdown(rows))
    return rows
  if args.families:
    if args.smoke and args.pairs == SMOKE["pairs"]:  # --smoke's T5 pair: the families' own
      args.pairs = None
    args.pairs = args.pairs or ",".join(FAMILY_PAIRS)
    args.slices = args.slices or "v5e-8,v4-8"
    args.recipe = args.recipe or FAMILY_RECIPE
    return families_main(args, argv)
  args.pairs, args.slices = args.pairs or "xl,xxl", args.slices or "v4-8,v4-32"
  args.recipe = args.recipe or "gkd"
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
