"""Temporary bytes of the compiled distillation step with and without the blocked loss.

  python bench/blocked_loss_memory.py --out /tmp/blocked_loss_memory.json
  python bench/blocked_loss_memory.py --smoke --out /tmp/blocked_loss_memory_smoke.json

Compiles (never runs) the trainer's real step (`dry_run.train_step_program`: the step the
trainer jits, state donated) for a Llama-kind target/draft pair of small width with a
Qwen-sized 151,936-row vocabulary, at --batch rows of --length tokens, once per
--block_sizes entry ("none" = the unblocked loss), on one CPU device with the dry run's XLA
flags (`dry_run.simulation_xla_flags`: XLA:CPU's memory-optimised scheduler). XLA's
`memory_analysis()` of each compiled program gives its argument, output and temporary
bytes; the small width keeps the models' own activations small, so the temporary bytes are
mostly the loss's [batch, length, vocab] logits (unblocked) or [batch, block, vocab] (blocked).
Prints a line per block size and writes {"setup", "rows": [{block_size, temp_bytes, ...}],
"temp_reduction": unblocked temp / smallest blocked temp}.
--smoke: a 4,096-row vocabulary, 64 tokens, blocks of 16 (seconds).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.core import validation  # noqa: E402
from distillspec_jax.distill import objectives  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training import dry_run  # noqa: E402
from distillspec_jax.training import partitioning  # noqa: E402
from distillspec_jax.training.trainer import OptimizerSpec  # noqa: E402

QWEN_VOCAB = 151_936


def pair(vocab: int, length: int) -> tuple:
  """(target, draft): small-width Llama-kind models (tied embeddings, as Qwen3's small ones)."""
  common = dict(vocab_size=vocab, max_decode_length=2 * length, logits_via_embedding=True)
  target = Model.from_name("tiny_llama", emb_dim=128, num_heads=4, num_kv_heads=2,
                           head_dim=32, mlp_dim=256, num_decoder_layers=2, **common)
  draft = Model.from_name("tiny_llama", emb_dim=64, num_heads=2, num_kv_heads=1,
                          head_dim=32, mlp_dim=128, num_decoder_layers=1, **common)
  return target, draft


def measure(target: Model, draft: Model, recipe: str, batch: int, length: int,
            block_size) -> dict:
  """One compiled step's bytes (XLA memory analysis) and compile seconds."""
  config = objectives.DistillationConfig.from_recipe(recipe, loss_block_size=block_size)
  objective = objectives.DistillationObjective(target, draft, config)
  mesh = partitioning.make_mesh(1, 1)
  program = dry_run.train_step_program(objective, OptimizerSpec("adamw", 1e-4, 0, 1000, 0.1),
                                       mesh, batch, {"inputs": length, "targets": length})
  start = time.perf_counter()
  compiled, _ = dry_run.compile_program(program)
  stats = compiled.memory_analysis()
  return {"block_size": block_size, "temp_bytes": int(stats.temp_size_in_bytes),
          "argument_bytes": int(stats.argument_size_in_bytes),
          "output_bytes": int(stats.output_size_in_bytes),
          "compile_s": round(time.perf_counter() - start, 1)}


def parse_block_size(text: str):
  if text == "none":
    return None
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--block_sizes entry {text!r}: pass ints >= 1, 'auto' or 'none'.") from None


def run(args) -> dict:
  if args.smoke:
    args.vocab, args.length, args.block_sizes = 4096, 64, "none,16"
  validation.check_positive_int(args.batch, "--batch")
  validation.check_positive_int(args.length, "--length")
  validation.check_positive_int(args.vocab, "--vocab")
  if args.recipe not in objectives.RECIPES:
    raise ValueError(f"--recipe={args.recipe!r}; use one of {sorted(objectives.RECIPES)}.")
  sizes = [parse_block_size(s) for s in args.block_sizes.split(",")]
  if None not in sizes or len(sizes) < 2:
    raise ValueError(f"--block_sizes={args.block_sizes!r} must hold 'none' and at least one "
                     "block size to compare with it.")
  target, draft = pair(args.vocab, args.length)
  rows = []
  for size in sizes:
    row = measure(target, draft, args.recipe, args.batch, args.length, size)
    print(f"block_size={size}: temp {row['temp_bytes'] / 2**30:.3f} GiB, arguments "
          f"{row['argument_bytes'] / 2**30:.3f} GiB (compiled in {row['compile_s']} s)",
          flush=True)
    rows.append(row)
  whole = next(r["temp_bytes"] for r in rows if r["block_size"] is None)
  smallest = min(r["temp_bytes"] for r in rows if r["block_size"] is not None)
  result = {"setup": {"vocab": args.vocab, "batch": args.batch, "length": args.length,
                      "recipe": args.recipe, "target": "llama kind, width 128, 2 layers",
                      "draft": "llama kind, width 64, 1 layer", "device": "1 CPU device",
                      "smoke": bool(args.smoke)},
            "rows": rows, "temp_reduction": whole / smallest}
  print(f"temporary bytes fall {result['temp_reduction']:.1f}x", flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--recipe", default="supervised_kd")
  parser.add_argument("--block_sizes", default="none,auto,128")
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args()
  # The dry run's XLA flags (its memory-optimised CPU scheduler), before JAX starts a backend.
  dry_run.set_simulation_flags(1)
  try:
    result = run(args)
  except ValueError as error:
    raise SystemExit(f"error: {error}") from None
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
