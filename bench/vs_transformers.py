"""Our speculative decoding vs transformers' assisted generation, same weights, same CPU.

    python bench/vs_transformers.py --out bench.json \\
        [--target PATH --draft PATH]      # any checkpoint importer.py reads (hf, t5x, ours)
        [--gamma 4 --max-new-tokens 32 --input-len 16 --num-prompts 8 --repeats 3]
    python bench/vs_transformers.py --out /tmp/bench.json --smoke   # two prompts, seconds

Default models: a random T5 1.1 pair, target 4+4 layers d_model 256, draft 1+1 layers d_model
64, vocabulary 512. Random models produce junk, so greedy acceptance (and tau) is low: the
numbers measure engine overhead per generated token, not a trained draft's speedup.

Both engines get identical weights (ours -> `hf_t5.to_transformers`, lm_head untied), the same
prompts, greedy decoding, exactly `max_new_tokens` new tokens (EOS disabled on both sides, so no
row stops early) and a fixed draft length: the assistant's generation_config has
num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
assistant_confidence_threshold=0. transformers' assisted generation refuses batch > 1, so only
b1 is compared; ours is also timed at b8. Greedy outputs must be identical token for token.
Timings exclude our one-off jit compilation (a warm-up call) and transformers' first call.
By default both engines run single-threaded (--threads 1): on a shared CPU, oversubscribed
OpenMP threads made torch's per-call time ~20x worse and the comparison meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distillspec_jax.decoding import plain  # noqa: E402
from distillspec_jax.decoding.speculative import speculative_decode  # noqa: E402
from distillspec_jax.interop import hf_t5  # noqa: E402
from distillspec_jax.interop import importer  # noqa: E402
from distillspec_jax.models.config import TransformerConfig  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
import smoke  # noqa: E402  (bench/smoke.py)

DEFAULT_TARGET = TransformerConfig(
    kind="encoder_decoder", vocab_size=512, emb_dim=256, num_heads=4, num_encoder_layers=4,
    num_decoder_layers=4, head_dim=64, mlp_dim=1024, dropout_rate=0.0, max_decode_length=128)
DEFAULT_DRAFT = TransformerConfig(
    kind="encoder_decoder", vocab_size=512, emb_dim=64, num_heads=2, num_encoder_layers=1,
    num_decoder_layers=1, head_dim=32, mlp_dim=128, dropout_rate=0.0, max_decode_length=128)
NO_EOS = -1  # An id no token has: every row generates exactly max_new_tokens.
# --smoke: a one-layer target on two short prompts, one timed call.
SMOKE = dict(gamma=2, max_new_tokens=4, input_len=4, num_prompts=2, repeats=1)
SMOKE_TARGET = DEFAULT_TARGET.replace(emb_dim=64, num_encoder_layers=1, num_decoder_layers=1,
                                      head_dim=16, mlp_dim=128)


def _models(args):
  if bool(args.target) != bool(args.draft):
    raise SystemExit("Pass both --target and --draft, or neither (random default pair).")
  if args.target:
    target_params, target_config = importer.load_checkpoint(args.target)
    draft_params, draft_config = importer.load_checkpoint(args.draft)
    source = {"target": args.target, "draft": args.draft}
  else:
    target_config = SMOKE_TARGET if args.smoke else DEFAULT_TARGET
    draft_config = DEFAULT_DRAFT
    target_params = Model(target_config).init(jax.random.PRNGKey(args.seed))
    draft_params = Model(draft_config).init(jax.random.PRNGKey(args.seed + 1))
    source = {"target": "random", "draft": "random"}
  if args.self_draft:
    # A consistency check, not a speedup claim: the draft is the target itself, so greedy
    # acceptance is ~100% and both engines' full-acceptance (bonus token) paths are exercised.
    draft_config, draft_params = target_config, target_params
    source["draft"] = "the target itself (--self-draft)"
  if target_config.kind != "encoder_decoder":
    raise SystemExit(hf_t5.DECODER_ONLY_NOTE)
  target_config = target_config.replace(dropout_rate=0.0)
  draft_config = draft_config.replace(dropout_rate=0.0)
  return target_config, target_params, draft_config, draft_params, source


def _timed(fn, repeats):
  """Median wall time of `repeats` calls after one warm-up call; returns (seconds, output)."""
  out = fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times)), out


def _ours(target, target_params, draft, draft_params, prompts, args, batch):
  """Runs our engine over all prompts in chunks of `batch`; returns (seconds, tokens, tau)."""
  sampling = plain.SamplingConfig(0.0, eos_id=NO_EOS)
  max_length = args.max_new_tokens + args.gamma + 8
  chunks = [jnp.asarray(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]

  def run():
    results = [speculative_decode(target, target_params, draft, draft_params,
                                  encoder_input_tokens=chunk, max_new_tokens=args.max_new_tokens,
                                  gamma=args.gamma, sampling=sampling,
                                  rng=jax.random.PRNGKey(0), max_length=max_length)
               for chunk in chunks]
    jax.block_until_ready([r.tokens for r in results])
    return results

  seconds, results = _timed(run, args.repeats)
  tokens = np.concatenate([np.asarray(r.tokens) for r in results])
  produced = sum(int(jnp.sum(r.produced)) for r in results)
  calls = sum(int(jnp.sum(r.target_calls)) for r in results)
  accepted = sum(int(jnp.sum(r.accepted)) for r in results)
  drafted = sum(int(jnp.sum(r.drafted)) for r in results)
  return seconds, tokens, produced / max(calls, 1), accepted / max(drafted, 1)


def _ours_greedy(model, params, prompts, args, batch):
  sampling = plain.SamplingConfig(0.0, eos_id=NO_EOS)
  chunks = [jnp.asarray(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]

  def run():
    out = [plain.decode(model, params, encoder_input_tokens=c,
                           max_new_tokens=args.max_new_tokens, sampling=sampling,
                           max_length=args.max_new_tokens + 8).tokens for c in chunks]
    return jax.block_until_ready(out)

  seconds, out = _timed(run, args.repeats)
  return seconds, np.concatenate([np.asarray(o) for o in out])


def _hf(hf_target, hf_draft, prompts, args, assisted):
  """transformers' generate, one prompt at a time (assisted generation refuses batch > 1)."""
  import torch
  calls = {"n": 0}
  hook = hf_target.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
  import copy
  config = copy.deepcopy(hf_target.generation_config)
  config.update(do_sample=False, num_beams=1, max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens, eos_token_id=None)
  kwargs = dict(generation_config=config)
  if assisted:
    kwargs["assistant_model"] = hf_draft

  def run():
    calls["n"] = 0
    outs = []
    with torch.no_grad():
      for row in prompts:
        ids = torch.tensor(row[None], dtype=torch.long)
        out = hf_target.generate(input_ids=ids, attention_mask=(ids > 0).long(), **kwargs)
        outs.append(out[0, 1:].numpy())  # drop the decoder start token
    return outs

  seconds, outs = _timed(run, args.repeats)
  hook.remove()
  tokens = np.stack([np.pad(o, (0, args.max_new_tokens - len(o)), constant_values=-1)
                     for o in outs])
  return seconds, tokens, calls["n"]


def _configure_hf_generation(model, gamma):
  config = model.generation_config
  config.eos_token_id = None  # Generate exactly max_new_tokens: no EOS stop on either side.
  config.pad_token_id = 0
  config.decoder_start_token_id = 0
  config.num_assistant_tokens = gamma
  config.num_assistant_tokens_schedule = "constant"
  config.assistant_confidence_threshold = 0.0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="JSON results file")
  parser.add_argument("--target", default=None, help="target checkpoint (hf, t5x or ours)")
  parser.add_argument("--draft", default=None, help="draft checkpoint (hf, t5x or ours)")
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--input-len", type=int, default=16)
  parser.add_argument("--num-prompts", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--self-draft", action="store_true",
                      help="use the target as its own draft (checks the full-acceptance path)")
  parser.add_argument("--threads", type=int, default=1,
                      help="1: both engines single-threaded (stable on a shared CPU, where "
                           "oversubscribed OpenMP threads made torch ~20x slower here); "
                           "0: library defaults")
  args = smoke.parse(parser, argv, SMOKE)

  import torch
  import transformers
  if args.threads == 1:
    # XLA reads this when its CPU backend starts, i.e. at the first computation below.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1")
  if args.threads > 0:
    torch.set_num_threads(args.threads)
  target_config, target_params, draft_config, draft_params, source = _models(args)
  target, draft = Model(target_config), Model(draft_config)
  rng = np.random.RandomState(args.seed)
  prompts = rng.randint(2, target_config.vocab_size,
                        size=(args.num_prompts, args.input_len)).astype(np.int32)

  hf_target = hf_t5.to_transformers(target_params, target_config)
  hf_draft = hf_t5.to_transformers(draft_params, draft_config)
  for model in (hf_target, hf_draft):
    _configure_hf_generation(model, args.gamma)

  n_tokens = args.num_prompts * args.max_new_tokens
  ours_b1_s, ours_b1, tau_b1, alpha_b1 = _ours(target, target_params, draft, draft_params,
                                               prompts, args, 1)
  ours_b8_s, ours_b8, tau_b8, alpha_b8 = _ours(target, target_params, draft, draft_params,
                                               prompts, args, 8)
  greedy_b1_s, greedy_b1 = _ours_greedy(target, target_params, prompts, args, 1)
  hf_b1_s, hf_b1, hf_calls = _hf(hf_target, hf_draft, prompts, args, assisted=True)
  hf_greedy_s, hf_greedy, _ = _hf(hf_target, hf_draft, prompts, args, assisted=False)

  mismatched = [i for i in range(args.num_prompts) if not np.array_equal(ours_b1[i], hf_b1[i])]
  results = {
      "ours_tokens_per_s_b1": n_tokens / ours_b1_s,
      "ours_tokens_per_s_b8": n_tokens / ours_b8_s,
      "hf_tokens_per_s_b1": n_tokens / hf_b1_s,
      "hf_tokens_per_s_b8": None,  # assisted generation refuses batch > 1
      "ours_greedy_tokens_per_s_b1": n_tokens / greedy_b1_s,
      "hf_greedy_tokens_per_s_b1": n_tokens / hf_greedy_s,
      "outputs_identical": not mismatched and bool(np.array_equal(ours_b1, ours_b8)),
      "mismatched_prompts": mismatched,
      "ours_b8_equals_b1": bool(np.array_equal(ours_b1, ours_b8)),
      "speculative_equals_greedy_ours": bool(np.array_equal(ours_b1, greedy_b1)),
      "hf_assisted_equals_hf_greedy": bool(np.array_equal(hf_b1, hf_greedy)),
      "ours_greedy_equals_hf_greedy": bool(np.array_equal(greedy_b1, hf_greedy)),
      # tau: tokens per target call. Ours excludes the prefill call and its first token;
      # transformers' count includes every target forward during generation.
      "ours_tau_b1": tau_b1, "ours_tau_b8": tau_b8, "ours_acceptance_rate": alpha_b1,
      "hf_tau_b1": n_tokens / max(hf_calls, 1),
      "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
      "input_len": args.input_len, "num_prompts": args.num_prompts, "repeats": args.repeats,
      "source": source,
      "target_config": {k: getattr(target_config, k) for k in (
          "vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim", "num_encoder_layers",
          "num_decoder_layers")},
      "draft_config": {k: getattr(draft_config, k) for k in (
          "vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim", "num_encoder_layers",
          "num_decoder_layers")},
      "platform": {"jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                   "torch_threads": torch.get_num_threads(), "threads_flag": args.threads,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "machine": platform.machine()},
  }
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)

  rows = [("ours speculative", "b1", results["ours_tokens_per_s_b1"], tau_b1),
          ("ours speculative", "b8", results["ours_tokens_per_s_b8"], tau_b8),
          ("hf assisted", "b1", results["hf_tokens_per_s_b1"], results["hf_tau_b1"]),
          ("ours greedy", "b1", results["ours_greedy_tokens_per_s_b1"], None),
          ("hf greedy", "b1", results["hf_greedy_tokens_per_s_b1"], None)]
  print(f"{'engine':<18}{'batch':>6}{'tokens/s':>12}{'tau':>8}")
  for name, batch, speed, tau in rows:
    print(f"{name:<18}{batch:>6}{speed:>12.1f}{'' if tau is None else f'{tau:.2f}':>8}")
  print(f"outputs identical (ours vs transformers, greedy): {results['outputs_identical']}")
  return 0 if results["outputs_identical"] else 1


if __name__ == "__main__":
  sys.exit(main())
