"""Does XLA:CPU run a collective beside independent computation? (docs/benchmarks.md, pipelining).

Times a 4 MiB ppermute over the node axis, an independent chain of matmuls, and both in one
program; run inside the emulated cluster as benchmarks/scripts/node_ring_pieces.py is. "both" near
the sum of the two means the runtime runs them in turn.
"""
import time, statistics
import numpy as np
import jaxring.distributed
jaxring.distributed.initialize()
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
me, nproc = jax.process_index(), jax.process_count()
mesh = jaxring.distributed.process_mesh()
per = mesh.shape["local"]
axes = ("node", "local")
n = 4 * (1 << 20) // 4   # 4 MiB per device per ppermute
sh = NamedSharding(mesh, P(axes))
x = jax.make_array_from_process_local_data(sh, np.ones((per, n), np.float32))
m = jax.make_array_from_process_local_data(sh, np.ones((per, 512*512), np.float32))
perm = [(i, (i + 1) % nproc) for i in range(nproc)]
def comm(v): return lax.ppermute(v, "node", perm)
def comp(w):
  a = w.reshape(512, 512)
  for _ in range(12): a = jnp.tanh(a @ a * 1e-3)
  return a.reshape(1, -1)
def sm(body, nin=1):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes),)*nin, out_specs=P(axes) if nin == 1 else (P(axes), P(axes)), check_vma=False))
cases = [("comm", sm(lambda v: comm(v)), (x,)), ("compute", sm(lambda w: comp(w)), (m,)),
         ("both", sm(lambda v, w: (comm(v), comp(w)), 2), (x, m)),
         ("comm x2 indep", sm(lambda v, w: (comm(v), comm(v * 2)), 2), (x, m)),
]
for name, f, args in cases:
  for _ in range(2): jax.block_until_ready(f(*args))
  jaxring.distributed.barrier("pre" + name, timeout_s=300)
  ts = []
  for _ in range(7):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
  jaxring.distributed.barrier("post" + name, timeout_s=300)
  if me == 0: print(f"PROF {name:20s} {1e3*statistics.median(ts):8.1f} ms", flush=True)
