"""Where an evaluation batch lives on a (data, model) mesh, in one process or across several.

  place = BatchPlacement(mesh, batch_size)      # examples.read_examples returns it too
  tokens = place.put(prompts)                   # [batch_size, P] host rows -> a global array
  result = place.gather(decode(..., encoder_input_tokens=tokens, rng=place.key(rng)))

The rows of each batch are split over the mesh's 'data' axis when it divides the batch
(else every device decodes the whole batch). With several processes (one mesh spanning
them, `partitioning.make_mesh` over `jax.devices()`) each process hands the decoders only
the rows its devices hold (`multihost.data_shard`: T5X's data layout), and the outputs are
gathered back to every process (`multihost_utils.process_allgather`), which then all score
the same texts; the callers let process 0 alone write. Every decode is the same program as
on one process with the same mesh shape, so the outputs are identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from distillspec_jax.training import multihost
from distillspec_jax.training import partitioning


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
  """One evaluation batch size's layout on `mesh` (see the module docstring).

  Attributes:
    mesh: the (data, model) mesh the models' parameters are on (all processes' devices).
    batch_size: the rows of every batch the decoders see (the last batch is padded to it).
  """

  mesh: jax.sharding.Mesh
  batch_size: int

  @property
  def split(self) -> bool:
    """Whether the rows go over 'data' (its size divides the batch), else replicated."""
    return self.batch_size % self.mesh.shape[partitioning.DATA_AXIS] == 0

  @property
  def sharding(self) -> jax.sharding.NamedSharding:
    if self.split:
      return partitioning.batch_sharding(self.mesh)
    return partitioning.replicated(self.mesh)

  @property
  def rows(self) -> slice:
    """The rows of a batch this process's devices hold (all of them when not split)."""
    if not self.split or jax.process_count() == 1:
      return slice(0, self.batch_size)
    return multihost.data_shard(self.mesh, self.batch_size).rows

  def put(self, array) -> jax.Array:
    """A [batch_size, ...] host array as a global array laid out by `sharding`; this
    process reads only `rows` of it."""
    array = np.asarray(array)
    if array.shape[0] != self.batch_size:
      raise ValueError(f"An evaluation batch has {array.shape[0]} rows; this placement is for "
                       f"batches of {self.batch_size} (pad the last batch to it).")
    if jax.process_count() == 1:
      return jax.device_put(array, self.sharding)
    return jax.make_array_from_process_local_data(self.sharding, array[self.rows],
                                                  array.shape)

  def key(self, rng: jax.Array) -> jax.Array:
    """A PRNG key (or any small array) replicated on every device of the mesh."""
    if jax.process_count() == 1:
      return rng
    return multihost.put_global(np.asarray(rng), partitioning.replicated(self.mesh))

  def gather(self, tree: Any) -> Any:
    """The decoders' outputs as host arrays, every row on every process."""
    if jax.process_count() == 1:
      return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
