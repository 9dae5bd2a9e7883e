"""Pure-jnp references for the kernels in xla_ext/: the definitions the FFI kernels must match.

Each function has the signature of its FFI wrapper in :mod:`jaxring._src.ext.kernels` and the same
numerics, rounding step by rounding step (the C++ twin of every rule is in ``xla_ext/numerics.h``):

* int8 blocks: ``amax = max|x|`` over a block of ``block_size`` elements (the last block may be
  partial); ``scale = amax * RN(1/127)`` and ``inv = 127 / amax``, each rounded once to f32;
  ``q = round_half_even(x * inv)`` (always within [-127, 127]). With stochastic rounding, in
  16-bit fixed point: ``f = clip(round_half_even(x * inv * 2^16), -127 * 2^16, 127 * 2^16)`` and
  ``q = (f + k) >> 16`` (a floor), where ``k`` in [0, 2^16) is a hash of (seed, element index
  within the row) (:func:`random_bits16`): P(round up) = (f mod 2^16) / 2^16 and E[q] = f / 2^16,
  so decoding is unbiased to within 2^-17 of a step. Decoding is ``q * scale`` rounded (to
  nearest even) to the output dtype.
* A block whose max|x| is below 2^-64 (all zeros, in particular) gets ``scale = 0`` and ``q = 0``.
* A block holding Inf or NaN gets ``scale = NaN`` and ``q = 0``: it decodes to NaN everywhere, so a
  non-finite gradient is never hidden by compression.
* Ring hops round twice, ``decode(recv)`` then ``+ partial`` (no fused multiply-add), so that CPU,
  GPU and these references agree bit for bit whatever the host's FMA support.

* fp4 blocks (e2m1 codes, two a byte, element 2i in the low nibble): ``scale = amax * c`` with
  ``c`` the largest f32 below 1/6 (so that ``6 * scale`` never exceeds ``amax``) and
  ``inv = 6 / amax``; ``v = x * inv`` is rounded to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (in
  magnitude) with ties to an even mantissa, as ``round_half_even(|v| / step) + offset`` over the
  binades of steps 0.5, 1 and 2 (offsets 0, 2, 4); with stochastic rounding the same fixed point
  as int8's on ``|v| / step``. The sign is v's, but for a zero magnitude (no -0 codes). Decoding
  is ``value(code) * scale``. The tiny and non-finite rules are int8's.

Every rule is written so that XLA cannot change it: XLA contracts ``a * b + c`` into an FMA on
hosts that have one, so no product here feeds an addition unless the product is exact, and the
decode before an addition is computed as the exact sum of two exact products (:func:`_decode_f32`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src.ext.table import FFI_KERNELS

__all__ = list(FFI_KERNELS)


def take(base, offset, n: int):
  """``base[offset:offset + n]``, what the windowed targets (:mod:`.window`) read in place: a static
  slice for an int ``offset``, else a dynamic one (a traced int32)."""
  if isinstance(offset, (int, np.integer)):
    return base[int(offset):int(offset) + n]
  return lax.dynamic_slice_in_dim(base, offset, n)


QMAX = 127.0
NONFINITE_BITS = 0x7F800000
MIN_AMAX_BITS = 0x1F800000  # 2^-64
INV_QMAX = np.float32(1.0) / np.float32(127.0)  # RN(1/127)
WEYL = 0x9E3779B9  # the Weyl step of the stochastic-rounding hash: 2^32 / golden ratio
CODE_LIMIT16 = 127 << 16  # the largest code, in the 16-bit fixed point of stochastic rounding


def _blocks(x: jax.Array, size: int) -> jax.Array:
  """Pads a flat array with zeros to whole blocks and returns it as [blocks, size]."""
  n = x.shape[0]
  nb = -(-n // size)
  return jnp.pad(x, (0, nb * size - n)).reshape(nb, size)


def _u32(v: int) -> jax.Array:
  return jnp.uint32(v)


def _mix32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * _u32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * _u32(0x846CA68B)
  return x ^ (x >> 16)


def random_bits16(seed: jax.Array | int, n: int) -> jax.Array:
  """The stochastic-rounding bits k[i] in [0, 2^16) (int32) for elements 0..n-1 of a row.

  The top half of two multiply-xorshift rounds over the Weyl sequence key + i * WEYL.
  """
  key = _mix32(jnp.asarray(seed, jnp.uint32) + _u32(WEYL))
  h = jnp.arange(n, dtype=jnp.uint32) * _u32(WEYL) + key
  h = h ^ (h >> 16)
  h = h * _u32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * _u32(0x846CA68B)
  return (h >> 16).astype(jnp.int32)


def block_scales(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(scale, inv) per row of an f32 [blocks, size] array, by the block-scale rule."""
  amax_bits = jnp.max(lax.bitcast_convert_type(blocks, jnp.uint32) & _u32(0x7FFFFFFF), axis=1)
  nonfinite = amax_bits >= _u32(NONFINITE_BITS)
  tiny = amax_bits < _u32(MIN_AMAX_BITS)
  amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
  scale = jnp.where(nonfinite, jnp.float32(jnp.nan), jnp.where(tiny, 0.0, amax * INV_QMAX))
  inv = jnp.where(nonfinite | tiny, 0.0, jnp.float32(QMAX) / jnp.where(tiny, 1.0, amax))
  return scale.astype(jnp.float32), inv.astype(jnp.float32)


def _encode(v: jax.Array, block_size: int, stochastic: bool, seed) -> tuple[jax.Array, jax.Array]:
  n = v.shape[0]
  blocks = _blocks(v.astype(jnp.float32), block_size)
  scale, inv = block_scales(blocks)
  if stochastic:
    # inv * 2^16 is exact, so this is round_half_even((x * inv) * 2^16) however XLA associates.
    f = jnp.round(blocks * (inv * jnp.float32(65536.0))[:, None]).astype(jnp.int32)
    f = jnp.clip(f, -CODE_LIMIT16, CODE_LIMIT16)
    k = random_bits16(seed, blocks.size).reshape(blocks.shape)
    r = ((f + k) >> 16).astype(jnp.float32)  # arithmetic shift: floor((f + k) / 2^16)
  else:
    r = jnp.round(blocks * inv[:, None])  # half to even
  r = jnp.where(inv[:, None] == 0, 0.0, r)
  return r.astype(jnp.int8).reshape(-1)[:n], scale


def _decode_f32(q: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
  """RN(q * scale), computed so that XLA cannot fuse it into a following addition.

  The scale is split into its top 16 significant bits and the rest; both products with a 7-bit
  code are exact, so their sum, rounded once, is RN(q * scale) whether or not XLA contracts it.
  """
  n = q.shape[0]
  hi = lax.bitcast_convert_type(
      lax.bitcast_convert_type(scales, jnp.uint32) & _u32(0xFFFFFF00), jnp.float32
  )
  lo = scales - hi
  codes = _blocks(q, block_size).astype(jnp.float32)
  return (codes * hi[:, None] + codes * lo[:, None]).reshape(-1)[:n]


def quantize_int8(x, block_size: int = 256, stochastic: bool = False, seed=0):
  """Reference for :func:`jaxring._src.ext.kernels.quantize_int8`."""
  return _encode(jnp.asarray(x), block_size, stochastic, seed)


def dequantize_int8(q, scales, block_size: int = 256, dtype=jnp.float32):
  """Reference for :func:`jaxring._src.ext.kernels.dequantize_int8`."""
  decoded = _blocks(jnp.asarray(q), block_size).astype(jnp.float32) * jnp.asarray(scales)[:, None]
  return decoded.reshape(-1)[: jnp.shape(q)[0]].astype(dtype)


def ring_hop_int8_last(q, scales, partial, block_size: int = 256):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_int8_last`."""
  return _decode_f32(jnp.asarray(q), jnp.asarray(scales), block_size) + partial


def ring_hop_int8(q, scales, partial, block_size: int = 256, stochastic: bool = False, seed=0):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_int8`."""
  new_partial = ring_hop_int8_last(q, scales, partial, block_size)
  q_out, scales_out = _encode(new_partial, block_size, stochastic, seed)
  return new_partial, q_out, scales_out


# --- fp4 (e2m1) blocks ----------------------------------------------------------------------

FP4_MAX = 6.0
FP4_SCALE_MUL = np.float32(float.fromhex("0x1.555554p-3"))  # the largest f32 below 1/6
#: The value of each 4-bit code: a sign bit over the e2m1 magnitudes.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def fp4_bytes(n: int) -> int:
  """Bytes of packed codes for ``n`` values (two a byte; an odd count ends in a padding nibble)."""
  return -(-int(n) // 2)


def fp4_block_scales(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(scale, inv) per row of an f32 [blocks, size] array, by the fp4 block-scale rule."""
  amax_bits = jnp.max(lax.bitcast_convert_type(blocks, jnp.uint32) & _u32(0x7FFFFFFF), axis=1)
  nonfinite = amax_bits >= _u32(NONFINITE_BITS)
  tiny = amax_bits < _u32(MIN_AMAX_BITS)
  amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
  scale = jnp.where(nonfinite, jnp.float32(jnp.nan), jnp.where(tiny, 0.0, amax * FP4_SCALE_MUL))
  inv = jnp.where(nonfinite | tiny, 0.0, jnp.float32(FP4_MAX) / jnp.where(tiny, 1.0, amax))
  return scale.astype(jnp.float32), inv.astype(jnp.float32)


def _fp4_steps(v: jax.Array, unit: float) -> tuple[jax.Array, jax.Array]:
  """``(|v| / step * unit, offset)`` per element: the binade's step is 0.5, 1 or 2 (exact)."""
  a = jnp.abs(v)
  big, mid = a >= 4.0, a >= 2.0
  mult = jnp.where(big, jnp.float32(0.5 * unit),
                   jnp.where(mid, jnp.float32(unit), jnp.float32(2.0 * unit)))
  return a * mult, jnp.where(big, 4, jnp.where(mid, 2, 0)).astype(jnp.int32)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
  """Flat 4-bit codes (int32) -> uint8 bytes, element 2i in the low nibble of byte i."""
  codes = jnp.pad(codes, (0, codes.shape[0] % 2)).reshape(-1, 2)
  return (codes[:, 0] | (codes[:, 1] << 4)).astype(jnp.uint8)


def _unpack_nibbles(q: jax.Array, n: int) -> jax.Array:
  """uint8 bytes -> the first ``n`` 4-bit codes (int32)."""
  q = q.astype(jnp.int32)
  return jnp.stack([q & 15, q >> 4], axis=1).reshape(-1)[:n]


def _fp4_encode(v: jax.Array, block_size: int, stochastic: bool,
                seed) -> tuple[jax.Array, jax.Array]:
  n = v.shape[0]
  blocks = _blocks(v.astype(jnp.float32), block_size)
  scale, inv = fp4_block_scales(blocks)
  scaled = blocks * inv[:, None]
  if stochastic:
    m16, offset = _fp4_steps(scaled, 65536.0)
    k = random_bits16(seed, blocks.size).reshape(blocks.shape)
    mag = jnp.minimum(((jnp.round(m16).astype(jnp.int32) + k) >> 16) + offset, 7)
  else:
    m, offset = _fp4_steps(scaled, 1.0)
    mag = jnp.round(m).astype(jnp.int32) + offset  # half to even
  code = mag | jnp.where(jnp.signbit(scaled) & (mag != 0), 8, 0)
  code = jnp.where(inv[:, None] == 0, 0, code)
  return _pack_nibbles(code.reshape(-1)[:n]), scale


def _fp4_values(q: jax.Array, n: int, block_size: int) -> jax.Array:
  """The codes' values as f32 [blocks, block_size] (zeros past ``n``)."""
  return _blocks(jnp.asarray(FP4_VALUES)[_unpack_nibbles(q, n)], block_size)


def quantize_fp4(x, block_size: int = 64, stochastic: bool = False, seed=0):
  """Reference for :func:`jaxring._src.ext.kernels.quantize_fp4`."""
  return _fp4_encode(jnp.asarray(x), block_size, stochastic, seed)


def dequantize_fp4(q, scales, block_size: int = 64, dtype=jnp.float32, n: int | None = None):
  """Reference for :func:`jaxring._src.ext.kernels.dequantize_fp4`."""
  q = jnp.asarray(q)
  n = 2 * q.shape[0] if n is None else n
  decoded = _fp4_values(q, n, block_size) * jnp.asarray(scales)[:, None]
  return decoded.reshape(-1)[:n].astype(dtype)


def ring_hop_fp4_last(q, scales, partial, block_size: int = 64):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_fp4_last`."""
  partial = jnp.asarray(partial)
  n = partial.shape[0]
  values, scales = _fp4_values(jnp.asarray(q), n, block_size), jnp.asarray(scales)
  # RN(value * scale) by the split of _decode_f32: both products are exact (2-bit values)
  hi = lax.bitcast_convert_type(
      lax.bitcast_convert_type(scales, jnp.uint32) & _u32(0xFFFFFF00), jnp.float32)
  lo = scales - hi
  return (values * hi[:, None] + values * lo[:, None]).reshape(-1)[:n] + partial


def ring_hop_fp4(q, scales, partial, block_size: int = 64, stochastic: bool = False, seed=0):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_fp4`."""
  new_partial = ring_hop_fp4_last(q, scales, partial, block_size)
  q_out, scales_out = _fp4_encode(new_partial, block_size, stochastic, seed)
  return new_partial, q_out, scales_out


def ring_hop_cast_last(recv, partial):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_cast_last`."""
  return jnp.asarray(recv).astype(jnp.float32) + partial


def ring_hop_cast(recv, partial):
  """Reference for :func:`jaxring._src.ext.kernels.ring_hop_cast`."""
  recv = jnp.asarray(recv)
  new_partial = ring_hop_cast_last(recv, partial)
  return new_partial, new_partial.astype(recv.dtype)


def chunk_norms(x, chunk_size: int):
  """Reference for :func:`jaxring._src.ext.kernels.chunk_norms` (f32 sums: within a few ulps)."""
  blocks = _blocks(jnp.asarray(x, jnp.float32), chunk_size)
  return jnp.sqrt(jnp.sum(blocks * blocks, axis=1))


def gather_chunks(x, idx, chunk_size: int):
  """Reference for :func:`jaxring._src.ext.kernels.gather_chunks` (indices must be in range)."""
  return _blocks(jnp.asarray(x), chunk_size)[jnp.asarray(idx)].reshape(-1)


def scatter_add_chunks(x, idx, packed, chunk_size: int):
  """Reference for :func:`jaxring._src.ext.kernels.scatter_add_chunks` (indices in range)."""
  x = jnp.asarray(x)
  blocks = _blocks(x, chunk_size)
  added = blocks.at[jnp.asarray(idx)].add(jnp.asarray(packed).reshape(-1, chunk_size))
  return added.reshape(-1)[: x.shape[0]]
