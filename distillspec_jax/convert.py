"""Checkpoint conversion CLI: Hugging Face (T5 1.1, Llama, Qwen2, Qwen3, Gemma 3 text), T5X and
our orbax format.

    python -m distillspec_jax.convert --from=hf|t5x|ours --to=ours|hf|t5x \\
        --input=PATH --output=PATH [--model=<preset name>] [--vocab_size=N] [--tokenizer_dir=DIR]

Without --model the configuration comes from config.json (hf) or is inferred from the stored
shapes (t5x, ours); with --model the preset is used (--vocab_size overrides its vocabulary)
and every shape is checked against it. The formats are described in
`distillspec_jax.interop.importer`. A RoPE-kind model exported --to=hf is a folder of its
family (`LlamaForCausalLM`, `Qwen2ForCausalLM` with q/k/v biases, `Qwen3ForCausalLM`,
`Gemma3ForCausalLM`); the tokenizer files of
--tokenizer_dir (default: --input when it is an hf folder) are copied into it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import jax
import numpy as np

from distillspec_jax.core.validation import check_positive_int
from distillspec_jax.interop import hf_llama
from distillspec_jax.interop import importer
from distillspec_jax.interop.importer import FORMATS, load_checkpoint, save_checkpoint
from distillspec_jax.models.config import model_config
from distillspec_jax.models.model import TokenIds
from distillspec_jax.training import checkpoints

# --- CLI --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
  """argparse with the binaries' user-error status: exit 1 with the message (not 2)."""

  def error(self, message):
    self.print_usage(sys.stderr)
    self.exit(1, f"{self.prog}: error: {message}\n")


def _export_token_ids(args) -> Optional[dict]:
  """bos/eos/pad ids for an hf export of our checkpoint with no tokenizer folder: those an
  import kept in its `meta`; None where it was trained with our vocabulary's ids (or says
  nothing). Raises ValueError for a model trained with other ids (a user's tokenizer), whose
  export would otherwise say our ids (eos 1, a real token of that tokenizer)."""
  meta = checkpoints.read_meta(args.input) or {}
  if meta.get(importer.HF_TOKEN_IDS):
    return dict(meta[importer.HF_TOKEN_IDS])
  trained = meta.get("token_ids")
  # TokenIds.from_json: meta written before a field existed (stop_ids) reads its default.
  if trained is not None and TokenIds.from_json(trained) != TokenIds():
    raise ValueError(
        f"--input={args.input} was trained with a tokenizer other than ours (special ids "
        f"{trained}), and no --tokenizer_dir is given, so the export would carry no tokenizer "
        "and our ids (bos 0, eos 1, pad 0). Fix: pass --tokenizer_dir=<the folder of the "
        "tokenizer it was trained with> (the target's Hugging Face folder).")
  return None


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = _Parser(prog="python -m distillspec_jax.convert",
                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--from", dest="source", choices=FORMATS, required=True)
  parser.add_argument("--to", dest="dest", choices=FORMATS, required=True)
  parser.add_argument("--input", required=True)
  parser.add_argument("--output", required=True)
  parser.add_argument("--model", default=None,
                      help="preset name from distillspec_jax.models.config.MODEL_CONFIGS; checks shapes")
  parser.add_argument("--vocab_size", type=int, default=None,
                      help="overrides the --model preset's vocabulary size")
  parser.add_argument("--tokenizer_dir", default=None,
                      help="--to=hf of a RoPE-kind model (llama, qwen3, gemma3): copy this folder's tokenizer files "
                           "(and its config.json's bos/eos/pad ids); default: an hf --input")
  args = parser.parse_args(argv)
  source = args.tokenizer_dir
  if source is not None and not os.path.isdir(source):
    parser.error(f"--tokenizer_dir={source} is not a folder; pass the folder holding "
                 "tokenizer.json / tokenizer_config.json.")
  if source is not None and not any(os.path.isfile(os.path.join(source, name))
                                    for name in hf_llama.TOKENIZER_FILES + ("config.json",)):
    parser.error(f"--tokenizer_dir={source} holds no tokenizer files (none of "
                 f"{list(hf_llama.TOKENIZER_FILES)}) and no config.json, so the export would "
                 "get neither the tokenizer nor its special ids; pass the target's Hugging Face "
                 "folder.")
  if source is None and args.source == "hf":
    source = args.input
  config = None
  if args.vocab_size is not None and not args.model:
    parser.error(f"--vocab_size={args.vocab_size} overrides a preset's vocabulary, so it needs "
                 "--model=<preset>; without --model the vocabulary comes from the checkpoint.")
  try:
    if args.vocab_size is not None:
      check_positive_int(args.vocab_size, "--vocab_size")
    if args.model:
      overrides = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
      config = model_config(args.model, **overrides)
  except ValueError as error:
    parser.error(str(error))
  if "://" not in args.input and not os.path.exists(args.input):
    parser.error(f"--input={args.input} does not exist; pass the checkpoint's folder (or file).")
  if os.path.exists(args.output) and (not os.path.isdir(args.output) or os.listdir(args.output)):
    parser.error(f"--output={args.output} exists and is not empty; choose a new path.")
  try:
    params, config = load_checkpoint(args.input, config, fmt=args.source)
  except (ValueError, OSError) as error:
    parser.error(f"--input={args.input} (--from={args.source}) cannot be read: "
                 f"{' '.join(str(error).split())} Fix: check --from, and --model/--vocab_size "
                 "against the checkpoint (or leave --model out to infer the model from it).")
  token_ids = None
  if args.source == "hf" and args.dest == "ours" and config.is_rope_decoder:
    token_ids = hf_llama.source_token_ids(args.input)
  elif args.source == "ours" and args.dest == "hf" and source is None and config.is_rope_decoder:
    try:
      token_ids = _export_token_ids(args)
    except ValueError as error:
      parser.error(str(error))
  save_checkpoint(params, config, args.output, args.dest, source=source, hf_token_ids=token_ids)
  count = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  print(json.dumps({"from": args.source, "to": args.dest, "output": args.output,
                    "kind": config.kind, "num_params": count}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
