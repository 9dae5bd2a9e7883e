"""Whether a top-k call in the emulated cluster's MPI shape costs more right after a long call of
another collective (MPICH's 32 MiB all-reduce) than after another top-k call: ``N`` pairs, a
barrier before each call, rank 0's medians (docs/simulations.md, "Calibration's top-k points, and
its plans' order"). Run it with the nodes' ``net.ipv4.tcp_slow_start_after_idle`` at 1 (Linux's
default) and at 0 (``ip netns exec jrq-nK sysctl -w ...``) to see whether restarting a
connection's congestion window after idling matters.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \\
      python benchmarks/scripts/topk_after_other_calls.py
"""
import os
import statistics
import time

import jax
import numpy as np
from mpi4py import MPI

import jaxring
from emulated_mpi import bind_mpi_shape

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm)
send = np.random.default_rng(rank).standard_normal((32 << 20) // 4, dtype=np.float32)
recv = np.empty_like(send)
x = jax.device_put(send)
f = jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm="hierarchical",
                                  compression={"node": jaxring.codecs.parse("topk")}))
for _ in range(3):
  jax.block_until_ready(f(x))
comm.Allreduce(send, recv)
a, b = [], []


def timed():
  comm.Barrier()
  start = time.perf_counter()
  jax.block_until_ready(f(x))
  return time.perf_counter() - start


for _ in range(int(os.environ.get("N", "30"))):
  comm.Barrier()
  comm.Allreduce(send, recv)
  a.append(timed())
  b.append(timed())
if rank == 0:
  print(f"top-k after MPICH's 32 MiB all-reduce {statistics.median(a) * 1e3:.1f} ms, after "
        f"another top-k call {statistics.median(b) * 1e3:.1f} ms", flush=True)
