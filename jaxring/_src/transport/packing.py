"""A payload of several arrays as one message: their bytes, concatenated (both transports).

A codec's hop carries several arrays (int8: codes and scales). Each collective costs messages
of its own, and so link bytes and time: with gloo a small int8 call put 20 KB on a node link
sent array by array and 12 KB packed, and took 15 ms instead of 10 at 10 Mbit/s
(docs/design.md, "Investigations"). The transports send a payload as one uint8 buffer
and split it on arrival.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _bytes_of(x):
  """``x``'s bytes as a flat uint8 vector."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def pack(arrays) -> jnp.ndarray:
  """The bytes of ``arrays``, one after the other, as a flat uint8 vector."""
  return jnp.concatenate([_bytes_of(x) for x in arrays])


def unpack(buf, like, leading: int = 0) -> tuple:
  """The arrays of :func:`pack`'s ``buf``, shaped and typed as ``like``'s. ``leading``: ``buf``
  holds that many members' packs, one per row (an all-gather's); each array comes back tiled,
  the members' pieces concatenated along its first axis."""
  out, at = [], 0
  rows = (leading,) if leading else ()
  for x in like:
    dtype = jnp.uint8 if x.dtype == jnp.bool_ else x.dtype
    size, item = x.size, jnp.dtype(dtype).itemsize
    part = buf[..., at:at + size * item]
    at += size * item
    part = part.reshape(rows + x.shape + ((item,) if item > 1 else ()))
    y = lax.bitcast_convert_type(part, dtype)
    if leading:
      y = y.reshape((leading * x.shape[0],) + x.shape[1:])
    out.append(y.astype(jnp.bool_) if x.dtype == jnp.bool_ else y)
  return tuple(out)
