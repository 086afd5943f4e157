"""Suite-wide setup: one JAX compilation cache shared by every test process of a run.

Many tests compile the same tiny programs (the same model's decode loop, the same trainer
step) in different workers and in the child processes they start (pinned timing children,
multi-host workers, binaries run as subprocesses). XLA's persistent cache, keyed on the
compiled program, lets each one be compiled once per run. The directory is new for every
run (made by the controlling process, inherited by workers and children through the
environment) so that a run never reuses another run's programs, and it is removed at the end.
Set DISTILLSPEC_TEST_COMPILATION_CACHE=0 to switch it off. Every process of the run also
compiles quickly (compilation.py): QUICK_XLA_FLAGS in XLA_FLAGS and jax's
`jax_disable_most_optimizations` through its environment variable, both set here before any
backend starts and inherited by the workers and every process a test starts. It changes how
fast the programs run, not what they compute; the memory measurements, which depend on the
optimised program, strip both from the environment of the process they start, and a module
marked `optimized_compilation` (its programs run longer than they compile) opts out.

Tiers (tests/README.md): a test that runs a binary, a pipeline, several processes or
simulated devices is marked `integration`; one that compiles a whole decoding or training
loop (a second or more) is marked `slow`, and so counts every integration test (added here),
so that `-m "not slow"` is the unit tier.

Shared fixtures (builders in tests/testing.py): `shared_stages`, the main job's vocab, target
and raw draft trained once per run for the whole-pipeline tests (marked `pipeline`).
"""

import gc
import os
import shutil
import tempfile

import pytest

_OWNER = "_DISTILLSPEC_TEST_CACHE_OWNER"


def pytest_configure(config):
  # Before any JAX backend starts (compilation.py).
  from compilation import ENV, QUICK_XLA_FLAGS, set_fast_compilation
  if QUICK_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
  os.environ[ENV] = "1"
  set_fast_compilation(True)  # jax is imported already: its flag read the variable before
  if os.environ.get("DISTILLSPEC_TEST_COMPILATION_CACHE", "1") == "0":
    return
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # a worker: the controller made it
    return
  directory = tempfile.mkdtemp(prefix="distillspec_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  os.environ[_OWNER] = str(os.getpid())


@pytest.hookimpl(tryfirst=True)  # the marks it adds are there before `-m` deselects
def pytest_collection_modifyitems(config, items):
  """Whole-pipeline tests, then the other long ones (marked `long`), then the rest, each
  group in collection order: pytest-xdist's workers then start on the long tests and end
  together on short ones, instead of one worker running a multi-minute test alone at the
  end of the run."""
  unmarked = [item.nodeid for item in items if item.get_closest_marker("pipeline")
              and not item.get_closest_marker("integration")]
  if unmarked:
    raise pytest.UsageError(f"tests marked 'pipeline' but not 'integration': {unmarked}")
  for item in items:
    if item.get_closest_marker("integration") and not item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.slow)

  def group(item):
    if item.get_closest_marker("pipeline"):
      return 0
    return 1 if item.get_closest_marker("long") else 2
  items.sort(key=group)  # stable


def pytest_collection_finish(session):
  """Python's garbage collector stops re-walking the long-lived heap (collector.py): full
  collections took 10.9 of the 128 CPU s of nine unit modules, 2.3 s after."""
  from collector import freeze_long_lived
  freeze_long_lived()


def pytest_unconfigure(config):
  directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if directory and os.environ.get(_OWNER) == str(os.getpid()):
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """After each module, JAX's in-memory caches of compiled programs are dropped: a worker runs
  hundreds of modules, and without this it held more than 5 GB a tenth of the way into a
  run. A later module that needs a program again reads it from the run's persistent
  compilation cache instead of compiling it. What is still alive then is frozen out of the
  garbage collector's walks (collector.py)."""
  yield
  import jax
  jax.clear_caches()
  gc.collect()
  gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _optimized_compilation(request):
  """Quick compilation off for a module marked `optimized_compilation` (its programs run long
  enough for XLA's optimisations to pay: tests/test_sampler.py's millions of draws run 3x
  slower without them), in this process and in the processes its tests start."""
  if request.node.get_closest_marker("optimized_compilation") is None:
    yield
    return
  from compilation import ENV, set_fast_compilation
  previous = set_fast_compilation(False)
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv(ENV, "0")
    yield
  set_fast_compilation(previous)


@pytest.fixture(scope="session")
def shared_stages(request, tmp_path_factory):
  """(run_dir, outcome) of testing.train_shared_stages: the main job's vocab, target and raw
  draft on testing.PIPELINE settings, trained once per test run (once for all pytest-xdist
  workers: their temporary folders share a parent) and never written to afterwards; tests
  copy them (testing.copy_stages) or name them as a study's reuse_run_dir."""
  import testing
  root = tmp_path_factory.getbasetemp()
  if hasattr(request.config, "workerinput"):  # a pytest-xdist worker's is <run>/popen-gwN
    root = root.parent
  return testing.train_shared_stages(str(root / "shared_pipeline_stages"))
