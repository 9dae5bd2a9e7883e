"""Mixed precision: a compute-dtype policy and dynamic loss scaling agreed on by every replica.

Parameters, optimizer state and gradient reduction stay in f32; only the forward and backward pass
run in the compute dtype. bf16 has f32's exponent range and needs no loss scaling; fp16 does: the
loss is multiplied by a scale before the backward pass, the gradients are divided by it, and a step
whose gradients overflowed is skipped. The skip decision must be identical on every replica, or the
replicated parameters diverge, so the finite-check is all-reduced (see jaxring._src.train.grad).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype the forward/backward pass computes in, and whether the loss is scaled.

  Attributes:
    compute_dtype: floating *arguments* of the function given to :func:`jaxring.value_and_grad`
      (parameters and batch) are cast to this dtype before the call; gradients come back in the
      parameters' dtype. Arrays the function closes over are not seen: pass the batch as an
      argument (``value_and_grad(loss_fn)(params, batch)``), or give Flax modules ``dtype=``.
    loss_scaling: multiply the loss by ``state.loss_scale`` before the backward pass (fp16).

  Example:
    >>> jaxring.train.Policy(jnp.bfloat16).cast_to_compute({"w": jnp.ones(2)})["w"].dtype
    dtype(bfloat16)
  """

  compute_dtype: Any = jnp.float32
  loss_scaling: bool = False

  def cast_to_compute(self, tree):
    """Casts the floating leaves of ``tree`` to the compute dtype (other leaves unchanged)."""
    dtype = jnp.dtype(self.compute_dtype)

    def cast(x):
      if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
      return x
    return jax.tree_util.tree_map(cast, tree)


_NAMED = {
    "bf16": Policy(jnp.bfloat16), "bfloat16": Policy(jnp.bfloat16),
    "fp16": Policy(jnp.float16, loss_scaling=True),
    "float16": Policy(jnp.float16, loss_scaling=True),
}


def as_policy(precision) -> Policy | None:
  """``None``/``"f32"`` -> no policy; ``"bf16"``; ``"fp16"`` (with loss scaling); or a Policy."""
  if precision is None or precision in ("f32", "fp32", "float32"):
    return None
  if isinstance(precision, Policy):
    return precision
  if precision in _NAMED:
    return _NAMED[precision]
  raise ValueError(f"precision must be None, 'bf16', 'fp16' or a jaxring.train.Policy; "
                   f"got {precision!r}")


@struct.dataclass
class DynamicLossScale:
  """Dynamic loss scale (Micikevicius et al. 2018): back off on overflow, grow after a calm period.

  Example:
    >>> s = jaxring.train.DynamicLossScale.create(initial_scale=2.0**15)
    >>> float(s.adjust(jnp.array(False)).scale)
    16384.0
  """

  scale: jax.Array
  good_steps: jax.Array
  growth_interval: int = struct.field(pytree_node=False, default=2000)
  growth_factor: float = struct.field(pytree_node=False, default=2.0)
  backoff_factor: float = struct.field(pytree_node=False, default=0.5)
  min_scale: float = struct.field(pytree_node=False, default=1.0)

  @classmethod
  def create(cls, initial_scale: float = 2.0 ** 15, **kwargs) -> DynamicLossScale:
    return cls(scale=jnp.asarray(initial_scale, jnp.float32),
               good_steps=jnp.zeros((), jnp.int32), **kwargs)

  @classmethod
  def from_state_dict(cls, d: dict) -> DynamicLossScale:
    """The scale from its serialized leaves (``flax.serialization`` restores a field whose
    template was None as a dict); the growth settings are the defaults."""
    return cls(scale=jnp.asarray(d["scale"], jnp.float32),
               good_steps=jnp.asarray(d["good_steps"], jnp.int32))

  def adjust(self, finite) -> DynamicLossScale:
    """The scale for the next step, given whether this step's gradients were all finite."""
    grown = self.good_steps + 1 >= self.growth_interval
    scale_ok = jnp.where(grown, self.scale * self.growth_factor, self.scale)
    scale_bad = jnp.maximum(self.scale * self.backoff_factor, jnp.float32(self.min_scale))
    return self.replace(
        scale=jnp.where(finite, scale_ok, scale_bad).astype(jnp.float32),
        good_steps=jnp.where(finite & ~grown, self.good_steps + 1, 0).astype(jnp.int32))


def select_tree(pred, on_true, on_false):
  """Leafwise ``where(pred, a, b)`` over two pytrees of the same structure."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
