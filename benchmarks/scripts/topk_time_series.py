"""Whether the MPI shape's top-k all-reduce drifts in phases: one plan at 32 MiB called for
``SECONDS_`` seconds (default 120), a barrier before each call, and for every call rank 0's
time, the slowest rank's time, and each rank's involuntary context switches, voluntary ones
(waits that slept) and minor page faults during it (``getrusage``), summed over the ranks. Rank
0 prints the series in 10-s windows and writes every call to
``benchmarks/results/topk-time-series-<time>.json``. ``PLAN``: algorithm:codec (default
hierarchical:topk); ``LOCAL``: ranks per node (default 2); ``BARRIER=sleep``: wait at the
barrier polling it every 0.2 ms instead of in MPICH's spinning ``MPI_Barrier``.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \\
      python benchmarks/scripts/topk_time_series.py
"""
import os
import resource
import statistics
import time

import jax
import numpy as np
from mpi4py import MPI

import jaxring
from jaxring._src.tools.bench import common
from emulated_mpi import bind_mpi_shape

SECONDS = float(os.environ.get("SECONDS_", "120"))
PLAN = os.environ.get("PLAN", "hierarchical:topk")
SLEEPING = os.environ.get("BARRIER", "spin") == "sleep"   # sleep 0.2 ms between polls
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm, local=int(os.environ.get("LOCAL", "2")))
algorithm, codec_name = PLAN.split(":")
codec = jaxring.codecs.parse(codec_name)
f = jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm=algorithm,
                                   compression=None if codec is None else {"node": codec}))
x = jax.device_put(np.random.default_rng(rank).standard_normal((32 << 20) // 4, np.float32))
for _ in range(3):
  jax.block_until_ready(f(x))


def usage():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return np.array([r.ru_nivcsw, r.ru_nvcsw, r.ru_minflt], np.float64)


calls = []
t_start = time.perf_counter()
while True:
  go = comm.bcast(time.perf_counter() - t_start < SECONDS if rank == 0 else None)
  if not go:
    break
  if SLEEPING:
    req = comm.Ibarrier()
    while not req.Test():
      time.sleep(2e-4)
  else:
    comm.Barrier()
  u0 = usage()
  t0 = time.perf_counter()
  jax.block_until_ready(f(x))
  dt = time.perf_counter() - t0
  counts = comm.reduce(usage() - u0, op=MPI.SUM)
  slowest = comm.reduce(dt, op=MPI.MAX)
  if rank == 0:
    calls.append({"t": t0 - t_start, "ms": dt * 1e3, "ms_max": slowest * 1e3,
                  "nivcsw": counts[0], "nvcsw": counts[1], "minflt": counts[2]})
if rank == 0:
  print(f"{PLAN}: {len(calls)} calls; 10-s windows: median ms, median slowest rank, "
        "involuntary / voluntary switches and minor faults per call (all ranks)")
  for w in range(int(SECONDS // 10) + 1):
    sel = [c for c in calls if w * 10 <= c["t"] < (w + 1) * 10]
    if sel:
      med = {k: statistics.median(c[k] for c in sel) for k in sel[0] if k != "t"}
      print(f"  {w * 10:4d}s {len(sel):4d} calls  {med['ms']:7.1f} {med['ms_max']:7.1f}  "
            f"{med['nivcsw']:6.0f} {med['nvcsw']:6.0f} {med['minflt']:6.0f}")
  print("wrote", common.write_json("topk-time-series", dict(
      bench="topk_time_series", plan=PLAN, seconds=SECONDS, barrier="sleep" if SLEEPING else "spin",
      ranks=comm.Get_size(), jax=jax.__version__, allocator=common.allocator(), calls=calls)))
