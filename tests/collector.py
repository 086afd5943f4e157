"""Python's cyclic garbage collector tuned for the suite's processes, which hold half a million
long-lived objects (JAX, Flax, TensorFlow through seqio, the package) and trace programs all
the time: each full collection walked that whole heap again (about a tenth of a unit module's
CPU). conftest.py calls `freeze_long_lived` once the test modules are imported (and freezes
again after each module); the worker scripts that tests start call it once their imports are
done. Garbage is freed as before; only cycles among the frozen long-lived objects would no
longer be."""

import gc


def freeze_long_lived() -> None:
  """Every object alive now moves to a permanent generation that the collector no longer
  walks, and a full collection waits for 100 middle-generation ones instead of 10."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(700, 10, 100)
