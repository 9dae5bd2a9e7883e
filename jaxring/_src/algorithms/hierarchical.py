"""BlueConnect (Cho et al., 2019): an all-reduce decomposed onto each level of the hierarchy.

For levels ordered fast -> slow with sizes p_1..p_k: reduce-scatter on each level from the fastest
(the buffer shrinks by p_i at each), all-reduce of the remaining 1/(p_1...p_{k-1}) shard on the
slowest level, then all-gather back from slow to fast. The slow level carries n/(p_1...p_{k-1})
instead of n: that factor is the win. Each level has its own algorithm and codec.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import vma
from jaxring._src.algorithms import ring
from jaxring._src.codecs.base import Codec
from jaxring._src.transport.groups import Group


def _level_reduce_scatter(x, group, codec, algo, dtype, transport, want_error):
  if algo == "xla":
    return lax.psum_scatter(x, _axis(group), tiled=True), (jnp.zeros_like(x) if want_error else None)
  return ring.reduce_scatter(x, group, codec, dtype, transport, want_error=want_error)


def _level_all_reduce(x, group, codec, algo, dtype, transport, want_error):
  if algo == "xla":
    return lax.psum(x, _axis(group)), (jnp.zeros_like(x) if want_error else None)
  return ring.all_reduce(x, group, codec, dtype, transport, want_error=want_error)


def _axis(group: Group):
  return group.axes if len(group.axes) > 1 else group.axes[0]


def all_reduce(flat, groups: list[Group], codecs: list[Codec], algos: list[str], dtype, transport,
               *, want_error=False):
  """Hierarchical all-reduce of ``flat`` (length a multiple of prod(sizes) * every codec's align).

  Returns ``(result, error)``; ``error`` (when asked) is this member's compression error laid out
  like ``flat``. An error made while encoding a shard that ``m`` members hold identically (the
  all-gather phase of a faster level) is split between them, so the errors of all members sum to
  the total error exactly once.
  """
  n = flat.shape[0]
  axes = tuple(dict.fromkeys(a for g in groups for a in g.axes))
  x = vma.pvary(flat, axes)
  if vma.is_varying(x, axes) and not all(g.whole for g in groups):
    return _all_reduce_flat_finish(x, groups, codecs, algos, dtype, transport, axes, want_error)
  err = jnp.zeros((n,), flat.dtype) if want_error else None
  offsets = [0]  # offset of x within flat, per depth
  for g, cd, al in zip(groups[:-1], codecs[:-1], algos[:-1]):
    c = x.shape[0] // g.size
    x, e = _level_reduce_scatter(x, g, cd, al, dtype, transport, want_error)
    if want_error:
      err = lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offsets[-1],), (e.shape[0],)) + e,
                                     (offsets[-1],))
    offsets.append(offsets[-1] + g.rank() * c)
  x, e = _level_all_reduce(x, groups[-1], codecs[-1], algos[-1], dtype, transport, want_error)
  if want_error:
    err = lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offsets[-1],), (e.shape[0],)) + e,
                                   (offsets[-1],))
  replicas = groups[-1].size
  for depth in range(len(groups) - 2, -1, -1):
    g, cd = groups[depth], codecs[depth]
    payload = cd.encode(x, dtype)
    if want_error:
      e = (x - cd.decode(payload, dtype)) / replicas
      err = lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offsets[depth + 1],), (e.shape[0],))
                                     + e.astype(err.dtype), (offsets[depth + 1],))
    x = cd.decode(ring.all_gather_payload(payload, g, transport), dtype)
    replicas *= g.size
  return x, err


def _all_reduce_flat_finish(flat, groups, codecs, algos, dtype, transport, axes, want_error):
  """Levels carved out of one axis, vma checked: reduce-scatter level by level, then one native
  all-gather over the whole axis, the only collective that types the result invariant (a
  grouped one cannot). It moves (p-1)/p of the buffer instead of the per-level all-gathers'
  share on the slow level: the price of check_vma=True on a Topology-split axis."""
  n = flat.shape[0]
  perm = chunk_permutation(groups, [g.stride for g in groups])
  p = math.prod(g.size for g in groups)
  shard, err = flat, (jnp.zeros_like(flat) if want_error else None)
  offset = 0
  for g, cd, al in zip(groups, codecs, algos):
    c = shard.shape[0] // g.size
    shard, e = _level_reduce_scatter(shard, g, cd, al, dtype, transport, want_error)
    if want_error:
      err = lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offset,), (e.shape[0],)) + e,
                                     (offset,))
    offset = offset + g.rank() * c
  cd = codecs[-1]
  payload = cd.encode(shard, dtype)
  if want_error:
    e = shard - cd.decode(payload, dtype)
    err = lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offset,), (e.shape[0],)) + e,
                                   (offset,))
  whole = Group(axes, p, 1, p, "/".join(map(str, axes)))
  gathered = transport.all_gather(payload, whole)
  rows = cd.decode(gathered, dtype).reshape(p, -1)  # row i: member i's chunk, chunk perm^-1[i]
  return rows[np.asarray(perm)].reshape(n), err


def chunk_permutation(groups: list[Group], strides: list[int]) -> list[int]:
  """Chunk order that makes hierarchical reduce-scatter hand member ``i`` chunk ``i``.

  ``strides[l]`` is level l's weight in the member's linear index (as ``lax.psum_scatter`` numbers
  members). Hierarchical reduce-scatter hands out chunks in mixed radix with the first (fastest)
  level most significant; ``perm[j]`` is the linear chunk index that must sit at position ``j``.
  """
  sizes = [g.size for g in groups]
  perm = []
  for j in range(math.prod(sizes)):
    digits, rem = [], j
    for p in reversed(sizes):
      digits.append(rem % p)
      rem //= p
    digits.reverse()
    perm.append(sum(d * s for d, s in zip(digits, strides)))
  return perm


def reduce_scatter(flat, groups: list[Group], codecs: list[Codec], algos: list[str], dtype,
                   transport):
  """Hierarchical reduce-scatter (chunks already permuted by :func:`chunk_permutation`)."""
  x = flat
  for g, cd, al in zip(groups, codecs, algos):
    x, _ = _level_reduce_scatter(x, g, cd, al, dtype, transport, False)
  return x


def all_gather(payload: tuple, groups: list[Group], transport) -> tuple:
  """Hierarchical all-gather of encoded chunks, slowest level first (inverse of reduce_scatter)."""
  for g in reversed(groups):
    # The ppermute ring, not the native gather: its transpose is a reduce-scatter, as lax's is.
    payload = ring.ring_all_gather_payload(payload, g, transport)
  return payload
