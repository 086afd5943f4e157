"""Our on-policy distillation step against TRL's GKDTrainer: one Llama architecture on both sides.

    python bench/vs_trl.py --out vs_trl.json [--threads 2] [--rounds 3] [--steps 20]
    python bench/vs_trl.py --out /tmp/vs_trl.json --smoke   # SMOKE_SHAPES, one step, seconds

Needs the `reference` extra (torch CPU wheel, transformers, trl). Both sides get random-init
Llama decoders of the same architecture and shapes (RoPE, SwiGLU, RMSNorm, untied logits; no
hub download): ours is the `llama` kind, TRL's a `LlamaForCausalLM` built from a config, with
an in-memory word-level tokenizer. Target d_model 128, 4 heads of 32, MLP 2048, 2 layers;
draft d_model 64, 2 heads of 32, MLP 128, 1 layer; vocabulary 256 (the demo pair's widths).
The same step on both sides: on-policy fraction lambda = 1 (every step samples from the
draft), forward KL (TRL: beta = 0), temperature 1, batch 16, 48-token prompts, 48 sampled
tokens, EOS id 1, AdamW. Each side runs in a fresh process pinned to the same `--threads`
cores (torch.set_num_threads there too); rounds alternate ours / TRL, and the medians over
rounds are reported with their ranges.

tokens/s counts the loss-weighted (sampled) tokens trained per second of step time. The
generation share is sampling time / step time: ours times the jitted batch-making part of
the step separately (as bench/distill_throughput.py), TRL's is the time inside its
`generate_on_policy_outputs` during the timed steps. Writes {"ours_tokens_per_s",
"trl_tokens_per_s", "ours_generation_share", "trl_generation_share", "shapes", "versions",
...} and prints a table.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.evaluation import pinning  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

SHAPES = {"vocab_size": 256, "batch_size": 16, "prompt_length": 48, "new_tokens": 48,
          "target": {"d_model": 128, "num_heads": 4, "head_dim": 32, "mlp_dim": 2048,
                     "num_layers": 2},
          "draft": {"d_model": 64, "num_heads": 2, "head_dim": 32, "mlp_dim": 128,
                    "num_layers": 1},
          "eos_id": 1, "learning_rate": 1e-4, "temperature": 1.0, "lambda": 1.0,
          "divergence": "fkl"}


# --smoke: both sides on two 8-token prompts, 8 sampled tokens, a narrow target MLP.
SMOKE_SHAPES = {**SHAPES, "batch_size": 2, "prompt_length": 8, "new_tokens": 8,
                "target": {**SHAPES["target"], "mlp_dim": 128}}
SMOKE = dict(threads=0, rounds=1, steps=1, warmup=1)


def _prompts(seed: int, shapes: dict):
  import numpy as np
  rng = np.random.default_rng(seed)
  return rng.integers(2, shapes["vocab_size"], (shapes["batch_size"],
                                                 shapes["prompt_length"])).astype(np.int32)


def _summary(step_s, gen_s, tokens, warmup):
  step_s, gen_s, tokens = step_s[warmup:], gen_s[warmup:], tokens[warmup:]
  return {"tokens_per_s": sum(tokens) / sum(step_s), "step_ms": 1e3 * statistics.median(step_s),
          "generation_share": min(sum(gen_s) / sum(step_s), 1.0),
          "tokens_per_step": sum(tokens) / len(tokens), "timed_steps": len(step_s)}


# --- ours -------------------------------------------------------------------------------------


def run_ours(steps: int, warmup: int, seed: int, shapes: dict = SHAPES) -> dict:
  """Our jitted GKD train step (trainer.make_train_step) on the Llama-kind pair."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from distillspec_jax.distill import objectives
  from distillspec_jax.training import partitioning
  from distillspec_jax.training import trainer
  from distillspec_jax.models.config import TransformerConfig
  from distillspec_jax.models.model import Model

  def config(side):
    s = shapes[side]
    # TRL's LlamaConfig below: as many key/value heads as heads, RoPE base 10000, eps 1e-6.
    return TransformerConfig(kind="llama", vocab_size=shapes["vocab_size"],
                             emb_dim=s["d_model"], num_heads=s["num_heads"],
                             num_kv_heads=s["num_heads"], num_encoder_layers=0,
                             num_decoder_layers=s["num_layers"], head_dim=s["head_dim"],
                             mlp_dim=s["mlp_dim"], dropout_rate=0.0, rope_theta=10000.0,
                             norm_epsilon=1e-6, max_decode_length=160)

  target, draft = Model(config("target")), Model(config("draft"))
  dc = objectives.DistillationConfig.from_recipe("gkd", max_new_tokens=shapes["new_tokens"])
  objective = objectives.DistillationObjective(target, draft, dc)
  tc = trainer.TrainConfig(model_dir="/tmp/unused", train_steps=steps,
                           batch_size=shapes["batch_size"],
                           optimizer="adamw", learning_rate=shapes["learning_rate"],
                           warmup_steps=0, decay_steps=steps + warmup)
  mesh = partitioning.make_mesh()
  step_fn, state_shardings, frozen_shardings = trainer.make_train_step(
      objective, tc.optimizer_spec, mesh)
  params = jax.jit(draft.init)(jax.random.PRNGKey(seed + 1))
  state = jax.device_put(trainer.TrainState(step=jnp.int32(0), params=params,
                                            opt_state=tc.optimizer_spec.make().init(params)),
                         state_shardings)
  frozen = jax.device_put({"target": jax.jit(target.init)(jax.random.PRNGKey(seed))},
                          frozen_shardings)
  p, n = shapes["prompt_length"], shapes["new_tokens"]
  batches = []
  for s in range(steps + warmup):
    # Prefix-LM rows [prompt, placeholder continuation]; the prompt is what is sampled from.
    full = np.concatenate([_prompts(seed + s, shapes),
                           _prompts(seed + s + 10_000, shapes)[:, :n]], axis=1)
    weights = np.concatenate([np.zeros((len(full), p)), np.ones((len(full), n))],
                             axis=1).astype(np.float32)
    batches.append(partitioning.shard_batch(
        {"decoder_target_tokens": full, "decoder_input_tokens": np.pad(full, ((0, 0), (1, 0)))[:, :-1],
         "decoder_loss_weights": weights}, mesh))
  base = jax.random.PRNGKey(seed)
  make_batch = jax.jit(objective.make_batch)
  step_s, gen_s, tokens = [], [], []
  for s in range(steps + warmup):
    key = jax.random.fold_in(base, s)
    t0 = time.perf_counter()
    jax.block_until_ready(make_batch(state.params, frozen, batches[s], key))
    gen_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step_fn(state, batches[s], key, frozen))
    step_s.append(time.perf_counter() - t0)
    tokens.append(float(metrics["num_tokens"]))
  out = _summary(step_s, gen_s, tokens, warmup)
  out.update(params={"target": target.num_params(), "draft": draft.num_params()},
             cores=sorted(os.sched_getaffinity(0)))
  return out


# --- TRL --------------------------------------------------------------------------------------


def _tokenizer(shapes: dict):
  """A word-level tokenizer over the ids as words, built in memory (no download)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {f"t{i}": i for i in range(shapes["vocab_size"])}
  core = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
  core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t1",
                                 unk_token="t2")


def run_trl(steps: int, warmup: int, seed: int, threads: int, shapes: dict = SHAPES) -> dict:
  """TRL's GKDTrainer.train() for steps + warmup steps; per-step times from a callback."""
  import tempfile
  import torch
  import transformers
  from datasets import Dataset
  from trl.experimental.gkd import GKDConfig, GKDTrainer
  if threads:  # 0: torch's default (an unpinned smoke run)
    torch.set_num_threads(threads)
  torch.manual_seed(seed)

  def model(side):
    s = shapes[side]
    config = transformers.LlamaConfig(
        vocab_size=shapes["vocab_size"], hidden_size=s["d_model"],
        intermediate_size=s["mlp_dim"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_heads"],
        head_dim=s["head_dim"], max_position_embeddings=256, pad_token_id=0,
        eos_token_id=shapes["eos_id"], bos_token_id=None, tie_word_embeddings=False,
        rms_norm_eps=1e-6, rope_theta=10000.0)
    m = transformers.LlamaForCausalLM(config)
    m.generation_config.eos_token_id = shapes["eos_id"]
    return m

  student, teacher = model("draft"), model("target")
  total = steps + warmup
  n = shapes["new_tokens"]
  prompts = [r.tolist() for s in range(total) for r in _prompts(seed + s, shapes)]
  completions = [r[:n].tolist() for s in range(total)
                 for r in _prompts(seed + s + 10_000, shapes)]
  dataset = Dataset.from_dict({"prompt_ids": prompts, "completion_ids": completions})

  def collate(examples):
    # What TRL's chat collator makes: prompt + reference completion, loss on the completion
    # (the trainer sizes its loss normaliser from these labels), and the prompt alone.
    prompt = torch.tensor([e["prompt_ids"] for e in examples], dtype=torch.long)
    full = torch.cat([prompt, torch.tensor([e["completion_ids"] for e in examples])], dim=1)
    labels = full.clone()
    labels[:, :prompt.shape[1]] = -100
    return {"input_ids": full, "attention_mask": torch.ones_like(full), "labels": labels,
            "prompts": prompt, "prompt_attention_mask": torch.ones_like(prompt)}

  gen_s, step_s, tokens, current = [], [], [], {}
  original_generate = GKDTrainer.generate_on_policy_outputs

  def timed_generate(model_, inputs, generation_config):
    t0 = time.perf_counter()
    out = original_generate(model_, inputs, generation_config)
    current["gen"] = current.get("gen", 0.0) + time.perf_counter() - t0
    current["tokens"] = float((out[2][:, 1:] != -100).sum())
    return out

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
      current.clear()
      current["t0"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      step_s.append(time.perf_counter() - current["t0"])
      gen_s.append(current.get("gen", 0.0))
      tokens.append(current.get("tokens", 0.0))

  GKDTrainer.generate_on_policy_outputs = staticmethod(timed_generate)
  with tempfile.TemporaryDirectory() as out_dir:
    args = GKDConfig(output_dir=out_dir, per_device_train_batch_size=shapes["batch_size"],
                     max_steps=total, lmbda=shapes["lambda"], beta=0.0,
                     temperature=shapes["temperature"], max_new_tokens=shapes["new_tokens"],
                     learning_rate=shapes["learning_rate"], lr_scheduler_type="constant",
                     optim="adamw_torch", logging_steps=10_000, save_strategy="no",
                     report_to=[], use_cpu=True, dataloader_num_workers=0, seed=seed,
                     gradient_checkpointing=False,  # TRL defaults to True: no KV cache in generate
                     disable_tqdm=True, max_length=shapes["prompt_length"] + shapes["new_tokens"])
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, data_collator=collate,
                         train_dataset=dataset, processing_class=_tokenizer(shapes),
                         callbacks=[Timer()])
    trainer.train()
  out = _summary(step_s, gen_s, tokens, warmup)
  out.update(params={"target": sum(p.numel() for p in teacher.parameters()),
                     "draft": sum(p.numel() for p in student.parameters())},
             cores=sorted(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads())
  return out


def _versions() -> dict:
  from importlib import metadata
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "accelerate"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def _spread(values):
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--threads", type=int, default=2, help="cores each side is pinned to")
  parser.add_argument("--rounds", type=int, default=3, help="alternating ours/TRL rounds")
  parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
  parser.add_argument("--seed", type=int, default=0)
  args = smoke.parse(parser, argv, SMOKE)
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  load_before = os.getloadavg()
  rounds = {"ours": [], "trl": []}
  for r in range(args.rounds):
    rounds["ours"].append(pinning.run_pinned(args.threads, run_ours, args.steps, args.warmup,
                                           args.seed, shapes))
    rounds["trl"].append(pinning.run_pinned(args.threads, run_trl, args.steps, args.warmup,
                                          args.seed, args.threads, shapes))
    print(f"round {r + 1}/{args.rounds}: ours {rounds['ours'][-1]['tokens_per_s']:,.0f} "
          f"tokens/s, TRL {rounds['trl'][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
  result = {"shapes": shapes, "versions": _versions(), "threads": args.threads,
            "rounds": rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "cpus": os.cpu_count()}
  for side in ("ours", "trl"):
    for key in ("tokens_per_s", "generation_share", "step_ms"):
      spread = _spread([r[key] for r in rounds[side]])
      result[f"{side}_{key}"] = spread["median"]
      result[f"{side}_{key}_range"] = [spread["min"], spread["max"]]
  result["speedup"] = result["ours_tokens_per_s"] / result["trl_tokens_per_s"]
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print("\n| side | tokens/s (median, range) | step ms | generation share |")
  print("|---|---:|---:|---:|")
  for side, label in (("ours", "ours (JAX, jitted step)"), ("trl", "TRL GKDTrainer")):
    low, high = result[f"{side}_tokens_per_s_range"]
    print(f"| {label} | {result[f'{side}_tokens_per_s']:,.0f} ({low:,.0f}-{high:,.0f}) | "
          f"{result[f'{side}_step_ms']:.1f} | {100 * result[f'{side}_generation_share']:.0f}% |")
  print(f"ours / TRL: {result['speedup']:.2f}x  (load average {load_before[0]:.1f} before, "
        f"{result['load_average_after'][0]:.1f} after; {os.cpu_count()} cores, shared machine)")
  return result


if __name__ == "__main__":
  main()
