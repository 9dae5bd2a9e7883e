"""The node-level ring alone, with each hop split into 1/2/4/8 pieces (docs/benchmarks.md,
"Inter-node step alone"). One process per node, 2 devices each; run inside the emulated cluster:

  sudo jaxring cluster up --name jrp --nodes 4 --link 1gbit
  sudo LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 jaxring cluster run --name jrp \
      --nodes 4 --procs-per-node 1 --devices-per-proc 2 -- env CODECS=none,bf16,int8 \
      python benchmarks/scripts/node_ring_pieces.py
  sudo jaxring cluster down --name jrp

Prints process 0's median and min over 3 rounds x 4 calls per variant, rounds interleaved.
"""
import os, time, statistics
import numpy as np
import jaxring.distributed
jaxring.distributed.initialize()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxring import codecs
from jaxring._src.algorithms import ring as R
from jaxring._src.transport.xla import XLA
from jaxring._src.transport.groups import whole_group
me, nproc = jax.process_index(), jax.process_count()
mesh = jaxring.distributed.process_mesh()
per = mesh.shape["local"]
axes = ("node", "local")
n = int(os.environ.get("MIB", "16")) * (1 << 20) // 4
sh = NamedSharding(mesh, P(axes))
x = jax.make_array_from_process_local_data(sh, np.random.default_rng(me).standard_normal((per, n), dtype=np.float32))
G = whole_group(("node",), nproc, "node")
def body(c, J):
  def f(v):
    pl, _ = R.all_reduce_payload(v.reshape(-1), G, c, jnp.float32, XLA, pieces=J)
    return c.decode(pl, jnp.float32)[None]
  return f
def sm(b):
  return jax.jit(jax.shard_map(b, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False))
cases = []
for cn in os.environ.get("CODECS", "bf16,int8").split(","):
  c = {"none": codecs.none(), "bf16": codecs.bf16(), "int8": codecs.int8()}[cn]
  for J in [1, 2, 4, 8]:
    cases.append((f"{cn} pieces={J}", sm(body(c, J))))
if me == 0:
  txt = cases[2][1].lower(x).compile().as_text()
  print("PROF collective-permutes in pieces=4 int8:", txt.count("collective-permute-start") or txt.count("collective-permute("))
res = {}
ref = None
for rnd in range(3):
  for name, f in cases:
    y = f(x); jax.block_until_ready(y)
    if rnd == 0:
      got = np.asarray(y.addressable_data(0))
      if "pieces=1" in name: ref = got
      if me == 0 and not np.array_equal(got, ref): print("PROF differs", name, np.abs(got-ref).max())
    jaxring.distributed.barrier(f"pre{rnd}{name}", timeout_s=300)
    for _ in range(4):
      t = time.perf_counter(); jax.block_until_ready(f(x)); res.setdefault(name, []).append(time.perf_counter() - t)
    jaxring.distributed.barrier(f"post{rnd}{name}", timeout_s=300)
if me == 0:
  for name, ts in res.items(): print(f"PROF {name:16s} median {1e3*statistics.median(ts):7.1f} ms min {1e3*min(ts):7.1f}", flush=True)
