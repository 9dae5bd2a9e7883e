"""A group: the members of one level of the hierarchy, as a strided subset of named axes."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax import lax


@dataclasses.dataclass(frozen=True)
class Group:
  """Members of one level: along ``axes`` (linear index, row-major), ``size`` members ``stride`` apart.

  A level that is a whole mesh axis is ``Group(("local",), n, 1, n)``; a level carved out of one
  flat axis by a Topology is e.g. ``Group(("data",), 2, 4, 8)`` (the node level of 2 nodes x 4).

  Attributes:
    axes: the named axes the collective spans (ppermute and axis_index run over all of them).
    size: members in one group.
    stride: linear-index distance between consecutive members.
    axes_size: product of the sizes of ``axes``.
    name: the level's name (key of per-level codec/algorithm dicts).
  """

  axes: tuple
  size: int
  stride: int
  axes_size: int
  name: str

  @property
  def whole(self) -> bool:
    """True when the group is all of ``axes`` (native collectives over the axes apply)."""
    return self.size == self.axes_size

  def rank(self):
    """This member's position in its group (a traced int32)."""
    if self.size == 1:
      return 0
    idx = lax.axis_index(axis_arg(self.axes))
    if self.whole:
      return idx
    return (idx // self.stride) % self.size

  def shift_perm(self, offset: int = 1) -> list[tuple[int, int]]:
    """(source, destination) pairs sending each member's data to the member ``offset`` ahead."""
    perm = []
    for i in range(self.axes_size):
      r = (i // self.stride) % self.size
      perm.append((i, i + (((r + offset) % self.size) - r) * self.stride))
    return perm


def axis_arg(axes: tuple):
  """``axes`` as lax's collectives take them: the one name alone, several as a tuple."""
  return axes if len(axes) > 1 else axes[0]


def whole_group(axes: tuple, axes_size: int, name: str | None = None) -> Group:
  return Group(tuple(axes), axes_size, 1, axes_size, name or "/".join(map(str, axes)))


def check_factorization(sizes: list[int], axes_size: int) -> None:
  if math.prod(sizes) != axes_size:
    raise ValueError(f"topology level sizes {sizes} multiply to {math.prod(sizes)}, but the axis "
                     f"has {axes_size} devices")


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """The levels of axes bound outside ``shard_map`` (an MPI communicator), fast -> slow.

  Attributes:
    groups: this member's group on each level (fast -> slow).
    levels: each level's size, bandwidth and latency (the cost model's input).
    strides: each level's weight in the member's linear index (its rank in ``whole``).
    whole: every member as one group (the flat ring).
    transport: moves the bytes within these groups.
  """

  groups: tuple
  levels: tuple
  strides: tuple[int, ...]
  whole: Any
  transport: Any
