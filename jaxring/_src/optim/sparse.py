"""What the compressed optimizers share: a mean all-reduce that says which values it sent, the
density warm-up of sparsifying codecs, and per-member state trees.

Momentum masking (Lin et al. 2018) needs to know which coordinates a step sent: the engine's
top-k all-reduce (``engine.sparse_all_reduce``, the one psum's top-k runs too) returns the
chunks it chose, and takes the warm-up's density. Here it plans the dense buffer of chosen
chunks for that buffer's own size, with the codec's dense part.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import fuse
from jaxring._src.algorithms import engine
from jaxring._src.codecs.base import accum_dtype, is_float
from jaxring._src.codecs.topk import TopKChunks

# the optimizers read these here; they live with error feedback, the layer below
from jaxring._src.error_feedback import is_sparsifying as is_sparsifying
from jaxring._src.error_feedback import zeros_per_member as zeros_per_member


def sparsifier(compression) -> TopKChunks | None:
  """The sparsifying codec in ``compression`` (a codec or a dict level -> codec), or None."""
  codecs = compression.values() if isinstance(compression, dict) else [compression]
  found = next((c for c in codecs if getattr(c, "sparsifying", False)), None)
  if found is not None and not isinstance(found, TopKChunks):
    raise NotImplementedError(f"{found.name}: the compressed optimizers know how to select and "
                              "mask topk_chunks only")
  return found


def mean_and_sent(flat, dtype, binding, algorithm, compression, density: float | None = None,
                  segments=None):
  """``(mean, error, sent)`` of one member's flat accumulator-dtype buffer.

  ``error`` is this member's share of what the reduction left out (None: nothing); ``sent`` is a
  boolean mask of the values that were sent (None for a dense codec: all of them).
  ``density`` overrides the sparsifying codec's (the warm-up); ``segments`` are the sizes of the
  tensors fused into ``flat`` (or None), for a per-tensor codec (``TopKChunks.select``).
  """
  p = binding.size
  codec = sparsifier(compression)
  if codec is None:
    total, err = engine.all_reduce_flat(flat, dtype, binding, algorithm, compression,
                                        want_error=True)
    # an exact reduction reports no error; a residual stays this member's (typed varying)
    err = jnp.zeros_like(flat) if err is None else err
    return total / jnp.asarray(p, flat.dtype), err, None
  total, err, idx = engine.sparse_all_reduce(flat, dtype, binding, codec, (algorithm, compression),
                                             want_error=True, segments=segments, density=density)
  return total / jnp.asarray(p, flat.dtype), err, codec.sent_mask(flat.shape[0], idx)


def warmup_densities(compression, warmup_steps: int, start: float) -> tuple[float, ...]:
  """The densities of the warm-up stages: ``start``, ``start / 4``, ... while above the codec's.

  Deep Gradient Compression's schedule (25%, 6.25%, 1.56%, 0.4%, then the target), each stage an
  equal share of ``warmup_steps``. Empty without warm-up or without a sparsifying codec.

  Example:
    >>> warmup_densities(jaxring.codecs.topk_chunks(0.01), 400, 0.25)
    (0.25, 0.0625, 0.015625)
  """
  codec = sparsifier(compression)
  if codec is None or warmup_steps <= 0:
    return ()
  out, d = [], float(start)
  while d > codec.density and len(out) < 8:
    out.append(d)
    d /= 4
  return tuple(out)


def with_density_schedule(count, warmup_steps: int, densities: tuple[float, ...],
                          reduce: Callable[[float | None], Any]):
  """``reduce(density)`` with the warm-up stage's density at step ``count`` (a traced int).

  One branch per stage (each its own static number of chunks), picked by ``lax.switch``: every
  member holds the same count, so all take the same branch and its collectives match.
  """
  if not densities:
    return reduce(None)
  stages = len(densities)
  stage = jnp.minimum(count.astype(jnp.int32) * stages // max(warmup_steps, 1), stages)
  branches = [lambda d=d: reduce(d) for d in densities] + [lambda: reduce(None)]
  return lax.switch(stage, branches)


@dataclasses.dataclass
class Groups:
  """Float leaves fused per dtype into flat accumulator-dtype buffers, and back."""

  treedef: Any
  leaves: list
  by_dtype: dict

  @classmethod
  def of(cls, tree) -> Groups:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    floats = fuse.by_dtype(leaves, lambda g: is_float(jnp.result_type(g)) and np.size(g) > 0)
    return cls(treedef, leaves, floats)

  def flat(self, tree, dtype) -> jax.Array:
    return fuse.concat(self.treedef.flatten_up_to(tree), self.by_dtype[dtype],
                       accum_dtype(dtype))

  def sizes(self, dtype) -> tuple[int, ...]:
    """The sizes of the leaves fused into ``flat(tree, dtype)``, in order."""
    return engine.segment_sizes(self.leaves[i] for i in self.by_dtype[dtype])

  def others(self) -> list[int]:
    floats = {i for idxs in self.by_dtype.values() for i in idxs}
    return [i for i in range(len(self.leaves)) if i not in floats]

  def unflatten(self, flats: dict, fill: list, cast: bool) -> Any:
    """A tree whose float leaves come from ``flats[dtype]`` (cast back if ``cast``), the other
    leaves from ``fill``."""
    out = list(fill)
    for dtype, idxs in self.by_dtype.items():
      for i, piece in zip(idxs, fuse.split(flats[dtype], self.leaves, idxs,
                                           dtype if cast else None)):
        out[i] = piece
    return jax.tree_util.tree_unflatten(self.treedef, out)


def global_norm(flats: dict) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(f.astype(jnp.float32))) for f in flats.values()))

