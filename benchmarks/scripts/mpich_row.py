"""Why ``bench cluster``'s MPICH row (``MPI_Allreduce`` from NumPy) can be slower than the same
``MPI_Allreduce`` reached through mpi4jax inside a jitted program: the two differ in the
communicator (``COMM_WORLD`` against a clone), in the buffers (NumPy's against XLA's, the output
a fresh one every call) and in who calls (Python against a custom call). This script times, side
by side in one job, variants that change one of these at a time.

On the emulated cluster (4 nodes x 2 ranks; for the 2 x 4 shape ``--nodes 2 --procs-per-node 4``
and ``LOCAL=4`` in the environment), ``MIB`` MiB of f32 per rank (default 32), a barrier before
every call, each round in its own order:

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      --failure-timeout 0 -- python benchmarks/scripts/mpich_row.py
  sudo jaxring cluster down --name jrq

Rank 0 prints each variant's median, quartiles and ratio to the bench's row, and writes
``benchmarks/results/mpich-row-<time>.json``.
"""
import datetime
import json
import mmap
import os
import pathlib
import statistics
import time

import jax
import mpi4jax
import numpy as np
from mpi4py import MPI

import jaxring
import jaxring.distributed

MIB = int(os.environ.get("MIB", "32"))
ROUNDS = int(os.environ.get("ROUNDS", "12"))

comm = MPI.COMM_WORLD
clone = comm.Clone()
rank, size = comm.Get_rank(), comm.Get_size()
local = int(os.environ.get("LOCAL", "2"))
n = MIB * (1 << 20) // 4
send = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
recv = np.empty_like(send)
comm.Allreduce(send, recv, op=MPI.SUM)
ref = recv.copy()


def page_aligned(like):
  """A NumPy array over fresh anonymous pages (4 KiB aligned), holding ``like``'s values."""
  out = np.frombuffer(mmap.mmap(-1, like.nbytes), dtype=like.dtype)
  out[:] = like
  return out


send_pages, recv_pages = page_aligned(send), page_aligned(np.zeros_like(send))
x = jax.device_put(send)
node_level = jaxring.Level("node", size // local, 1e9 / 8, 1e-4)
jaxring.distributed.bind_mpi_axis(
    "mpi", comm, jaxring.Topology((jaxring.Level("local", local), node_level)))
native = jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm="xla"))
bare = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=clone))
for f in (native, bare):
  got = np.asarray(jax.block_until_ready(f(x)))
  assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))

calls = {
    "NumPy, COMM_WORLD (the bench's row)": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
    "NumPy, a clone of COMM_WORLD": lambda: clone.Allreduce(send, recv, op=MPI.SUM),
    "NumPy, page-aligned buffers": lambda: comm.Allreduce(send_pages, recv_pages, op=MPI.SUM),
    "NumPy, a fresh output each call": lambda: comm.Allreduce(send, np.empty_like(send),
                                                              op=MPI.SUM),
    "NumPy, input an XLA buffer": lambda: comm.Allreduce(np.asarray(x), recv, op=MPI.SUM),
    "mpi4jax in jit, clone": lambda: jax.block_until_ready(bare(x)),
    "jaxring.psum xla (calibration's)": lambda: jax.block_until_ready(native(x)),
}
names = list(calls)
for call in calls.values():
  call()
times = {k: [] for k in names}
for r in range(ROUNDS):
  order = names[r % len(names):] + names[:r % len(names)]
  if r % 2:
    order = order[::-1]
  for k in order:
    comm.Barrier()
    t = time.perf_counter()
    calls[k]()
    times[k].append(time.perf_counter() - t)

# rank 0's medians, and the slowest rank's median per variant
medians = np.max(comm.allgather(np.array([statistics.median(times[k]) for k in names])), axis=0)
if rank == 0:
  base = statistics.median(times[names[0]])
  rows = []
  print(f"{size} ranks, {local} per node, {MIB} MiB f32, {ROUNDS} rounds, a barrier before each "
        f"call; LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}")
  for k, worst in zip(names, medians):
    q1, med, q3 = np.percentile(times[k], [25, 50, 75])
    rows.append(dict(variant=k, median_ms=med * 1e3, q1_ms=q1 * 1e3, q3_ms=q3 * 1e3,
                     slowest_rank_median_ms=worst * 1e3, vs_row=med / base))
    print(f"{k:>38}: {med * 1e3:8.1f} ms ({q1 * 1e3:.1f}-{q3 * 1e3:.1f}; slowest rank "
          f"{worst * 1e3:.1f})  {med / base:.3f}")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = pathlib.Path(__file__).resolve().parents[1] / "results" / f"mpich-row-{stamp}.json"
  out.write_text(json.dumps(dict(
      bench="mpich_row", mib=MIB, ranks=size, per_node=local, rounds=ROUNDS,
      allocator=os.environ.get("LD_PRELOAD", "glibc"), jax=jax.__version__, rows=rows),
      indent=1))
  print("wrote", out)
