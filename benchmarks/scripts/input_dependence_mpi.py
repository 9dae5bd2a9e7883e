"""Whether a plan's time depends on what it reduces: calibration times every plan on an input of
ones, ``bench cluster`` its rows on standard normal draws (different on every rank). Each plan at
32 MiB is compiled once and called on both inputs, the calls interleaved in rounds as ``bench
cluster`` times its rows (``cluster_worker.time_rounds``); rank 0 prints each pair's medians and
their ratio.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi -- \\
      python benchmarks/scripts/input_dependence_mpi.py
"""
import os
import statistics
from types import SimpleNamespace

import jax
from mpi4py import MPI

import jaxring
from jaxring._src.tools.bench import cluster_worker
from emulated_mpi import bind_mpi_shape, both_inputs, contenders_on, largest_over

ROUNDS = int(os.environ.get("ROUNDS", "4"))
PLANS = os.environ.get("PLANS", "hierarchical:topk,ring:topk,hierarchical:int8,ring:int8")
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm)
n = (32 << 20) // 4
inputs = both_inputs(n, rank)
ready = []
for plan in PLANS.split(","):
  algorithm, codec_name = plan.split(":")
  codec = jaxring.codecs.parse(codec_name)
  comp = None if codec is None else {"node": codec}
  f = jax.jit(lambda v, a=algorithm, c=comp: jaxring.psum(v, "mpi", algorithm=a, compression=c))
  ready += contenders_on(f"{algorithm} {codec_name}", f, inputs)

agree = largest_over(comm)
rows = {label: times for label, times, _, _ in cluster_worker.time_rounds(
    ready, SimpleNamespace(reps=ROUNDS), lambda name: comm.Barrier(), "lo", agree)}
if rank == 0:
  print(f"{'plan':<20} {'calls':>5} {'ones ms':>8} {'normal ms':>10} {'normal/ones':>12}")
  for plan in PLANS.split(","):
    label = plan.replace(":", " ")
    a, b = rows[f"{label} ones"], rows[f"{label} normal"]
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{label:<20} {len(a):>5} {ma * 1e3:>8.1f} {mb * 1e3:>10.1f} {mb / ma:>12.3f}",
          flush=True)
