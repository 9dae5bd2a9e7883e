"""XLA transport: every step is an XLA collective (gloo on CPU, NCCL on GPU, memcpy in-process)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxring._src import native, vma
from jaxring._src.transport.groups import Group, axis_arg
from jaxring._src.transport.packing import pack, unpack

# XLA:CPU promotes 16-bit float collectives to f32 on the wire (all-reduce promotion and float
# normalization passes; measured, ../shared/ENVIRONMENT.md). Moving their bit patterns as uint16
# keeps two bytes per value on the wire.
# Several arrays of an all-gather travel as one message below this many bytes per member (a
# message fewer saves a collective's latency); above it each array is gathered alone, since
# splitting the gathered bytes back into arrays copies every member's piece (an all-gather of
# 1 MiB of int8 a member: docs/design.md, "Investigations").
PACK_BELOW = 256 << 10
_BITCAST = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def _as_wire(x):
  t = _BITCAST.get(x.dtype)
  return (lax.bitcast_convert_type(x, t), x.dtype) if t is not None else (x, None)


def _from_wire(x, dtype):
  return x if dtype is None else lax.bitcast_convert_type(x, dtype)


class XlaTransport:
  """Moves arrays between the members of a :class:`Group` with XLA collectives."""

  name = "xla"
  # A lossless slow level uses the native all-reduce: on the emulated cluster (4 nodes x 2
  # devices, 1 Gbit/s, 32 MiB) gloo's took 572 ms in the hierarchical all-reduce, the ring 933 ms.
  native_all_reduce_wins = True
  native_all_reduce_loses_from = None   # without a profile, lossless all-reduces stay native
  has_reduce_scatter = True
  takes_order = False      # rows travel as they lie: an algorithm permutes them itself
  spans_processes = True   # gloo/NCCL between processes (psum_scatter there: docs/design.md)

  def shift(self, payload: tuple, group: Group, offset: int = 1) -> tuple:
    """Sends ``payload``'s arrays to the member ``offset`` ahead (several as one message of
    their bytes, :mod:`~jaxring._src.transport.packing`); returns what arrived."""
    perm = group.shift_perm(offset)
    if len(payload) == 1:
      w, dt = _as_wire(payload[0])
      return (_from_wire(lax.ppermute(w, axis_arg(group.axes), perm), dt),)
    packed = lax.ppermute(pack(payload), axis_arg(group.axes), perm)
    return unpack(packed, payload)

  def all_gather(self, payload: tuple, group: Group) -> tuple:
    """Native all-gather (tiled, member order) of each array over a whole group's axes (several
    arrays as one message of their bytes, as in :meth:`shift`).

    Typed invariant when the input is typed varying (check_vma=True): the only way to end an
    all-reduce invariant without a second reduction.

    Raises:
      ValueError: the group is part of its axes (a Topology split): XLA's all-gather spans whole
        axes; the ring (``ring.ring_all_gather_payload``) gathers such a group.
    """
    if not group.whole:
      raise ValueError(f"XLA transport: native all-gather over level {group.name!r}, a part of "
                       f"axes {group.axes}; it spans whole axes only")
    if len(payload) > 1 and sum(x.size * x.dtype.itemsize for x in payload) < PACK_BELOW:
      g = self._gather(pack(payload), group)   # one message, as in shift
      return unpack(g.reshape(group.size, -1), payload, leading=group.size)
    out = []
    for x in payload:
      w, dt = _as_wire(x)
      out.append(_from_wire(self._gather(w, group), dt))
    return tuple(out)

  @staticmethod
  def _gather(w, group: Group):
    if vma.is_varying(w, group.axes):
      return vma.all_gather_invariant(w, axis_arg(group.axes), tiled=True)
    return native.all_gather(w, axis_arg(group.axes), tiled=True)

  def all_reduce(self, x, group: Group):
    """Native all-reduce (``lax.psum``) over a whole group's axes."""
    return native.psum(x, axis_arg(group.axes))

  def reduce_scatter(self, x, group: Group):
    """Native reduce-scatter (``lax.psum_scatter``, tiled) over a whole group's axes."""
    return native.psum_scatter(x, axis_arg(group.axes), tiled=True)


XLA = XlaTransport()
