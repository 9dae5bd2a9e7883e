"""Bandwidth-optimal ring reduce-scatter and all-gather over one group (Thakur et al. 2005, sec. 4).

Each member holds its buffer as ``p`` chunks. Chunk indices that depend on the member's rank would
be dynamic slices at every hop; instead each member first rotates its chunks by its rank, after
which every hop reads and writes the same *static* chunk on every member (measured: static indexing
halves the ring's cost on CPU). One dynamic rotation in, one out.

All functions take flat buffers whose length is a multiple of ``group.size * codec.align`` and
return flat buffers. Partial sums stay in the accumulator dtype; ``codec`` decides what travels.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxring._src import vma
from jaxring._src.algorithms.base import Plan, PlanRequest, permute_flat, register
from jaxring._src.codecs.base import Codec
from jaxring._src.transport.binding import mesh_axis_names
from jaxring._src.transport.groups import Group, whole_group


def _unrotate(chunks: list, r):
  """Rows ``out[(r + k) % p] = chunks[k]`` (``r`` may be traced), written in place one row at a
  time: XLA:CPU runs a roll by a traced shift (``jnp.roll``) as a select per element, several
  times slower than these copies."""
  p = len(chunks)
  if isinstance(r, int) and r == 0:
    return jnp.stack(chunks)
  out = jnp.zeros((p,) + chunks[0].shape, chunks[0].dtype)
  for k, chunk in enumerate(chunks):
    out = lax.dynamic_update_index_in_dim(out, chunk, (r + k) % p, axis=0)
  return out


def reduce_scatter(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False,
                   pieces: int = 1):
  """Ring reduce-scatter: member ``r`` ends with the sum of chunk ``r`` (p - 1 hops).

  Args:
    flat: this member's buffer, accumulator dtype, length ``p * c``.
    group: the members of the ring.
    codec: wire format; each hop is one ``codec.hop`` (decode + add + re-encode).
    dtype: the user's dtype (the codec's wire format may depend on it).
    transport: moves payloads between members.
    want_error: also return the compression error this member introduced, laid out like ``flat``
      (what error feedback must carry to the next step); None otherwise.
    pieces: split every hop into this many independent sub-chunk transfers (``c`` must be a
      multiple of ``pieces * codec.align``; otherwise the hop stays whole). Piece ``j + 1`` is
      on the wire while piece ``j`` is decoded, added and re-encoded: the executor overlaps the
      hop kernel with the transfer instead of running them in turn.

  Returns:
    ``(shard, error)``: the reduced chunk ``r`` (length ``c``) and the error (or None).
  """
  p = group.size
  if p == 1:
    return flat, (jnp.zeros_like(flat) if want_error else None)
  c = flat.shape[0] // p
  if pieces < 1 or c % (pieces * codec.align):
    pieces = 1
  rows, r, cp = flat.reshape(p, c), group.rank(), c // pieces

  def local(k, j):
    """Piece ``j`` of local chunk ``k``, i.e. of row ``(r + k) % p`` (sliced where it is used:
    no rotated copy of the whole buffer)."""
    row = lax.dynamic_index_in_dim(rows, (r + k) % p, axis=0, keepdims=False)
    return row[j * cp:(j + 1) * cp]

  def at(k, j):
    """Where that piece starts in ``flat``: the codecs' kernels read it there (codecs/base.py,
    ``hop_at``) instead of a copy XLA would make of the slice."""
    return ((r + k) % p) * c + j * cp

  in_place = flat.shape[0] < 2**31   # what a traced int32 offset addresses
  encode = ((lambda k, j: codec.encode_at(flat, at(k, j), cp, dtype)) if in_place else
            (lambda k, j: codec.encode(local(k, j), dtype)))
  hop = ((lambda recv, k, j: codec.hop_at(recv, flat, at(k, j), cp, dtype)) if in_place else
         (lambda recv, k, j: codec.hop(recv, local(k, j), dtype)))
  last_hop = ((lambda recv, j: codec.last_hop_at(recv, flat, at(0, j), cp, dtype)) if in_place
              else (lambda recv, j: codec.last_hop(recv, local(0, j), dtype)))

  # Hop s sends local chunk p-1-s; the predecessor's chunk p-1-s is our chunk p-2-s.
  payloads = [encode(p - 1, j) for j in range(pieces)]
  errors = [[None] * p for _ in range(pieces)]
  if want_error:
    for j in range(pieces):
      errors[j][p - 1] = local(p - 1, j) - codec.decode(payloads[j], dtype)
  shards = [None] * pieces
  for s in range(p - 1):
    k = p - 2 - s
    for j in range(pieces):
      recv = transport.shift(payloads[j], group)
      if k > 0:
        partial, payloads[j] = hop(recv, k, j)
        if want_error:
          errors[j][k] = partial - codec.decode(payloads[j], dtype)
      else:
        shards[j] = last_hop(recv, j)
  shard = _concat(shards)
  if not want_error:
    return shard, None
  for j in range(pieces):
    errors[j][0] = jnp.zeros_like(shards[j])
  err = [_concat([errors[j][k] for j in range(pieces)]) for k in range(p)]  # local chunk k's
  return shard, _unrotate(err, r).reshape(-1)


def _concat(parts, axis=0):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def all_gather_payload(payload: tuple, group: Group, transport) -> tuple:
  """Gathers each member's encoded chunk; arrays come back concatenated in member order.

  The native all-gather is used when the group is a whole set of axes (it is itself a
  bandwidth-optimal ring in gloo and NCCL, and the only way to type the result invariant);
  a ppermute ring of p - 1 hops, forwarding without re-encoding, otherwise.
  """
  p = group.size
  if p == 1:
    return payload
  if group.whole:
    return transport.all_gather(payload, group)
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
  return tuple(_unrotate([slot[i] for slot in slots], r).reshape(-1) for i in range(len(payload)))


#: Below this many bytes gathered a member, :func:`all_reduce` is one all-gather and a local sum:
#: a few bytes cost what a collective costs, not what they weigh (a top-k sync of one fragment
#: over gloo, 4 processes: 18.1 KB on a node's link by the ring's 3 hops and all-gather, 16.1 KB
#: by one all-gather; docs/design.md, "Investigations").
GATHER_BELOW = 8 << 10


def all_reduce(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False,
               pieces: int = 1):
  """Ring all-reduce: reduce-scatter, encode the owned chunk once, all-gather, decode.

  A small buffer (every other member's payload under :data:`GATHER_BELOW` bytes together) over a
  whole group is gathered encoded and summed where it lands (:func:`gather_sum`): latency-bound,
  one message instead of ``2 (p - 1)``. Every member decodes the same gathered payload, so the
  result is bit-identical on all members. Returns ``(result, error)`` like
  :func:`reduce_scatter`.
  """
  if gathers(flat, group, codec, dtype):
    return gather_sum(flat, group, codec, dtype, transport, want_error=want_error)
  gathered, err = all_reduce_payload(flat, group, codec, dtype, transport, want_error=want_error,
                                     pieces=pieces)
  return codec.decode(gathered, dtype), err


def gathers(flat, group: Group, codec: Codec, dtype) -> bool:
  """Whether the all-reduce of ``flat`` gathers instead of ringing (:data:`GATHER_BELOW`)."""
  p = group.size
  return p > 1 and group.whole and (p - 1) * codec.wire_bytes(flat.shape[0], dtype) < GATHER_BELOW


def gather_sum(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False):
  """Every member's whole buffer encoded once, gathered, decoded and summed in member order.

  The sum of the decoded values is the same on every member and rounds once per value (the
  ring's partial sums round at every hop); the error is this member's one encoding's. The
  buffer is typed varying first (as a ring's hops type it), so that the gather types the sum
  invariant, as ``lax.psum`` does.
  """
  flat = vma.pvary(flat, group.axes)
  payload = codec.encode(flat, dtype)
  rows = codec.decode(transport.all_gather(payload, group), dtype).reshape(group.size, -1)
  total = jnp.sum(rows, axis=0, dtype=flat.dtype)
  return total, (flat - codec.decode(payload, dtype) if want_error else None)


def all_reduce_payload(flat, group: Group, codec: Codec, dtype, transport, *, want_error=False,
                       pieces: int = 1):
  """:func:`all_reduce` without the final decode: ``(gathered payload, error)``.

  The payload holds every member's encoded chunk in member order; a caller that must move the
  result further (the all-gather phase of faster levels) can carry it encoded. A small buffer is
  gathered and summed (:func:`gather_sum`) and the sum encoded once, that encoding's error split
  evenly between the members (each holds the same sum), so that their errors add up to it once.
  """
  if gathers(flat, group, codec, dtype):
    total, err = gather_sum(flat, group, codec, dtype, transport, want_error=want_error)
    payload = codec.encode(total, dtype)
    if want_error:
      err = err + (total - codec.decode(payload, dtype)) / jnp.asarray(group.size, flat.dtype)
    return payload, err
  shard, err = reduce_scatter(flat, group, codec, dtype, transport, want_error=want_error,
                              pieces=pieces)
  payload = codec.encode(shard, dtype)
  if want_error and group.size > 1:
    c = shard.shape[0]
    own = (shard - codec.decode(payload, dtype))
    # the reduce-scatter left this member's own chunk error-free: the encoding error goes there
    err = lax.dynamic_update_slice(err, own, (group.rank() * c,))
  elif want_error:
    err = shard - codec.decode(payload, dtype)
  return all_gather_payload(payload, group, transport), err


def _mesh_order(axes: tuple, sizes: tuple) -> tuple[tuple, tuple[int, ...] | None]:
  """The axes in mesh order, and the lax-numbered member at each ring position (None: same)."""
  mesh_names = mesh_axis_names()
  if not set(axes) <= set(mesh_names):
    return axes, None
  ordered = tuple(a for a in mesh_names if a in axes)
  if ordered == axes:
    return axes, None
  size_of = dict(zip(axes, sizes))
  weight = {a: math.prod(sizes[i + 1:]) for i, a in enumerate(axes)}  # lax numbering
  order = []
  for k in range(math.prod(sizes)):
    rem, idx = k, 0
    for a in reversed(ordered):
      idx += (rem % size_of[a]) * weight[a]
      rem //= size_of[a]
    order.append(idx)
  return ordered, tuple(order)


class Ring:
  """One ring over every member; the slowest level's codec travels on it."""

  name = "ring"
  min_levels = 1

  def plan(self, r: PlanRequest) -> Plan:
    pieces = (r.levels[-1].pieces,)
    if len(r.axes) == 1:
      return Plan("ring", (r.whole,), (r.codecs[-1],), ("ring",), (1,), transport=r.transport,
                  pieces=pieces)
    ring_axes, order = _mesh_order(tuple(r.axes), tuple(r.sizes))
    g = whole_group(ring_axes, math.prod(r.sizes), r.groups[-1].name)
    return Plan("ring", (g,), (r.codecs[-1],), ("ring",), (1,), order, pieces=pieces)

  def all_reduce(self, buf, plan: Plan, dtype, *, want_error: bool):
    return all_reduce(buf, plan.groups[0], plan.codecs[0], dtype, plan.transport,
                      want_error=want_error, pieces=plan.pieces[0])

  def reduce_scatter(self, buf, plan: Plan, dtype, order=None):
    return self.reduce_scatter_with_error(buf, plan, dtype, want_error=False, order=order)[0]

  def reduce_scatter_with_error(self, buf, plan: Plan, dtype, *, want_error: bool = True,
                                order=None):
    return reduce_scatter(permute_flat(buf, order), plan.groups[0], plan.codecs[0], dtype,
                          plan.transport, want_error=want_error, pieces=plan.pieces[0])

  def all_gather(self, payload: tuple, plan: Plan, order=None) -> tuple:
    gathered = ring_all_gather_payload(payload, plan.groups[0], plan.transport)
    return tuple(permute_flat(a, order) for a in gathered)

  def chunk_order(self, plan: Plan) -> tuple[int, ...] | None:
    return plan.member_order


register(Ring())
