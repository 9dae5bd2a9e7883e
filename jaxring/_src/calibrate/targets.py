"""What calibration times on: a mesh's devices (XLA collectives, every process of a
``jax.distributed`` job) or an axis name bound to an MPI communicator (one process per device).
Each gives the program of one plan, its input, and the collective steps calibration needs
between the processes (a barrier, a broadcast of process 0's timings, the largest value over
the processes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src import collectives, distributed
from jaxring._src.algorithms import planner
from jaxring._src.transport import mpi_axis

#: Seconds a process waits at the barrier before each timed call for the others to arrive.
BARRIER_TIMEOUT_S = 300.0


class MeshTarget:
  """psum over axes of a mesh (XLA collectives; every process of a jax.distributed job)."""

  def __init__(self, mesh, axes):
    self.mesh, self.axes = mesh, axes
    self.sizes = tuple(mesh.shape[a] for a in axes)
    self.groups = tuple(planner.levels_for(axes, self.sizes, mesh_names=mesh.axis_names)[0])
    self.transport = "xla"

  def program(self, algorithm, comp):
    spec = P(self.axes)
    return jax.jit(jax.shard_map(
        lambda v: collectives.psum(v, self.axes, algorithm=algorithm, compression=comp),
        mesh=self.mesh, in_specs=spec, out_specs=P()))

  def input(self, n: int):
    # from this process's shards only: device_put of the global array compared it across
    # processes, 12 s per 16 MiB per device on the emulated cluster (most of calibration's time)
    mine = sum(d.process_index == jax.process_index() for d in self.mesh.devices.flat)
    return jax.make_array_from_process_local_data(NamedSharding(self.mesh, P(self.axes)),
                                                  np.ones((mine * n,), np.float32))

  def barrier(self) -> None:
    if jax.process_count() > 1:
      distributed.barrier("jaxring.calibrate", timeout_s=BARRIER_TIMEOUT_S)

  def broadcast(self, values: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
      return values
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(values))

  def most(self, values: list[int]) -> list[int]:   # per element, the largest over the processes
    if jax.process_count() == 1:
      return list(values)
    from jax.experimental import multihost_utils
    everyone = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return [int(v) for v in np.max(np.asarray(everyone), axis=0)]


class MpiTarget:
  """psum over an axis name bound to an MPI communicator (one process per device)."""

  def __init__(self, binding):
    self.binding, self.axes, self.sizes = binding, binding.axes, binding.sizes
    self.groups = tuple(binding.hierarchy.groups)
    self.transport = binding.hierarchy.transport.name

  def program(self, algorithm, comp):
    return jax.jit(lambda v: collectives.psum(v, self.axes, algorithm=algorithm,
                                              compression=comp))

  def input(self, n: int):
    return jnp.ones((n,), jnp.float32)

  def barrier(self) -> None:
    self.binding.comm.Barrier()

  def broadcast(self, values: np.ndarray) -> np.ndarray:
    return np.asarray(self.binding.comm.bcast(values, root=0))

  def most(self, values: list[int]) -> list[int]:
    return [int(v) for v in np.max(self.binding.comm.allgather(list(values)), axis=0)]


def target(mesh, axes):
  if mesh is not None:
    return MeshTarget(mesh, tuple(mesh.axis_names if axes is None else axes))
  binding = mpi_axis.lookup(tuple(axes or ()))
  if binding is None:
    raise ValueError(f"calibrate: give the mesh of axes {axes}, or an axis name bound to an MPI "
                     "communicator by jaxring.distributed.bind_mpi_axis")
  return MpiTarget(binding)
