"""What calling MPI from inside a jitted program costs, apart from the bytes: a 4-byte
all-reduce from NumPy (MPICH through mpi4py) against mpi4jax's ``allreduce`` in ``jax.jit``, and a
jitted ``x + 1`` (4 bytes) beside them (docs/benchmarks.md, the 1 MiB paragraph of "Current
figures").

On the emulated cluster (8 ranks sharing the VM's cores; a barrier before each call, 25 rounds,
rank 0's medians):

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      -- python benchmarks/scripts/mpi_call_overhead.py
  sudo jaxring cluster down --name jrq

In one process alone (``python benchmarks/scripts/mpi_call_overhead.py``) it times the same calls
200 times each: the cost of dispatching each program on an idle machine.
"""
import time

import jax
import mpi4jax
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
send = np.ones(1, np.float32)
recv = np.empty_like(send)
x = jax.device_put(send)
allreduce = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))
plus_one = jax.jit(lambda v: v + 1)
cands = {
    "MPICH from NumPy": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
    "mpi4jax allreduce in jit": lambda: jax.block_until_ready(allreduce(x)),
    "jitted x + 1": lambda: jax.block_until_ready(plus_one(x)),
}
for call in cands.values():
  call(), call()
rounds = 200 if comm.Get_size() == 1 else 25
times = {name: [] for name in cands}
for _ in range(rounds):
  for name, call in cands.items():
    comm.Barrier()
    t = time.perf_counter()
    call()
    times[name].append(time.perf_counter() - t)
if comm.Get_rank() == 0:
  print(f"{comm.Get_size()} rank(s), 4 bytes, median of {rounds} calls after a barrier each")
  for name, ts in times.items():
    print(f"  {name:26s} {1e6 * np.median(ts):9.1f} us", flush=True)
