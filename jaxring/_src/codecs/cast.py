"""16-bit float wires: bf16 and fp16. Partial sums stay f32; only what crosses a link is cast.

Every ring hop adds the received 16-bit chunk to the local f32 partial and rounds the new partial
once for the wire (bf16: the fused ``ring_hop_cast`` kernel), so the error of one all-reduce is
one rounding per encode of each partial sum, never the accumulated rounding of summing in 16 bits:
for an element whose partial sums on its way round the ring are ``S_1 .. S_p`` (``S_p`` the total,
encoded once more for the all-gather), ``|error| <= u * sum_j |S_j|`` with the unit roundoff
``u = 2**-8`` (bf16) or ``2**-11`` (fp16), plus f32 rounding, and for fp16 plus
``2**-39 * sum_j max|S_j over its block|`` (below).

bf16 has f32's exponent range: it cannot overflow where f32 does not, and it keeps f32's normal
numbers (XLA:CPU flushes f32 subnormals, below ``2**-126``, to zero in any arithmetic).

fp16 has 5 exponent bits: unscaled, gradients below ``2**-14`` would lose bits (fp16 subnormals;
``1e-7`` erred by 36%) and anything below ``2**-25`` would be zero, while partial sums past 65504
would be ``inf``. So the fp16 wire is scaled like loss scaling, per block of ``block_size``
values, by a power of two (exact) chosen at every encode from the block's largest finite
magnitude, which lands in ``[2**14, 2**15)``; the exponent travels as one more fp16 value per
block, in the same message. One encode then errs by at most ``2**-11 * |x|`` for every element at
least ``2**-28`` times its block's largest magnitude, and by at most ``2**-39`` times that
magnitude for the smaller ones (elements below ``2**-40`` times it, measured, become zero).

Overflow: no finite value encodes or decodes to ``inf``, up to f32's largest number (a value that
would round up to ``2**15`` on the wire is kept below it). The partial sums are f32 sums, with
f32's range: like an f32 sum taken in another order, a total within the error bound of f32's
largest number (``3.4e38``) may still overflow. Non-finite values are not scaled away: ``inf``
and ``nan`` travel as themselves and propagate into the result, element by element, as in f32
arithmetic.
"""
from __future__ import annotations

import dataclasses
import operator

import jax.numpy as jnp
from jax import lax

from jaxring._src.codecs import kernels
from jaxring._src.codecs.base import (
    MAX_BLOCK_SIZE,
    Codec,
    accum_dtype,
    is_float,
    no_inner,
    spelling,
)

_F32 = jnp.dtype(jnp.float32)
_BELOW_2_15 = 32752.0  # the largest fp16 value below 2**15


def _block_size(codec: str, value) -> int:
  try:
    bs = operator.index(value)
  except TypeError:
    raise ValueError(f"{codec}: block_size must be a positive integer, got {value!r}") from None
  if not 1 <= bs <= MAX_BLOCK_SIZE:
    raise ValueError(f"{codec}: block_size must be a positive integer of at most "
                     f"{MAX_BLOCK_SIZE} (2**31 - 1), got {bs}")
  return bs


def _frexp_exponent(a):
  """``jnp.frexp(a)[1]`` for finite ``a >= 0`` (0 for 0), read off the float's exponent bits.

  ``jnp.frexp`` and ``jnp.ldexp`` handle every special case in the traced program (a third of
  the fp16 ring's HLO and of its compile time); here the values are finite and non-negative and
  the powers of two normal, so the bits give the same numbers. A subnormal ``a`` reads as
  ``minexp`` (-126; frexp: lower still), which the encoder's clamp (``k <= -minexp``) makes the
  same scale.
  """
  info = jnp.finfo(a.dtype)
  if info.bits != 32:
    return jnp.frexp(a)[1]
  bits = lax.bitcast_convert_type(a, jnp.int32) & 0x7FFFFFFF
  biased = bits >> info.nmant
  return jnp.where(bits == 0, 0, biased - 126)   # bits, not a == 0: XLA:CPU flushes subnormals


def _pow2(k, dtype):
  """``2.0 ** k`` in ``dtype`` for integer ``k`` whose power is a normal number of it (exact)."""
  info = jnp.finfo(dtype)
  if info.bits != 32:
    return jnp.ldexp(jnp.ones((), dtype), k)
  return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << info.nmant, jnp.float32)


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

  def hop_at(self, payload: tuple, base, offset, n: int, dtype) -> tuple:
    at = kernels.in_place("ring_hop_cast", base, n)
    if at is None or payload[0].dtype == _F32:
      return super().hop_at(payload, base, offset, n, dtype)
    partial, out = at(payload[0], base, offset)
    return partial, (out,)

  def last_hop_at(self, payload: tuple, base, offset, n: int, dtype):
    at = kernels.in_place("ring_hop_cast_last", base, n)
    if at is None:
      return super().last_hop_at(payload, base, offset, n, dtype)
    return at(payload[0], base, offset)


@dataclasses.dataclass(frozen=True)
class Bf16(CastCodec):
  """bf16 on the wire (8 significant bits, f32's exponent range)."""

  name = "bf16"
  wire_dtype = jnp.dtype(jnp.bfloat16)
  unit_roundoff = 2.0 ** -8

  def in_process_decode(self, dtype) -> int | None:
    if not self.applies_to(dtype):
      return super().in_process_decode(dtype)
    return 0 if accum_dtype(dtype) == _F32 else None


@dataclasses.dataclass(frozen=True)
class Fp16(CastCodec):
  """fp16 on the wire (11 significant bits), scaled by a power of two per block (module docstring).

  Attributes:
    block_size: values per scale exponent; also the chunk alignment on the ring. The wire holds
      ``block_size + 1`` fp16 values per block.
  """

  block_size: int = 256

  name = "fp16"
  wire_dtype = jnp.dtype(jnp.float16)
  unit_roundoff = 2.0 ** -11

  def __post_init__(self):
    object.__setattr__(self, "block_size", _block_size("fp16", self.block_size))

  @property
  def align(self) -> int:  # type: ignore[override]
    return self.block_size

  def wire_bytes(self, n: int, dtype=jnp.float32) -> int:
    if not self.applies_to(dtype):
      return super().wire_bytes(n, dtype)
    n = int(n)
    return (n + -(-n // self.block_size)) * self.wire_dtype.itemsize

  def encode(self, x, dtype) -> tuple:
    blocks = x.reshape(-1, self.block_size)
    finite = jnp.isfinite(blocks)
    amax = jnp.max(jnp.where(finite, jnp.abs(blocks), 0), axis=1)
    e = _frexp_exponent(amax)  # amax = m 2**e, m in [0.5, 1): amax * 2**(15 - e) in [2**14, 2**15)
    # 2**k and 2**-k stay normal numbers of the accumulator dtype
    k = jnp.minimum(15 - e, -jnp.finfo(x.dtype).minexp).astype(jnp.int32)
    scaled = blocks * _pow2(k, x.dtype)[:, None]
    # a finite value rounded up to 2**15 would decode past f32's largest number when the block
    # is in f32's top binade; the largest fp16 value below 2**15 errs by less than 2**-11 |x| too
    scaled = jnp.where(finite, jnp.clip(scaled, -_BELOW_2_15, _BELOW_2_15), scaled)
    wire = jnp.concatenate([scaled.astype(self.wire_dtype),
                            k.astype(self.wire_dtype)[:, None]], axis=1)
    return (wire.reshape(-1),)

  def decode(self, payload: tuple, dtype):
    acc = accum_dtype(dtype)
    wire = payload[0].reshape(-1, self.block_size + 1)
    k = wire[:, self.block_size].astype(jnp.int32)
    scale = _pow2(-k, acc)
    return (wire[:, :self.block_size].astype(acc) * scale[:, None]).reshape(-1)

  def hop(self, payload: tuple, local, dtype) -> tuple:
    return Codec.hop(self, payload, local, dtype)

  def last_hop(self, payload: tuple, local, dtype):
    return Codec.last_hop(self, payload, local, dtype)

  def hop_at(self, payload: tuple, base, offset, n: int, dtype) -> tuple:
    return Codec.hop_at(self, payload, base, offset, n, dtype)

  def last_hop_at(self, payload: tuple, base, offset, n: int, dtype):
    return Codec.last_hop_at(self, payload, base, offset, n, dtype)


def bf16() -> Bf16:
  """bf16 on the wire, f32 partial sums: half the bytes of f32, ``|error| <= 2**-8 sum_j |S_j|``.

  Example:
    >>> jaxring.psum(x, "data", algorithm="ring", compression=jaxring.codecs.bf16())
    >>> jaxring.codecs.bf16().wire_bytes(1024, jnp.float32)
    2048
  """
  return Bf16()


def fp16(block_size: int = 256) -> Fp16:
  """fp16 on the wire, f32 partial sums: 3 more significant bits than bf16, scaled per block.

  Each block of ``block_size`` values is scaled by a power of two so that its largest magnitude
  uses fp16's top binade: ``|error| <= 2**-11 |x|`` per encode for every element at least
  ``2**-28`` times its block's largest magnitude, however small the gradients are, and no finite
  value overflows. Costs one fp16 value per block on the wire. See the module docstring.

  Args:
    block_size: values per scale exponent (a positive integer, at most ``2**31 - 1``).

  Returns:
    The codec, for ``compression=`` of the collectives and ``jaxring.reduce_gradients``.

  Raises:
    ValueError: ``block_size`` is not a positive integer, or too large.

  Example:
    >>> jaxring.codecs.fp16().compression_ratio(jnp.float32)  # 0.5, plus 1 exponent per 256
    0.501953125
  """
  return Fp16(block_size)


@spelling("bf16", "bf16", sweep=True)
def _read_bf16(args, inner) -> Bf16:
  no_inner("bf16", inner)
  if args:
    raise ValueError("bf16 takes no arguments")
  return bf16()


@spelling("fp16[:block_size]", "fp16")
def _read_fp16(args, inner) -> Fp16:
  no_inner("fp16", inner)
  if len(args) > 1:
    raise ValueError("fp16 takes at most a block size")
  return fp16(*map(int, args))
