"""Single small all-reduces on the emulated cluster, each after a pause that lets the link's token
bucket refill (docs/benchmarks.md, "One message per hop"; docs/simulations.md, "Training
steps"): what one reduction of a train step costs when the link is not the bottleneck. Median
and fastest ms of 15 calls on node 0: gloo's psum (4 B, the 10.8 KB of 2,695 chunk norms,
168 KiB), jaxring's hierarchical plan (int8; none on 1.7 KB of chosen chunks; top-k 1% with
16- and 4096-value chunks) on 168 KiB per device, the GroupNorm ResNet's gradient.

  sudo jaxring cluster up --name jrp --nodes 4 --link 10mbit
  sudo jaxring cluster run --name jrp --nodes 4 --procs-per-node 1 --devices-per-proc 2 \\
      -- python benchmarks/scripts/single_calls.py
  sudo jaxring cluster down --name jrp
"""
import json
import os
import statistics
import time

import numpy as np

import jaxring.distributed

jaxring.distributed.initialize()
import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxring  # noqa: E402

PAUSE_S, CALLS = float(os.environ.get("PAUSE", "0.25")), 15
me = jax.process_index()
mesh = jaxring.distributed.process_mesh()
axes = ("node", "local")
CODECS = {None: None, "none": None, "int8": jaxring.codecs.int8(),
          "topk16": jaxring.codecs.topk_chunks(0.01, chunk_size=16),
          "topk4096": jaxring.codecs.topk_chunks(0.01)}
PLANS = [("xla", None, 4), ("xla", None, 10780), ("xla", None, 168 << 10),
         ("hierarchical", "int8", 168 << 10), ("hierarchical", "none", 1728),
         ("hierarchical", "topk16", 168 << 10), ("hierarchical", "topk4096", 168 << 10)]
for algorithm, codec, nbytes in PLANS:
  comp = None if CODECS[codec] is None else {"node": CODECS[codec]}
  body = (lambda v: jax.lax.psum(v, axes)) if algorithm == "xla" else (
      lambda v, comp=comp: jaxring.psum(v, axes, algorithm="hierarchical", compression=comp))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(), check_vma=False))
  local = np.random.default_rng(me).standard_normal((mesh.shape["local"], max(1, nbytes // 4)))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)),
                                             local.astype(np.float32))
  for _ in range(2):
    jax.block_until_ready(f(x))
  times = []
  for i in range(CALLS):
    time.sleep(PAUSE_S)
    jaxring.distributed.barrier(f"{algorithm}-{codec}-{nbytes}-{i}", timeout_s=300)
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t)
  if me == 0:
    print(json.dumps({"algorithm": algorithm, "codec": codec, "bytes": nbytes,
                      "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}),
          flush=True)
jaxring.distributed.barrier("end", timeout_s=300)
