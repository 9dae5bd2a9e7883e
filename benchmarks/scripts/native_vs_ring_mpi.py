"""Whether calibration's way of timing and ``bench cluster``'s rank two plans differently: in the
emulated cluster's MPI shape, MPICH's all-reduce from NumPy and jaxring's native (mpi4jax's
all-reduce in a jitted program) and flat-ring plans at ``MIB`` MiB (default 1), each plan on
ones (calibration's input) and on normal draws (the rows'), timed the rows' way
(``cluster_worker.time_rounds``, 5 rounds) and then calibration's (``timing.unpaged``, 36 calls
each, spread), twice; rank 0 prints the medians.

  jaxring cluster up --name jrq --nodes 2
  jaxring cluster run --name jrq --nodes 2 --procs-per-node 1 --transport mpi -- \\
      python benchmarks/scripts/native_vs_ring_mpi.py
"""
import os
import statistics
from types import SimpleNamespace

import jax
import numpy as np
from mpi4py import MPI

import jaxring
from jaxring._src import timing
from jaxring._src.tools.bench import cluster_worker
from emulated_mpi import bind_mpi_shape, both_inputs, contenders_on, largest_over

LOCAL = int(os.environ.get("LOCAL", "1"))   # ranks per node
MIB = float(os.environ.get("MIB", "1"))
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm, local=LOCAL)
n = int(MIB * (1 << 20)) // 4
inputs = both_inputs(n, rank)
send = np.random.default_rng(rank).standard_normal(n, np.float32)
recv = np.empty_like(send)
ready = [("MPICH", lambda: comm.Allreduce(send, recv, op=MPI.SUM), {})]
for algorithm in ("xla", "ring"):
  f = jax.jit(lambda v, a=algorithm: jaxring.psum(v, "mpi", algorithm=a))
  ready += contenders_on("native" if algorithm == "xla" else algorithm, f, inputs)
agree = largest_over(comm)
for _ in range(2):
  rows = [times for _, times, _, _ in cluster_worker.time_rounds(
      ready, SimpleNamespace(reps=5), lambda name: comm.Barrier(), "lo", agree)]
  calib = timing.unpaged([call for _, call, _ in ready], [36] * len(ready), comm.Barrier,
                         lambda v: [int(u) for u in agree(v)])
  if rank == 0:
    for way, timed in (("rows' way", rows), ("calibration's way", calib)):
      print(f"{way:<18} " + "  ".join(f"{label} {statistics.median(t) * 1e3:.2f}"
                                      for (label, _, _), t in zip(ready, timed)), flush=True)
