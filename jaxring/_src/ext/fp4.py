"""Typed wrappers around the fp4 (e2m1) block codec's FFI kernels (``xla_ext/cpu_fp4*.cc``,
``cuda_fp4.cu``): codes of 4 bits, two a byte, with one f32 scale per block of an even size.

As the int8 wrappers of :mod:`.kernels`: flat 1-D operands checked before anything is launched
(``TypeError``/``ValueError`` naming the argument), ``jit`` and ``vmap`` (batch rows). The
numerics are defined in :mod:`jaxring._src.ext.reference`.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxring._src.ext.checks import call as _call
from jaxring._src.ext.checks import flat, positive_int, same_length
from jaxring._src.ext.reference import fp4_bytes

__all__ = ["quantize_fp4", "dequantize_fp4", "ring_hop_fp4", "ring_hop_fp4_last", "fp4_bytes"]

WIRE_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32 = jnp.dtype(jnp.float32)
_U8 = jnp.dtype(jnp.uint8)


def even_block(block_size) -> int:
  """``block_size`` as an int, or raises: a positive even integer (blocks start on a byte)."""
  bs = positive_int("block_size", block_size)
  if bs % 2:
    raise ValueError(f"block_size must be even (two fp4 codes a byte), got {bs}")
  return bs


def _num_blocks(n: int, block_size: int) -> int:
  return -(-n // block_size)


def _seed(seed) -> jax.Array:
  if isinstance(seed, (int, np.integer)):
    return jnp.asarray(np.uint32(int(seed) & 0xFFFFFFFF))
  seed = jnp.asarray(seed)
  if seed.ndim != 0 or not jnp.issubdtype(seed.dtype, jnp.integer):
    raise TypeError(f"seed must be an integer scalar, got {seed.dtype}{list(seed.shape)}")
  return seed.astype(jnp.uint32)


def _codes_for(name: str, q, n: int) -> jax.Array:
  q = flat(name, q, (_U8,))
  if q.shape[0] != fp4_bytes(n):
    raise ValueError(f"{name} has {q.shape[0]} bytes but {n} values take {fp4_bytes(n)} "
                     "(two fp4 codes a byte)")
  return q


def _scales_for(name: str, scales, n: int, block_size: int) -> jax.Array:
  scales = flat(name, scales, (_F32,))
  if scales.shape[0] != _num_blocks(n, block_size):
    raise ValueError(f"{name} has {scales.shape[0]} elements but {n} values in blocks of "
                     f"{block_size} need {_num_blocks(n, block_size)}")
  return scales


def _not_differentiable(*_):
  raise TypeError("quantize_fp4 is not differentiable (its codes are integers)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantize(x, seed, block_size: int, stochastic: bool):
  n = x.shape[0]
  results = (jax.ShapeDtypeStruct((fp4_bytes(n),), _U8),
             jax.ShapeDtypeStruct((_num_blocks(n, block_size),), _F32))
  return tuple(_call("quantize_fp4", results, x, seed, block_size=np.int64(block_size),
                     stochastic=np.bool_(stochastic)))


_quantize.defvjp(lambda x, seed, bs, st: (_quantize(x, seed, bs, st), None), _not_differentiable)


def quantize_fp4(x: ArrayLike, block_size: int = 64, stochastic: bool = False,
                 seed: int | ArrayLike = 0) -> tuple[jax.Array, jax.Array]:
  """Encodes a flat array as 4-bit e2m1 codes, two a byte, with one f32 scale per block.

  ``scale = max|x_block| * c`` (``c`` the largest f32 below 1/6) and each ``x * 6 / max|x_block|``
  is rounded to the nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to an even mantissa; with
  ``stochastic=True`` to one of its two neighbours, unbiased (to within 2^-17 of a step), from a
  hash of ``seed`` and the element index. Blocks whose max|x| is below 2^-64 get scale 0; blocks
  holding Inf/NaN get scale NaN and decode to NaN. The rules, exactly:
  :mod:`jaxring._src.ext.reference`.

  Args:
    x: f32, bf16 or f16 array of shape ``[n]``.
    block_size: elements per scale (static, even); the last block may be partial.
    stochastic: stochastic instead of round-to-nearest-even rounding (static).
    seed: integer scalar (may be traced) keying the stochastic rounding.

  Returns:
    ``(q, scales)``: uint8 ``[ceil(n / 2)]`` (element 2i in the low nibble of byte i) and f32
    ``[ceil(n / block_size)]``.

  Example:
      >>> q, s = quantize_fp4(jnp.array([3.0, -1.0, 0.5], jnp.float32), block_size=2)
      >>> [hex(b) for b in q.tolist()], s.tolist()
      (['0xc7', '0x7'], [0.4999999701976776, 0.0833333283662796])
  """
  x = flat("x", x, WIRE_FLOAT_DTYPES)
  return _quantize(x, _seed(seed), even_block(block_size), bool(stochastic))


def _value_grads(block_size: int, q, n: int, ct) -> jax.Array:
  """d/dscale_b of ``value(code) * scale``: the sum over the block of ``ct * value``."""
  from jaxring._src.ext import reference
  return jnp.sum(reference._fp4_values(q, n, block_size) *   # noqa: SLF001
                 reference._blocks(ct.astype(_F32), block_size), axis=1)  # noqa: SLF001


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dequantize(q, scales, block_size: int, dtype, n: int):
  return _call("dequantize_fp4", jax.ShapeDtypeStruct((n,), dtype), q, scales,
               block_size=np.int64(block_size))


def _dequantize_fwd(q, scales, block_size, dtype, n):
  return _dequantize(q, scales, block_size, dtype, n), q


def _dequantize_bwd(block_size, dtype, n, q, ct):
  return None, _value_grads(block_size, q, n, ct)


_dequantize.defvjp(_dequantize_fwd, _dequantize_bwd)


def dequantize_fp4(q: ArrayLike, scales: ArrayLike, block_size: int = 64,
                   dtype: DTypeLike = jnp.float32, n: int | None = None) -> jax.Array:
  """Decodes packed fp4 codes and per-block scales: ``x = value(code) * scale``, rounded to
  ``dtype``.

  Args:
    q: uint8 array of shape ``[ceil(n / 2)]``.
    scales: f32 array of shape ``[ceil(n / block_size)]``.
    block_size: elements per scale (static, even).
    dtype: f32, bf16 or f16 result dtype.
    n: how many values (static); ``2 * q.shape[0]`` by default (an odd count is one less).

  Returns:
    The decoded ``[n]`` array. Differentiable with respect to ``scales``.

  Example:
      >>> q, s = quantize_fp4(jnp.array([3.0, -1.0, 0.5], jnp.float32), block_size=2)
      >>> dequantize_fp4(q, s, block_size=2, n=3).tolist()
      [2.999999761581421, -0.9999999403953552, 0.4999999701976776]
  """
  q = flat("q", q, (_U8,))
  bs = even_block(block_size)
  n = 2 * q.shape[0] if n is None else operator.index(n)
  if n < 0:
    raise ValueError(f"n must be a count of values, got {n}")
  q = _codes_for("q", q, n)
  scales = _scales_for("scales", scales, n, bs)
  dtype = jnp.dtype(dtype)
  if dtype not in WIRE_FLOAT_DTYPES:
    raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  return _dequantize(q, scales, bs, dtype, n)


def _check_hop(q, scales, partial, block_size):
  partial = flat("partial", partial, (_F32,))
  bs = even_block(block_size)
  n = partial.shape[0]
  return _codes_for("q", q, n), _scales_for("scales", scales, n, bs), partial, bs


def ring_hop_fp4(q: ArrayLike, scales: ArrayLike, partial: ArrayLike, block_size: int = 64,
                 stochastic: bool = False,
                 seed: int | ArrayLike = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One ring hop on the fp4 wire: decode what arrived, add the local partial, re-encode.

  One pass over memory, as :func:`ring_hop_int8`: ``new_partial = decode(q, scales) + partial``
  (two roundings, no FMA) and ``(q_out, scales_out) = quantize_fp4(new_partial, block_size,
  stochastic, seed)`` exactly. Not differentiable.

  Args:
    q: received packed codes ``[ceil(n / 2)]``.
    scales: received f32 scales ``[ceil(n / block_size)]``.
    partial: local f32 partial sum ``[n]``.
    block_size: elements per scale (static, even), the same on both sides of the hop.
    stochastic: stochastic rounding for the outgoing encoding (static).
    seed: integer scalar keying the stochastic rounding.

  Returns:
    ``(new_partial, q_out, scales_out)``.

  Example:
      >>> q, s = quantize_fp4(jnp.ones(4), block_size=2)
      >>> p, q2, s2 = ring_hop_fp4(q, s, jnp.ones(4), block_size=2)
      >>> p.tolist(), q2.tolist()
      ([2.0, 2.0, 2.0, 2.0], [119, 119])
  """
  q, scales, partial, bs = _check_hop(q, scales, partial, block_size)
  n = partial.shape[0]
  results = (jax.ShapeDtypeStruct((n,), _F32), jax.ShapeDtypeStruct(q.shape, _U8),
             jax.ShapeDtypeStruct(scales.shape, _F32))
  return tuple(_call("ring_hop_fp4", results, q, scales, partial, _seed(seed),
                     block_size=np.int64(bs), stochastic=np.bool_(bool(stochastic))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _hop_last(q, scales, partial, block_size: int):
  return _call("ring_hop_fp4_last", jax.ShapeDtypeStruct(partial.shape, _F32), q, scales,
               partial, block_size=np.int64(block_size))


def _hop_last_bwd(block_size, q, ct):
  return None, _value_grads(block_size, q, ct.shape[0], ct), ct


_hop_last.defvjp(lambda q, s, p, bs: (_hop_last(q, s, p, bs), q), _hop_last_bwd)


def ring_hop_fp4_last(q: ArrayLike, scales: ArrayLike, partial: ArrayLike,
                      block_size: int = 64) -> jax.Array:
  """The last hop of an fp4 reduce-scatter: ``decode(q, scales) + partial``, nothing encoded.

  Args:
    q: received packed codes ``[ceil(n / 2)]``.
    scales: received f32 scales ``[ceil(n / block_size)]``.
    partial: local f32 partial sum ``[n]``.
    block_size: elements per scale (static, even).

  Returns:
    The f32 ``[n]`` sum; differentiable in ``scales`` and ``partial``.

  Example:
      >>> q, s = quantize_fp4(jnp.ones(4), block_size=2)
      >>> ring_hop_fp4_last(q, s, jnp.ones(4), block_size=2).tolist()
      [2.0, 2.0, 2.0, 2.0]
  """
  q, scales, partial, bs = _check_hop(q, scales, partial, block_size)
  return _hop_last(q, scales, partial, bs)
