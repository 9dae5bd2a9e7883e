"""Typed wrappers around the FFI kernels of xla_ext/: int8 block codec and fused ring hops.

Every wrapper takes flat 1-D arrays, checks dtypes, shapes and attributes before anything is
launched (raising ``TypeError``/``ValueError`` naming the argument), and works under ``jit`` and
``vmap`` (``vmap_method="broadcast_all"``: the C++ handlers loop over leading batch rows). The
numerics are defined in :mod:`jaxring._src.ext.reference`; the chunk kernels (top-k) are in
:mod:`jaxring._src.ext.chunks`, the fp4 codec's in :mod:`jaxring._src.ext.fp4`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxring._src.ext.checks import call as _call
from jaxring._src.ext.checks import flat, positive_int, same_length
from jaxring._src.ext.chunks import chunk_norms as chunk_norms
from jaxring._src.ext.chunks import gather_chunks as gather_chunks
from jaxring._src.ext.chunks import num_chunks as num_chunks
from jaxring._src.ext.chunks import scatter_add_chunks as scatter_add_chunks
from jaxring._src.ext.fp4 import dequantize_fp4 as dequantize_fp4
from jaxring._src.ext.fp4 import fp4_bytes as fp4_bytes
from jaxring._src.ext.fp4 import quantize_fp4 as quantize_fp4
from jaxring._src.ext.fp4 import ring_hop_fp4 as ring_hop_fp4
from jaxring._src.ext.fp4 import ring_hop_fp4_last as ring_hop_fp4_last
from jaxring._src.ext.table import KERNELS

__all__ = list(KERNELS)

WIRE_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32 = jnp.dtype(jnp.float32)
_INT8 = jnp.dtype(jnp.int8)


def num_blocks(n: int, block_size: int) -> int:
  """Number of int8 scale blocks (the last may be partial) for ``n`` values.

  Example:
      >>> num_blocks(1000, 256)
      4
  """
  return -(-n // block_size)


def _seed(seed) -> jax.Array:
  if isinstance(seed, (int, np.integer)):
    return jnp.asarray(np.uint32(int(seed) & 0xFFFFFFFF))
  seed = jnp.asarray(seed)
  if seed.ndim != 0 or not jnp.issubdtype(seed.dtype, jnp.integer):
    raise TypeError(f"seed must be an integer scalar, got {seed.dtype}{list(seed.shape)}")
  return seed.astype(jnp.uint32)


def _scales_for(name: str, scales, n: int, block_size: int) -> jax.Array:
  scales = flat(name, scales, (_F32,))
  if scales.shape[0] != num_blocks(n, block_size):
    raise ValueError(
        f"{name} has {scales.shape[0]} elements but {n} values in blocks of {block_size} "
        f"need {num_blocks(n, block_size)}"
    )
  return scales


def _not_differentiable(name: str, hint: str):
  def raise_error(*_):
    raise TypeError(f"{name} is not differentiable; {hint}")

  return raise_error


# --- int8 block codec -----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantize(x, seed, block_size: int, stochastic: bool):
  n = x.shape[0]
  results = (
      jax.ShapeDtypeStruct((n,), _INT8),
      jax.ShapeDtypeStruct((num_blocks(n, block_size),), _F32),
  )
  return tuple(
      _call("quantize_int8", results, x, seed, block_size=np.int64(block_size),
            stochastic=np.bool_(stochastic))
  )


_quantize.defvjp(
    lambda x, seed, bs, st: (_quantize(x, seed, bs, st), None),
    _not_differentiable("quantize_int8",
                        "use fake_quantize_int8 for a straight-through round trip"),
)


def quantize_int8(x: ArrayLike, block_size: int = 256, stochastic: bool = False,
                  seed: int | ArrayLike = 0) -> tuple[jax.Array, jax.Array]:
  """Encodes a flat array as int8 codes with one f32 scale per block.

  ``scale = max|x_block| * RN(1/127)`` and ``q = round_half_even(x * (127 / max|x_block|))``; with
  ``stochastic=True`` the code rounds up with probability frac(x * 127 / max|x_block|) (to within
  2^-17), from a hash of ``seed`` and the element index, so that decoding is unbiased. Blocks whose
  max|x| is below 2^-64 (zeros) get scale 0; blocks holding Inf/NaN get scale NaN, codes 0, and
  decode to NaN. The rules, exactly: :mod:`jaxring._src.ext.reference`.

  Args:
    x: f32, bf16 or f16 array of shape ``[n]``.
    block_size: elements per scale (static); the last block may be partial.
    stochastic: stochastic instead of round-to-nearest-even rounding (static).
    seed: integer scalar (may be traced) keying the stochastic rounding.

  Returns:
    ``(q, scales)``: int8 ``[n]`` and f32 ``[ceil(n / block_size)]``.

  Example:
      >>> q, s = quantize_int8(jnp.array([0.5, -1.0, 0.25], jnp.float32), block_size=2)
      >>> q.tolist(), s.tolist()
      ([64, -127, 127], [0.007874015718698502, 0.0019685039296746254])
  """
  x = flat("x", x, WIRE_FLOAT_DTYPES)
  bs = positive_int("block_size", block_size)
  return _quantize(x, _seed(seed), bs, bool(stochastic))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dequantize(q, scales, block_size: int, dtype):
  return _call("dequantize_int8", jax.ShapeDtypeStruct(q.shape, dtype), q, scales,
               block_size=np.int64(block_size))


def _dequantize_fwd(q, scales, block_size, dtype):
  return _dequantize(q, scales, block_size, dtype), q


def _dequantize_bwd(block_size, dtype, q, ct):
  # Linear in the scales: d/dscale_b = sum over the block of ct * q. The codes are integers.
  from jaxring._src.ext import reference

  blocks = reference._blocks(ct.astype(_F32) * q.astype(_F32), block_size)
  return None, jnp.sum(blocks, axis=1)


_dequantize.defvjp(_dequantize_fwd, _dequantize_bwd)


def dequantize_int8(q: ArrayLike, scales: ArrayLike, block_size: int = 256,
                    dtype: DTypeLike = jnp.float32) -> jax.Array:
  """Decodes int8 codes and per-block scales: ``x = q * scale``, rounded to ``dtype``.

  Args:
    q: int8 array of shape ``[n]``.
    scales: f32 array of shape ``[ceil(n / block_size)]``.
    block_size: elements per scale (static).
    dtype: f32, bf16 or f16 result dtype.

  Returns:
    The decoded ``[n]`` array. Differentiable with respect to ``scales``.

  Example:
      >>> q, s = quantize_int8(jnp.array([0.5, -1.0, 0.25], jnp.float32), block_size=2)
      >>> dequantize_int8(q, s, block_size=2).tolist()
      [0.5039370059967041, -1.0, 0.25]
  """
  q = flat("q", q, (_INT8,))
  bs = positive_int("block_size", block_size)
  scales = _scales_for("scales", scales, q.shape[0], bs)
  dtype = jnp.dtype(dtype)
  if dtype not in WIRE_FLOAT_DTYPES:
    raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  return _dequantize(q, scales, bs, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fake_quantize(x, seed, block_size: int, stochastic: bool):
  q, scales = _quantize(x, seed, block_size, stochastic)
  return _dequantize(q, scales, block_size, x.dtype)


_fake_quantize.defvjp(
    lambda x, seed, bs, st: (_fake_quantize(x, seed, bs, st), None),
    lambda bs, st, _, ct: (ct, None),  # straight-through: the round trip's gradient is identity
)


def fake_quantize_int8(x: ArrayLike, block_size: int = 256, stochastic: bool = False,
                       seed: int | ArrayLike = 0) -> jax.Array:
  """The int8 round trip ``dequantize(quantize(x))`` with a straight-through gradient.

  Args:
    x: f32, bf16 or f16 array of shape ``[n]``.
    block_size: elements per scale (static).
    stochastic: stochastic rounding (static).
    seed: integer scalar keying the stochastic rounding.

  Returns:
    An array like ``x``; ``jax.grad`` through it is the identity.

  Example:
      >>> jax.grad(lambda x: fake_quantize_int8(x).sum())(jnp.ones(3)).tolist()
      [1.0, 1.0, 1.0]
  """
  x = flat("x", x, WIRE_FLOAT_DTYPES)
  return _fake_quantize(x, _seed(seed), positive_int("block_size", block_size), bool(stochastic))


# --- fused ring hops --------------------------------------------------------------------------


def _check_hop_int8(q, scales, partial, block_size):
  q = flat("q", q, (_INT8,))
  bs = positive_int("block_size", block_size)
  scales = _scales_for("scales", scales, q.shape[0], bs)
  partial = flat("partial", partial, (_F32,))
  same_length("partial", partial, "q", q)
  return q, scales, partial, bs


def ring_hop_int8(q: ArrayLike, scales: ArrayLike, partial: ArrayLike, block_size: int = 256,
                  stochastic: bool = False,
                  seed: int | ArrayLike = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One ring hop on the int8 wire: decode what arrived, add the local partial, re-encode.

  One pass over memory: each block is decoded, accumulated in f32 and encoded again while it is
  in L1. ``new_partial = decode(q, scales) + partial`` (two roundings, no FMA) and
  ``(q_out, scales_out) = quantize_int8(new_partial, block_size, stochastic, seed)`` exactly.
  Not differentiable.

  Args:
    q: received int8 codes ``[n]``.
    scales: received f32 scales ``[ceil(n / block_size)]``.
    partial: local f32 partial sum ``[n]``.
    block_size: elements per scale (static), the same on both sides of the hop.
    stochastic: stochastic rounding for the outgoing encoding (static).
    seed: integer scalar keying the stochastic rounding.

  Returns:
    ``(new_partial, q_out, scales_out)``.

  Example:
      >>> q, s = quantize_int8(jnp.ones(4), block_size=2)
      >>> p, q2, s2 = ring_hop_int8(q, s, jnp.ones(4), block_size=2)
      >>> p.tolist(), q2.tolist()
      ([2.0, 2.0, 2.0, 2.0], [127, 127, 127, 127])
  """
  q, scales, partial, bs = _check_hop_int8(q, scales, partial, block_size)
  n = q.shape[0]
  results = (
      jax.ShapeDtypeStruct((n,), _F32),
      jax.ShapeDtypeStruct((n,), _INT8),
      jax.ShapeDtypeStruct(scales.shape, _F32),
  )
  return tuple(
      _call("ring_hop_int8", results, q, scales, partial, _seed(seed),
            block_size=np.int64(bs), stochastic=np.bool_(bool(stochastic)))
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _hop_int8_last(q, scales, partial, block_size: int):
  return _call("ring_hop_int8_last", jax.ShapeDtypeStruct(partial.shape, _F32), q, scales,
               partial, block_size=np.int64(block_size))


def _hop_int8_last_bwd(block_size, q, ct):
  return _dequantize_bwd(block_size, _F32, q, ct) + (ct,)


_hop_int8_last.defvjp(lambda q, s, p, bs: (_hop_int8_last(q, s, p, bs), q), _hop_int8_last_bwd)


def ring_hop_int8_last(q: ArrayLike, scales: ArrayLike, partial: ArrayLike,
                       block_size: int = 256) -> jax.Array:
  """The last hop of an int8 reduce-scatter: ``decode(q, scales) + partial``, nothing encoded.

  Args:
    q: received int8 codes ``[n]``.
    scales: received f32 scales ``[ceil(n / block_size)]``.
    partial: local f32 partial sum ``[n]``.
    block_size: elements per scale (static).

  Returns:
    The f32 ``[n]`` sum; differentiable in ``scales`` and ``partial``.

  Example:
      >>> q, s = quantize_int8(jnp.ones(4), block_size=2)
      >>> ring_hop_int8_last(q, s, jnp.ones(4), block_size=2).tolist()
      [2.0, 2.0, 2.0, 2.0]
  """
  q, scales, partial, bs = _check_hop_int8(q, scales, partial, block_size)
  return _hop_int8_last(q, scales, partial, bs)


def _check_hop_cast(recv, partial):
  recv = flat("recv", recv, WIRE_FLOAT_DTYPES)
  partial = flat("partial", partial, (_F32,))
  same_length("partial", partial, "recv", recv)
  return recv, partial


@jax.custom_vjp
def _hop_cast_last(recv, partial):
  return _call("ring_hop_cast_last", jax.ShapeDtypeStruct(partial.shape, _F32), recv, partial)


def _dtype_residual(x: jax.Array) -> jax.Array:
  return jnp.zeros((0,), x.dtype)  # residuals must be arrays: an empty one carries the dtype


_hop_cast_last.defvjp(
    lambda r, p: (_hop_cast_last(r, p), _dtype_residual(r)),
    lambda res, ct: (ct.astype(res.dtype), ct),
)


@jax.custom_vjp
def _hop_cast(recv, partial):
  results = (jax.ShapeDtypeStruct(partial.shape, _F32),
             jax.ShapeDtypeStruct(recv.shape, recv.dtype))
  return tuple(_call("ring_hop_cast", results, recv, partial))


def _hop_cast_bwd(res, cts):
  ct = cts[0] + cts[1].astype(_F32)  # straight-through the outgoing cast
  return ct.astype(res.dtype), ct


_hop_cast.defvjp(lambda r, p: (_hop_cast(r, p), _dtype_residual(r)), _hop_cast_bwd)


def ring_hop_cast(recv: ArrayLike, partial: ArrayLike) -> tuple[jax.Array, jax.Array]:
  """One ring hop on a float wire (f32/bf16/f16): accumulate in f32 and cast for the next hop.

  Args:
    recv: received ``[n]`` chunk, f32, bf16 or f16.
    partial: local f32 partial sum ``[n]``.

  Returns:
    ``(new_partial, out)``: ``recv.astype(f32) + partial`` and the same rounded to
    ``recv.dtype`` (for an f32 wire both are the same array). Differentiable (straight-through
    the cast).

  Example:
      >>> p, out = ring_hop_cast(jnp.ones(3, jnp.bfloat16), jnp.full(3, 0.5))
      >>> p.dtype, out.dtype, out.tolist()
      (dtype('float32'), dtype(bfloat16), [1.5, 1.5, 1.5])
  """
  recv, partial = _check_hop_cast(recv, partial)
  if recv.dtype == _F32:
    new_partial = _hop_cast_last(recv, partial)
    return new_partial, new_partial
  return _hop_cast(recv, partial)


def ring_hop_cast_last(recv: ArrayLike, partial: ArrayLike) -> jax.Array:
  """The last hop of a float-wire reduce-scatter: ``recv.astype(f32) + partial``.

  Args:
    recv: received ``[n]`` chunk, f32, bf16 or f16.
    partial: local f32 partial sum ``[n]``.

  Returns:
    The f32 ``[n]`` sum; differentiable.

  Example:
      >>> ring_hop_cast_last(jnp.ones(2, jnp.float16), jnp.ones(2)).tolist()
      [2.0, 2.0]
  """
  recv, partial = _check_hop_cast(recv, partial)
  return _hop_cast_last(recv, partial)
