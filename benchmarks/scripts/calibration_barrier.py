"""Whether calibration should wait at a barrier before each timed call: the calibration's own
candidate plans at one size, compiled as it compiles them, timed side by side
(``jaxring._src.timing.side_by_side``) with the calibration's numbers of calls, in alternating
passes with and without a barrier before each call. Rank 0's medians (the calibration's
statistic) beside the median over ranks of each rank's median.

Without a barrier a call's time on rank 0 starts when rank 0 finished the previous call, and
holds the skew that call left between the ranks (a 32 MiB all-reduce ends at different times on
different ranks); ``bench cluster`` waits at a barrier before every call of its rows.

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      -- python benchmarks/scripts/calibration_barrier.py [--mib 32] [--passes 4]
  sudo jaxring cluster down --name jrq
"""
import argparse
import json
import os
import time

import jax
import numpy as np
from mpi4py import MPI

from jaxring._src import calibrate, timing
from emulated_mpi import bind_mpi_shape

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=32)
ap.add_argument("--passes", type=int, default=4)
ap.add_argument("--procs-per-node", type=int, default=2)
ap.add_argument("--out-dir", default="benchmarks/results")
args = ap.parse_args()
comm = MPI.COMM_WORLD
local = args.procs_per_node
bind_mpi_shape(comm, local)
target = calibrate.targets.target(None, ("mpi",))
plans = list(calibrate._candidates(target.groups, calibrate.DEFAULT_CODECS))
names = [f"{a} {calibrate._label(c)}" for a, c in plans]
x = target.input(args.mib << 18)
calls = [lambda g=calibrate._compiled(target.program(a, c), x): jax.block_until_ready(g(x))
         for a, c in plans]
counts = calibrate._counts(target, args.mib << 20, 3, calls, 1)   # warmed up and counted as calibrate does
modes = ("no barrier", "barrier")
times = {mode: [[] for _ in plans] for mode in modes}
for p in range(args.passes):
  for mode in (modes if p % 2 == 0 else modes[::-1]):
    comm.Barrier()
    got = timing.side_by_side(calls, counts, comm.Barrier if mode == "barrier" else None)
    for i, t in enumerate(got):
      times[mode][i] += t
every = comm.gather({m: [float(np.median(t)) for t in ts] for m, ts in times.items()}, root=0)
if comm.Get_rank() == 0:
  print(f"{comm.Get_size()} ranks, {args.mib} MiB, the calibration's plans, {args.passes} passes "
        "each way; ms: rank 0's median / the median over ranks of each rank's median")
  print(f"{'plan':>24} {'calls':>5} {'no barrier':>21} {'barrier':>21}")
  result = {}
  for i, name in enumerate(names):
    cells = []
    for mode in modes:
      mine = 1e3 * float(np.median(times[mode][i]))
      ranks = 1e3 * float(np.median([e[mode][i] for e in every]))
      result.setdefault(name, {})[mode] = {"rank0_ms": mine, "ranks_median_ms": ranks,
                                           "calls": len(times[mode][i])}
      cells.append(f"{mine:9.2f} / {ranks:9.2f}")
    print(f"{name:>24} {len(times[modes[0]][i]):>5} {cells[0]:>21} {cells[1]:>21}")
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, time.strftime("calibration-barrier-%Y%m%d-%H%M%S.json"))
  with open(path, "w") as fh:
    json.dump({"ranks": comm.Get_size(), "mib": args.mib, "passes": args.passes,
               "plans": result}, fh, indent=1)
  print("wrote", path)
