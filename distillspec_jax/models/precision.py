"""Precision and rematerialisation: `PrecisionConfig`, the binaries' one config of both, and
a model's parameters cast to a narrower float type.

Training keeps fp32 parameters (T5X: bf16 activations, fp32 weights and optimizer state). A
*frozen* model (the distillation target, and every model at inference) may hold its
parameters in bf16 (TARGET_PARAM_DTYPE): half the bytes, exact to count. The layers cast each
weight to the activation dtype where they use it (`jnp.asarray(kernel, dtype)`), so a bf16
weight in an fp32 network is upcast per use: the values are the bf16-rounded weights, the
arithmetic stays fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from distillspec_jax.core.validation import check_field_types
from distillspec_jax.models.config import DTYPES, REMAT_POLICIES, TransformerConfig

# The dtypes a frozen model's parameters may be cast to.
PARAM_DTYPES = ("float32", "bfloat16")
ActivationDtype = Literal[DTYPES]
RematPolicy = Literal[REMAT_POLICIES]
ParamDtype = Literal[PARAM_DTYPES]
ROLES = ("target", "draft")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """How the models compute and hold their numbers, shared by the three binaries
  (`PipelineConfig.precision`, `EvalConfig.precision`, the train binary's `run.precision`;
  gin: `PrecisionConfig.activation_dtype = %ACTIVATION_DTYPE`, `PrecisionConfig.remat_policy =
  %REMAT_POLICY`, `PrecisionConfig.target_param_dtype = %TARGET_PARAM_DTYPE`). None leaves a
  model as it is configured: its preset's value, or what its checkpoint stores.

  Attributes:
    activation_dtype: both models' activations (TransformerConfig.dtype: one of DTYPES);
      parameters stay fp32 in training.
    remat_policy: rematerialisation of both models' layers (TransformerConfig.remat_policy:
      one of models/config.py REMAT_POLICIES); it changes a backward pass's memory and
      compute, never the values.
    target_remat_policy / draft_remat_policy: one model's policy (None = remat_policy).
    target_param_dtype: the target's parameters where it is frozen (distillation,
      evaluation), cast after loading (one of PARAM_DTYPES; None = as stored).
  """

  activation_dtype: Optional[ActivationDtype] = None
  remat_policy: Optional[RematPolicy] = None
  target_remat_policy: Optional[RematPolicy] = None
  draft_remat_policy: Optional[RematPolicy] = None
  target_param_dtype: Optional[ParamDtype] = None

  def __post_init__(self):
    check_field_types(self)

  def remat_of(self, role: str) -> Optional[str]:
    """The remat policy of the "target" or "draft" model (None: as configured)."""
    if role not in ROLES:
      raise ValueError(f"role={role!r} is not a model role; use one of {ROLES}.")
    specific = self.target_remat_policy if role == "target" else self.draft_remat_policy
    return specific or self.remat_policy

  def model_overrides(self, role: str) -> dict:
    """The TransformerConfig fields this sets on the "target" or "draft" model (the ones it
    leaves as configured are absent)."""
    overrides = {"dtype": self.activation_dtype, "remat_policy": self.remat_of(role)}
    return {name: value for name, value in overrides.items() if value is not None}

  def configure(self, config: TransformerConfig, role: str) -> TransformerConfig:
    """`config` of the "target" or "draft" model with this precision."""
    return config.replace(**self.model_overrides(role))

  def apply(self, model, role: str):
    """`model` (a models.model.Model, the "target" or "draft") with this precision."""
    return dataclasses.replace(model, config=self.configure(model.config, role))


def check_param_dtype(value: Optional[str], name: str) -> Optional[str]:
  """`value` if it is None (keep the stored dtype) or one of PARAM_DTYPES, else ValueError
  naming the value (as `name`) and the choices."""
  if value is None or (isinstance(value, str) and value in PARAM_DTYPES):
    return value
  hint = " (float16 is an activation dtype only)" if value in DTYPES else ""
  raise ValueError(f"{name}={value!r} is not a parameter dtype{hint}; use one of "
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
