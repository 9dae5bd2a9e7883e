"""Axis names bound to MPI communicators: jaxring's collectives across ``mpirun`` processes.

Under ``mpirun`` with one process per device, no ``shard_map`` spans the processes: every process
runs the per-device program. :func:`mpi_axis` binds an axis name to a communicator; inside it,
``jaxring.psum(x, name, ...)`` (and pmean, psum_scatter, all_gather, reduce_gradients) run the same
ring and hierarchical algorithms and codecs over MPI (mpi4jax), eagerly or inside ``jit``.

The topology's levels become sub-communicators, fast -> slow. By default they come from the hosts:
``local`` holds the ranks of one host (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``), ``node``
the ranks with the same local rank on every host. An explicit :class:`~jaxring.Topology` splits the
ranks row-major instead (the fastest level varies fastest: rank ``r`` is member
``(r // stride_k) % size_k`` of level ``k``), which also lets one host play several nodes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Hashable
from typing import Any

from jaxring._src import topology as topo_mod
from jaxring._src.reliability import flight_recorder, mpi_heartbeats
from jaxring._src.transport.groups import Hierarchy
from jaxring._src.transport.mpi import MPI_TRANSPORT, MpiGroup, mpi4jax_module, mpi_module
from jaxring._src.reliability.watchdog import (
  ENV_FAILURE_TIMEOUT,
  Watchdog,
  failure_timeout,
)


@dataclasses.dataclass(frozen=True, eq=False)
class MpiAxis:
  """An axis name bound to a communicator.

  Attributes:
    name: the axis name.
    comm: jaxring's own duplicate of the communicator given (its messages cannot match the
      application's).
    topology: the levels (fast -> slow, sizes > 1 only) the hierarchy is built from.
    hierarchy: this process's group on every level, for the planner.
    contiguous: whether a member's linear index in the hierarchy is its rank in ``comm`` (what
      psum_scatter/all_gather with ``hierarchical`` need to hand out blocks in rank order).
    control: another duplicate, on which the ranks compare what they plan (fingerprints).
  """

  name: Hashable
  comm: Any
  topology: topo_mod.Topology
  hierarchy: Hierarchy
  contiguous: bool
  control: Any = None   # a duplicate of comm for the ranks' fingerprints (reliability/fingerprint)
  # not bound by shard_map/pmap: lax's collectives and derivative rules do not apply to it
  lax_bound = False

  @property
  def size(self) -> int:
    return self.comm.Get_size()

  @property
  def rank(self) -> int:
    return self.comm.Get_rank()

  @property
  def axes(self) -> tuple:
    return (self.name,)

  @property
  def sizes(self) -> tuple[int, ...]:
    return (self.size,)

  def check_index_groups(self, op: str) -> None:
    """Raises: ``axis_index_groups`` has no meaning over a communicator."""
    raise NotImplementedError(f"jaxring.{op}: axis_index_groups over an MPI-bound axis "
                              f"{self.axes}; bind a sub-communicator to its own axis name instead")


def _host_levels(comm) -> tuple[list[tuple[topo_mod.Level, Any]], list[int]]:
  """``local`` (ranks sharing a host) and ``node`` (one rank per host) levels, and the rank's
  digit on each."""
  MPI = mpi_module()
  local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
  counts = comm.allgather(local.Get_size())
  if len(set(counts)) != 1:
    raise ValueError(f"jaxring.mpi_axis: hosts run different numbers of ranks {sorted(counts)}; "
                     "the hierarchy needs the same number on every host (or pass topology=)")
  node = comm.Split(local.Get_rank(), comm.Get_rank())
  levels = [(topo_mod.Level("local", local.Get_size()), local),
            (topo_mod.Level("node", node.Get_size(), topo_mod.NETWORK_BANDWIDTH,
                            topo_mod.NETWORK_LATENCY), node)]
  return levels, [local.Get_rank(), node.Get_rank()]


def _row_major_levels(comm, topology: topo_mod.Topology):
  """One sub-communicator per level of ``topology``, ranks split row-major."""
  if topology.size != comm.Get_size():
    raise ValueError(f"jaxring.mpi_axis: topology {topology.names} has "
                     f"{[lv.size for lv in topology.levels]} = {topology.size} members, but the "
                     f"communicator has {comm.Get_size()} ranks")
  r = comm.Get_rank()
  levels, digits = [], []
  for lv, stride in zip(topology.levels, topology.strides()):
    digit = (r // stride) % lv.size
    levels.append((lv, comm.Split(r - digit * stride, digit)))
    digits.append(digit)
  return levels, digits


def _make_axis(name: Hashable, comm, topology: topo_mod.Topology | None) -> MpiAxis:
  mpi4jax_module()  # fail now, with the install hint, rather than at the first collective
  comm = comm.Dup()
  if topology is None:
    levels, digits = _host_levels(comm)
  else:
    levels, digits = _row_major_levels(comm, topology)
  strides = [math.prod(lv.size for lv, _ in levels[:i]) for i in range(len(levels))]
  linear = sum(d * s for d, s in zip(digits, strides))
  contiguous = all(i == j for i, j in enumerate(comm.allgather(linear)))
  kept = [(lv, c, s) for (lv, c), s in zip(levels, strides) if lv.size > 1] or [
      (levels[0][0], comm, 1)]
  whole = MpiGroup(comm, str(name))
  groups = tuple(MpiGroup(comm if len(kept) == 1 else c, lv.name) for lv, c, _ in kept)
  topo = topo_mod.Topology(tuple(lv for lv, _, _ in kept))
  hierarchy = Hierarchy(groups, topo.levels, tuple(s for _, _, s in kept), whole, MPI_TRANSPORT)
  return MpiAxis(name, comm, topo, hierarchy, contiguous, comm.Dup())


_bound: dict[Hashable, MpiAxis] = {}
_watchdog: list[Watchdog | None] = [None]


# All-to-all heartbeats cost each rank n - 1 tiny messages per interval; above this many ranks
# the watchdog stays off unless asked for (the launcher's own failure handling remains).
_WATCHDOG_MAX_RANKS = 256


def _start_watchdog(comm, failure_timeout_s: float | None) -> None:
  explicit = failure_timeout_s is not None or bool(os.environ.get(ENV_FAILURE_TIMEOUT))
  failure_timeout_s = failure_timeout(failure_timeout_s)
  if failure_timeout_s <= 0 or _watchdog[0] is not None or comm.Get_size() < 2:
    return
  MPI = mpi_module()
  if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    warnings.warn("jaxring: MPI was initialized without MPI_THREAD_MULTIPLE, so the peer "
                  "watchdog (a thread) cannot run: a hung rank will not be named", stacklevel=3)
    return
  if comm.Get_size() > _WATCHDOG_MAX_RANKS and not explicit:
    return
  _watchdog[0] = mpi_heartbeats.start_watchdog(comm, failure_timeout_s)


def bind_mpi_axis(axis_name: Hashable = "data", comm=None,
                  topology: topo_mod.Topology | None = None, *,
                  failure_timeout_s: float | None = None) -> MpiAxis:
  """Binds ``axis_name`` to ``comm`` for jaxring's collectives until :func:`unbind_mpi_axis`.

  Collective over ``comm``: every rank must call it, in the same order as its other bindings.

  Args:
    axis_name: the name collectives will be called with.
    comm: an ``mpi4py.MPI.Intracomm`` (default ``MPI.COMM_WORLD``); jaxring works on a duplicate.
    topology: the levels, fast -> slow, whose sizes multiply to the communicator's size (ranks
      split row-major); default: ``local`` = ranks of one host, ``node`` = hosts.
    failure_timeout_s: the peer watchdog's timeout (reliability/watchdog.py, a thread that
      heartbeats over a duplicate of ``comm``): a rank silent this long is named (rank, pid, host)
      and every other rank exits instead of hanging. Default ``JAXRING_FAILURE_TIMEOUT``, else
      120 s as for :func:`jaxring.distributed.initialize`; ``0`` turns it off. It needs
      ``MPI_THREAD_MULTIPLE`` (mpi4py's default) and, unless asked for, at most 256 ranks; one
      watchdog per process (the first binding starts it).

  Returns:
    The binding (``.topology`` shows the levels found).

  Raises:
    ImportError: mpi4py or mpi4jax is missing (the message names ``jaxring[mpi]``).

  Example:
    >>> from mpi4py import MPI
    >>> axis = jaxring.distributed.bind_mpi_axis("data", MPI.COMM_WORLD)  # doctest: +SKIP
    >>> jax.jit(lambda g: jaxring.pmean(g, "data", compression=jaxring.codecs.bf16()))(g)  # doctest: +SKIP
  """
  if comm is None:
    comm = mpi_module().COMM_WORLD
  if topology is not None and not isinstance(topology, topo_mod.Topology):
    raise TypeError(f"topology must be a jaxring.Topology or None, got {type(topology).__name__}")
  axis = _make_axis(axis_name, comm, topology)
  # no SIGUSR1 handler here: MPICH's launcher signals SIGUSR1 to the ranks left when one exits,
  # and MPICH handles it in C (unseen by Python's signal module)
  flight_recorder.set_identity(comm.Get_rank(), comm.Get_size())
  _start_watchdog(comm, failure_timeout_s)
  _bound[axis_name] = axis
  return axis


def unbind_mpi_axis(axis_name: Hashable = "data") -> None:
  """Forgets the binding of ``axis_name`` (collectives over it raise ``NameError`` again).

  Example:
    >>> jaxring.distributed.unbind_mpi_axis("data")  # doctest: +SKIP
  """
  _bound.pop(axis_name, None)


@contextlib.contextmanager
def mpi_axis(comm=None, axis_name: Hashable = "data", topology: topo_mod.Topology | None = None,
             *, failure_timeout_s: float | None = None):
  """Within the block, ``axis_name`` names ``comm`` for jaxring's collectives (see
  :func:`bind_mpi_axis`); a binding the name had before comes back afterwards.

  Functions traced inside the block keep the communicator they were traced with.

  Example:
    >>> # mpirun -n 4 python train.py
    >>> with jaxring.distributed.mpi_axis(MPI.COMM_WORLD, "data"):  # doctest: +SKIP
    ...   total = jax.jit(lambda g: jaxring.psum(g, "data", algorithm="ring",
    ...                                          compression=jaxring.codecs.int8()))(g)
  """
  before = _bound.get(axis_name)
  axis = bind_mpi_axis(axis_name, comm, topology, failure_timeout_s=failure_timeout_s)
  try:
    yield axis
  finally:
    if before is None:
      _bound.pop(axis_name, None)
    else:
      _bound[axis_name] = before


def lookup(axes: tuple) -> MpiAxis | None:
  """The MPI binding of ``axes`` (one bound name), None when no name in ``axes`` is MPI-bound."""
  hits = [a for a in axes if a in _bound]
  if not hits:
    return None
  if len(axes) > 1:
    raise NotImplementedError(f"jaxring: axis names {axes} mix or combine MPI-bound names "
                              f"{hits}; reduce over one MPI-bound name (its topology gives the "
                              "levels)")
  return _bound[axes[0]]
