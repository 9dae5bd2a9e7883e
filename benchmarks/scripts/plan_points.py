"""Plans timed side by side at chosen sizes, in rounds (each program once per round), on the
emulated cluster: the measurements behind the measured planner's model (docs/benchmarks-history.md,
"`auto` after calibration", and jaxring/_src/algorithms/planner.py ``predict``).

PROGS lists ``algorithm:codec:KiB`` (codec on the node level); R the rounds. JAX shape (a process
per node, 2 devices) and MPI shape (a rank per device, the MPI transport):
  sudo jaxring cluster up --name jrcal --nodes 4 --subnet 10.213.77.0/24
  sudo PROGS="xla:none:32768 hierarchical:none:32768 ring:topk:32768 hierarchical:topk:32768" R=9 \
      jaxring cluster run --name jrcal --procs-per-node 1 --devices-per-proc 2 --transport jax \
      -- python benchmarks/scripts/plan_points.py
  sudo PROGS=... R=9 jaxring cluster run --name jrcal --procs-per-node 2 --transport mpi \
      -- python benchmarks/scripts/plan_points.py --mpi
"""
import os
import statistics
import sys
import time

import numpy as np


def _programs(make, inputs_for):
  progs = [p.split(":") for p in os.environ["PROGS"].split()]
  out = []
  for alg, codec, kib in progs:
    import jaxring
    c = jaxring.codecs.parse(codec)
    f, x = make(alg, None if c is None else {"node": c}), inputs_for(int(kib) * 1024 // 4)
    out.append((f"{alg} {codec} {kib}KiB", f, x))
  return out


def _rounds(progs, barrier, me):
  import jax
  for _, f, x in progs:
    jax.block_until_ready(f(x))
    jax.block_until_ready(f(x))
  times = {k: [] for k, _, _ in progs}
  for r in range(int(os.environ.get("R", "7"))):
    for k, f, x in progs:
      barrier(f"{r}{k}")
      t = time.perf_counter()
      jax.block_until_ready(f(x))
      times[k].append(time.perf_counter() - t)
  if me == 0:
    for k, ts in times.items():
      ts = sorted(ts)
      print(f"{k:<34} median {statistics.median(ts) * 1e3:8.1f} ms  quartiles "
            f"{ts[len(ts) // 4] * 1e3:8.1f} {ts[(3 * len(ts)) // 4] * 1e3:8.1f}", flush=True)


def main_jax():
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  mesh, axes, me = jaxring.distributed.process_mesh(), ("node", "local"), jax.process_index()
  cache = {}

  def inputs_for(n):
    if n not in cache:
      local = np.random.default_rng(me).standard_normal((mesh.shape["local"], n), np.float32)
      cache[n] = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)), local)
    return cache[n]

  make = lambda alg, comp: jax.jit(jax.shard_map(
      lambda v: jaxring.psum(v, axes, algorithm=alg, compression=comp), mesh=mesh,
      in_specs=P(axes), out_specs=P()))
  _rounds(_programs(make, inputs_for), lambda name: jaxring.distributed.barrier(name, 300), me)


def main_mpi():
  from mpi4py import MPI
  comm = MPI.COMM_WORLD
  import jax

  import jaxring
  import jaxring.distributed
  local = 2
  jaxring.distributed.bind_mpi_axis("mpi", comm, jaxring.Topology((
      jaxring.Level("local", local), jaxring.Level("node", comm.Get_size() // local, 1.25e8, 1e-4))))
  inputs_for = lambda n: jax.device_put(
      np.random.default_rng(comm.Get_rank()).standard_normal(n, dtype=np.float32))
  make = lambda alg, comp: jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm=alg,
                                                          compression=comp))
  _rounds(_programs(make, inputs_for), lambda name: comm.Barrier(), comm.Get_rank())


if __name__ == "__main__":
  sys.exit(main_mpi() if "--mpi" in sys.argv else main_jax())
