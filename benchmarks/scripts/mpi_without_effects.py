"""What jaxring's MPI plans would cost at 1 MiB if their programs had no JAX effect: mpi4jax's
operations carry an ordered effect, and jaxring's launch markers a host callback, and either one
sends a program through JAX's Python dispatch instead of its C++ one. This script times, side by
side, MPICH's ``MPI_Allreduce`` from NumPy, jaxring's hierarchical and native (``xla``) plans as
shipped, and the same plans traced after mpi4jax's primitives are re-registered without their
effect (each operation lowered with a fresh token instead of the threaded one). An experiment,
not a mode of the library: without the effect nothing orders two MPI operations that no data
orders, within a program or across programs (docs/benchmarks.md, the 1 MiB paragraph of
"Current figures").

Run on the emulated cluster without the watchdog (``--failure-timeout 0``: no launch markers):

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 2 --transport mpi \\
      --failure-timeout 0 -- python benchmarks/scripts/mpi_without_effects.py
  sudo jaxring cluster down --name jrq

Rank 0 prints the medians over ``ROUNDS`` rounds (every contender once a round, a barrier before
each call) and writes ``benchmarks/results/mpi-without-effects-<time>.json``.
"""
import datetime
import json
import os
import pathlib
import statistics
import time

import jax
import numpy as np
from mpi4py import MPI

import jaxring
from jaxring._src.transport import launches
from emulated_mpi import bind_mpi_shape

ROUNDS = 150
NBYTES = 1 << 20

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
bind_mpi_shape(comm)
send = np.random.default_rng(rank).standard_normal(NBYTES // 4, dtype=np.float32)
recv = np.empty_like(send)
comm.Allreduce(send, recv, op=MPI.SUM)
x = jax.device_put(send)
PLANS = ("hierarchical", "xla")


def programs():
  out = {a: jax.jit(lambda v, a=a: jaxring.psum(v, "mpi", algorithm=a)) for a in PLANS}
  effects = {a: sorted(type(e).__name__ for e in jax.make_jaxpr(
      lambda v, a=a: jaxring.psum(v, "mpi", algorithm=a))(x).effects) for a in PLANS}
  for a, f in out.items():
    got = np.asarray(jax.block_until_ready(f(x)))
    assert np.max(np.abs(got - recv)) <= 1e-5 * np.max(np.abs(recv)), a
  return out, effects


shipped, shipped_effects = programs()

# mpi4jax's primitives again, without their effect: each lowering gets a fresh token
from jax._src.interpreters import mlir  # noqa: E402
from mpi4jax._src.collective_ops import allgather, allreduce, sendrecv  # noqa: E402

for module, prim, abstract in ((allreduce, allreduce.mpi_allreduce_p,
                                allreduce.mpi_allreduce_abstract_eval),
                               (sendrecv, sendrecv.mpi_sendrecv_p,
                                sendrecv.mpi_sendrecv_abstract_eval),
                               (allgather, allgather.mpi_allgather_p,
                                allgather.mpi_allgather_abstract_eval)):
  module.get_token_effect = lambda ctx, effect: mlir.create_token()
  module.set_token_effect = lambda ctx, effect, token: None
  prim.def_effectful_abstract_eval(lambda *a, _f=abstract, **k: (_f(*a, **k)[0], set()))
bare, bare_effects = programs()

calls = {"MPICH MPI_Allreduce (NumPy)": lambda: comm.Allreduce(send, recv, op=MPI.SUM)}
for a in PLANS:
  calls[f"jaxring {a}, as shipped"] = lambda f=shipped[a]: jax.block_until_ready(f(x))
  calls[f"jaxring {a}, no effect"] = lambda f=bare[a]: jax.block_until_ready(f(x))
times = {k: [] for k in calls}
for _ in range(ROUNDS):
  for k, call in calls.items():
    comm.Barrier()
    t = time.perf_counter()
    call()
    times[k].append(time.perf_counter() - t)

if rank == 0:
  base = statistics.median(times["MPICH MPI_Allreduce (NumPy)"])
  rows = []
  for k, t in times.items():
    q1, med, q3 = np.percentile(t, [25, 50, 75])
    rows.append(dict(contender=k, median_ms=med * 1e3, q1_ms=q1 * 1e3, q3_ms=q3 * 1e3,
                     vs_mpich=med / base))
    print(f"{k:>32}: {med * 1e3:6.2f} ms (quartiles {q1 * 1e3:.2f}-{q3 * 1e3:.2f})  "
          f"{med / base:.3f} x MPICH")
  print("effects as shipped:", shipped_effects, " without:", bare_effects,
        " launch markers:", launches.enabled())
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = pathlib.Path(__file__).resolve().parents[1] / "results" / f"mpi-without-effects-{stamp}.json"
  out.write_text(json.dumps(dict(
      bench="mpi_without_effects", nbytes=NBYTES, ranks=comm.Get_size(), rounds=ROUNDS,
      launch_markers=launches.enabled(), effects_shipped=shipped_effects,
      effects_without=bare_effects, allocator=os.environ.get("LD_PRELOAD", "glibc"),
      jax=jax.__version__, rows=rows), indent=1))
  print("wrote", out)
