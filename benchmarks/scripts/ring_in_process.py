"""The ring's collectives on 8 emulated CPU devices in one process (docs/benchmarks.md, "The ring
without a rotated copy"): reduce-scatter, all-reduce and all-gather over the 4-member "node" axis,
16 MiB of f32 per device, and the hierarchical all-reduce; median ms of 7 rounds, every case once
per round. Run: python benchmarks/scripts/ring_in_process.py
"""
import os, time, statistics
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import PartitionSpec as P, NamedSharding
import jaxring as jr
from jaxring import codecs
mesh = jax.make_mesh((4,2),("node","local"))
axes=("node","local")
n = 4*(1<<20)
x = jax.device_put(np.random.default_rng(0).standard_normal((8,n)).astype(np.float32), NamedSharding(mesh, P(axes)))
xs = jax.device_put(np.random.default_rng(0).standard_normal((8,n//4)).astype(np.float32), NamedSharding(mesh, P(axes)))
def sm(body):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False))
cases = {
 "RS ring int8": (sm(lambda v: jr.psum_scatter(v[0], "node", tiled=True, algorithm="ring", compression=codecs.int8())[None]), x),
 "AR ring none": (sm(lambda v: jr.psum(v, "node", algorithm="ring")), x),
 "AR ring int8": (sm(lambda v: jr.psum(v, "node", algorithm="ring", compression=codecs.int8())), x),
 "AR hier int8": (sm(lambda v: jr.psum(v, ("local","node"), algorithm="hierarchical", compression={"node": codecs.int8()})), x),
 "AG ring int8": (sm(lambda v: jr.all_gather(v[0], "node", tiled=True, algorithm="ring", compression=codecs.int8())[None]), xs),
}
res = {k: [] for k in cases}
for k,(f,a) in cases.items(): jax.block_until_ready(f(a))
for rep in range(7):
  for k,(f,a) in cases.items():
    t=time.perf_counter(); jax.block_until_ready(f(a)); res[k].append(time.perf_counter()-t)
for k in cases: print(f"{k:16s} {1e3*statistics.median(res[k]):8.1f} ms")
