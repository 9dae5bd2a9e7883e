"""The node level of the hierarchical all-reduce, native (gloo psum) against jaxring's ppermute ring, in JAX's
shape (docs/design.md, "Transports"; docs/benchmarks.md). One process per node, 2 devices each:
  sudo jaxring cluster up --name jrx --nodes 4 --link 1gbit
  sudo LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 jaxring cluster run --name jrx \
      --nodes 4 --procs-per-node 1 --devices-per-proc 2 -- python benchmarks/scripts/node_level_native_vs_ring.py
"""
import time, statistics
import numpy as np
import jaxring.distributed
jaxring.distributed.initialize()
import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxring
me, nproc = jax.process_index(), jax.process_count()

mesh = jaxring.distributed.process_mesh(); per = mesh.shape["local"]
axes = ("node", "local")
n = 32 * (1 << 20) // 4
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)), np.random.default_rng(me).standard_normal((per, n), dtype=np.float32))
sm = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P()))
cases = [("gloo psum", sm(lambda v: lax.psum(v, axes))),
         ("hier none", sm(lambda v: jaxring.psum(v, axes, algorithm="hierarchical"))),
         ("hier none node=ring", sm(lambda v: jaxring.psum(v, axes, algorithm={"node": "ring", "local": "xla"}))),
         ("hier none both ring", sm(lambda v: jaxring.psum(v, axes, algorithm={"node": "ring", "local": "ring"})))]
for name, f in cases:
    jax.block_until_ready(f(x)); jaxring.distributed.barrier("a" + name, timeout_s=300)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t)
    jaxring.distributed.barrier("b" + name, timeout_s=300)
    if me == 0: print(f"{name:20s} median {statistics.median(ts)*1e3:7.1f}", [round(t*1e3) for t in ts], flush=True)
