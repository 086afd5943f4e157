"""tests/mesh_worker.py's checks for Llama-family pairs (run by tests/test_llama_mesh.py).

  python tests/llama_mesh_worker.py PRESET:CHECK [PRESET:CHECK ...]

CHECK is `step` or `decode`, PRESET tiny_llama, tiny_qwen3 or tiny_gemma3 (the same checks),
each run in turn in this one process (testing.run_checks: `CHECK_BEGIN tiny_llama:step` ...
`CHECK_OK tiny_llama:step`). The pair of a preset: a 2-layer target with 2 key/value heads for
4 query heads and a 1-layer draft with one key/value head, so the mesh (2, 4) has fewer
key/value heads than model-axis devices (the rules replicate them) and (4, 2) splits the
target's. `step` is mesh_worker's distillation step on decoder-only batches; `decode`
compares on-policy sampling, speculative decoding and the evaluation statistics under both
meshes with one device and looks inside the compiled speculative program.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mesh_worker as mw  # noqa: E402  (sets XLA_FLAGS: 8 simulated CPU devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from distillspec_jax.decoding import plain  # noqa: E402
from distillspec_jax.decoding import speculative  # noqa: E402
from distillspec_jax.decoding import stats as stats_lib  # noqa: E402
from distillspec_jax.distill import objectives  # noqa: E402
from distillspec_jax.models.model import Model  # noqa: E402
from distillspec_jax.training import partitioning  # noqa: E402
from distillspec_jax.training import trainer  # noqa: E402
import testing  # noqa: E402
from collector import freeze_long_lived  # noqa: E402

VOCAB = 64
TARGET = DRAFT = None  # use_pair's


def use_pair(preset: str) -> None:
  """Points this module's and mesh_worker's checks (they read module globals) at `preset`'s
  pair, its random weights and decoder-only batches."""
  global TARGET, DRAFT
  TARGET = Model.from_name(preset, vocab_size=VOCAB, emb_dim=32, head_dim=8, mlp_dim=64,
                           num_decoder_layers=2, max_decode_length=48)
  DRAFT = Model.from_name(preset, vocab_size=VOCAB, emb_dim=32, head_dim=8, mlp_dim=64,
                          num_decoder_layers=1, num_kv_heads=1, max_decode_length=48)
  mw.TARGET, mw.DRAFT = TARGET, DRAFT
  mw.TARGET_PARAMS = jax.device_get(testing.random_params(TARGET, 1))
  mw.DRAFT_PARAMS = jax.device_get(testing.random_params(DRAFT, 2))
  mw.DATA = trainer.SyntheticData(mw.BATCH, input_length=6, target_length=8,
                                  vocab_size=VOCAB, seed=5, decoder_only=True)


def check_layout():
  """The key/value kernels are split over 'model' only where it divides their heads."""
  for shape, target_kv, draft_kv in (((4, 2), "model", None), ((2, 4), None, None)):
    mesh = partitioning.make_mesh(*shape)
    for model, expected in ((TARGET, target_kv), (DRAFT, draft_kv)):
      spec = partitioning.param_shardings(model, mesh)["decoder"]["layers_0"][
          "self_attention"]["key"]["kernel"].spec
      assert tuple(spec) + (None,) * (3 - len(spec)) == (None, expected, None), (shape, spec)
    print(shape, "kv layout ok", flush=True)


def check_decode():
  """On-policy samples, speculative outputs and tau / alpha / TVD on each mesh equal one
  device; the compiled speculative program takes the rules' shardings and gathers no
  model-sharded parameter."""
  sampling = plain.SamplingConfig(temperature=1.0)
  key = jax.random.PRNGKey(11)
  sample = jax.jit(lambda p, batch, rng: objectives.sample_batch(
      DRAFT, p, batch, rng, max_new_tokens=8, temperature=1.0))
  results = {}
  for shape in ((1, 1),) + mw.MESHES:
    mesh = mw.one_device_mesh() if shape == (1, 1) else partitioning.make_mesh(*shape)
    target_params, draft_params = mw.place(mesh)
    batch = mw.batch_on(mesh)
    prompts = objectives.prompt_tokens_from_batch(batch)
    if shape == (1, 1):
      spec = speculative.speculative_decode(TARGET, target_params, DRAFT, draft_params,
                                            prompt_tokens=prompts, max_new_tokens=8, gamma=3,
                                            sampling=sampling, rng=key)
    else:
      compiled = speculative._speculative_jit.lower(  # pylint: disable=protected-access
          TARGET, target_params, DRAFT, draft_params, None, prompts, key, max_new_tokens=8,
          gamma=3, sampling=sampling, lenience=speculative.Lenience(),
          max_length=TARGET.config.max_decode_length,
          draft_length=speculative.DraftLength()).compile()
      mw.check_param_shardings(compiled.input_shardings[0][0], TARGET, mesh, shape)
      mw.check_param_shardings(compiled.input_shardings[0][1], DRAFT, mesh, shape)
      mw.check_no_param_gather(compiled, mw.sharded_param_shapes(TARGET, DRAFT, mesh),
                               f"speculative {shape}")
      spec = compiled(target_params, draft_params, None, prompts, key)
    samples = sample(draft_params, batch, key)
    stats = stats_lib.block_efficiency_stats(spec)
    tvd = float(jax.jit(objectives.mean_tvd, static_argnums=(0, 2))(
        TARGET, target_params, DRAFT, draft_params, batch))
    results[shape] = dict(samples=jax.device_get(samples), tokens=np.asarray(spec.tokens),
                          stats=stats, tvd=tvd)
    print(shape, "tau", stats["tau"], "alpha", stats["alpha"], "tvd", tvd, flush=True)
  reference = results[(1, 1)]
  for shape in mw.MESHES:
    got = results[shape]
    for k in reference["samples"]:
      np.testing.assert_array_equal(got["samples"][k], reference["samples"][k], err_msg=k)
    np.testing.assert_array_equal(got["tokens"], reference["tokens"])
    assert got["stats"] == reference["stats"], (shape, got["stats"], reference["stats"])
    np.testing.assert_allclose(got["tvd"], reference["tvd"], rtol=1e-5)


def _check(preset: str, name: str):
  def run():
    use_pair(preset)
    if name == "step":
      check_layout()
      mw.check_step()
    else:
      check_decode()
  return run


if __name__ == "__main__":
  freeze_long_lived()  # the imports are done (collector.py)
  assert jax.device_count() == 8, jax.devices()
  names = sys.argv[1:]
  checks = {n: _check(*n.split(":")) for n in names}
  sys.exit(testing.run_checks(checks, names))
