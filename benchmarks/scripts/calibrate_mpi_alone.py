"""``jaxring.calibrate`` alone in the emulated cluster's MPI shape (one process per device, the
axis bound as ``bench cluster``'s MPI job binds it), rank 0's log with seconds since the start,
and the points it kept. ``WARMUP`` sets calibrate's ``warmup`` (default 1); ``SLICED=1`` slices the
ring's chunks before each kernel, as before the codecs read them in place.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \
      env WARMUP=0 python benchmarks/scripts/calibrate_mpi_alone.py
"""
import os
import time

from mpi4py import MPI

import jaxring
from emulated_mpi import bind_mpi_shape

comm = MPI.COMM_WORLD
if os.environ.get("SLICED"):   # the ring's chunks sliced, as before they were read in place
  from jaxring._src.codecs import kernels as codec_kernels
  codec_kernels.in_place = lambda *a, **k: None
bind_mpi_shape(comm)
warmup = int(os.environ.get("WARMUP", "1"))
t0 = time.perf_counter()


def log(line):
  print(f"[{time.perf_counter() - t0:6.1f}] {line}", flush=True)


prof = jaxring.calibrate(axes="mpi", reuse=False, save=False, warmup=warmup,
                         log=log if comm.Get_rank() == 0 else None)
if comm.Get_rank() == 0:
  print(f"WARMUP={warmup} total {time.perf_counter() - t0:.1f} s")
  for f in prof.fits:
    print("FIT", f.algorithm, f.codecs[-1][:12], [round(s * 1e3, 1) for s in f.seconds])
