"""Leaves of one dtype fused into one flat buffer and split back: one collective per dtype,
not one per leaf (per-leaf collectives each pay the link's latency, and XLA:CPU's combiner hands
gloo a tuple it reduces operand by operand: docs/design.md, "Collectives").

Example:
  >>> leaves = [jnp.ones(3), jnp.zeros((2, 2)), jnp.arange(2)]
  >>> groups = by_dtype(leaves)
  >>> {str(d): i for d, i in groups.items()}
  {'float32': [0, 1], 'int32': [2]}
  >>> flat = concat(leaves, groups[jnp.dtype(jnp.float32)])
  >>> [x.shape for x in split(flat, leaves, groups[jnp.dtype(jnp.float32)])]
  [(3,), (2, 2)]
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np


def by_dtype(leaves: Sequence, include: Callable | None = None) -> dict:
  """The indices of ``leaves`` grouped by dtype, in the order the dtypes first appear; only the
  leaves for which ``include(leaf)`` is true (default: all)."""
  out: dict = {}
  for i, leaf in enumerate(leaves):
    if include is None or include(leaf):
      out.setdefault(jnp.dtype(jnp.result_type(leaf)), []).append(i)
  return out


def concat(leaves: Sequence, idxs: Sequence[int], dtype=None):
  """``leaves[i]`` for ``i`` in ``idxs``, raveled (cast to ``dtype`` if given) and concatenated."""
  return jnp.concatenate([jnp.ravel(leaves[i]) if dtype is None else
                          jnp.ravel(leaves[i]).astype(dtype) for i in idxs])


def split(flat, leaves: Sequence, idxs: Sequence[int], dtype=None) -> list:
  """``flat`` (as :func:`concat` made it) cut back into arrays shaped like ``leaves[i]``, cast to
  ``dtype`` if given."""
  out, offset = [], 0
  for i in idxs:
    size, shape = int(np.size(leaves[i])), np.shape(leaves[i])
    piece = flat[offset:offset + size].reshape(shape)
    out.append(piece if dtype is None else piece.astype(dtype))
    offset += size
  return out
