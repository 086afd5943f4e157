"""Multi-host runs, T5X style: one process per host, every process runs the same program.

All multi-host helpers live here; binaries call `initialize_from_flags(argv)` first, before
anything touches a JAX backend.

Flags (the T5X names), parsed by `initialize_from_flags`:
  --coordinator_address=HOST:PORT   process 0's address (it serves the coordination service)
  --process_count=N                 number of processes (hosts)
  --process_index=I                 this process, 0 <= I < N
  --initialization_timeout=S        seconds to wait for all processes (default 300)
  --heartbeat_timeout=S             seconds after which a silent peer counts as dead (100)

With none of them: on a Cloud TPU VM (libtpu installed) `jax.distributed.initialize()` is
called with no arguments (JAX finds the slice itself); anywhere else the run is a single
process. On GPU clusters pass all three coordinator flags on every node.

Data: every process reads only the rows of the global batch its devices hold
(`data_shard(mesh, batch_size)`: T5X's data layout; processes whose devices hold the same
rows, e.g. a model axis spanning hosts, read the same shard), and the global batch is built
with `jax.make_array_from_process_local_data` (`global_batch`).

Writes: process 0 is the only writer of metrics, TensorBoard, stage markers, reports and
plots (`is_primary()`); `barrier(name)` makes the others wait where they read what it wrote.
Orbax checkpoints are saved and restored by all processes together (each writes its shards).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import socket
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

from distillspec_jax.training import partitioning

DEFAULT_INITIALIZATION_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
DEFAULT_BARRIER_TIMEOUT_S = 3600
FLAGS = ("coordinator_address", "process_count", "process_index", "initialization_timeout",
         "heartbeat_timeout")


class MultihostError(RuntimeError):
  """A multi-host setup that cannot work; the message names the value and the fix."""


def _on_tpu_vm() -> bool:
  """libtpu installed: a Cloud TPU VM, where jax.distributed finds the slice by itself."""
  return importlib.util.find_spec("libtpu") is not None


def _positive_int(value, name: str) -> int:
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise MultihostError(f"--{name}={value!r} is not an integer; pass e.g. --{name}=2.") from None
  if isinstance(value, bool) or number != float(value) or number < 0:
    raise MultihostError(f"--{name}={value!r} must be a non-negative integer.")
  return number


def check_coordinator_address(address: str) -> tuple[str, int]:
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise MultihostError(f"--coordinator_address={address!r} is not HOST:PORT; pass process "
                         "0's address with a free port, e.g. --coordinator_address=10.0.0.2:1234.")
  return host, int(port)


def _check_port_free(host: str, port: int, address: str) -> None:
  """Process 0 serves the coordinator on every interface at `port`: it must be free."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    try:
      probe.bind(("", port))
    except OSError as error:
      raise MultihostError(
          f"Process 0 cannot serve the coordinator at --coordinator_address={address}: port "
          f"{port} cannot be bound on this host ({error}). Pick a free port (the same on every "
          "process).") from error


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Waits until process 0's coordinator at `address` accepts connections.

  jax.distributed aborts the whole process (a C++ fatal error) when it cannot register in
  time; this probe first turns an unreachable coordinator into a MultihostError that names
  the address."""
  host, port = check_coordinator_address(address)
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    try:
      with socket.create_connection((host.strip("[]"), port), timeout=1.0):
        return
    except OSError as error:
      last = error
    if time.monotonic() >= deadline:
      raise MultihostError(
          f"The coordinator at --coordinator_address={address} was not reachable within "
          f"--initialization_timeout={timeout_s:g} s ({last}). Start process 0 with the same "
          "address, check the host name / IP and that the port is open between the hosts, or "
          "raise --initialization_timeout.")
    time.sleep(0.25)


def initialize(coordinator_address: Optional[str] = None, process_count: Optional[int] = None,
               process_index: Optional[int] = None, *,
               initialization_timeout: int = DEFAULT_INITIALIZATION_TIMEOUT_S,
               heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
  """Starts jax.distributed for this process (see the module docstring for the cases).

  Raises:
    MultihostError: incomplete or inconsistent flags; a coordinator that cannot be reached
      within `initialization_timeout` seconds (the message names the address).
  """
  given = {"coordinator_address": coordinator_address, "process_count": process_count,
           "process_index": process_index}
  if all(v is None for v in given.values()):
    if _on_tpu_vm():
      logging.info("TPU VM: jax.distributed.initialize() with no arguments.")
      jax.distributed.initialize()
    return
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise MultihostError(
        f"Multi-host flags {', '.join('--' + k for k in missing)} missing (given: "
        + ", ".join(f"--{k}={v}" for k, v in given.items() if v is not None)
        + "); pass all of --coordinator_address=HOST:PORT, --process_count=N and "
        "--process_index=I on every process (or none of them on a TPU VM or a single host).")
  check_coordinator_address(coordinator_address)
  count = _positive_int(process_count, "process_count")
  index = _positive_int(process_index, "process_index")
  if count < 1:
    raise MultihostError(f"--process_count={process_count} must be >= 1.")
  if not 0 <= index < count:
    raise MultihostError(f"--process_index={process_index} must lie in [0, {count}) for "
                         f"--process_count={count}; number the processes 0..{count - 1}.")
  timeout = _positive_int(initialization_timeout, "initialization_timeout")
  heartbeat = _positive_int(heartbeat_timeout, "heartbeat_timeout")
  host, port = check_coordinator_address(coordinator_address)
  start = time.monotonic()
  if index == 0:
    _check_port_free(host, port, coordinator_address)
  else:
    wait_for_coordinator(coordinator_address, timeout)
  remaining = max(int(timeout - (time.monotonic() - start)), 1)
  # Said before the call: if a process never joins, jax.distributed ends this process with a
  # fatal error after the timeout, which does not name the address.
  logging.warning("Process %d of %d joining the coordinator at %s (timeout %d s).", index,
                  count, coordinator_address, remaining)
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=count, process_id=index,
        cluster_detection_method="deactivate", initialization_timeout=remaining,
        heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=max(heartbeat, 10))
  except Exception as error:  # XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE) and others
    raise MultihostError(
        f"Process {index} of {count} could not join the coordinator at "
        f"--coordinator_address={coordinator_address} within --initialization_timeout="
        f"{timeout} s ({type(error).__name__}: {str(error).splitlines()[0][:300]}). Check that "
        "process 0 runs with the same address and --process_count, that the host is "
        "reachable and the port free/open, and that every process started.") from error
  logging.info("jax.distributed: process %d of %d, coordinator %s, %d local devices of %d.",
               jax.process_index(), jax.process_count(), coordinator_address,
               jax.local_device_count(), jax.device_count())


def parse_flags(argv: Sequence[str]) -> tuple[dict, list[str]]:
  """Splits the multi-host flags (`--name=value` or `--name value`) out of argv."""
  values, rest = {}, []
  args = list(argv)
  i = 0
  while i < len(args):
    name, eq, value = args[i].partition("=")
    key = name[2:] if name.startswith("--") else None
    if key in FLAGS:
      if not eq:
        if i + 1 >= len(args):
          raise MultihostError(f"--{key} needs a value, e.g. --{key}=VALUE.")
        value, i = args[i + 1], i + 1
      values[key] = value
    else:
      rest.append(args[i])
    i += 1
  return values, rest


def initialize_from_flags(argv: Sequence[str]) -> list[str]:
  """Parses the multi-host flags of argv, initializes, returns the other arguments.

  Call first in a binary's main, before any other JAX call (the backend must not be started
  before jax.distributed)."""
  values, rest = parse_flags(argv)
  initialize(values.get("coordinator_address"), values.get("process_count"),
             values.get("process_index"),
             initialization_timeout=values.get("initialization_timeout",
                                               DEFAULT_INITIALIZATION_TIMEOUT_S),
             heartbeat_timeout=values.get("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT_S))
  return rest


def is_primary() -> bool:
  """Process 0: the one writer of metrics, TensorBoard, markers, reports and plots."""
  return jax.process_index() == 0


_BARRIER_COUNTS: dict = {}


def barrier(name: str, timeout_s: int = DEFAULT_BARRIER_TIMEOUT_S) -> None:
  """All processes wait here until every one arrives (no-op for one process).

  Uses the coordination service's barrier (bounded by `timeout_s`: a dead peer gives an
  error naming the barrier, not a hang). Every process must call the same barriers in the
  same order; repeated names are numbered."""
  if jax.process_count() == 1:
    return
  count = _BARRIER_COUNTS.get(name, 0)
  _BARRIER_COUNTS[name] = count + 1
  from jax._src import distributed  # the coordination-service client (as orbax uses it)
  client = distributed.global_state.client
  barrier_id = f"distillspec:{name}:{count}"
  if client is None:  # processes wired by another mechanism: a device collective
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(barrier_id)
    return
  try:
    client.wait_at_barrier(barrier_id, timeout_in_ms=int(timeout_s * 1000))
  except Exception as error:
    raise MultihostError(
        f"Barrier {name!r} failed on process {jax.process_index()} of {jax.process_count()} "
        f"(timeout {timeout_s} s; {type(error).__name__}: {str(error).splitlines()[0][:300]}): "
        "another process failed, stopped or is still busy past the timeout. See the other "
        "processes' logs.") from error


def all_gather_objects(value: Any) -> list:
  """Every process's `value` (a picklable object: small host data such as texts, row
  positions, lengths), in process order, on every process ([value] for one process). Every
  process must call it at the same point. The objects travel pickled between the processes
  of one job (trusted peers)."""
  if jax.process_count() == 1:
    return [value]
  import pickle
  from jax.experimental import multihost_utils
  data = np.frombuffer(pickle.dumps(value), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, longest]
  return [pickle.loads(every[p, :int(sizes[p, 0])].tobytes()) for p in range(len(every))]


# --- data ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataShard:
  """The rows of a global batch this process reads: [row_start, row_start + local_batch_size).

  index / num_shards: seqio's ShardInfo (processes holding the same rows share an index)."""

  index: int
  num_shards: int
  local_batch_size: int
  global_batch_size: int

  @property
  def row_start(self) -> int:
    return self.index * self.local_batch_size

  @property
  def rows(self) -> slice:
    return slice(self.row_start, self.row_start + self.local_batch_size)

  def shard_info(self):
    """seqio.ShardInfo(index, num_shards) for `seqio.get_dataset(shard_info=...)`."""
    import seqio  # TF only when a streamed task is read
    return seqio.ShardInfo(index=self.index, num_shards=self.num_shards)


def data_shard(mesh: jax.sharding.Mesh, batch_size: int) -> DataShard:
  """This process's shard of a [batch_size, ...] batch split over the mesh's 'data' axis."""
  partitioning.check_batch_size(batch_size, mesh)
  sharding = partitioning.batch_sharding(mesh)
  slices = sharding.addressable_devices_indices_map((batch_size,)).values()
  starts = sorted({s[0].start or 0 for s in slices})
  stops = sorted({batch_size if s[0].stop is None else s[0].stop for s in slices})
  start, stop = starts[0], stops[-1]
  local = stop - start
  per_device = batch_size // mesh.shape[partitioning.DATA_AXIS]
  if len(starts) * per_device != local or batch_size % local:
    raise MultihostError(
        f"Process {jax.process_index()}'s devices hold the non-contiguous rows starting at "
        f"{starts} of a batch of {batch_size}; build the mesh with "
        "partitioning.make_mesh (devices ordered by process).")
  return DataShard(index=start // local, num_shards=batch_size // local,
                   local_batch_size=local, global_batch_size=batch_size)


def global_batch(local_batch: dict, mesh: jax.sharding.Mesh, shard: DataShard) -> dict:
  """Global arrays [global_batch_size, ...] split over 'data' from this process's rows."""
  sharding = partitioning.batch_sharding(mesh)
  out = {}
  for key, value in local_batch.items():
    value = np.asarray(value)
    if value.shape[0] != shard.local_batch_size:
      raise ValueError(f"{key}: this process's data gave {value.shape[0]} rows but its shard "
                       f"holds {shard.local_batch_size} (global batch {shard.global_batch_size}"
                       f" over {shard.num_shards} data shards); make the data source return "
                       "local_batch_size rows.")
    out[key] = jax.make_array_from_process_local_data(
        sharding, value, (shard.global_batch_size,) + value.shape[1:])
  return out


def put_global(tree: Any, shardings: Any) -> Any:
  """Places a tree of arrays on (possibly multi-process) shardings without donating them.

  Arrays already laid out as asked are copied on device; host or single-device values are
  put directly with one process, and sliced on the host into each process's own shards with
  several (`jax.make_array_from_callback`: no device holds the whole array)."""
  def put(x, sharding):
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return jax.device_put(x, sharding, may_alias=False)
    if jax.process_count() == 1 or sharding.is_fully_addressable:
      return jax.device_put(x, sharding, may_alias=False)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(put, tree, shardings)
