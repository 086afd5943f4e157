"""Pinning a process to cores, and running a function in a fresh pinned process.

XLA sizes its CPU thread pools from the cores a process may use when JAX starts, so a timing
process is pinned before its first computation (`pin_cores`), or started fresh and pinned
(`start_pinned`, `run_pinned`). This module imports no JAX, so it can pin before JAX starts.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable


def pin_cores(count: int) -> list:
  """Restricts this process to its last `count` allowed cores (0: leaves it as it is) and
  returns the cores it may use.

  Must run before JAX's first computation: XLA sizes its CPU thread pools from the cores the
  process may use. On the 2-vCPU VMs this project is developed on, the intra-op pool hands the
  small models' microsecond kernels between two threads; one core is as fast or faster for
  every decoding quantity and its timings vary less (docs/benchmarks.md).
  """
  allowed = sorted(os.sched_getaffinity(0))
  if count <= 0:
    return allowed
  check_cores(count)
  os.sched_setaffinity(0, allowed[-count:])
  return allowed[-count:]


def check_cores(count: int, name: str = "cpus") -> None:
  """Refuses pinning to more cores than this process may use, naming `name` and the fix
  (a job checks it before training, not when its timing starts)."""
  allowed = sorted(os.sched_getaffinity(0))
  if count > len(allowed):
    raise ValueError(f"{name}={count} but this process may use only {len(allowed)} cores "
                     f"({allowed}); pass at most {len(allowed)}, or 0 for no pinning.")


def timing_cpus(cpus: int, process_count: int) -> int:
  """The cores to time on: `cpus`, except that a job of several processes never times in
  its own process (0 counts as 1): the timing reads checkpoints by itself, and in a job of
  several processes a checkpoint read is a collective that every process must join."""
  return cpus if process_count == 1 else max(cpus, 1)


def machine_info() -> dict:
  """{"cpus": cores of the machine, "pinned": cores this process may use}."""
  return {"cpus": os.cpu_count(), "pinned": sorted(os.sched_getaffinity(0))}


# In a process started by `start_pinned`: the event its parent sets to let it time.
_RELEASE = None


def _start_child(cpus: int, release) -> None:
  global _RELEASE
  pin_cores(cpus)
  _RELEASE = release


def wait_for_release() -> None:
  """In a process started by `start_pinned`: blocks until the parent calls `release()` (or
  `result()`); anywhere else returns at once. Pass it as `measure_speed`'s `before_timing`."""
  if _RELEASE is not None:
    _RELEASE.wait()


class PinnedRun:
  """`function(*args, **kwargs)` started in a fresh process pinned to `cpus` cores, so that
  its loading and compiling overlap the caller's own work; `release()` lets it pass
  `wait_for_release()` (where it starts timing), `result()` releases it and returns what it
  returned (or raises what it raised). With cpus <= 0 the function runs in this process,
  unpinned, inside `result()`. Use as a context manager: leaving it early stops the child."""

  def __init__(self, cpus: int, function: Callable, *args, **kwargs):
    self._call = (function, args, kwargs)
    self._pool = self._async = None
    if cpus > 0:
      context = multiprocessing.get_context("spawn")
      self._release = context.Event()
      self._pool = context.Pool(1, initializer=_start_child, initargs=(cpus, self._release))
      self._async = self._pool.apply_async(function, args, kwargs)

  def release(self) -> None:
    if self._pool is not None:
      self._release.set()

  def result(self):
    if self._pool is None:
      function, args, kwargs = self._call
      return function(*args, **kwargs)
    self.release()
    try:
      return self._async.get()
    finally:
      self._pool.close()
      self._pool.join()
      self._pool = None

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    if self._pool is not None:  # left before result(): stop the child
      self._pool.terminate()
      self._pool.join()
      self._pool = None


def start_pinned(cpus: int, function: Callable, *args, **kwargs) -> PinnedRun:
  """A `PinnedRun` of `function` (module-level and picklable, with picklable arguments; it
  must load what it needs itself, since the child starts empty)."""
  return PinnedRun(cpus, function, *args, **kwargs)


def run_pinned(cpus: int, function: Callable, *args, **kwargs):
  """`function(*args, **kwargs)` in a fresh process pinned to `cpus` cores (0: in this
  process, unpinned); see `start_pinned`."""
  with start_pinned(cpus, function, *args, **kwargs) as run:
    return run.result()
