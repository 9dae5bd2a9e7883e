"""Which transport an axis name is bound to: what the engine reduces over.

Names bound by ``shard_map``/``pmap`` come first: XLA collectives move the bytes and lax's own
collectives and derivatives apply (:class:`MeshAxes`). Otherwise a name bound to an MPI
communicator by ``jaxring.distributed.bind_mpi_axis``: mpi4jax moves the bytes
(:class:`~jaxring._src.transport.mpi_axis.MpiAxis`). Both offer what the engine reads:

* ``axes``, ``sizes`` and ``size``: the names and the members along each, and in all;
* ``hierarchy``: the levels, or None where the planner derives them from the mesh axes and the
  default topology;
* ``lax_bound``: whether lax's collectives (and so their derivatives) apply to the names;
* ``contiguous``: whether a member's linear index in the hierarchy is its index along the axes;
* ``batched``: whether a name is a ``vmap`` axis (no devices: lax's collective batches it);
* ``check_index_groups(op)``: raises where ``axis_index_groups`` has no meaning.
"""
from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax

from jaxring._src.transport import mpi_axis


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Names bound by ``shard_map``/``pmap`` (XLA collectives; lax's rules apply).

  Attributes:
    axes: the names, as the caller gave them.
    sizes: the members along each name.
  """

  axes: tuple
  sizes: tuple[int, ...]
  batched: bool = False  # a name bound by vmap, not by a mesh (lax's own collective runs)
  hierarchy = None   # the planner reads the levels from the mesh axes and the default topology
  lax_bound = True
  contiguous = True  # the planner's chunk permutation hands blocks out in lax's member order

  @property
  def size(self) -> int:
    return math.prod(self.sizes)

  def check_index_groups(self, op: str) -> None:
    """``axis_index_groups`` is lax's to honour over mesh axes: nothing to refuse."""
    del op


def mesh_axis_names() -> tuple:
  """The axes of the mesh in context (shard_map's, or pmap's axis); vmap adds none."""
  try:
    return tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no mesh in context
    return ()


def bind(axes: tuple, op: str) -> MeshAxes | mpi_axis.MpiAxis:
  """The binding of ``axes`` (already validated): mesh axes first, else one MPI-bound name.

  Raises:
    NameError: a name bound by neither, with lax's wording (``op`` names the public function).
    NotImplementedError: MPI-bound names mixed or combined (see ``mpi_axis.lookup``).

  Example:
    >>> jax.shard_map(lambda x: bind(("i",), "psum").size, ...)  # doctest: +SKIP
  """
  sizes = []
  for a in axes:
    try:
      sizes.append(int(lax.axis_size(a)))
    except NameError:
      unbound = a
      break
  else:
    return MeshAxes(axes, tuple(sizes), batched=not set(axes) <= set(mesh_axis_names()))
  mpi = mpi_axis.lookup(axes)
  if mpi is not None:
    return mpi
  # lax's own wording first: code written against lax.psum matches on it
  raise NameError(f"Found an unbound axis name: {unbound}. To fix this, please call {op} under "
                  f"`jax.shard_map`. (jaxring.{op} also runs under `jax.pmap`, and over a name "
                  "bound to an MPI communicator by `jaxring.distributed.mpi_axis`.)")
