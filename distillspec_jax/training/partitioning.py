"""Partitioning: the one place that maps logical axis names to a (data, model) device mesh.

T5X style: every parameter carries logical axis names (`Model.logical_axes()`, e.g.
`('embed', 'mlp')`); `LOGICAL_AXIS_RULES` maps each name to a mesh axis, and flax's
`logical_to_mesh_sharding` turns the tree of names into a tree of `NamedSharding`s.
The batch dimension of every input is split over 'data'; 1-D (data, 1) meshes give plain
data parallelism, (1, n) meshes pure model (tensor) parallelism.

The mesh is a plain `jax.sharding.Mesh` (Auto axes), not `jax.make_mesh`'s Explicit axes:
the models are written for GSPMD-style sharding propagation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distillspec_jax.core.validation import check_field_types, check_positive_int

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)

# Logical axis name -> mesh axis (None = replicated). The standard T5X 1-D model-parallel
# rules: the wide dimensions (vocab, MLP, heads) are split over 'model', d_model is not.
LOGICAL_AXIS_RULES: tuple[tuple[str, Optional[str]], ...] = (
    ("batch", DATA_AXIS),
    ("vocab", MODEL_AXIS),
    ("mlp", MODEL_AXIS),
    ("heads", MODEL_AXIS),
    ("joined_kv", MODEL_AXIS),
    # Key/value heads of grouped-query attention (kind 'llama'): split like the query heads
    # when the model axis divides them, else replicated (logical_to_mesh_spec), so each
    # device keeps every key/value head its query heads read.
    ("kv_heads", MODEL_AXIS),
    ("embed", None),
    ("kv", None),
    ("length", None),
    ("relpos_buckets", None),
    ("acceptance", None),  # the acceptance head's one output (models/acceptance_head.py)
)


def make_mesh(data: int = -1, model: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A (data, model) `Mesh` over `devices` (default: all devices).

  Args:
    data: size of the data axis; -1 = all devices left over after `model`.
    model: size of the model axis.
  Raises:
    ValueError: the sizes do not multiply to the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if model < 1 or n % model:
    raise ValueError(f"model={model} must be >= 1 and divide the {n} available devices; "
                     f"set the model-parallel size to one of {_divisors(n)}.")
  if data == -1:
    data = n // model
  if data < 1 or data * model != n:
    raise ValueError(f"Mesh data={data} x model={model} = {data * model} does not match the "
                     f"{n} available devices; use data * model == {n} (or data=-1).")
  return Mesh(np.asarray(devices).reshape(data, model), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The (data, model) mesh a job lays its parameters and batches on, shared by the three
  binaries (`TrainConfig.mesh`, `PipelineConfig.mesh`, `EvalConfig.mesh`; gin:
  `MeshConfig.data_parallel = %DATA_PARALLEL`, `MeshConfig.model_parallel = %MODEL_PARALLEL`).

  Attributes:
    data_parallel: size of the data axis; -1 = the devices left over after the model axis.
    model_parallel: size of the model axis (it must divide the models' heads, MLP widths and
      vocabulary: check_model_axis).
  """

  data_parallel: int = -1
  model_parallel: int = 1

  def __post_init__(self):
    check_field_types(self)
    if self.data_parallel != -1 and self.data_parallel < 1:
      raise ValueError(f"MeshConfig.data_parallel={self.data_parallel} must be -1 (the devices "
                       "left over) or an integer >= 1 (DATA_PARALLEL).")
    check_positive_int(self.model_parallel, "MeshConfig.model_parallel")

  def make(self, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The mesh over `devices` (default: all); a ValueError naming both sizes and the fix
    when they do not divide them."""
    try:
      return make_mesh(self.data_parallel, self.model_parallel, devices)
    except ValueError as error:
      raise ValueError(f"MeshConfig.data_parallel={self.data_parallel} (DATA_PARALLEL), "
                       f"MeshConfig.model_parallel={self.model_parallel} (MODEL_PARALLEL): "
                       f"{error}") from None


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def logical_to_mesh_spec(logical: PartitionSpec, shape: Sequence[int], mesh: Mesh,
                         rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
  """Mesh PartitionSpec for one parameter; a dimension that the mesh axis does not divide is
  replicated (T5X would fail; tiny test models have e.g. 2 heads on a model axis of 4)."""
  spec = nn.logical_to_mesh_axes(tuple(logical), rules)
  if spec is None:
    return PartitionSpec()
  out = []
  for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    size = 1 if axis is None else int(np.prod([mesh.shape[a] for a in
                                                ((axis,) if isinstance(axis, str) else axis)]))
    out.append(axis if size > 1 and dim % size == 0 else None)
  return PartitionSpec(*out)


def check_rules(rules, mesh: Mesh, logical_names=()) -> None:
  """Refuses rules that name a mesh axis the mesh lacks, and logical names (of a model's
  parameters) that no rule maps, naming them and the known ones."""
  for name, axis in rules:
    axes = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"The logical-axis rule ({name!r}, {axis!r}) names mesh axis "
                       f"{unknown[0]!r}, which the mesh does not have (its axes: "
                       f"{tuple(mesh.axis_names)}); map {name!r} to one of them or None.")
  ruled = {name for name, _ in rules}
  missing = sorted({n for n in logical_names if n is not None and n not in ruled})
  if missing:
    raise ValueError(f"No logical-axis rule for {missing}; add ({missing[0]!r}, mesh axis or "
                     f"None) to the rules (known logical names: {sorted(ruled)}).")


def param_shardings(model, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
  """Tree (same structure as the params) of `NamedSharding` from `model.logical_axes()`."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  logical = model.logical_axes()
  check_rules(rules, mesh, {n for spec in jax.tree.leaves(logical, is_leaf=is_spec)
                            for n in tuple(spec)})
  shapes = model.param_shapes()
  specs = jax.tree.map(lambda spec, s: logical_to_mesh_spec(spec, s.shape, mesh, rules),
                       logical, shapes, is_leaf=is_spec)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)


def _dict_keys(path) -> tuple:
  """The trailing dict keys of a tree path (an optax state's copy of the params' paths)."""
  keys = []
  for key in reversed(path):
    if not isinstance(key, jax.tree_util.DictKey):
      break
    keys.append(key.key)
  return tuple(reversed(keys))


def optimizer_state_shardings(opt_state_shapes: Any, param_shapes: Any, params_shardings: Any,
                              mesh: Mesh) -> Any:
  """Shardings of an optimizer state that follow its parameters' (T5X style).

  A state leaf under the same dict path as a parameter (optax's mu / nu / v trees) gets the
  parameter's spec when it has the parameter's shape, and the spec without the reduced
  dimension when its shape is the parameter's minus one dimension (Adafactor's factored
  v_row / v_col). Anything else (step counts, Adafactor's (1,) placeholders) is replicated.
  XLA cannot infer these: an initial state of zeros does not depend on the parameters.
  """
  params = {_dict_keys(path): (tuple(shape.shape), sharding.spec) for (path, shape), sharding
            in zip(jax.tree_util.tree_flatten_with_path(param_shapes)[0],
                   jax.tree.leaves(params_shardings))}

  def pick(path, leaf):
    keys, shape = _dict_keys(path), tuple(leaf.shape)
    for start in range(len(keys)):
      if keys[start:] not in params:
        continue
      param_shape, spec = params[keys[start:]]
      spec = tuple(spec) + (None,) * (len(param_shape) - len(spec))
      if shape == param_shape:
        return NamedSharding(mesh, PartitionSpec(*spec))
      for i in range(len(param_shape)):
        if shape == param_shape[:i] + param_shape[i + 1:]:
          return NamedSharding(mesh, PartitionSpec(*(spec[:i] + spec[i + 1:])))
      break
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(pick, opt_state_shapes)


def flax_param_shardings(model, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
  """The unadjusted flax mapping (`nn.logical_to_mesh_sharding`), for shapes the mesh divides."""
  return nn.logical_to_mesh_sharding(model.logical_axes(), mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Inputs [batch, ...]: rows split over 'data', everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.shape[DATA_AXIS]:
    raise ValueError(f"batch_size={batch_size} is not divisible by the data-parallel mesh size "
                     f"{mesh.shape[DATA_AXIS]}; use a multiple of it or a smaller data axis.")


def shard_batch(batch: dict, mesh: Mesh) -> dict:
  """Puts a host NumPy batch on the mesh, rows split over 'data'."""
  sharding = batch_sharding(mesh)
  return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}


def check_model_axis(models: dict, mesh: Mesh) -> None:
  """Refuses a model axis that does not divide every width the rules split over 'model'
  (heads, MLP widths, vocabulary) of each of `models` ({role: Model}), naming the role, the
  width and the model-axis sizes that would divide them all (T5X fails on these too).

  A Llama-family model's key/value heads (`num_kv_heads`) need not divide: with grouped-query
  attention there are often fewer of them than model-axis devices, and `logical_to_mesh_spec`
  then keeps them whole on every device (MaxText does the same), which costs memory, not
  correctness (tests/test_llama_mesh.py runs 2 and 1 kv heads on a model axis of 4)."""
  size = mesh.shape[MODEL_AXIS]
  if size == 1:
    return
  widths = {}
  for role, model in models.items():
    c = getattr(model.config, "layer_config", model.config)  # a draft head: its layer's
    for name, value in (("num_heads", c.num_heads), ("mlp_dim", c.mlp_dim),
                        ("encoder_mlp_dim", getattr(c, "encoder_mlp_width", c.mlp_dim)),
                        ("vocab_size", c.vocab_size)):
      widths[f"the {role}'s {name}={value}"] = int(value)
  bad = [name for name, value in widths.items() if value % size]
  if bad:
    devices = mesh.devices.size
    valid = [d for d in _divisors(devices) if all(v % d == 0 for v in widths.values())]
    raise ValueError(f"MODEL_PARALLEL={size} does not divide {', '.join(bad)}; the model axis "
                     f"splits heads, MLP and vocabulary. Use a model axis of {valid} "
                     f"(--gin.MODEL_PARALLEL=...; DATA_PARALLEL=-1 takes the rest of the "
                     f"{devices} devices).")
