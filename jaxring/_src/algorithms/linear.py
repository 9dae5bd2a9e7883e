"""The derivatives of jaxring's collectives: lax's, straight through the wire format.

psum, psum_scatter and all_gather are linear, so their derivatives do not depend on how the bytes
move: a tangent is reduced (or gathered) exactly as lax would reduce it, and transposing that gives
lax's transpose in either vma mode (``check_vma=True``: psum's transpose is a ``pvary``;
``check_vma=False`` and ``pmap``: a psum). The ring itself cannot be differentiated as it is: its
16-bit payloads cross the wire bitcast to uint16 (XLA:CPU would widen them to f32), int8 payloads
are integers, and neither carries a tangent, so the derivative seen through the hops would miss
everything that arrived from other members. The lossy rounding is treated as the identity, as
loss scaling and quantization-aware training treat it.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def _axis_arg(axes: tuple):
  return axes if len(axes) > 1 else axes[0]


def straight_through(forward: Callable, exact: Callable) -> Callable:
  """``forward`` on values, ``exact`` (a linear lax collective) on tangents.

  Args:
    forward: the jaxring reduction of one array (any algorithm, any codec).
    exact: the lax collective with the same contract, applied to tangents; JAX transposes it for
      reverse mode.

  Returns:
    A function equal to ``forward`` whose JVP is ``exact``.

  Example:
    >>> f = straight_through(lambda v: ring_psum(v), lambda t: lax.psum(t, "d"))
  """

  @jax.custom_jvp
  def reduce(x):
    return forward(x)

  @reduce.defjvp
  def _jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # reduce (not forward) for the value: a second derivative goes through this rule again
    return reduce(x), exact(t)

  return reduce


def differentiable(dtype) -> bool:
  """Whether values of ``dtype`` have tangents (floating and complex dtypes)."""
  return jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)


def psum(forward: Callable, axes: tuple) -> Callable:
  """``forward`` (an all-reduce of one flat array over ``axes``) with ``lax.psum``'s derivative."""
  return straight_through(forward, lambda t: lax.psum(t, _axis_arg(axes)))


def psum_scatter(forward: Callable, axes: tuple, scatter_dimension: int, tiled: bool) -> Callable:
  """``forward`` (a reduce-scatter of one leaf) with ``lax.psum_scatter``'s derivative."""
  return straight_through(forward, lambda t: lax.psum_scatter(
      t, _axis_arg(axes), scatter_dimension=scatter_dimension, tiled=tiled))


def all_gather(forward: Callable, axes: tuple, axis: int, tiled: bool) -> Callable:
  """``forward`` (an all-gather of one leaf) with ``lax.all_gather``'s derivative."""
  return straight_through(forward, lambda t: lax.all_gather(t, _axis_arg(axes), axis=axis,
                                                            tiled=tiled))
