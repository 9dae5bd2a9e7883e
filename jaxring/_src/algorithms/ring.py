"""Bandwidth-optimal ring reduce-scatter and all-gather over one group (Thakur et al. 2005, sec. 4).

Each member holds its buffer as ``p`` chunks. Chunk indices that depend on the member's rank would
be dynamic slices at every hop; instead each member first rotates its chunks by its rank, after
which every hop reads and writes the same *static* chunk on every member (measured: static indexing
halves the ring's cost on CPU). One dynamic rotation in, one out.

All functions take flat buffers whose length is a multiple of ``group.size * codec.align`` and
return flat buffers. Partial sums stay in the accumulator dtype; ``codec`` decides what travels.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxring._src.codecs.base import Codec
from jaxring._src.transport.groups import Group


def _rotate(chunks, shift):
  """``out[k] = chunks[(k + shift) % p]`` along axis 0 (shift may be traced)."""
  if isinstance(shift, int) and shift == 0:
    return chunks
  return jnp.roll(chunks, -shift, axis=0)


def reduce_scatter(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False):
  """Ring reduce-scatter: member ``r`` ends with the sum of chunk ``r`` (p - 1 hops).

  Args:
    flat: this member's buffer, accumulator dtype, length ``p * c``.
    group: the members of the ring.
    codec: wire format; each hop is one ``codec.hop`` (decode + add + re-encode).
    dtype: the user's dtype (the codec's wire format may depend on it).
    transport: moves payloads between members.
    want_error: also return the compression error this member introduced, laid out like ``flat``
      (what error feedback must carry to the next step); None otherwise.

  Returns:
    ``(shard, error)``: the reduced chunk ``r`` (length ``c``) and the error (or None).
  """
  p = group.size
  if p == 1:
    return flat, (jnp.zeros_like(flat) if want_error else None)
  c = flat.shape[0] // p
  rot = _rotate(flat.reshape(p, c), group.rank())
  # Hop s sends local chunk p-1-s; the predecessor's chunk p-1-s is our chunk p-2-s.
  payload = codec.encode(rot[p - 1], dtype)
  errors = [None] * p
  if want_error:
    errors[p - 1] = rot[p - 1] - codec.decode(payload, dtype)
  shard = None
  for s in range(p - 1):
    recv = transport.shift(payload, group)
    k = p - 2 - s
    if k > 0:
      partial, payload = codec.hop(recv, rot[k], dtype)
      if want_error:
        errors[k] = partial - codec.decode(payload, dtype)
    else:
      shard = codec.last_hop(recv, rot[0], dtype)
  if not want_error:
    return shard, None
  errors[0] = jnp.zeros_like(shard)
  return shard, _rotate(jnp.stack(errors), -group.rank()).reshape(-1)


def all_gather_payload(payload: tuple, group: Group, transport) -> tuple:
  """Gathers each member's encoded chunk; arrays come back concatenated in member order.

  The native all-gather is used when the group is a whole set of axes (it is itself a
  bandwidth-optimal ring in gloo and NCCL, and the only way to type the result invariant);
  a ppermute ring of p - 1 hops, forwarding without re-encoding, otherwise.
  """
  p = group.size
  if p == 1:
    return payload
  native = transport.all_gather(payload, group)
  if native is not None:
    return native
  return ring_all_gather_payload(payload, group, transport)


def ring_all_gather_payload(payload: tuple, group: Group, transport) -> tuple:
  """All-gather as a ppermute ring: hop s forwards what arrived at hop s - 1 (p - 1 hops)."""
  p = group.size
  if p == 1:
    return payload
  # Local (rotated) chunk k is member (r + k)'s data; we hold k = 0 and receive k = p-1, p-2, ...
  slots = [None] * p
  slots[0] = payload
  cur = payload
  for s in range(p - 1):
    cur = transport.shift(cur, group)
    slots[p - 1 - s] = cur
  r = group.rank()
  out = []
  for i in range(len(payload)):
    stacked = jnp.stack([slot[i] for slot in slots])
    out.append(_rotate(stacked, -r).reshape(-1))
  return tuple(out)


def all_reduce(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False):
  """Ring all-reduce: reduce-scatter, encode the owned chunk once, all-gather, decode.

  Every member decodes the same gathered payload, so the result is bit-identical on all members.
  Returns ``(result, error)`` like :func:`reduce_scatter`.
  """
  shard, err = reduce_scatter(flat, group, codec, dtype, transport, want_error=want_error)
  payload = codec.encode(shard, dtype)
  if want_error and group.size > 1:
    c = shard.shape[0]
    own = (shard - codec.decode(payload, dtype))
    err = err + _place(own, group.rank(), c, flat.shape[0])
  elif want_error:
    err = shard - codec.decode(payload, dtype)
  gathered = all_gather_payload(payload, group, transport)
  return codec.decode(gathered, dtype), err


def _place(chunk, index, c, n):
  """A length-``n`` zero buffer with ``chunk`` at chunk position ``index`` (index may be traced)."""
  from jax import lax
  return lax.dynamic_update_slice(jnp.zeros((n,), chunk.dtype), chunk, (index * c,))
