"""The derivatives of jaxring's collectives: lax's, straight through the wire format.

psum, psum_scatter and all_gather are linear, so their derivatives do not depend on how the bytes
move: a tangent is reduced (or gathered) exactly as lax would reduce it, and transposing that gives
lax's transpose in either vma mode (``check_vma=True``: psum's transpose is a ``pvary``;
``check_vma=False`` and ``pmap``: a psum). The ring itself cannot be differentiated as it is: its
16-bit payloads cross the wire bitcast to uint16 (XLA:CPU would widen them to f32), int8 payloads
are integers, and neither carries a tangent, so the derivative seen through the hops would miss
everything that arrived from other members. The lossy rounding is treated as the identity, as
loss scaling and quantization-aware training treat it.

Over a name bound to an MPI communicator no lax collective exists to borrow a derivative from:
:func:`summed` gives an all-reduce the identity (lax.psum's rule for a cotangent the same on every
member), and :func:`not_differentiable` makes the derivative of the others raise.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxring._src import native
from jaxring._src.transport.groups import axis_arg


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
  return straight_through(forward, lambda t: native.psum(t, axis_arg(axes)))


def psum_scatter(forward: Callable, axes: tuple, scatter_dimension: int, tiled: bool) -> Callable:
  """``forward`` (a reduce-scatter of one leaf) with ``lax.psum_scatter``'s derivative."""
  return straight_through(forward, lambda t: native.psum_scatter(
      t, axis_arg(axes), scatter_dimension=scatter_dimension, tiled=tiled))


def all_gather(forward: Callable, axes: tuple, axis: int, tiled: bool) -> Callable:
  """``forward`` (an all-gather of one leaf) with ``lax.all_gather``'s derivative."""
  return straight_through(forward, lambda t: native.all_gather(t, axis_arg(axes), axis=axis,
                                                               tiled=tiled))


# --- over an MPI-bound axis ----------------------------------------------------------------------
# mpi4jax's operations carry an ordered effect, which jax.custom_jvp/custom_vjp refuse; the rules
# below wrap only the *result* (computed outside, under stop_gradient), so they see no effect.


@jax.custom_jvp
def summed(x, total):
  """``total`` (the all-reduce of ``x``, stop_gradient'ed) with the identity as derivative.

  That is ``lax.psum``'s rule in ``shard_map`` for a cotangent that is the same on every member
  (a loss computed identically from the sum), and ``mpi4jax.allreduce``'s rule. For a cotangent
  that differs between ranks lax would sum the cotangents; MPI processes cannot tell the two apart.
  """
  del x
  return total


@summed.defjvp
def _summed_jvp(primals, tangents):
  _, total = primals
  dx, _ = tangents
  return total, dx


def not_differentiable(op: str):
  """An identity on ``(x, result) -> result`` whose derivative raises, naming ``op``."""

  @jax.custom_jvp
  def result(x, out):
    del x
    return out

  @result.defjvp
  def _jvp(primals, tangents):
    raise NotImplementedError(
        f"jaxring.{op} over an MPI-bound axis is not differentiable (mpi4jax's allgather has no "
        "transpose rule); differentiate psum/pmean, or call it under shard_map")

  return result
