"""Parameter precision: a model's parameters cast to a narrower float type.

Training keeps fp32 parameters (T5X: bf16 activations, fp32 weights and optimizer state). A
*frozen* model (the distillation target, and every model at inference) may hold its
parameters in bf16 (TARGET_PARAM_DTYPE): half the bytes, exact to count. The layers cast each
weight to the activation dtype where they use it (`jnp.asarray(kernel, dtype)`), so a bf16
weight in an fp32 network is upcast per use: the values are the bf16-rounded weights, the
arithmetic stays fp32.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.models.config import DTYPES

# The dtypes a frozen model's parameters may be cast to.
PARAM_DTYPES = ("float32", "bfloat16")


def check_param_dtype(value: Optional[str], macro: str = "TARGET_PARAM_DTYPE") -> Optional[str]:
  """`value` if it is None (keep the stored dtype) or one of PARAM_DTYPES, else ValueError
  naming the value, the choices and the macro."""
  if value is None or (isinstance(value, str) and value in PARAM_DTYPES):
    return value
  hint = " (float16 is an activation dtype only)" if value in DTYPES else ""
  raise ValueError(f"{macro}={value!r} is not a parameter dtype{hint}; use one of "
                   f"{PARAM_DTYPES} or None (keep the checkpoint's float32).")


def cast_dtype(dtype, target: Optional[str]):
  """`dtype` cast to `target` when both are floating (integers and None stay)."""
  if target is None or not jnp.issubdtype(dtype, jnp.floating):
    return dtype
  return jnp.dtype(target)


def cast_params(params: Any, dtype: Optional[str]) -> Any:
  """Every floating leaf of `params` cast to `dtype` (None: unchanged). Sharded arrays keep
  their sharding (an elementwise cast of each shard)."""
  check_param_dtype(dtype, "dtype")
  if dtype is None:
    return params

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
      return x
    if isinstance(x, jax.Array):
      return x.astype(dtype)
    return np.asarray(x).astype(jnp.dtype(dtype))

  return jax.tree.map(cast, params)


def param_bytes(params: Any) -> int:
  """Total bytes of the leaves of `params` (arrays or ShapeDtypeStructs)."""
  return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(params)))
