"""T5X checkpoints (msgpack + TensorStore zarr, as the public T5 1.1 ones) import exactly."""

import os

import jax
import numpy as np
import pytest
import testing

from distillspec_jax.interop import t5x as t5x_lib
from distillspec_jax.models.model import Model


TINY = testing.T5_TINY


def _flat(tree, prefix=()):
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, prefix + (k,)))
    return out
  return {prefix: np.asarray(tree)}


def _write_t5x_like_public(params, directory):
  """Writes a checkpoint the way T5X does, independently of the code under test.

  `checkpoint` is msgpack {"version": 3, "optimizer": {"target": ..., "state": ...}} where each
  array is replaced by a TensorStore spec with a path relative to the checkpoint directory;
  arrays are zarr (gzip, "<f4", chunked) in directories named `target.encoder.layers_0....`.
  Adafactor-like slots are written too, to check the importer ignores them.
  """
  import tensorstore as ts
  from flax import serialization
  os.makedirs(directory)

  def spec_for(name, array):
    # Split the first axis into 2 chunks when possible: real checkpoints are multi-chunk.
    chunks = list(array.shape)
    if chunks and chunks[0] % 2 == 0:
      chunks[0] //= 2
    return {"driver": "zarr", "dtype": "float32",
            "kvstore": {"driver": "file", "path": name},
            "metadata": {"chunks": chunks, "compressor": {"id": "gzip", "level": 1},
                         "dtype": "<f4", "fill_value": None, "filters": None, "order": "C",
                         "shape": list(array.shape), "zarr_format": 2}}

  def write(tree, keys):
    if isinstance(tree, dict):
      return {k: write(v, keys + (k,)) for k, v in tree.items()}
    array = np.asarray(tree, np.float32)
    name = ".".join(keys)
    spec = spec_for(name, array)
    local = dict(spec, kvstore={"driver": "file", "path": os.path.join(directory, name)})
    ts.open(local, create=True).result().write(array).result()
    return spec

  slots = jax.tree.map(lambda x: np.full(np.shape(x)[-1:], 7.0, np.float32), params)
  state = {"target": write(params, ("target",)),
           "state": {"step": np.int32(1000), "param_states": write(slots, ("state",
                                                                           "param_states"))}}
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize({"version": 3, "optimizer": state}))


@pytest.mark.slow
def test_t5x_layout_imports_exactly(tmp_path):
  params = Model(TINY).init(jax.random.PRNGKey(0))
  ckpt = tmp_path / "model_dir" / "checkpoint_1000"
  _write_t5x_like_public(params, str(ckpt))
  # The on-disk names are T5X's.
  assert (ckpt / "target.encoder.layers_0.attention.query.kernel" / ".zarray").exists()
  assert (ckpt / "target.decoder.logits_dense.kernel").is_dir()
  for path in (str(ckpt), str(ckpt / "checkpoint"), str(tmp_path / "model_dir")):
    loaded = t5x_lib.load_t5x(path, TINY)
    want, got = _flat(params), _flat(loaded)
    assert want.keys() == got.keys()
    for key in want:
      assert got[key].dtype == np.float32
      np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
  assert t5x_lib.is_t5x_checkpoint(str(tmp_path / "model_dir"))
  assert not t5x_lib.is_t5x_checkpoint(str(tmp_path))


def test_relocated_checkpoint_still_loads(tmp_path):
  """Paths in the msgpack are relative: moving the directory must not break the import."""
  params = Model(TINY).init(jax.random.PRNGKey(1))
  _write_t5x_like_public(params, str(tmp_path / "a"))
  os.rename(tmp_path / "a", tmp_path / "b")
  loaded = t5x_lib.load_t5x(str(tmp_path / "b"), TINY)
  np.testing.assert_array_equal(loaded["token_embedder"]["embedding"],
                                np.asarray(params["token_embedder"]["embedding"]))


def test_wrong_shapes_are_refused_with_first_mismatches(tmp_path):
  params = Model(TINY).init(jax.random.PRNGKey(2))
  _write_t5x_like_public(params, str(tmp_path / "ckpt"))
  other = TINY.replace(vocab_size=256)
  with pytest.raises(ValueError) as info:
    t5x_lib.load_t5x(str(tmp_path / "ckpt"), other)
  message = str(info.value)
  assert "decoder/logits_dense/kernel: expected (64, 256), found (64, 128)" in message
  assert "token_embedder/embedding: expected (256, 64), found (128, 64)" in message
  assert "2 mismatches" in message
  with pytest.raises(ValueError, match=r"relpos_bias/rel_embedding: expected \(8, 32\), found \(4, 32\)"):
    t5x_lib.load_t5x(str(tmp_path / "ckpt"), TINY.replace(num_heads=8, head_dim=8))


def test_save_t5x_round_trip_and_orbax_written_checkpoint(tmp_path):
  import orbax.checkpoint as ocp
  params = Model(TINY).init(jax.random.PRNGKey(3))
  directory = t5x_lib.save_t5x(params, str(tmp_path / "t5x"), step=5)
  assert directory.endswith("checkpoint_5")
  loaded = t5x_lib.load_t5x(str(tmp_path / "t5x"), TINY)
  for key, value in _flat(params).items():
    np.testing.assert_array_equal(_flat(loaded)[key], value)

  # An orbax PyTree save with T5X's top-level structure {"target", "state"}.
  orbax_dir = str(tmp_path / "orbax" / "checkpoint_7")
  ocp.PyTreeCheckpointer().save(orbax_dir, {"target": params, "state": {"step": np.int32(7)}})
  loaded = t5x_lib.load_t5x(str(tmp_path / "orbax"), TINY)
  for key, value in _flat(params).items():
    np.testing.assert_array_equal(_flat(loaded)[key], value)


def _shapes(tree):
  return {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _remove_chunks(directory):
  """Deletes every zarr chunk (array data), keeping the .zarray headers."""
  removed = 0
  for root, _, files in os.walk(directory):
    for name in files:
      if not name.startswith(".") and name != "checkpoint" and "." in name:
        os.remove(os.path.join(root, name))
        removed += 1
  return removed


def test_shapes_come_from_metadata_without_reading_arrays(tmp_path):
  """`read_t5x_shapes` reads the msgpack specs (or, without a shape in the spec, the zarr
  header) and orbax metadata: it still works with every array's data deleted."""
  import orbax.checkpoint as ocp
  params = Model(TINY).init(jax.random.PRNGKey(4))
  want = _shapes(params)
  public = str(tmp_path / "public")
  _write_t5x_like_public(params, public)
  t5x_lib.save_t5x(params, str(tmp_path / "ours_writer"), step=2)
  assert _remove_chunks(public) > 0 and _remove_chunks(str(tmp_path / "ours_writer")) > 0
  # The data is really gone: TensorStore reads missing chunks as the fill value.
  gone = t5x_lib.load_t5x(public, TINY)["token_embedder"]["embedding"]
  assert not np.any(gone) and np.any(np.asarray(params["token_embedder"]["embedding"]))
  orbax_dir = str(tmp_path / "orbax" / "checkpoint_7")
  ocp.PyTreeCheckpointer().save(orbax_dir, {"target": params, "state": {"step": np.int32(7)}})
  for path in (public, str(tmp_path / "ours_writer"), str(tmp_path / "orbax")):
    assert _shapes(t5x_lib.read_t5x_shapes(path)) == want, path


def test_shapes_from_the_zarr_header_when_the_spec_has_none(tmp_path):
  from flax import serialization
  params = Model(TINY).init(jax.random.PRNGKey(5))
  directory = t5x_lib.save_t5x(params, str(tmp_path / "t5x"))
  with open(os.path.join(directory, "checkpoint"), "rb") as f:
    tree = serialization.msgpack_restore(f.read())
  strip = lambda t: ({k: strip(v) for k, v in t.items() if k != "metadata"}  # noqa: E731
                     if isinstance(t, dict) else t)
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(strip(tree)))
  _remove_chunks(directory)
  assert _shapes(t5x_lib.read_t5x_shapes(directory)) == _shapes(params)
