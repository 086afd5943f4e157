"""Quick XLA compilation for the tests: the backend at optimisation level 0, no expensive
LLVM passes (`jax_disable_most_optimizations`).

For modules of many tiny programs, compiling costs more than running: tests/test_speculative.py
and tests/test_eval.py took 164 s instead of 236 s. It changes how fast the programs run, not
the math they compute; rounding can differ in the last bits, so every process whose results
are compared bit for bit must compile the same way. conftest.py switches it on for every
process of a test run (this process, the workers, and through the environment every process
a test starts); the worker scripts the tests start set it themselves as well (mesh_worker.py,
multihost_worker.py, the teacher-cache writer in test_teacher_cache.py).
"""

import jax
from jax._src import compiler  # noqa: F401  (registers the flag)

FLAG = "jax_disable_most_optimizations"
# XLA's CPU code generation by its older elemental emitters instead of its fusion emitters:
# at optimisation level 0 it halves the compile time of the suite's tiny programs (the tiny
# pairs' speculative and plain decodes of tests/test_speculative.py: 8.6 s of CPU instead of
# 17.1 s). XLA reads XLA_FLAGS when its backend starts, so conftest.py sets it for the whole
# run (workers and every process they start inherit it); tests that start a process with its
# own XLA_FLAGS add these (`xla_flags`), except the memory measurements (test_memory_table.py,
# test_remat_precision.py's temporaries), which compile as a user does.
#
# And each program's LLVM module compiled whole (`parallel_codegen_split_count=1`) instead of
# split into parts for parallel code generation: the parts cost more to compile than one
# module, and the suite's workers already fill the cores (17% less CPU for the tiny pairs'
# decodes of tests/test_speculative.py). Neither changes the instructions' math.
QUICK_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_parallel_codegen_split_count=1")
# The same switch as an environment variable, read by every process JAX starts in.
ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def set_fast_compilation(on: bool) -> bool:
  """Switches quick compilation on or off for this process; returns the previous setting."""
  previous = jax.config.read(FLAG)
  jax.config.update(FLAG, on)
  return previous


def xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a process a test starts: QUICK_XLA_FLAGS, then `flags`."""
  return " ".join((QUICK_XLA_FLAGS,) + flags)
