"""Parts of the hierarchical all-reduce timed apart, with CPU time per process (docs/benchmarks-history.md,
"Where the rest of the time goes"): gloo psum, hierarchical per codec, the node ring on the shard,
the local reduce-scatter / all-gather, and x + 1. Run inside the emulated cluster as
benchmarks/scripts/node_ring_pieces.py is (env ONLY=name,... keeps matching cases; CODECS, MIB, REPS).
"""
import os, time, statistics
import numpy as np
import jaxring.distributed
jaxring.distributed.initialize()
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxring
from jaxring import codecs

me, nproc = jax.process_index(), jax.process_count()
mesh = jaxring.distributed.process_mesh()
per = mesh.shape["local"]
axes = ("node", "local")
MIB = int(os.environ.get("MIB", "32"))
n = MIB * (1 << 20) // 4
sh = NamedSharding(mesh, P(axes))
x = jax.make_array_from_process_local_data(sh, np.random.default_rng(me).standard_normal((per, n), dtype=np.float32))
xs = jax.make_array_from_process_local_data(sh, np.random.default_rng(me).standard_normal((per, n // per), dtype=np.float32))
C = {"none": None, "bf16": codecs.bf16(), "int8": codecs.int8(), "topk": codecs.topk_chunks(0.01)}
def sm(body, inp=x, out=P()):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=out, check_vma=bool(int(os.environ.get("VMA","0")))))
cases = []
ONLY=os.environ.get("ONLY")
cases.append(("gloo psum", sm(lambda v: lax.psum(v, axes)), x))
which = os.environ.get("CODECS", "none,bf16,int8").split(",")
for c in which:
  comp = None if C[c] is None else {"node": C[c]}
  cases.append((f"hier {c}", sm(lambda v, comp=comp: jaxring.psum(v, axes, algorithm="hierarchical", compression=comp)), x))
  cases.append((f"node ring {c} (shard)", sm(lambda v, c=c: jaxring.psum(v, "node", algorithm="ring", compression=C[c]), out=P(None, "local")), xs))
cases.append(("local RS+AG", sm(lambda v: lax.all_gather(lax.psum_scatter(v.reshape(-1), "local", tiled=True), "local", tiled=True)[None], out=P("node")), x))
cases.append(("local RS", sm(lambda v: lax.psum_scatter(v.reshape(-1), "local", tiled=True)[None], out=P(axes)), x))
K = int(os.environ.get("K", "4"))
for c in which:
  comp = None if C[c] is None else {"node": C[c]}
  def body(v, comp=comp):
    parts = jnp.split(v.reshape(-1), K)
    return jnp.concatenate([jaxring.psum(p, axes, algorithm="hierarchical", compression=comp) for p in parts])[None]
  cases.append((f"hier {c} split{K}", sm(body), x))
cases.append(("x+1", sm(lambda v: v + 1, out=P(axes)), x))
reps = int(os.environ.get("REPS", "5"))
for name, f, inp in cases:
  if ONLY and not any(o in name for o in ONLY.split(",")): continue
  jax.block_until_ready(f(inp)); jax.block_until_ready(f(inp))
  jaxring.distributed.barrier("pre" + name, timeout_s=300)
  ts = []
  c0 = os.times()
  for _ in range(reps):
    t = time.perf_counter(); jax.block_until_ready(f(inp)); ts.append(time.perf_counter() - t)
  c1 = os.times()
  cpu = 1e3 * ((c1.user - c0.user) + (c1.system - c0.system)) / reps
  sysms = 1e3 * (c1.system - c0.system) / reps
  jaxring.distributed.barrier("post" + name, timeout_s=300)
  if me == 0:
    print(f"PROF {name:28s} {1e3*statistics.median(ts):8.1f} ms  (min {1e3*min(ts):.1f})  cpu/proc {cpu:7.1f} ms (sys {sysms:.1f})", flush=True)
