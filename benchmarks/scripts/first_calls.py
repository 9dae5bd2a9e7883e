"""Why a compiled program's first calls are slow on the emulated cluster (docs/simulations.md,
"What makes a program's first calls slow"): the calibration's plans at one size, compiled as
calibration compiles them, then each called CALLS times in a row (each call after a barrier), in the
calibration's order or reversed. Per call: rank 0's milliseconds, and every rank's minor page
faults (a fault of a huge page zeroes 2 MiB). Before anything, rank 0 times the first touch of
256 MiB of fresh memory against a rewrite of it (what a page fault costs on this machine).

  jaxring cluster up --name jrq --nodes 4
  [REVERSED=1] [MIB=32] [CALLS=5] jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 \\
      --transport mpi -- python benchmarks/scripts/first_calls.py
  jaxring cluster down --name jrq

Writes benchmarks/results/first-calls-<time>.json.
"""
import datetime
import json
import os
import resource
import time

import jax
import numpy as np
from mpi4py import MPI

from jaxring._src import calibrate
from emulated_mpi import bind_mpi_shape

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
mib, calls_per_plan = int(os.environ.get("MIB", 32)), int(os.environ.get("CALLS", 5))
reversed_order = os.environ.get("REVERSED", "0") == "1"


def touch_rates(nbytes=256 << 20):
  """MiB/s of a first touch of fresh memory (page faults) and of a rewrite of the same memory."""
  t0 = time.perf_counter()
  a = np.ones(nbytes, np.uint8)
  t1 = time.perf_counter()
  a[:] = 2
  t2 = time.perf_counter()
  return (nbytes >> 20) / (t1 - t0), (nbytes >> 20) / (t2 - t1)


first_touch = touch_rates() if rank == 0 else None
bind_mpi_shape(comm)
target = calibrate.targets.target(None, ("mpi",))
plans = list(calibrate._candidates(target.groups, calibrate.DEFAULT_CODECS))
x = target.input(mib << 18)
programs = [calibrate._compiled(target.program(a, c), x) for a, c in plans]
order = list(range(len(plans)))[::-1] if reversed_order else list(range(len(plans)))
rows = []
for i in order:
  ms, faults = [], []
  for _ in range(calls_per_plan):
    comm.Barrier()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    jax.block_until_ready(programs[i](x))
    ms.append((time.perf_counter() - t) * 1e3)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  every = comm.gather(faults, root=0)
  if rank == 0:
    name = f"{plans[i][0]} {calibrate._label(plans[i][1])}"
    rows.append({"plan": name, "ms": [round(t, 1) for t in ms], "faults_per_rank": every})
    print(f"{name:>26} ms " + " ".join(f"{t:6.0f}" for t in ms)
          + "   faults, ranks 0-7: " + " ".join(str(f) for f in every), flush=True)
if rank == 0:
  print(f"fresh memory: first touch {first_touch[0]:.0f} MiB/s, rewrite {first_touch[1]:.0f} MiB/s")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  os.makedirs("benchmarks/results", exist_ok=True)
  with open(f"benchmarks/results/first-calls-{stamp}.json", "w") as f:
    json.dump({"bench": "first-calls", "mib": mib, "reversed": reversed_order,
               "ranks": comm.Get_size(), "first_touch_mib_per_s": first_touch[0],
               "rewrite_mib_per_s": first_touch[1],
               "allocator": os.environ.get("GLIBC_TUNABLES") or os.environ.get("LD_PRELOAD", ""),
               "rows": rows}, f, indent=1)
