"""Why calibration's top-k points in the emulated cluster's MPI shape come out below the top-k rows
of ``bench cluster`` (docs/simulations.md): the same compiled programs timed in one job, first
calibration's way, then the rows' way, with each call's page faults.

After ``jaxring.calibrate`` (its log and kept points printed), the hierarchical and ring plans with
top-k at 32 MiB, beside the lossless and int8 hierarchical plans, are timed ``ROUNDS`` rounds as
``bench cluster`` times its rows (``cluster_worker.time_rounds``: a barrier before each call,
every contender's calls spread over each round). Rank 0 prints, per contender: the median of all
calls (the row's statistic), the median of the calls in which no rank faulted in more than
``timing.FRESH_PAGES`` pages (what calibration keeps), the share of calls that faulted, and the
calibrated point.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \\
      python benchmarks/scripts/topk_points_mpi.py
"""
import os
import statistics
import time
from types import SimpleNamespace

import jax
import numpy as np
from mpi4py import MPI

import jaxring
from jaxring._src import timing
from jaxring._src.tools.bench import cluster_worker
from emulated_mpi import bind_mpi_shape

ROUNDS = int(os.environ.get("ROUNDS", "4"))
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm)
t0 = time.perf_counter()
_confirm = timing.confirm


def confirm(first, groups, retime, **kwargs):   # the second timing, beside the first
  def shown(rows, j):
    out = retime(rows, j)
    if rank == 0:
      print(f"size {j}: " + "  ".join(f"{groups[i]} first {first[i, j] * 1e3:.1f} again "
                                      f"{a * 1e3:.1f} pooled {b * 1e3:.1f} ms"
                                      for i, (a, b) in zip(rows, out) if "topk" in groups[i]))
    return out
  return _confirm(first, groups, shown, **kwargs)


timing.confirm = confirm
profile = jaxring.calibrate(axes="mpi", reuse=False, save=False, log=(
    (lambda line: print(f"[{time.perf_counter() - t0:6.1f}] {line}", flush=True))
    if rank == 0 else None))
n = (32 << 20) // 4
x = jax.device_put(np.random.default_rng(rank).standard_normal(n, dtype=np.float32))
plans = [("hierarchical", "topk"), ("ring", "topk"), ("hierarchical", "none"),
         ("hierarchical", "int8")]
faults = {}
ready = []
for algorithm, codec_name in plans:
  codec = jaxring.codecs.parse(codec_name)
  comp = None if codec is None else {"node": codec}
  f = jax.jit(lambda v, a=algorithm, c=comp: jaxring.psum(v, "mpi", algorithm=a, compression=c))
  for _ in range(3):
    jax.block_until_ready(f(x))
  label = f"{algorithm} {codec_name}"
  faults[label] = []

  def call(f=f, label=label):
    f0 = timing.minor_faults()
    jax.block_until_ready(f(x))
    faults[label].append(timing.minor_faults() - f0)
  ready.append((label, call, {}))

agree = lambda values: np.max(comm.allgather(np.asarray(values)), axis=0)   # noqa: E731
rows = list(cluster_worker.time_rounds(ready, SimpleNamespace(reps=ROUNDS),
                                       lambda name: comm.Barrier(), "lo", agree))
point = {(f.algorithm, "topk" if "TopK" in f.codecs[-1] else "int8" if "Int8" in f.codecs[-1]
          else "bf16" if "Bf16" in f.codecs[-1] else "none"): dict(zip(f.sizes, f.seconds))
         for f in profile.fits}
if rank == 0:
  print(f"{'plan':<20} {'calls':>5} {'median all':>11} {'median unpaged':>15} {'faulted':>8} "
        f"{'calibrated':>11}")
for label, times, _, _ in rows:
  worst = agree(faults[label])
  clean = [t for t, w in zip(times, worst) if w <= timing.FRESH_PAGES]
  algorithm, codec_name = label.split()
  cal = point.get((algorithm, codec_name), {}).get(32 << 20)
  if rank == 0:
    print(f"{label:<20} {len(times):>5} {statistics.median(times) * 1e3:>9.1f} ms "
          f"{(statistics.median(clean) * 1e3 if clean else float('nan')):>12.1f} ms "
          f"{1 - len(clean) / len(times):>8.0%} "
          f"{(cal * 1e3 if cal else float('nan')):>8.1f} ms", flush=True)
