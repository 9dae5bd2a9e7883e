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


def both_inputs(n: int, rank: int) -> dict:
  """``n`` f32 elements as calibration times plans (ones) and as ``bench cluster``'s rows do
  (standard normal draws, different on every rank)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  return {"ones": jnp.ones((n,), jnp.float32),
          "normal": jax.device_put(np.random.default_rng(rank).standard_normal(n, np.float32))}


def contenders_on(label: str, f, inputs: dict, warmup: int = 3) -> list:
  """``cluster_worker.time_rounds`` contenders ``(f"{label} {input}", call, {})`` calling the
  jitted ``f`` on each of ``inputs``, each warmed up ``warmup`` times."""
  import jax
  out = []
  for name, x in inputs.items():
    for _ in range(warmup):
      jax.block_until_ready(f(x))
    out.append((f"{label} {name}", lambda x=x: jax.block_until_ready(f(x)), {}))
  return out


def largest_over(comm):
  """``agree`` for ``time_rounds``: each value's largest over the ranks of ``comm``."""
  import numpy as np
  return lambda values: np.max(comm.allgather(np.asarray(values)), axis=0)
