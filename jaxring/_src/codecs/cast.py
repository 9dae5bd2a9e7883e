"""16-bit float wires: bf16 and fp16. Partial sums stay f32; only what crosses a link is cast.

Every ring hop adds the received 16-bit chunk to the local f32 partial and rounds the new partial
once to the wire dtype (the fused ``ring_hop_cast`` kernel), so the error of one all-reduce is at
most one rounding per encode of each partial sum, never the accumulated rounding of summing in
16 bits: for an element whose partial sums on its way round the ring are ``S_1 .. S_p`` (``S_p``
the total, encoded once for the all-gather), ``|error| <= u * sum_j |S_j|`` with the unit
roundoff ``u = 2**-8`` (bf16) or ``2**-11`` (fp16), plus f32 rounding.

Overflow (fp16): a partial sum beyond the fp16 range (|x| >= 65520 rounds to inf) becomes ``inf``
on the wire and therefore ``inf`` (or ``nan`` where infinities of both signs meet) in the result,
on every member. It is never clipped: a clipped gradient is silently wrong, while an ``inf`` is
what mixed-precision training already checks for (``optax.apply_if_finite``, loss scaling) and
skips. Error feedback does not carry a non-finite error into the next step
(jaxring._src.error_feedback). bf16 has f32's exponent range and cannot overflow where f32 does not.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxring._src.codecs import kernels
from jaxring._src.codecs.base import Codec, accum_dtype, is_float

_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class CastCodec(Codec):
  """Base of the 16-bit float wires: floats wider than 16 bits travel as ``wire_dtype``."""

  wire_dtype = _F32
  unit_roundoff = 0.0
  lossy = True

  def applies_to(self, dtype) -> bool:
    # 16-bit inputs already travel in 16 bits (the identity codec does that losslessly).
    return is_float(dtype) and jnp.dtype(dtype).itemsize > self.wire_dtype.itemsize

  def wire_bytes(self, n: int, dtype=jnp.float32) -> int:
    if not self.applies_to(dtype):
      return super().wire_bytes(n, dtype)
    return int(n) * self.wire_dtype.itemsize

  def encode(self, x, dtype) -> tuple:
    return (x.astype(self.wire_dtype),)

  def decode(self, payload: tuple, dtype):
    return payload[0].astype(accum_dtype(dtype))

  def hop(self, payload: tuple, local, dtype) -> tuple:
    if local.dtype != _F32:  # f64 partials: the kernels are f32-only
      return super().hop(payload, local, dtype)
    partial, out = kernels.ops().ring_hop_cast(payload[0], local)
    return partial, (out,)

  def last_hop(self, payload: tuple, local, dtype):
    if local.dtype != _F32:
      return super().last_hop(payload, local, dtype)
    return kernels.ops().ring_hop_cast_last(payload[0], local)


@dataclasses.dataclass(frozen=True)
class Bf16(CastCodec):
  """bf16 on the wire (8 significant bits, f32's exponent range)."""

  name = "bf16"
  wire_dtype = jnp.dtype(jnp.bfloat16)
  unit_roundoff = 2.0 ** -8


@dataclasses.dataclass(frozen=True)
class Fp16(CastCodec):
  """fp16 on the wire (11 significant bits, |x| < 65520); overflow shows as inf in the result."""

  name = "fp16"
  wire_dtype = jnp.dtype(jnp.float16)
  unit_roundoff = 2.0 ** -11


def bf16() -> Bf16:
  """bf16 on the wire, f32 partial sums: half the bytes of f32, ``|error| <= 2**-8 sum_j |S_j|``.

  Example:
    >>> jaxring.psum(x, "data", algorithm="ring", compression=jaxring.codecs.bf16())
    >>> jaxring.codecs.bf16().wire_bytes(1024, jnp.float32)
    2048
  """
  return Bf16()


def fp16() -> Fp16:
  """fp16 on the wire, f32 partial sums: 3 more significant bits than bf16, range |x| < 65520.

  A partial sum beyond the fp16 range is ``inf`` in the result (never clipped); see the module
  docstring.

  Example:
    >>> jaxring.codecs.fp16().compression_ratio(jnp.float32)
    0.5
  """
  return Fp16()
