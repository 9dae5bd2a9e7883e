"""The flat ring with bf16 between nodes, timed alone over the MPI transport (one rank per
device, 4 nodes x 2 ranks, 32 MiB of f32 per rank): all-ones input (as jaxring.calibrate uses)
against normal draws, beside the hierarchical plan; 4 calls after a barrier each, rank 0's median
(docs/simulations.md, "Validation after the asynchronous in-process level").

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      -- python benchmarks/scripts/ring_bf16_mpi.py
  sudo jaxring cluster down --name jrq
"""
import time, numpy as np
from mpi4py import MPI
import jax, jax.numpy as jnp
import jaxring, jaxring.distributed
comm = MPI.COMM_WORLD
local, nodes = 2, comm.Get_size() // 2
jaxring.distributed.bind_mpi_axis("mpi", comm, jaxring.Topology((jaxring.Level("local", local), jaxring.Level("node", nodes, 1e9 / 8, 1e-4))))
n = 8 << 20
inputs = {"ones": jnp.ones((n,), jnp.float32),
          "normal": jax.device_put(np.random.default_rng(comm.Get_rank()).standard_normal(n, dtype=np.float32)),
          "ones*1.001": jnp.ones((n,), jnp.float32) * 1.001}
for algo in ("ring", "hierarchical"):
  f = jax.jit(lambda v, a=algo: jaxring.psum(v, "mpi", algorithm=a, compression={"node": jaxring.codecs.bf16()}))
  for name, x in inputs.items():
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(4):
      comm.Barrier(); t = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t)
    if comm.Get_rank() == 0:
      print(f"{algo:12s} {name:10s} median {1e3*np.median(ts):7.1f} ms  {[round(1e3*t) for t in ts]}", flush=True)
