"""Parts of the hierarchical all-gather and reduce-scatter timed apart on the emulated cluster
(docs/benchmarks.md, "Sharded state"): gloo's whole all-gather, its node-level all-gather of f32
and of int8, the local level through gloo and in shared memory, jaxring's hierarchical
all-gather / reduce-scatter, the node ring alone, chained ppermutes, an int8 encode + decode and
x + 1 of 32 MiB, and the int8 all-gather built by hand with and without each of its extra copies
(docs/benchmarks.md, "Rows reordered by slices"). Median ms of 7 calls on node 0 and CPU ms per
process per call.

  sudo jaxring cluster up --name jrp --nodes 4 --link 1gbit
  sudo jaxring cluster run --name jrp -- env LD_PRELOAD=<libtcmalloc_minimal.so.4> BAR=1 \
      python benchmarks/scripts/gather_scatter_parts.py
  sudo jaxring cluster down --name jrp

ONLY=substr,... keeps matching cases; BAR=1 puts a barrier before every timed call.
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
from jaxring._src.transport import inprocess
from jaxring._src.transport.groups import Group

me = jax.process_index()
mesh = jaxring.distributed.process_mesh()
per = mesh.shape["local"]; p = mesh.devices.size
axes = ("node", "local")
n = 32 * (1 << 20) // 4 // p
sh = NamedSharding(mesh, P(axes))
def arr(m, dt=np.float32):
  return jax.make_array_from_process_local_data(sh, np.random.default_rng(me).standard_normal((per, m)).astype(dt))
x = arr(n)
xi8 = jax.make_array_from_process_local_data(sh, np.zeros((per, n), np.int8))
x4 = arr(4 * n)
def sm(body, out=P(axes), vma=False):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=out, check_vma=vma))
LOCAL = Group(("local",), per, 1, per, "local")
def chain3(v):
  c = v[0].reshape(4, -1)[3]
  q, sc = codecs.int8().encode(c, jnp.float32)
  perm = [(i,(i+1)%4) for i in range(4)]
  for _ in range(3):
    q = lax.ppermute(q, "node", perm); sc = lax.ppermute(sc, "node", perm)
  return codecs.int8().decode((q, sc), jnp.float32)[None]
I8 = codecs.int8()
ORDER_INV = np.argsort(np.asarray([0, 2, 4, 6, 1, 3, 5, 7]))  # local-major -> node-major, 4 x 2
def by_hand(v, reorder=None, pack=False):
  """int8 all-gather of v over (node, local) built by hand: encode, gloo all-gather over node
  (codes and scales apart, or packed into one u8 message), shared-memory gather over local,
  an optional reorder of the rows ("gather": fancy indexing; "slices": permute_rows), decode."""
  from jaxring._src.algorithms.base import permute_rows
  q, sc = I8.encode(v[0], jnp.float32)
  if pack:
    nq = q.shape[0]
    buf = jnp.concatenate([lax.bitcast_convert_type(q, jnp.uint8),
                           lax.bitcast_convert_type(sc, jnp.uint8).reshape(-1)])
    g = lax.all_gather(buf, "node", tiled=True).reshape(4, -1)
    q = lax.bitcast_convert_type(g[:, :nq], jnp.int8).reshape(-1)
    sc = lax.bitcast_convert_type(g[:, nq:].reshape(-1, 4), jnp.float32).reshape(-1)
  else:
    q, sc = lax.all_gather(q, "node", tiled=True), lax.all_gather(sc, "node", tiled=True)
  q, sc = inprocess.all_gather((q, sc), LOCAL)
  if reorder == "gather":
    q, sc = (a.reshape(8, -1)[ORDER_INV].reshape(-1) for a in (q, sc))
  elif reorder == "slices":
    q, sc = (permute_rows(a.reshape(8, -1), ORDER_INV).reshape(-1) for a in (q, sc))
  return I8.decode((q, sc), jnp.float32)[None]
cases = [
 ("gloo AG all", sm(lambda v: lax.all_gather(v[0], axes, tiled=True)[None]), x),
 ("gloo AG node f32", sm(lambda v: lax.all_gather(v[0], "node", tiled=True)[None]), x),
 ("gloo AG node int8", sm(lambda v: lax.all_gather(v[0], "node", tiled=True)[None]), xi8),
 ("gloo AG local f32 (16MiB->32)", sm(lambda v: lax.all_gather(v[0], "local", tiled=True)[None]), x4),
 ("shm AG local f32 (16MiB->32)", sm(lambda v: inprocess.all_gather((v[0],), LOCAL)[0][None]), x4),
 ("jr AG hier none", sm(lambda v: jaxring.all_gather(v[0], ("local","node"), tiled=True, algorithm="hierarchical")[None]), x),
 ("jr AG hier int8", sm(lambda v: jaxring.all_gather(v[0], ("local","node"), tiled=True, algorithm="hierarchical", compression={"node": codecs.int8()})[None]), x),
 ("jr AG hier int8 nl", sm(lambda v: jaxring.all_gather(v[0], axes, tiled=True, algorithm="hierarchical", compression={"node": codecs.int8()})[None]), x),
 ("AG int8 by hand", sm(by_hand), x),
 ("AG int8 by hand + reorder gather", sm(lambda v: by_hand(v, "gather")), x),
 ("AG int8 by hand + reorder slices", sm(lambda v: by_hand(v, "slices")), x),
 ("AG int8 by hand + packed", sm(lambda v: by_hand(v, pack=True)), x),
 ("jr AG hier none nl", sm(lambda v: jaxring.all_gather(v[0], axes, tiled=True, algorithm="hierarchical")[None]), x),
 ("gloo RS all", sm(lambda v: lax.psum_scatter(v[0], axes, tiled=True)[None]), arr(8*n)),
 ("jr RS hier int8 nl", sm(lambda v: jaxring.psum_scatter(v[0], axes, tiled=True, algorithm="hierarchical", compression={"node": codecs.int8()})[None]), arr(8*n)),
 ("jr RS hier none nl", sm(lambda v: jaxring.psum_scatter(v[0], axes, tiled=True, algorithm="hierarchical")[None]), arr(8*n)),
 ("shm RS local 32MiB", sm(lambda v: inprocess.reduce_scatter(v[0], LOCAL)[None]), arr(8*n)),
 ("jr RS node ring int8 16MiB", sm(lambda v: jaxring.psum_scatter(v[0], "node", tiled=True, algorithm="ring", compression=codecs.int8())[None]), arr(4*n)),
 ("jr RS node ring none 16MiB", sm(lambda v: jaxring.psum_scatter(v[0], "node", tiled=True, algorithm="ring")[None]), arr(4*n)),
 ("ppermute node 4KiB", sm(lambda v: lax.ppermute(v[0], "node", [(i,(i+1)%4) for i in range(4)])[None]), arr(1024)),
 ("ppermute node 1MiB", sm(lambda v: lax.ppermute(v[0], "node", [(i,(i+1)%4) for i in range(4)])[None]), arr(1<<18)),
 ("ppermute node 2x4KiB", sm(lambda v: (lax.ppermute(v[0], "node", [(i,(i+1)%4) for i in range(4)]) + lax.ppermute(v[0]*2, "node", [(i,(i+1)%4) for i in range(4)]))[None]), arr(1024)),
 ("ppermute node 4MiB", sm(lambda v: lax.ppermute(v[0], "node", [(i,(i+1)%4) for i in range(4)])[None]), arr(1<<20)),
 ("chain roll 16MiB", sm(lambda v: jnp.roll(v[0].reshape(4,-1), -lax.axis_index("node"), axis=0)[1:2]), arr(4*n)),
 ("chain 3 ppermute int8 1MiB+scales", sm(chain3), arr(4*n)),
 ("int8 decode 32MiB", sm(lambda v: codecs.int8().decode(codecs.int8().encode(v[0], jnp.float32), jnp.float32)[None]), arr(8*n)),
 ("x+1 32MiB", sm(lambda v: v + 1), arr(8*n)),
]
ONLY = os.environ.get("ONLY")
for name, f, inp in cases:
  if ONLY and not any(o in name for o in ONLY.split(",")): continue
  jax.block_until_ready(f(inp)); jax.block_until_ready(f(inp))
  jaxring.distributed.barrier("pre" + name, timeout_s=300)
  ts = []
  c0 = os.times()
  for i in range(7):
    if os.environ.get("BAR"): jaxring.distributed.barrier(f"b{name}{i}", timeout_s=300)
    t = time.perf_counter(); jax.block_until_ready(f(inp)); ts.append(time.perf_counter() - t)
  c1 = os.times()
  cpu = 1e3 * ((c1.user - c0.user) + (c1.system - c0.system)) / 7
  jaxring.distributed.barrier("post" + name, timeout_s=300)
  if me == 0:
    print(f"PROF {name:32s} {1e3*statistics.median(ts):8.1f} ms (min {1e3*min(ts):.1f}) cpu/proc {cpu:7.1f}", flush=True)
