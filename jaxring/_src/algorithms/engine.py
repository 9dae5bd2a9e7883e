"""psum_scatter and all_gather of one array by a ring or hierarchical plan, in lax's layout.

The ring and hierarchical algorithms work on flat buffers of ``p`` equal chunks; these functions
move one array's scatter dimension (or gather axis) to the front, pad its rows to the codecs'
alignment, permute them into the order the plan hands chunks out, and put the result back where
``lax.psum_scatter`` / ``lax.all_gather`` would.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxring._src.algorithms import hierarchical, ring
from jaxring._src.algorithms.planner import Plan
from jaxring._src.codecs.base import accum_dtype


def _pad_to(flat, multiple: int):
  n = flat.shape[0]
  m = -(-max(n, 1) // multiple) * multiple
  return jnp.pad(flat, (0, m - n)) if m != n else flat


def reduce_scatter_leaf(leaf, d, tiled, p, dtype, plan: Plan):
  """``lax.psum_scatter(leaf, scatter_dimension=d, tiled=tiled)`` over the ``p`` members of a
  ring or hierarchical ``plan``; ``dtype`` is the leaf's."""
  moved = jnp.moveaxis(leaf, d, 0)
  rest = moved.shape[1:]
  rows = moved.reshape(p, -1).astype(accum_dtype(dtype))
  m = rows.shape[1]
  m_pad = -(-max(m, 1) // plan.align) * plan.align
  rows = jnp.pad(rows, ((0, 0), (0, m_pad - m)))
  if plan.kind == "ring":
    if plan.member_order is not None:
      rows = rows[np.asarray(plan.member_order)]
    shard, _ = ring.reduce_scatter(rows.reshape(-1), plan.groups[0], plan.codecs[0], dtype,
                                   plan.transport, pieces=plan.pieces[0])
  else:
    rows = rows[np.asarray(hierarchical.chunk_permutation(list(plan.groups), list(plan.strides)))]
    shard = hierarchical.reduce_scatter(rows.reshape(-1), list(plan.groups), list(plan.codecs),
                                        list(plan.algos), dtype, plan.transport,
                                        pieces=list(plan.pieces))
  block = shard[:m].astype(dtype)
  if tiled:
    return jnp.moveaxis(block.reshape((moved.shape[0] // p,) + tuple(rest)), 0, d)
  return block.reshape(rest)


def all_gather_leaf(leaf, ax, tiled, p, dtype, plan: Plan):
  """``lax.all_gather(leaf, axis=ax, tiled=tiled)`` over the ``p`` members of a ring or
  hierarchical ``plan``. Each value crosses every level once, encoded by one codec (the slowest
  level's)."""
  codec = plan.codecs[-1]
  n = leaf.size
  flat = _pad_to(jnp.ravel(leaf).astype(accum_dtype(dtype)), plan.align)
  payload = codec.encode(flat, dtype)
  if plan.kind == "ring":
    gathered = ring.ring_all_gather_payload(payload, plan.groups[0], plan.transport)
    rows = codec.decode(gathered, dtype).reshape(p, -1)
    if plan.member_order is not None:
      rows = rows[np.argsort(np.asarray(plan.member_order))]
  else:
    gathered = hierarchical.all_gather(payload, list(plan.groups), plan.transport)
    rows = codec.decode(gathered, dtype).reshape(p, -1)
    perm = hierarchical.chunk_permutation(list(plan.groups), list(plan.strides))
    rows = rows[np.argsort(np.asarray(perm))]
  return place_rows(rows[:, :n].astype(dtype).reshape((p,) + leaf.shape), ax, tiled)


def place_rows(stacked, ax, tiled):
  """``stacked[i]`` is member i's value: lax.all_gather's layout along ``ax``."""
  moved = jnp.moveaxis(stacked, 0, ax)  # (..., p, d_ax, ...)
  if not tiled:
    return moved
  shape = list(stacked.shape[1:])
  shape[ax] *= stacked.shape[0]
  return moved.reshape(shape)

