"""What an algorithm is, and the registry the planner and the engine read.

An algorithm is one file in this folder: an object with the :class:`Algorithm` methods, registered
with :func:`register` (and imported by the package's ``__init__``). The planner offers every
registered name as ``algorithm=``; the engine runs a plan by asking the registry for its kind.
``xla`` (the transport's native collective) is no entry: it moves no chunks of ours.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax.numpy as jnp

from jaxring._src.codecs.base import Codec
from jaxring._src.transport.groups import Group
from jaxring._src.transport.xla import XLA


@dataclasses.dataclass(frozen=True)
class Plan:
  kind: str                       # "xla" or a registered algorithm's name
  groups: tuple[Group, ...] = ()  # fast -> slow
  codecs: tuple[Codec, ...] = ()
  algos: tuple[str, ...] = ()     # per level: "xla" (its transport's native collective) | "ring"
  strides: tuple[int, ...] = ()   # each level's weight in the member's linear index
  # ring over several axes: the ring runs in mesh axis order (ppermute over axes named out of mesh
  # order transposes wrongly in jax 0.10); member_order[k] is the lax-numbered index (axes as the
  # caller named them) of the member at ring position k. None when the orders agree.
  member_order: tuple[int, ...] | None = None
  transport: Any = XLA            # moves the bytes of `whole` and of every level without its own
  whole: Any = None               # every member as one group; None: the axes (lax collectives)
  pieces: tuple[int, ...] = ()    # per level: sub-chunk transfers per ring hop (Level.pieces)
  # per level: what moves that level's bytes (hierarchical: the in-process transport on a level
  # of devices in this process); () is `transport` on every level
  level_transports: tuple[Any, ...] = ()

  @property
  def transports(self) -> tuple:
    """Each level's transport, fast -> slow."""
    return self.level_transports or (self.transport,) * len(self.groups)

  @property
  def align(self) -> int:
    codec_align = math.lcm(*(c.align for c in self.codecs)) if self.codecs else 1
    return codec_align * max(self.pieces, default=1)

  @property
  def size(self) -> int:
    return math.prod(g.size for g in self.groups)


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """What the planner knows when an algorithm lays itself out."""
  axes: tuple
  sizes: tuple[int, ...]
  groups: tuple[Group, ...]       # the levels the axes span, fast -> slow
  levels: tuple[Any, ...]         # their topology.Level parameters
  strides: tuple[int, ...]
  codecs: tuple[Codec, ...]       # per level
  whole: Any                      # every member as one group
  transport: Any
  algorithm: Any                  # the caller's argument: a name or a dict level ->
                                  # planner.LEVEL_ALGORITHMS (old spellings already replaced)
  multi_process: bool
  dtype: Any = None               # the values' dtype


class Algorithm(Protocol):
  """A way to reduce flat accumulator-dtype buffers of ``plan.size`` equal chunks."""

  name: str
  #: the fewest levels the algorithm is a plan of its own over (``hierarchical``: 2; over one
  #: level it lays itself out as the ring): the planner and calibration offer it from there
  min_levels: int

  def plan(self, request: PlanRequest) -> Plan:
    """The plan for ``request`` (its ``kind`` may name another algorithm it reduces to)."""

  def all_reduce(self, buf, plan: Plan, dtype, *, want_error: bool):
    """``(sum, this member's compression error or None)`` of ``buf``."""

  def reduce_scatter(self, buf, plan: Plan, dtype, order=None):
    """Member ``i`` ends with the sum of chunk ``i`` of ``permute_flat(buf, order)`` (``order``:
    :meth:`chunk_order`, or None). An algorithm may read the chunks where they lie instead of
    permuting a copy."""

  # Optional: ``reduce_scatter_with_error(buf, plan, dtype, *, want_error, order) -> (shard,
  # error)``, the error this member's encodings introduced, laid out like ``permute_flat(buf,
  # order)``. Error feedback on a reduce-scatter (a sharded train step's gradients) needs it; an
  # algorithm without it is refused there.

  def all_gather(self, payload: tuple, plan: Plan, order=None) -> tuple:
    """Every member's encoded chunk, in :meth:`chunk_order`, each array's rows then placed as
    ``permute_flat(array, order)`` places them (an algorithm may place them as it gathers)."""

  def chunk_order(self, plan: Plan) -> tuple[int, ...] | None:
    """Which member's chunk sits at each position the algorithm hands out (None: identity)."""

  # Optional: ``all_gather_decoded(payload, plan, codec, dtype, order) -> array``,
  # ``codec.decode(all_gather(payload, plan, order), dtype)`` in fewer passes (hierarchical: the
  # in-process level decodes as it gathers).


_REGISTRY: dict[str, Algorithm] = {}


def permute_rows(rows, order):
  """``rows`` reordered along its first axis: row ``j`` of the result is row ``order[j]``.

  Static slices (runs of consecutive rows together) and one concatenate, not fancy indexing:
  XLA:CPU runs a gather with constant indices element by element (reordering 8 MiB of int8
  rows cost ~20 ms of CPU per process and 35 ms a call on the emulated cluster, a concatenate
  nothing measurable: docs/design.md, "Investigations").

  Example:
    >>> permute_rows(jnp.arange(4), [2, 3, 0, 1])
    Array([2, 3, 0, 1], dtype=int32)
  """
  order = [int(i) for i in order]
  if order == list(range(len(order))):
    return rows
  runs = [[order[0], order[0] + 1]]
  for i in order[1:]:
    if i == runs[-1][1]:
      runs[-1][1] += 1
    else:
      runs.append([i, i + 1])
  return jnp.concatenate([rows[a:b] for a, b in runs], axis=0)


def permute_flat(flat, order):
  """``flat`` as ``len(order)`` rows, reordered by :func:`permute_rows`, flat again (None: as is)."""
  if order is None:
    return flat
  return permute_rows(flat.reshape(len(order), -1), order).reshape(-1)


def register(algorithm: Algorithm) -> Algorithm:
  """Makes ``algorithm`` available as ``algorithm=<its name>`` everywhere."""
  if algorithm.name in ("auto", "xla"):
    raise ValueError(f"{algorithm.name!r} is reserved")
  _REGISTRY[algorithm.name] = algorithm
  return algorithm


def get(name: str) -> Algorithm:
  return _REGISTRY[name]


def names() -> tuple[str, ...]:
  return tuple(_REGISTRY)


def candidates(num_levels: int) -> tuple[str, ...]:
  """The registered algorithms that are plans of their own over ``num_levels`` levels: what
  ``auto`` weighs and calibration times besides the native collective.

  Example:
    >>> candidates(1), candidates(2)
    (('ring',), ('ring', 'hierarchical'))
  """
  return tuple(n for n, a in _REGISTRY.items() if getattr(a, "min_levels", 1) <= num_levels)
