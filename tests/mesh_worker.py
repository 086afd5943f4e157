"""The compiled paths under a mesh, on 8 simulated CPU devices (run by tests/test_mesh_paths.py).

  python tests/mesh_worker.py CHECK [CHECK ...]    (step, decode, checkpoint)

Every check compares the meshes (4, 2) and (2, 4) with one device (a (1, 1) mesh of
the first device), target and draft sharded by partitioning's logical-axis rules, and looks
inside the compiled programs: parameter input shardings are the rules', and no all-gather
produces a full model-sharded parameter. The checks run in turn in this one process
(testing.run_checks: `CHECK_BEGIN step` ... `CHECK_OK step`).
"""

import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compilation import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from collector import freeze_long_lived  # noqa: E402
from compilation import set_fast_compilation  # noqa: E402

# Tiny programs: compiling them costs more than running them (compilation.py). Every run this
# script compares is compiled the same way.
set_fast_compilation(True)
import numpy as np  # noqa: E402

from distillspec_jax.decoding import stats as stats_lib
from distillspec_jax.training import checkpoints
from distillspec_jax.decoding import plain
from distillspec_jax.distill import objectives
from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning
from distillspec_jax.decoding import speculative
from distillspec_jax.training import trainer
import testing  # noqa: E402  (tests/testing.py: the tiny pair every mesh test uses)

# Both axes > 1 once each way; pure data parallelism, (8, 1), is in the checkpoint check.
MESHES = ((4, 2), (2, 4))
BATCH = 8
TARGET, DRAFT = testing.tiny_pair(vocab_size=64)
TARGET_PARAMS = jax.device_get(testing.random_params(TARGET, 1))  # host copies
DRAFT_PARAMS = jax.device_get(testing.random_params(DRAFT, 2))
DATA = trainer.SyntheticData(BATCH, vocab_size=64, seed=5)


def one_device_mesh():
  return partitioning.make_mesh(1, 1, devices=jax.devices()[:1])


def place(mesh):
  return (multihost.put_global(TARGET_PARAMS, partitioning.param_shardings(TARGET, mesh)),
          multihost.put_global(DRAFT_PARAMS, partitioning.param_shardings(DRAFT, mesh)))


def batch_on(mesh, step=0):
  shard = multihost.data_shard(mesh, BATCH)
  return multihost.global_batch({k: v[shard.rows] for k, v in DATA.batch_at(step).items()},
                                mesh, shard)


def _spec(spec):
  spec = tuple(spec)
  while spec and spec[-1] is None:  # P(None, None) and P(None,) say the same
    spec = spec[:-1]
  return spec


def check_param_shardings(tree, model, mesh, where):
  """Every leaf of `tree` (arrays or shardings) is laid out as the rules say."""
  def check(path, x, expected):
    sharding = x if isinstance(x, jax.sharding.Sharding) else x.sharding
    assert sharding.mesh.shape == mesh.shape, (where, path)
    assert _spec(sharding.spec) == _spec(expected.spec), (where, path, sharding, expected)
  jax.tree_util.tree_map_with_path(check, tree, partitioning.param_shardings(model, mesh))


def sharded_param_shapes(*models_and_mesh):
  """Full shapes of the parameters that the rules split (over an axis of size > 1)."""
  *models, mesh = models_and_mesh
  shapes = set()
  for model in models:
    for s, sh in zip(jax.tree.leaves(model.param_shapes()),
                     jax.tree.leaves(partitioning.param_shardings(model, mesh))):
      if any(a is not None for a in sh.spec):
        shapes.add(tuple(s.shape))
  return shapes


def check_no_param_gather(compiled, shapes, where):
  gathered = {tuple(int(d) for d in dims.split(",") if d) for dims in
              re.findall(r"= f32\[([0-9,]*)\]\S* all-gather\(", compiled.as_text())}
  assert not gathered & shapes, (where, "all-gathers full parameters", gathered & shapes)


def close(a, b, where, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=where)


def check_step():
  """A distillation step (on-policy: every step samples from the draft) on each mesh."""
  objective = objectives.DistillationObjective(
      TARGET, DRAFT, objectives.DistillationConfig(lambda1=0.0, lambda2=1.0,
                                                     max_new_tokens=8))
  config = trainer.TrainConfig(model_dir="/tmp/unused", train_steps=1, batch_size=BATCH,
                               optimizer="adafactor", learning_rate=1e-2, warmup_steps=0,
                               decay_steps=10)
  optimizer = config.optimizer_spec.make()
  results = {}
  for shape in ((1, 1),) + MESHES:
    mesh = one_device_mesh() if shape == (1, 1) else partitioning.make_mesh(*shape)
    step_fn, state_sh, frozen_sh = trainer.make_train_step(objective, config.optimizer_spec,
                                                           mesh)
    target_params, params = place(mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=state_sh.opt_state)(params)
    # The frozen target gets no optimizer state: the state is the draft's alone.
    assert (jax.tree.structure(opt_state)
            == jax.tree.structure(jax.eval_shape(optimizer.init, DRAFT.param_shapes())))
    assert sum(x.size for x in jax.tree.leaves(opt_state)) < 2 * DRAFT.num_params()
    state = trainer.TrainState(step=jnp.int32(0), params=params, opt_state=opt_state)
    args = (state, batch_on(mesh), jax.random.PRNGKey(7), {"target": target_params})
    if shape != (1, 1):
      compiled = step_fn.lower(*args).compile()
      check_param_shardings(compiled.input_shardings[0][0].params, DRAFT, mesh, shape)
      check_param_shardings(compiled.input_shardings[0][3]["target"], TARGET, mesh, shape)
      check_no_param_gather(compiled, sharded_param_shapes(TARGET, DRAFT, mesh),
                            f"train step {shape}")
      # Optimizer state sharded like the params: a share per device, not all of it.
      opt_bytes = sum(x.size * 4 for x in jax.tree.leaves(opt_state))
      local = sum(s.data.size * 4 for x in jax.tree.leaves(opt_state)
                  for s in x.addressable_shards if s.device == jax.devices()[0])
      if shape[1] > 1:
        assert local < 0.75 * opt_bytes, (shape, local, opt_bytes)
    new_state, metrics = step_fn(*args)
    check_param_shardings(new_state.params, DRAFT, mesh, f"updated params {shape}")
    assert int(metrics["source"]) == objectives.DRAFT
    results[shape] = (float(metrics["loss"]), jax.device_get(new_state.params))
    print(shape, "loss", results[shape][0], flush=True)
  loss, params = results[(1, 1)]
  for shape in MESHES:
    np.testing.assert_allclose(results[shape][0], loss, rtol=1e-6)
    close(results[shape][1], params, f"updated params {shape}")


def check_decode():
  """On-policy samples, speculative outputs and the speculative evaluation on each mesh."""
  sampling = plain.SamplingConfig(temperature=1.0)
  key = jax.random.PRNGKey(11)
  sample = jax.jit(lambda p, batch, rng: objectives.sample_batch(
      DRAFT, p, batch, rng, max_new_tokens=8, temperature=1.0))
  results = {}
  for shape in ((1, 1),) + MESHES:
    mesh = one_device_mesh() if shape == (1, 1) else partitioning.make_mesh(*shape)
    target_params, draft_params = place(mesh)
    batch = batch_on(mesh)
    prompts = batch["encoder_input_tokens"]
    if shape == (1, 1):  # the public entry points
      samples = sample(draft_params, batch, key)
      spec = speculative.speculative_decode(TARGET, target_params, DRAFT, draft_params,
                                            encoder_input_tokens=prompts, max_new_tokens=8,
                                            gamma=3, sampling=sampling, rng=key)
    else:  # the same programs compiled once, inspected, then run
      shapes = sharded_param_shapes(TARGET, DRAFT, mesh)
      compiled = speculative._speculative_jit.lower(  # the engine's one compiled program
          TARGET, target_params, DRAFT, draft_params, prompts, None, key, max_new_tokens=8,
          gamma=3, sampling=sampling, lenience=speculative.Lenience(),
          max_length=TARGET.config.max_decode_length,
          draft_length=speculative.DraftLength()).compile()
      check_param_shardings(compiled.input_shardings[0][0], TARGET, mesh, shape)
      check_param_shardings(compiled.input_shardings[0][1], DRAFT, mesh, shape)
      check_no_param_gather(compiled, shapes, f"speculative {shape}")
      full = sum(x.size * 4 for x in jax.tree.leaves((TARGET_PARAMS, DRAFT_PARAMS)))
      if shape[1] > 1:  # per-device arguments: a share of the weights, not all of them
        assert compiled.memory_analysis().argument_size_in_bytes < 0.75 * full, shape
      spec = compiled(target_params, draft_params, prompts, None, key)
      compiled = sample.lower(draft_params, batch, key).compile()
      check_param_shardings(compiled.input_shardings[0][0], DRAFT, mesh, shape)
      check_no_param_gather(compiled, shapes, f"on-policy sampling {shape}")
      samples = compiled(draft_params, batch, key)
    stats = stats_lib.block_efficiency_stats(spec)  # the evaluation's tau / alpha
    tvd = float(jax.jit(objectives.mean_tvd, static_argnums=(0, 2))(
        TARGET, target_params, DRAFT, draft_params, batch))
    results[shape] = dict(samples=jax.device_get(samples), tokens=np.asarray(spec.tokens),
                          stats=stats, tvd=tvd)
    print(shape, "tau", stats["tau"], "alpha", stats["alpha"], "tvd", tvd, flush=True)
  reference = results[(1, 1)]
  for shape in MESHES:
    got = results[shape]
    for k in reference["samples"]:
      np.testing.assert_array_equal(got["samples"][k], reference["samples"][k], err_msg=k)
    np.testing.assert_array_equal(got["tokens"], reference["tokens"])
    assert got["stats"] == reference["stats"], (shape, got["stats"], reference["stats"])
    np.testing.assert_allclose(got["tvd"], reference["tvd"], rtol=1e-5)


def check_checkpoint():
  """Saved under (4, 2), restored under (2, 4), (8, 1) and one device."""
  directory = tempfile.mkdtemp()
  optimizer = trainer.OptimizerSpec("adafactor", 1e-2, 0, 10, 0.1).make()
  mesh = partitioning.make_mesh(4, 2)
  _, params = place(mesh)
  opt_state = jax.jit(optimizer.init)(params)
  saver = checkpoints.Checkpointer(directory, save_every=1)
  saver.save(1, params, opt_state, {"mesh": [4, 2]}, force=True)
  saver.close()
  for shape in ((2, 4), (8, 1), (1, 1)):
    other = one_device_mesh() if shape == (1, 1) else partitioning.make_mesh(*shape)
    shardings = partitioning.param_shardings(DRAFT, other)
    abstract = checkpoints.abstract_like(DRAFT.param_shapes(), shardings)
    abstract_opt = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=partitioning.replicated(other)),
        jax.eval_shape(optimizer.init, DRAFT.param_shapes()))
    restored, _, meta = checkpoints.Checkpointer(directory).restore(1, abstract, abstract_opt)
    check_param_shardings(restored, DRAFT, other, f"restored under {shape}")
    close(restored, DRAFT_PARAMS, f"restored under {shape}", rtol=0, atol=0)
    assert meta["mesh"] == [4, 2]
    only = checkpoints.restore_params(directory, abstract)
    close(only, DRAFT_PARAMS, f"restore_params under {shape}", rtol=0, atol=0)
    print("restored under", shape, flush=True)
  # Bad input, with the messages the test checks.
  for what, fn in (("batch of 6", lambda: multihost.data_shard(mesh, 6)),
                   ("mesh of 3 x 2", lambda: partitioning.make_mesh(3, 2))):
    try:
      fn()
    except ValueError as error:
      print(f"{what} refused: {error}", flush=True)


if __name__ == "__main__":
  freeze_long_lived()  # the imports are done (collector.py)
  assert jax.device_count() == 8, jax.devices()
  sys.exit(testing.run_checks(
      {"step": check_step, "decode": check_decode, "checkpoint": check_checkpoint},
      sys.argv[1:]))
