"""Partitioning: logical-axis rules, the (data, model) mesh, a sharded train step on 8 CPUs.

The 8-device part runs in a subprocess because XLA_FLAGS must be set before jax starts;
the rest of the suite keeps one device.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from compilation import xla_flags

from distillspec_jax.training import partitioning


def test_rules_are_the_t5x_1d_model_parallel_rules():
  rules = dict(partitioning.LOGICAL_AXIS_RULES)
  assert rules["batch"] == "data"
  for name in ("vocab", "mlp", "heads", "joined_kv"):
    assert rules[name] == "model"
  for name in ("embed", "kv", "length", "relpos_buckets"):
    assert rules[name] is None


def test_single_device_mesh_and_errors():
  mesh = partitioning.make_mesh()
  assert mesh.axis_names == ("data", "model") and mesh.devices.size == jax.device_count()
  with pytest.raises(ValueError, match="model=3"):
    partitioning.make_mesh(model=3)
  with pytest.raises(ValueError, match="data=2 x model=1"):
    partitioning.make_mesh(data=2, model=1)


SCRIPT = textwrap.dedent("""
    import os
    import jax, numpy as np, tempfile
    from jax.sharding import PartitionSpec as P
    from distillspec_jax.training import partitioning
    from distillspec_jax.training import trainer
    from distillspec_jax.distill import objectives
    from distillspec_jax.models.model import Model
    assert jax.device_count() == 8, jax.devices()
    mesh = partitioning.make_mesh(data=4, model=2)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert type(mesh) is jax.sharding.Mesh
    model = Model.from_name("tiny_encoder_decoder", vocab_size=64)
    shardings = partitioning.param_shardings(model, mesh)
    specs = jax.tree.map(lambda s: s.spec, shardings)
    assert specs["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"] == P(None, "model"), specs
    assert specs["decoder"]["layers_0"]["mlp"]["wo"]["kernel"] == P("model", None)
    assert specs["token_embedder"]["embedding"] == P("model", None)
    assert specs["decoder"]["logits_dense"]["kernel"] == P(None, "model")
    assert specs["encoder"]["layers_0"]["attention"]["query"]["kernel"] == P(None, "model")
    assert specs["decoder"]["decoder_norm"]["scale"] == P(None)
    # Same as flax's own mapping wherever the mesh divides the dimension.
    flax_specs = jax.tree.map(lambda s: s.spec, partitioning.flax_param_shardings(model, mesh))
    assert flax_specs["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"] == P(None, "model")
    batch = partitioning.shard_batch(trainer.SyntheticData(8, vocab_size=64).batch_at(0), mesh)
    assert batch["decoder_target_tokens"].sharding.spec == P("data")
    # A real sharded distillation run (all sources) on the (4, 2) mesh.
    target = model
    draft = Model.from_name("demo_draft", vocab_size=64)
    config = trainer.TrainConfig(model_dir=tempfile.mkdtemp(), train_steps=4, batch_size=8,
        optimizer="adafactor", learning_rate=1e-2, warmup_steps=0, decay_steps=10,
        save_every=2, log_every=2, progress_bar=False,
        mesh=partitioning.MeshConfig(data_parallel=4, model_parallel=2))
    result = trainer.distill(config, target, target.init(jax.random.PRNGKey(1)), draft,
        trainer.SyntheticData(8, vocab_size=64), objectives.DistillationConfig(lambda1=0.3, lambda2=0.5))
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert all(np.isfinite(losses)), losses
    kernel = result.state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "model"), kernel.sharding
    assert len(kernel.sharding.device_set) == 8
    print("OK", losses)
""")


@pytest.mark.integration
def test_eight_device_mesh_in_subprocess():
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 0, out.stderr[-4000:]
  assert "OK" in out.stdout
