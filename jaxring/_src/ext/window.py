"""The ring's kernels reading the local chunk in place: ``base[offset:offset + n]``.

The ring's hop adds what arrived to a chunk of its own buffer. Handed a slice, XLA copies the
chunk into a buffer of its own before the custom call (a custom call takes whole buffers): on
the emulated cluster, the JAX shape's hierarchical int8 all-reduce of 32 MiB spent 10-19 ms of CPU
a process a call on them (docs/design.md, "Investigations"). These wrappers
take the whole flat f32 buffer and the chunk's first element instead (an int32 scalar, traced
where it depends on the device's rank), and the CPU targets ``jaxring_<name>_at`` read the chunk
where it lies.

They exist on the CPU only. Elsewhere, and wherever the codecs run a kernel's jnp reference
instead of its FFI target (``codecs/kernels.py``), the caller slices and calls the kernel
(``reference.take``), which is the same arithmetic. Each wrapper is differentiated as the sliced
call is.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxring._src.ext import kernels
from jaxring._src.ext.checks import call
from jaxring._src.ext.reference import take

_F32 = jnp.dtype(jnp.float32)


def _call(kernel, results, *args, **attrs):
  """Calls kernel's windowed target ``jaxring_<kernel>_at``; it takes flat operands, so under
  vmap it is called once per row."""
  return call(f"{kernel}_at", results, *args, vmap_method="sequential", **attrs)


def _offset(offset) -> jax.Array:
  return jnp.asarray(offset, jnp.int32)


def _differentiated_as_sliced(in_place, sliced, *args):
  """``in_place(*args)``, with the derivative of ``sliced(*args)`` (the same values)."""
  f = jax.custom_vjp(in_place)
  f.defvjp(lambda *a: (in_place(*a), a), lambda a, ct: jax.vjp(sliced, *a)[1](ct))
  return f(*args)


def quantize_int8(base, offset, n: int, block_size: int):
  """``kernels.quantize_int8(base[offset:offset + n], block_size)`` (round to nearest)."""
  blocks = kernels.num_blocks(n, block_size)
  results = (jax.ShapeDtypeStruct((n,), jnp.int8), jax.ShapeDtypeStruct((blocks,), _F32))

  def in_place(b, o):
    return tuple(_call("quantize_int8", results, b, o, jnp.uint32(0),
                       block_size=np.int64(block_size), stochastic=np.bool_(False)))

  def sliced(b, o):
    return tuple(kernels.quantize_int8(take(b, o, n), block_size))
  return _differentiated_as_sliced(in_place, sliced, base, _offset(offset))


def ring_hop_int8(q, scales, base, offset, block_size: int):
  """``kernels.ring_hop_int8(q, scales, base[offset:offset + n], block_size)``."""
  n = q.shape[0]
  results = (jax.ShapeDtypeStruct((n,), _F32), jax.ShapeDtypeStruct((n,), jnp.int8),
             jax.ShapeDtypeStruct(scales.shape, _F32))

  def in_place(q, s, b, o):
    return tuple(_call("ring_hop_int8", results, q, s, b, o, jnp.uint32(0),
                       block_size=np.int64(block_size), stochastic=np.bool_(False)))

  def sliced(q, s, b, o):
    return tuple(kernels.ring_hop_int8(q, s, take(b, o, n), block_size))
  return _differentiated_as_sliced(in_place, sliced, q, scales, base, _offset(offset))


def ring_hop_int8_last(q, scales, base, offset, block_size: int):
  """``kernels.ring_hop_int8_last(q, scales, base[offset:offset + n], block_size)``."""
  n = q.shape[0]

  def in_place(q, s, b, o):
    return _call("ring_hop_int8_last", jax.ShapeDtypeStruct((n,), _F32), q, s, b, o,
                 block_size=np.int64(block_size))

  def sliced(q, s, b, o):
    return kernels.ring_hop_int8_last(q, s, take(b, o, n), block_size)
  return _differentiated_as_sliced(in_place, sliced, q, scales, base, _offset(offset))


def ring_hop_cast(recv, base, offset):
  """``kernels.ring_hop_cast(recv, base[offset:offset + n])`` for a 16-bit ``recv``."""
  n = recv.shape[0]
  results = (jax.ShapeDtypeStruct((n,), _F32), jax.ShapeDtypeStruct((n,), recv.dtype))

  def in_place(r, b, o):
    return tuple(_call("ring_hop_cast", results, r, b, o))

  def sliced(r, b, o):
    return tuple(kernels.ring_hop_cast(r, take(b, o, n)))
  return _differentiated_as_sliced(in_place, sliced, recv, base, _offset(offset))


def ring_hop_cast_last(recv, base, offset):
  """``kernels.ring_hop_cast_last(recv, base[offset:offset + n])``."""
  n = recv.shape[0]

  def in_place(r, b, o):
    return _call("ring_hop_cast_last", jax.ShapeDtypeStruct((n,), _F32), r, b, o)

  def sliced(r, b, o):
    return kernels.ring_hop_cast_last(r, take(b, o, n))
  return _differentiated_as_sliced(in_place, sliced, recv, base, _offset(offset))


def quantize_fp4(base, offset, n: int, block_size: int):
  """``kernels.quantize_fp4(base[offset:offset + n], block_size)`` (round to nearest); ``n`` is
  even (the target counts the chunk's values as twice its code bytes: the ring's chunks are
  whole blocks of an even size)."""
  if n % 2:
    raise ValueError(f"the windowed quantize_fp4 takes an even count of values, got {n}")
  results = (jax.ShapeDtypeStruct((n // 2,), jnp.uint8),
             jax.ShapeDtypeStruct((kernels.num_blocks(n, block_size),), _F32))

  def in_place(b, o):
    return tuple(_call("quantize_fp4", results, b, o, jnp.uint32(0),
                       block_size=np.int64(block_size), stochastic=np.bool_(False)))

  def sliced(b, o):
    return tuple(kernels.quantize_fp4(take(b, o, n), block_size))
  return _differentiated_as_sliced(in_place, sliced, base, _offset(offset))


def ring_hop_fp4(q, scales, base, offset, n: int, block_size: int):
  """``kernels.ring_hop_fp4(q, scales, base[offset:offset + n], block_size)``."""
  results = (jax.ShapeDtypeStruct((n,), _F32), jax.ShapeDtypeStruct(q.shape, jnp.uint8),
             jax.ShapeDtypeStruct(scales.shape, _F32))

  def in_place(q, s, b, o):
    return tuple(_call("ring_hop_fp4", results, q, s, b, o, jnp.uint32(0),
                       block_size=np.int64(block_size), stochastic=np.bool_(False)))

  def sliced(q, s, b, o):
    return tuple(kernels.ring_hop_fp4(q, s, take(b, o, n), block_size))
  return _differentiated_as_sliced(in_place, sliced, q, scales, base, _offset(offset))


def ring_hop_fp4_last(q, scales, base, offset, n: int, block_size: int):
  """``kernels.ring_hop_fp4_last(q, scales, base[offset:offset + n], block_size)``."""
  def in_place(q, s, b, o):
    return _call("ring_hop_fp4_last", jax.ShapeDtypeStruct((n,), _F32), q, s, b, o,
                 block_size=np.int64(block_size))

  def sliced(q, s, b, o):
    return kernels.ring_hop_fp4_last(q, s, take(b, o, n), block_size)
  return _differentiated_as_sliced(in_place, sliced, q, scales, base, _offset(offset))
