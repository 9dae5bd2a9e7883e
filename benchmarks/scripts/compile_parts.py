"""What compiling calibration's programs costs in the MPI shape (docs/simulations.md, "What makes a
program's first calls slow"): every candidate plan at every size calibration times it at, traced,
lowered and compiled apart, on every rank at once as calibration does; rank 0's seconds per step.

  jaxring cluster up --name jrq --nodes 4
  [XLA_FLAGS=...] jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      -- [env XLA_FLAGS=...] [SLICED=1] python benchmarks/scripts/compile_parts.py

``SLICED=1``: the ring's chunks sliced before each kernel (XLA copies them), as before the
codecs read them in place (docs/design.md, "The ring's chunks are read in place").
"""
import os
import time

import numpy as np
from mpi4py import MPI

from jaxring._src import calibrate
from emulated_mpi import bind_mpi_shape

comm = MPI.COMM_WORLD
if os.environ.get("SLICED"):   # the ring's chunks sliced, as before they were read in place
  from jaxring._src.codecs import kernels as codec_kernels
  codec_kernels.in_place = lambda *a, **k: None
bind_mpi_shape(comm)
target = calibrate.targets.target(None, ("mpi",))
rows = []
start = time.perf_counter()
for algorithm, comp in calibrate._candidates(target.groups, calibrate.DEFAULT_CODECS):
  for n in calibrate._sizes_for(comp, calibrate.DEFAULT_SIZES):
    x = target.input(n // 4)
    t0 = time.perf_counter()
    traced = target.program(algorithm, comp).trace(x)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    rows.append((algorithm, calibrate._label(comp), n, t1 - t0, t2 - t1, t3 - t2))
comm.Barrier()
if comm.Get_rank() == 0:
  print(f"{len(rows)} programs in {time.perf_counter() - start:.1f} s")
  for a, c, n, *s in rows:
    print(f"{a:>12} {c:>11} {n:>9} B  trace {s[0]:.2f}  lower {s[1]:.2f}  compile {s[2]:.2f} s")
  sums = np.sum([r[3:] for r in rows], 0)
  print("sums: trace {:.1f}, lower {:.1f}, compile {:.1f} s".format(*sums))
