"""The emulated cluster's MPI shape as these scripts bind it: ``local`` consecutive ranks per node
(the namespaces share one hostname, so the levels are given, not detected), 1 Gbit/s node links.

  from emulated_mpi import bind_mpi_shape   # beside the script: its folder is on sys.path
  topology = bind_mpi_shape(MPI.COMM_WORLD)
"""
import jaxring
import jaxring.distributed

NODE_BANDWIDTH = 1e9 / 8   # bytes/s: the links `jaxring cluster up` shapes by default
NODE_LATENCY = 1e-4


def bind_mpi_shape(comm, local: int = 2, name: str = "mpi") -> "jaxring.Topology":
  """Binds axis ``name`` to ``comm`` with levels ``local`` (ranks of a node) and ``node``;
  returns the topology."""
  topology = jaxring.Topology((
      jaxring.Level("local", local),
      jaxring.Level("node", comm.Get_size() // local, NODE_BANDWIDTH, NODE_LATENCY)))
  jaxring.distributed.bind_mpi_axis(name, comm, topology)
  return topology
