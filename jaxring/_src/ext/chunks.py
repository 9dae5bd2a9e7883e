"""Typed wrappers around the chunk kernels of xla_ext/, for coarse-grained top-k compression.

A flat buffer of ``n`` values is seen as ``ceil(n / chunk_size)`` chunks (the last may be partial).
:func:`chunk_norms` ranks them, :func:`gather_chunks` packs the selected ones densely and
:func:`scatter_add_chunks` adds a packed buffer back. All three work under ``jit``, ``vmap`` and
``grad``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxring._src.ext.checks import call as _call
from jaxring._src.ext.checks import flat, positive_int

__all__ = ["num_chunks", "chunk_norms", "gather_chunks", "scatter_add_chunks"]

_F32 = jnp.dtype(jnp.float32)
_GATHER_DTYPES = (_F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.int8))
# XLA computes an array's byte size in int64 and aborts the process (SIGABRT, "overflow in static
# extent product") when it overflows, before any Python error can be raised: shapes are checked
# against this here, while a ValueError is still possible.
_MAX_ARRAY_BYTES = 2**63 - 1


def num_chunks(n: int, chunk_size: int) -> int:
  """Number of chunks (the last may be partial) of a flat buffer of ``n`` values.

  Example:
      >>> num_chunks(10, 4)
      3
  """
  return -(-n // chunk_size)


def _chunk_size(value) -> int:
  if isinstance(value, (bool, np.bool_)):  # operator.index(True) == 1: a flag, not a size
    raise TypeError(f"chunk_size must be a static Python int, got {value!r}")
  return positive_int("chunk_size", value)


def _check_packed_size(k: int, chunk_size: int, dtype) -> None:
  """Raises if ``k`` chunks of ``chunk_size`` values of ``dtype`` exceed XLA's largest array."""
  nbytes = k * chunk_size * jnp.dtype(dtype).itemsize
  if nbytes > _MAX_ARRAY_BYTES:
    raise ValueError(
        f"{k} chunks of chunk_size={chunk_size} {jnp.dtype(dtype).name} values need {nbytes} "
        f"bytes, more than the largest array XLA can describe ({_MAX_ARRAY_BYTES} bytes); "
        "chunk_size is far too large"
    )


def _check_idx(idx, n: int, chunk_size: int) -> jax.Array:
  idx = flat("idx", idx, (jnp.dtype(jnp.int32),))
  if not isinstance(idx, jax.core.Tracer):  # concrete indices: check them before launching
    values = np.asarray(idx)
    nc = num_chunks(n, chunk_size)
    bad = np.flatnonzero((values < 0) | (values >= nc))
    if bad.size:
      i = int(bad[0])
      raise ValueError(
          f"idx[{i}] = {int(values[i])} is out of range: x has {nc} chunks of {chunk_size}"
      )
  return idx


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _chunk_norms(x, chunk_size: int):
  out = jax.ShapeDtypeStruct((num_chunks(x.shape[0], chunk_size),), _F32)
  return _call("chunk_norms", out, x, chunk_size=np.int64(chunk_size))


def _chunk_norms_fwd(x, chunk_size):
  norms = _chunk_norms(x, chunk_size)
  return norms, (x, norms)


def _chunk_norms_bwd(chunk_size, res, ct):
  x, norms = res
  per_chunk = jnp.where(norms > 0, ct / jnp.where(norms > 0, norms, 1.0), 0.0)
  # A chunk longer than x is one chunk of x.shape[0]: the padded chunks * chunk_size shape is never
  # built, which for a huge chunk_size would not fit an XLA shape.
  n = x.shape[0]
  return (x * jnp.repeat(per_chunk, min(chunk_size, n))[:n],)


_chunk_norms.defvjp(_chunk_norms_fwd, _chunk_norms_bwd)


def chunk_norms(x: ArrayLike, chunk_size: int) -> jax.Array:
  """L2 norm of each chunk of a flat f32 buffer.

  Squares are summed in f64 and the root rounded once to f32, so a norm is within 1 ulp of the
  float64 result and stays finite where an f32 sum of squares would overflow. Inf/NaN inside a
  chunk give an Inf/NaN norm.

  Args:
    x: f32 array of shape ``[n]``.
    chunk_size: elements per chunk (static); the last chunk may be partial.

  Returns:
    f32 ``[ceil(n / chunk_size)]``. The gradient of a zero chunk's norm is taken as 0.

  Example:
      >>> chunk_norms(jnp.array([3.0, 4.0, 0.0, 12.0, 5.0]), 2).tolist()
      [5.0, 12.0, 5.0]
  """
  x = flat("x", x, (_F32,))
  return _chunk_norms(x, _chunk_size(chunk_size))


def _shape_residual(x: jax.Array) -> jax.Array:
  return jnp.zeros((x.shape[0], 0), x.dtype)  # carries n and the dtype at no cost


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather(x, idx, chunk_size: int):
  out = jax.ShapeDtypeStruct((idx.shape[0] * chunk_size,), x.dtype)
  return _call("gather_chunks", out, x, idx, chunk_size=np.int64(chunk_size))


def _gather_bwd(chunk_size, res, ct):
  idx, like = res
  zeros = jnp.zeros((like.shape[0],), _F32)
  dx = _scatter_add(zeros, idx, ct.astype(_F32), chunk_size)
  return dx.astype(like.dtype), None


_gather.defvjp(lambda x, idx, cs: (_gather(x, idx, cs), (idx, _shape_residual(x))), _gather_bwd)


def gather_chunks(x: ArrayLike, idx: ArrayLike, chunk_size: int) -> jax.Array:
  """Packs the chunks ``idx`` of a flat buffer densely, in the order given.

  Args:
    x: f32, bf16, f16 or int8 array of shape ``[n]``.
    idx: int32 ``[k]`` chunk indices in ``[0, ceil(n / chunk_size))``; duplicates allowed.
      Concrete indices are checked here; traced ones by the kernel (an error at run time on
      CPU; on GPU an out-of-range chunk is read as zeros).
    chunk_size: elements per chunk (static).

  Returns:
    ``[k * chunk_size]`` array of ``x.dtype``; a partial last chunk is padded with zeros.

  Raises:
    ValueError: an index out of range, a non-positive ``chunk_size``, or a result too large for
      an XLA array (``k * chunk_size`` values over 2**63 - 1 bytes).

  Example:
      >>> gather_chunks(jnp.arange(5.0), jnp.array([2, 0], jnp.int32), 2).tolist()
      [4.0, 0.0, 0.0, 1.0]
  """
  x = flat("x", x, _GATHER_DTYPES)
  cs = _chunk_size(chunk_size)
  idx = _check_idx(idx, x.shape[0], cs)
  _check_packed_size(idx.shape[0], cs, x.dtype)
  return _gather(x, idx, cs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scatter_add(x, idx, packed, chunk_size: int):
  out = jax.ShapeDtypeStruct(x.shape, _F32)
  # The result reuses x's buffer; XLA copies x first only when x is still needed.
  return _call("scatter_add_chunks", out, x, idx, packed, aliases={0: 0},
               chunk_size=np.int64(chunk_size))


def _scatter_add_bwd(chunk_size, idx, ct):
  return ct, None, _gather(ct, idx, chunk_size)


_scatter_add.defvjp(lambda x, idx, p, cs: (_scatter_add(x, idx, p, cs), idx), _scatter_add_bwd)


def scatter_add_chunks(x: ArrayLike, idx: ArrayLike, packed: ArrayLike,
                       chunk_size: int) -> jax.Array:
  """Adds a packed buffer back into the chunks ``idx`` of a flat f32 buffer.

  ``x'[chunk idx[j]] = x[chunk idx[j]] + packed[j * chunk_size : (j + 1) * chunk_size]``, the
  inverse layout of :func:`gather_chunks`; padding beyond the end of ``x`` is ignored and
  duplicate indices add up.

  Args:
    x: f32 array of shape ``[n]``.
    idx: int32 ``[k]`` chunk indices (checked as in :func:`gather_chunks`; on GPU an
      out-of-range chunk is skipped).
    packed: f32 ``[k * chunk_size]``.
    chunk_size: elements per chunk (static).

  Returns:
    The updated f32 ``[n]`` array.

  Example:
      >>> scatter_add_chunks(jnp.zeros(5), jnp.array([2], jnp.int32), jnp.ones(2), 2).tolist()
      [0.0, 0.0, 0.0, 0.0, 1.0]
  """
  x = flat("x", x, (_F32,))
  cs = _chunk_size(chunk_size)
  idx = _check_idx(idx, x.shape[0], cs)
  packed = flat("packed", packed, (_F32,))
  if packed.shape[0] != idx.shape[0] * cs:
    raise ValueError(
        f"packed has {packed.shape[0]} elements but {idx.shape[0]} chunks of {cs} need "
        f"{idx.shape[0] * cs}"
    )
  return _scatter_add(x, idx, packed, cs)
