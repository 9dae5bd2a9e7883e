"""A member's share of a fragment over the fast axes (:func:`jaxring.diloco`'s ``fast_axes``).

The members of the fast axes hold the same parameters (a replicated model spans them), so each
can take its own ``1/size`` of a fragment's flat values without any exchange, and what they
computed on their shares an ``all_gather`` over the fast axes puts back together. Two things cut
the fragments so: ``shard="optimizer"`` (a member keeps and steps only its share of the outer
parameters, of the outer optimizer's state and of the residual) and ``transfer="host"`` (a
member moves only its share over the slow links).

A share is ``m`` consecutive values of the fragment's flat, zero-padded to ``size * m``, where
``m`` is a multiple of the codec's ``align`` (its blocks then never straddle two members).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxring._src.collectives import all_gather, axis_names
from jaxring._src.transport import binding as binding_mod


class Shares:
  """The shares of ``fast_axes`` (none: one member holding everything).

  Args:
    fast_axes: the axes whose members hold the same parameters.
    align: a share's length is a multiple of it.
    mpi_only: the fast axes must be bound to MPI (a host transfer's members are processes).
  """

  def __init__(self, fast_axes, align: int = 1, *, mpi_only: bool = False):
    self.axes = axis_names(fast_axes)
    self.align = max(int(align or 1), 1)
    self.mpi_only = mpi_only

  def member(self):
    """(this member's index along the fast axes, their members): an int, or traced under
    ``shard_map``."""
    if not self.axes:
      return 0, 1
    try:
      bound = binding_mod.bind(self.axes, "diloco")
    except NameError:
      bound = None
    if bound is None or (self.mpi_only and bound.lax_bound):
      where = ("bind them with jaxring.distributed.bind_mpi_axis, or leave fast_axes empty "
               "(every member then sends the whole fragment)" if self.mpi_only else
               "call the transformation's init and update inside the shard_map (or pmap) whose "
               "axes include them, or bind them with jaxring.distributed.bind_mpi_axis "
               "(jaxring.train_step keeps the outer state whole: shard='none' there)")
      raise ValueError(f"diloco: the fast axes {self.axes} are not bound "
                       f"{'to MPI' if self.mpi_only else 'here'}; {where}")
    if bound.lax_bound:
      return lax.axis_index(self.axes), bound.size
    return bound.rank, bound.size

  def layout(self, n: int):
    """(this member's offset, its share's length, the padded length) of an ``n``-value flat."""
    r, k = self.member()
    m = -(-n // (k * self.align)) * self.align
    return r * m, m, k * m

  def take(self, flat):
    """This member's share of ``flat`` (1-D)."""
    n = flat.shape[0]
    start, m, total = self.layout(n)
    return lax.dynamic_slice(jnp.pad(flat, (0, total - n)), (start,), (m,))

  def place(self, share, n: int):
    """``share`` at this member's place in zeros of ``n`` values (its part of a whole)."""
    start, _, total = self.layout(n)
    return lax.dynamic_update_slice(jnp.zeros((total,), share.dtype), share, (start,))[:n]

  def gather(self, share, n: int):
    """The ``n`` values whose shares the members hold (``share`` is this member's)."""
    if self.member()[1] == 1:
      return share[:n]
    return all_gather(share, self.axes, tiled=True)[:n]
