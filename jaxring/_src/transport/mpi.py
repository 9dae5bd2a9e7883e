"""MPI transport: every step is an mpi4jax operation on an mpi4py communicator.

For jobs launched by ``mpirun`` with one process per device: a level of the hierarchy is one
communicator, so the ring's hop is an ``MPI_Sendrecv`` to the neighbour and the native all-gather
and all-reduce are ``MPI_Allgather`` and ``MPI_Allreduce`` on that communicator. Member ranks are
plain Python ints here (the communicator knows them when the program is traced), so the ring's
chunk rotations are static slices.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src.extras import require
from jaxring._src.transport.packing import pack, unpack

# mpi4jax's MPI datatype table (mpi4jax/_src/utils.py: MPI_TYPE_MAP). Anything else (bf16, f16,
# float8) travels as its bit pattern in an unsigned integer of its width: bytes, never a promoted
# float.
_MPI_DTYPES = frozenset(map(np.dtype, (
    "float32", "float64", "complex64", "complex128", "bool", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64")))
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


_NEEDS = ("jaxring's MPI transport (jaxring.distributed.bind_mpi_axis, mpi_axis) needs MPICH, "
          "mpi4py and mpi4jax")
_MPI4JAX_BUILD = ("mpi4jax 0.9 is an sdist: `pip install cython nanobind mpi4py wheel setuptools`, "
                  "then `pip install --no-build-isolation mpi4jax`, with CUDA_ROOT set where CUDA "
                  "is installed (docs/install.md)")


def mpi_module():
  """``mpi4py.MPI``, or an ImportError naming ``jaxring[mpi]``."""
  return require("mpi4py.MPI", "mpi", _NEEDS)


def mpi4jax_module():
  """``mpi4jax``, or an ImportError naming ``jaxring[mpi]`` and how to build mpi4jax."""
  return require("mpi4jax", "mpi", _NEEDS, hint=_MPI4JAX_BUILD)


def _as_wire(x):
  dt = jnp.dtype(x.dtype)
  if dt in _MPI_DTYPES:
    return x, None
  return lax.bitcast_convert_type(x, _UINT_OF_WIDTH[dt.itemsize]), dt


def _from_wire(x, dtype):
  return x if dtype is None else lax.bitcast_convert_type(x, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class MpiGroup:
  """The members of one level: the processes of one MPI communicator, in rank order.

  It offers what the ring and hierarchical algorithms read from a
  :class:`~jaxring._src.transport.groups.Group`; ``axes`` is empty because no ``shard_map`` axis
  is involved (nothing to type as varying or invariant).

  Attributes:
    comm: the ``mpi4py.MPI.Intracomm`` of this process's group.
    name: the level's name (key of per-level codec/algorithm dicts).
  """

  comm: Any
  name: str
  axes = ()
  whole = True  # every level is a communicator of its own: MPI's collectives apply to it

  @property
  def size(self) -> int:
    return self.comm.Get_size()

  @property
  def stride(self) -> int:
    return 1

  def rank(self) -> int:
    """This process's rank in the group's communicator (a static int)."""
    return self.comm.Get_rank()


class MpiTransport:
  """Moves arrays between the members of an :class:`MpiGroup` with mpi4jax."""

  name = "mpi"
  # A lossless slow level uses the Sendrecv ring, not MPI_Allreduce: on the emulated cluster
  # (4 nodes x 2 ranks, 1 Gbit/s, 32 MiB, MPICH 5 over UCX/TCP) the hierarchical all-reduce took
  # 522 ms with the ring on the node level and 674 ms with MPICH's MPI_Allreduce there.
  native_all_reduce_wins = False
  # Without a profile, a lossless all-reduce over several levels runs the hierarchical plan from
  # 1 MiB (planner.choose): calibrated there (bench cluster, MPI shape) MPI_Allreduce through
  # mpi4jax took 10.6 / 12.7 / 27.2 / 920 ms at 1 KiB / 64 KiB / 1 MiB / 32 MiB per rank, the
  # hierarchical plan 11.9 / 15.2 / 27.1 / 532, and the native row 1.12x MPICH's own (numpy
  # buffers) at 32 MiB: a user's mpi4jax.allreduce is what the native plan runs.
  native_all_reduce_loses_from = 1 << 20
  # mpi4jax has no MPI_Reduce_scatter; the ring moves (p-1)/p of the buffer, which is what MPICH's
  # own reduce-scatter moves for large messages, where all-reduce + slice would move twice that.
  has_reduce_scatter = False
  takes_order = False      # rows travel as they lie: an algorithm permutes them itself
  spans_processes = True   # one process per rank

  def shift(self, payload: tuple, group: MpiGroup, offset: int = 1) -> tuple:
    """Sends ``payload``'s arrays to the member ``offset`` ahead (several as one message of
    their bytes, :mod:`~jaxring._src.transport.packing`); returns what arrived."""
    mpi4jax = mpi4jax_module()
    p, r = group.size, group.rank()

    def sendrecv(w):
      return mpi4jax.sendrecv(w, w, source=(r - offset) % p, dest=(r + offset) % p,
                              comm=group.comm)

    if len(payload) > 1:
      return unpack(sendrecv(pack(payload)), payload)
    w, dt = _as_wire(payload[0])
    return (_from_wire(sendrecv(w), dt),)

  def all_gather(self, payload: tuple, group: MpiGroup) -> tuple:
    """``MPI_Allgather`` of each array, concatenated in member (rank) order."""
    mpi4jax = mpi4jax_module()
    out = []
    for x in payload:
      w, dt = _as_wire(x)
      out.append(_from_wire(mpi4jax.allgather(w, comm=group.comm), dt).reshape(-1))
    return tuple(out)

  def all_reduce(self, x, group: MpiGroup):
    """``MPI_Allreduce`` (sum); 16-bit floats are summed in f32 (MPI has no such type)."""
    MPI = mpi_module()
    mpi4jax = mpi4jax_module()
    dt = jnp.dtype(x.dtype)
    if dt in _MPI_DTYPES:
      return mpi4jax.allreduce(x, op=MPI.SUM, comm=group.comm)
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(f"jaxring MPI transport: cannot sum {dt} with MPI_Allreduce")
    return mpi4jax.allreduce(x.astype(jnp.float32), op=MPI.SUM, comm=group.comm).astype(dt)

  def reduce_scatter(self, x, group: MpiGroup):
    """Not offered (``has_reduce_scatter`` is False): the ring is MPI's reduce-scatter here."""
    raise NotImplementedError(f"jaxring MPI transport: no native reduce-scatter over level "
                              f"{group.name!r} (mpi4jax has no MPI_Reduce_scatter); use the ring")


MPI_TRANSPORT = MpiTransport()
