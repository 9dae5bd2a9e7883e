"""Where the MPI shape's 1 MiB all-reduce spends its time (one rank per device, 4 nodes x 2
ranks): MPICH's Allreduce from NumPy, mpi4jax's allreduce alone in jax.jit, jaxring.psum native
and hierarchical, and a jitted x + 1 (the cost of running any jitted program); 15 rounds, a
barrier before each call, rank 0's medians (docs/benchmarks.md, the 1 MiB paragraph of
"Current figures (2026-11-27)").

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      -- python benchmarks/scripts/mpi_1mib_overhead.py
  sudo jaxring cluster down --name jrq
"""
import time, numpy as np
from mpi4py import MPI
import jax
import mpi4jax
import jaxring, jaxring.distributed
comm = MPI.COMM_WORLD
local, nodes = 2, comm.Get_size() // 2
jaxring.distributed.bind_mpi_axis("mpi", comm, jaxring.Topology((jaxring.Level("local", local), jaxring.Level("node", nodes, 1e9 / 8, 1e-4))))
n = 1 << 18
send = np.random.default_rng(comm.Get_rank()).standard_normal(n, dtype=np.float32); recv = np.empty_like(send)
x = jax.device_put(send)
cands = {
  "MPICH numpy": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
  "mpi4jax in jit": (lambda f: lambda: jax.block_until_ready(f(x)))(jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))),
  "jaxring xla": (lambda f: lambda: jax.block_until_ready(f(x)))(jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm="xla"))),
  "jaxring hier": (lambda f: lambda: jax.block_until_ready(f(x)))(jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm="hierarchical"))),
  "jit x+1": (lambda f: lambda: jax.block_until_ready(f(x)))(jax.jit(lambda v: v + 1)),
}
for c in cands.values():
  c(); c()
ts = {k: [] for k in cands}
for r in range(15):
  for k, c in cands.items():
    comm.Barrier(); t = time.perf_counter(); c(); ts[k].append(time.perf_counter() - t)
if comm.Get_rank() == 0:
  for k, v in ts.items():
    print(f"{k:16s} median {1e3*np.median(v):7.2f} ms  min {1e3*min(v):7.2f}", flush=True)
