"""Quick XLA compilation for the tests: the backend at optimisation level 0, no expensive
LLVM passes (`jax_disable_most_optimizations`).

For modules of many tiny programs, compiling costs more than running: tests/test_speculative.py
and tests/test_eval.py took 164 s instead of 236 s. It changes how fast the programs run, not
the math they compute; rounding can differ in the last bits, so every process whose results
are compared bit for bit must compile the same way. Used by conftest.py's `fast_compilation`
fixture (which also sets it in the environment for the processes its tests start) and by the
worker scripts the tests start (mesh_worker.py, multihost_worker.py, the teacher-cache writer in
test_teacher_cache.py).
"""

import jax
from jax._src import compiler  # noqa: F401  (registers the flag)

FLAG = "jax_disable_most_optimizations"
# The same switch as an environment variable, read by every process JAX starts in.
ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def set_fast_compilation(on: bool) -> bool:
  """Switches quick compilation on or off for this process; returns the previous setting."""
  previous = jax.config.read(FLAG)
  jax.config.update(FLAG, on)
  return previous
