"""Parts of the hierarchical all-reduce over the MPI transport (one rank per device), timed apart with
CPU time per rank (docs/design.md, "Pipelining"; docs/benchmarks.md): hierarchical per codec, the
node ring on the 1/2 shard, the local reduce-scatter, and x + 1. Run inside the emulated cluster:
  sudo jaxring cluster up --name jrx --nodes 4 --link 1gbit
  CODECS=none,bf16,int8 jaxring cluster run --name jrx --nodes 4 --procs-per-node 2 --transport mpi \
    -- python benchmarks/scripts/hierarchical_parts_mpi.py
"""
import time, statistics, os
import numpy as np
from mpi4py import MPI
import jax
import jaxring, jaxring.distributed
from jaxring import codecs
w = MPI.COMM_WORLD; r = w.Get_rank(); L = 2
ringc = w.Split(r % L, r); localc = w.Split(r // L, r)
topo = jaxring.Topology((jaxring.Level("local", L), jaxring.Level("node", w.Get_size() // L, 1e9/8, 1e-4)))
jaxring.distributed.bind_mpi_axis("mpi", w, topo)
jaxring.distributed.bind_mpi_axis("node", ringc, jaxring.Topology((jaxring.Level("node", ringc.Get_size(), 1e9/8, 1e-4),)))
jaxring.distributed.bind_mpi_axis("local", localc, jaxring.Topology((jaxring.Level("local", L),)))
n = 32 * (1 << 20) // 4
x = jax.device_put(np.random.default_rng(r).standard_normal(n).astype(np.float32))
xs = x[: n // L]
C = {"none": None, "bf16": codecs.bf16(), "int8": codecs.int8()}
cases = []
for c in os.environ.get("CODECS", "none").split(","):
    cases.append((f"hier {c}", jax.jit(lambda v, c=c: jaxring.psum(v, "mpi", algorithm="hierarchical", compression=None if C[c] is None else {"node": C[c]})), x))
    cases.append((f"node ring {c}", jax.jit(lambda v, c=c: jaxring.psum(v, "node", algorithm="ring", compression=C[c])), xs))
cases.append(("hier none node=ring", jax.jit(lambda v: jaxring.psum(v, "mpi", algorithm={"node": "ring", "local": "ring"})), x))
cases.append(("local RS", jax.jit(lambda v: jaxring.psum_scatter(v, "local", algorithm="ring", tiled=True)), x))
cases.append(("local psum ring", jax.jit(lambda v: jaxring.psum(v, "local", algorithm="ring")), x))
cases.append(("x+1", jax.jit(lambda v: v + 1), x))
for name, f, a in cases:
    jax.block_until_ready(f(a)); w.Barrier()
    ts = []; cpu = []
    for _ in range(7):
        w.Barrier(); t = time.perf_counter(); c0 = time.process_time(); jax.block_until_ready(f(a)); ts.append(time.perf_counter() - t); cpu.append(time.process_time() - c0)
    if r == 0: print(f"{name:18s} median {statistics.median(ts)*1e3:7.1f} ms cpu {statistics.median(cpu)*1e3:6.1f}", [round(t*1e3) for t in ts], flush=True)
