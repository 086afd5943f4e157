"""The dry run: what each compiled program of a job needs per device, before launch.

A program (a training step, the speculative engine) is lowered on *abstract* inputs:
`jax.ShapeDtypeStruct`s carrying the shardings the partitioning rules give them on the job's
(data, model) mesh (`Model.param_shapes` is an `eval_shape` of the init: no weight is ever
materialised), then compiled for that mesh (`.lower(...).compile()`). Per device it reports:

  arguments  the exact bytes of each input's shard (parameters, optimizer state, frozen
             target, batch): `sharding.shard_shape` times the itemsize, for any backend;
  temp       XLA's `memory_analysis().temp_size_in_bytes` of the compiled program
             (activations kept for the backward pass, gradients, logits, decoding caches);
  peak       arguments + outputs - donated (aliased) + temp, as XLA accounts them;
  flops      `cost_analysis()["flops"]` of the partitioned program (one device's share of one
             step), and the step time those FLOPs imply at `peak_fraction` of the chip's bf16
             matmul peak: an estimate, not a measurement (no memory or collective time).
             XLA counts a while loop's body once, so a program that loops (the on-policy
             sampler inside a GKD step, the speculative engine's rounds) is undercounted: its
             FLOPs are the loop-free part plus one iteration.

Without an accelerator the devices are simulated CPU devices
(`--xla_force_host_platform_device_count`, set by `simulation_xla_flags` before JAX starts).
The CPU compiler's buffer assignment is not the TPU's, so `temp` is an estimate of the TPU's;
XLA:CPU's default scheduler favours concurrency and hoists a rematerialised layer's
recomputation next to the others (the saving of `remat_policy` then disappears), so the dry
run compiles with its memory-optimised scheduler (`MEMORY_SCHEDULER_FLAG`), which is closer to
the TPU's memory-aware scheduling. bf16 *activations* cannot be measured on CPU (it computes
them in f32 with converts); bf16 *parameters* are counted exactly (they are arguments).

`proxy_data` compiles a mesh (d, m) as (proxy_data, m) at batch * proxy_data / d: the same
per-device shapes on far fewer simulated devices (bench/memory_table.py measured 576 bytes of
11.2 GB between the two for T5 1.1 XL / Small on (16, 1)).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.models import precision
from distillspec_jax.training import partitioning

GIB = 2 ** 30
MEMORY_SCHEDULER_FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The fraction of the chip's peak the step-time estimate assumes (a typical model FLOPs
# utilisation of a well-sharded T5 step; the estimate scales as 1 / fraction).
DEFAULT_PEAK_FRACTION = 0.4


@dataclasses.dataclass(frozen=True)
class Chip:
  """One JAX device of an accelerator: its memory and its dense bf16 matmul peak."""

  name: str
  hbm_gib: float
  peak_tflops: float
  cores_per_chip_in_slice_name: int = 1  # v4-32 / v5p-32 count TensorCores: 2 per chip


# Public figures per chip (= one JAX device; v4 and v5p are megacore: two TensorCores, one
# device). Peak = dense bf16 matmul FLOP/s.
CHIPS = {
    "v4": Chip("TPU v4", 32, 275, 2),
    "v5e": Chip("TPU v5e", 16, 197),
    "v5p": Chip("TPU v5p", 95, 459, 2),
    "v6e": Chip("TPU v6e", 32, 918),
    "a100": Chip("NVIDIA A100 80GB", 80, 312),
    "h100": Chip("NVIDIA H100 80GB", 80, 989),
    "h200": Chip("NVIDIA H200", 141, 989),
}


def parse_slice(name: str) -> tuple[str, Chip, int]:
  """'v4-32' -> ('v4-32', Chip v4, 16 devices); 'v5e-16' -> 16; 'h100-8' -> 8 GPUs.

  Raises ValueError naming the value and the known chips."""
  if isinstance(name, str) and "-" in name:
    chip_name, _, count = name.partition("-")
    chip = CHIPS.get(chip_name.lower())
    if chip is not None and count.isdigit() and int(count) > 0:
      per_chip = chip.cores_per_chip_in_slice_name
      if int(count) % per_chip == 0:
        return name, chip, int(count) // per_chip
  raise ValueError(f"slice={name!r} is not a slice name; use <chip>-<count> with a chip of "
                   f"{sorted(CHIPS)} (v4 and v5p count TensorCores, 2 per chip: v4-32 = 16 "
                   "chips; v5e, v6e and GPUs count chips), e.g. 'v4-32' (gin: SLICE).")


def simulation_xla_flags(devices: int, existing: str = "") -> str:
  """XLA_FLAGS that simulate `devices` CPU devices and schedule for memory (module doc).

  Call before JAX starts its backend; flags already in `existing` are kept."""
  flags = existing.split()
  if not any(f.startswith(DEVICE_COUNT_FLAG) for f in flags):
    flags.append(f"{DEVICE_COUNT_FLAG}={devices}")
  if not any(f.startswith("--xla_cpu_scheduler_type") for f in flags):
    flags.append(MEMORY_SCHEDULER_FLAG)
  return " ".join(flags)


def set_simulation_flags(devices: int) -> None:
  """Sets XLA_FLAGS (simulation_xla_flags) in this process's environment."""
  os.environ["XLA_FLAGS"] = simulation_xla_flags(devices, os.environ.get("XLA_FLAGS", ""))


# --- abstract inputs ----------------------------------------------------------------------------


def local_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s: each leaf's
  `sharding.shard_shape` (the largest shard; the rules only split evenly) times its itemsize."""
  return int(sum(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64) * x.dtype.itemsize
                 for x in jax.tree.leaves(tree)))


def abstract(shapes, shardings, dtype: Optional[str] = None):
  """Sharded `ShapeDtypeStruct`s (the inputs a program is lowered on; nothing allocated);
  floating leaves take `dtype` when given (precision.cast_params' rule)."""
  def leaf(s, sharding):
    target = precision.cast_dtype(s.dtype, dtype)
    return jax.ShapeDtypeStruct(s.shape, target, sharding=sharding)
  return jax.tree.map(leaf, shapes, shardings)


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


def _replicated_key(mesh):
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=partitioning.replicated(mesh))


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted function and the abstract inputs it will be called with.

  parts: {name: tree of sharded ShapeDtypeStructs} whose bytes sum to the arguments
  ("params", "optimizer", "frozen", "batch", "other")."""

  name: str
  fn: Any
  inputs: tuple
  parts: dict
  kwargs: dict = dataclasses.field(default_factory=dict)


def train_step_program(objective, optimizer_spec, mesh, batch_size: int, lengths: dict, *,
                       frozen_param_dtype: Optional[str] = None) -> Program:
  """The trainer's real step (`trainer.make_train_step`: shardings from the rules, the state
  donated) on abstract inputs. `objective`: FinetuneObjective or DistillationObjective;
  `frozen_param_dtype`: the frozen models' parameters cast (TARGET_PARAM_DTYPE)."""
  from distillspec_jax.training import trainer  # the trainer imports nothing of this module
  partitioning.check_batch_size(batch_size, mesh)
  model = objective.model
  step_fn, state_shardings, frozen_shardings = trainer.make_train_step(
      objective, optimizer_spec, mesh)
  params = abstract(model.param_shapes(), state_shardings.params)
  opt_shapes = jax.eval_shape(optimizer_spec.make().init, model.param_shapes())
  opt_state = abstract(opt_shapes, state_shardings.opt_state)
  frozen = {}
  for name in objective.frozen_names:
    frozen_model = objective.target if name == "target" else objective.reference
    frozen[name] = abstract(frozen_model.param_shapes(), frozen_shardings[name],
                            frozen_param_dtype)
  batch = abstract_batch(mesh, batch_size, lengths, model.is_encoder_decoder)
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=partitioning.replicated(mesh))
  rng = _replicated_key(mesh)
  state = trainer.TrainState(step=step, params=params, opt_state=opt_state)
  parts = {"params": params, "optimizer": opt_state, "frozen": frozen, "batch": batch,
           "other": (step, rng)}
  return Program(f"train step ({objective.name})", step_fn, (state, batch, rng, frozen), parts)


def speculative_program(target, draft, mesh, batch_size: int, input_length: int,
                        max_new_tokens: int, *, gamma: int = 5, temperature: float = 1.0,
                        target_param_dtype: Optional[str] = None,
                        draft_param_dtype: Optional[str] = None) -> Program:
  """The speculative engine's one compiled program (target + draft + both decoding caches)
  on a batch of `batch_size` prompts of `input_length` tokens, rows over 'data'; each model's
  parameters cast to its dtype (None: fp32)."""
  from distillspec_jax.decoding import plain
  from distillspec_jax.decoding import speculative
  partitioning.check_batch_size(batch_size, mesh)
  target_params = abstract(target.param_shapes(), partitioning.param_shardings(target, mesh),
                           target_param_dtype)
  draft_params = abstract(draft.param_shapes(), partitioning.param_shardings(draft, mesh),
                          draft_param_dtype)
  prompts = jax.ShapeDtypeStruct((batch_size, input_length), jnp.int32,
                                 sharding=partitioning.batch_sharding(mesh))
  # The engine's minimum capacity: the decoder prompt, then the last round's block.
  prompt_width = 1 if target.is_encoder_decoder else 1 + input_length
  max_length = prompt_width + max_new_tokens + gamma - 1
  sampling = plain.SamplingConfig(temperature=temperature)

  def decode(target_params, draft_params, prompts, rng):
    # The public entry point, traced: its checks of concrete prompts are skipped, and it
    # calls the engine's own jitted program.
    tokens = ({"encoder_input_tokens": prompts} if target.is_encoder_decoder
              else {"prompt_tokens": prompts})
    return speculative.speculative_decode(
        target, target_params, draft, draft_params, max_new_tokens=max_new_tokens,
        gamma=gamma, sampling=sampling, rng=rng, max_length=max_length, **tokens)

  parts = {"params": draft_params, "frozen": target_params, "batch": prompts,
           "other": _replicated_key(mesh)}
  return Program(f"speculative decoding (gamma {gamma}, T={temperature:g})", jax.jit(decode),
                 (target_params, draft_params, prompts, parts["other"]), parts)


def teacher_cache_program(target, mesh, batch_size: int, lengths: dict, *, k: int,
                          temperature: float = 1.0,
                          target_param_dtype: Optional[str] = None) -> Program:
  """The teacher cache's target program (`teacher_cache.bins_fn`: the target's forward pass
  and its top-k log-probabilities) on a batch of `batch_size` rows over 'data', the target's
  parameters sharded by the rules and cast to `target_param_dtype`."""
  from distillspec_jax.distill import teacher_cache  # distill sits below training
  partitioning.check_batch_size(batch_size, mesh)
  params = abstract(target.param_shapes(), partitioning.param_shardings(target, mesh),
                    target_param_dtype)
  batch = abstract_batch(mesh, batch_size, lengths, target.is_encoder_decoder)
  parts = {"params": {}, "frozen": params, "batch": batch}
  return Program(f"teacher cache (target forward, top-{k})",
                 teacher_cache.bins_fn(target, k, temperature), (params, batch), parts)


# --- compile and measure ------------------------------------------------------------------------


def proxy_shape(mesh_shape: Sequence[int], batch_size: int, proxy_data: Optional[int]):
  """(mesh shape, batch) compiled for `mesh_shape` at `batch_size`: (proxy_data, model) at
  batch * proxy_data / data when that keeps the per-device shapes (same parameter shards, same
  rows per device), else the mesh itself."""
  data, model = (int(v) for v in mesh_shape)
  if not proxy_data or proxy_data >= data or data % proxy_data:
    return (data, model), batch_size
  return (proxy_data, model), batch_size * proxy_data // data


def compile_program(program: Program) -> tuple:
  """(compiled, seconds): `program.fn.lower(*inputs, **kwargs).compile()`."""
  start = time.perf_counter()
  compiled = program.fn.lower(*program.inputs, **program.kwargs).compile()
  return compiled, time.perf_counter() - start


def measure(stage: str, program: Program, chip: Chip, *, mesh_shape, devices: int,
            compile_on: Optional[Program] = None, compiled_mesh=None,
            peak_fraction: float = DEFAULT_PEAK_FRACTION) -> dict:
  """One row of the table for `program` on the mesh `mesh_shape` of `devices` devices.

  compile_on: the same program on a proxy mesh (`proxy_shape`; same per-device shapes) to
  compile instead; its per-device arguments must equal `program`'s. A program whose exact
  arguments alone exceed the chip's HBM is not compiled (it cannot fit)."""
  hbm = chip.hbm_gib * GIB
  row = {"stage": stage, "program": program.name, "mesh": list(mesh_shape),
         "devices": devices, "chip": chip.name, "hbm_bytes": int(hbm)}
  row.update({f"{name}_bytes": local_bytes(tree) for name, tree in program.parts.items()})
  row["arguments_bytes"] = sum(row[f"{name}_bytes"] for name in program.parts)
  if row["arguments_bytes"] >= hbm:
    row.update(method="arguments only (they alone exceed HBM: not compiled)", temp_bytes=None,
               peak_bytes=None, flops=None, step_s_estimate=None, fits=False)
    return row
  target = compile_on or program
  if compile_on is not None:
    proxy = {k: local_bytes(v) for k, v in compile_on.parts.items()}
    if proxy != {k: local_bytes(v) for k, v in program.parts.items()}:
      raise AssertionError(f"{stage}: the proxy mesh's per-device arguments differ.")
  compiled, seconds = compile_program(target)
  stats = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get("flops", 0.0)) if cost else None
  row.update(method="compile" if compile_on is None else
             f"compile on proxy mesh {tuple(compiled_mesh)} (same per-device shapes)",
             compile_s=round(seconds, 1), xla_argument_bytes=int(stats.argument_size_in_bytes),
             xla_output_bytes=int(stats.output_size_in_bytes),
             xla_alias_bytes=int(stats.alias_size_in_bytes),
             temp_bytes=int(stats.temp_size_in_bytes), flops=flops)
  row["peak_bytes"] = (row["xla_argument_bytes"] + row["xla_output_bytes"]
                       - row["xla_alias_bytes"] + row["temp_bytes"])
  row["fits"] = bool(row["peak_bytes"] <= hbm)
  row["peak_fraction"] = peak_fraction
  row["step_s_estimate"] = (None if not flops else
                            flops / (peak_fraction * chip.peak_tflops * 1e12))
  return row


def _gib(value) -> str:
  return "n/a" if value is None else f"{value / GIB:.3g}"


def table(rows: Sequence[dict]) -> str:
  """The rows as a markdown table (GiB per device)."""
  lines = ["| stage | program | mesh (data, model) | params | optimizer | frozen | batch | "
           "arguments | temp | peak | HBM | fits | GFLOP / device | step s (estimate) | "
           "method |", "|" + "---|" * 15]
  for r in rows:
    flops = "n/a" if r.get("flops") is None else f"{r['flops'] / 1e9:.4g}"
    step = ("n/a" if r.get("step_s_estimate") is None else
            f"{r['step_s_estimate']:.3g} at {r['peak_fraction']:.0%} of peak")
    lines.append(
        f"| {r['stage']} | {r['program']} | ({r['mesh'][0]}, {r['mesh'][1]}) | "
        + " | ".join(_gib(r.get(f"{k}_bytes")) for k in ("params", "optimizer", "frozen",
                                                         "batch", "arguments", "temp", "peak"))
        + f" | {r['hbm_bytes'] / GIB:.0f} | {'yes' if r['fits'] else '**no**'} | {flops} | "
        f"{step} | {r['method']} |")
  return "\n".join(lines)


def failures(rows: Sequence[dict]) -> list:
  """One message per row that does not fit: the stage, the mesh and the bytes."""
  out = []
  for r in rows:
    if r["fits"]:
      continue
    need = r["peak_bytes"] if r["peak_bytes"] is not None else r["arguments_bytes"]
    what = "peak" if r["peak_bytes"] is not None else "arguments alone"
    out.append(f"stage {r['stage']!r} ({r['program']}) does not fit on mesh (data, model) = "
               f"({r['mesh'][0]}, {r['mesh'][1]}) of {r['devices']} {r['chip']}: {what} "
               f"{need / GIB:.2f} GiB per device > {r['hbm_bytes'] / GIB:.0f} GiB of HBM "
               f"({need:,} bytes).")
  return out


# --- a job's stages ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stage:
  """One compiled program of a job: `build(mesh, batch_size)` makes it on abstract inputs.

  models: {role: Model} the program shards (checked against the model axis)."""

  name: str
  build: Callable[[Any, int], Program]
  batch_size: int
  models: dict


def dry_run_devices(count: int) -> list:
  """`count` devices to compile for: the accelerator's when it has that many, else simulated
  CPU devices (set_simulation_flags before JAX starts). Raises ValueError naming the fix."""
  if jax.default_backend() != "cpu" and jax.device_count() >= count:
    return jax.devices()[:count]
  cpus = jax.devices("cpu")
  if len(cpus) < count:
    raise ValueError(f"The dry run needs {count} devices but JAX has {len(cpus)} CPU devices; "
                     f"start it with XLA_FLAGS={DEVICE_COUNT_FLAG}={count} (the binaries' "
                     "--dry_run sets it when JAX has not started yet).")
  return cpus[:count]


def check_stages(stages: Sequence[Stage], mesh) -> None:
  """Every stage's batch against the data axis and models against the model axis: the bad
  value and the fix, before anything is compiled."""
  for stage in stages:
    try:
      partitioning.check_batch_size(stage.batch_size, mesh)
      partitioning.check_model_axis(stage.models, mesh)
    except ValueError as error:
      raise ValueError(f"Stage {stage.name!r}: {error}") from None


def run(stages: Sequence[Stage], mesh_shape, devices: Sequence, chip: Chip, *,
        proxy_data: Optional[int] = 2, peak_fraction: float = DEFAULT_PEAK_FRACTION,
        log: Callable[[str], None] = print) -> list:
  """Measures every stage on the (data, model) mesh over `devices`; returns the rows.

  The mesh, batches and model axis are checked first (make_mesh, check_stages). On simulated
  CPU devices each stage is compiled on its proxy mesh (`proxy_shape`)."""
  data, model = (int(v) for v in mesh_shape)
  mesh = partitioning.make_mesh(data, model, devices=devices)
  shape = tuple(mesh.devices.shape)
  check_stages(stages, mesh)
  simulated = devices[0].platform == "cpu"
  rows = []
  for stage in stages:
    program = stage.build(mesh, stage.batch_size)
    compile_on = None
    proxy, proxy_batch = proxy_shape(shape, stage.batch_size, proxy_data if simulated else None)
    if proxy != shape:
      proxy_mesh = partitioning.make_mesh(*proxy, devices=devices[:int(np.prod(proxy))])
      compile_on = stage.build(proxy_mesh, proxy_batch)
    row = measure(stage.name, program, chip, mesh_shape=shape, devices=len(devices),
                  compile_on=compile_on, compiled_mesh=proxy, peak_fraction=peak_fraction)
    log(f"dry run: {stage.name}: {row['program']} on {shape}: peak {_gib(row['peak_bytes'])} "
        f"GiB, arguments {_gib(row['arguments_bytes'])} GiB, compile {row.get('compile_s')} s")
    rows.append(row)
  return rows


def argument_fits(stage: Stage, devices: Sequence, chip: Chip) -> list:
  """[(mesh shape, argument bytes)] of the meshes of `devices` whose model axis divides the
  stage's models and whose exact per-device arguments fit the chip (nothing compiled)."""
  out = []
  for model in range(1, len(devices) + 1):
    if len(devices) % model:
      continue
    mesh = partitioning.make_mesh(-1, model, devices=devices)
    try:
      check_stages([stage], mesh)
    except ValueError:
      continue
    arguments = local_bytes(stage.build(mesh, stage.batch_size).parts)
    if arguments < chip.hbm_gib * GIB:
      out.append(((len(devices) // model, model), arguments))
  return out


def report(rows: Sequence[dict], stages: Sequence[Stage], devices: Sequence, chip: Chip,
           levers: Sequence[str] = ()) -> tuple[str, list]:
  """(the table, failure messages): each row that does not fit named with its stage, mesh and
  bytes, the meshes on which its arguments would fit, and `levers` (settings not yet used,
  e.g. "--gin.REMAT_POLICY=full")."""
  by_name = {s.name: s for s in stages}
  messages = []
  for row, message in zip([r for r in rows if not r["fits"]], failures(rows)):
    fits = argument_fits(by_name[row["stage"]], devices, chip)
    if fits:
      where = ", ".join(f"({d}, {m}): {b / GIB:.2f} GiB" for (d, m), b in fits)
      where = (f"Its arguments alone would fit on {where} (their temporaries need a dry run "
               "on that mesh: --gin.MODEL_PARALLEL=m)")
    else:
      where = "Its arguments alone fit on none of this slice's meshes"
    messages.append(f"{message} {where}"
                    + (f"; not used yet: {', '.join(levers)}" if levers else "") + ".")
  return table(rows), messages
