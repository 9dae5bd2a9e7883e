"""What a momentum-corrected top-k step computes on each member besides its collectives, timed
with the collectives taken out (``bench tta``'s top-k contenders, ``resnet_gn``, one bucket).

Each member: the bucket's automatic clipping, velocity and residual, chunk norms at the run's
chunk size, one ``top_k`` per pool of tensors (``TopKChunks.quotas``), gathering the chosen
chunks, scattering them back, the momentum masking and the next residual: the arithmetic of
``jaxring._src.optim.momentum.corrected_mean`` with the norms' all-reduce and the dense plan
replaced by identities. Run it as ``bench tta``'s nodes run (one process per node, two devices
each, ``--procs`` of them at once on this machine) to compare with the step's measured time and
with ``compute_s``.

  python benchmarks/scripts/topk_local_work.py --procs 4 --chunk-size 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one(chunk_size: int, per_tensor: bool, reps: int) -> float:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  from jaxring._src.algorithms import engine
  from jaxring._src.error_feedback import next_residual
  from jaxring._src.optim.momentum import auto_clip
  from jaxring._src.tools.bench.models import MODELS
  from jaxring._src.tools.bench.tta import MOMENTUM as m

  leaves = jax.tree.leaves(MODELS["resnet_gn"][0](jax.random.key(0)))
  segments = engine.segment_sizes(leaves) + (1,)      # the bucket's tensors and its token
  n = sum(segments)
  codec = jaxring.codecs.topk_chunks(0.01, chunk_size=chunk_size, per_tensor=per_tensor)
  members = 8

  def local(u, g, r, average):
    scale, average = auto_clip(jnp.linalg.norm(g), average)
    u = m * u + g * scale
    tail = m / (1 - m) * u
    buf = r + u + tail
    idx = codec.select(buf, lambda v: v, segments)
    total, err = codec.reduce_selected(buf, idx, want_error=True,
                                       reduce_dense=lambda b, want: (b, jnp.zeros_like(b)))
    sent = codec.sent_mask(n, idx)
    u = jnp.where(sent, 0.0, u)
    err = jnp.where(sent, err, err - tail)
    mean = total / members
    return u, next_residual(mean, err, jnp.float32), average

  mesh = Mesh(np.asarray(jax.local_devices()), ("d",), axis_types=(AxisType.Auto,))
  d = len(jax.local_devices())
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                               check_vma=False))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))
  g = put(jax.random.normal(jax.random.key(1), (d * n,)))
  u, r, avg = put(jnp.zeros(d * n)), put(jnp.zeros(d * n)), put(jnp.zeros(d))
  for _ in range(3):
    u, r, avg = step(u, g, r, avg)
  jax.block_until_ready(avg)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(20):
      u, r, avg = step(u, g, r, avg)
      jax.block_until_ready(avg)
    times.append((time.perf_counter() - t0) / 20)
  return statistics.median(times)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--procs", type=int, default=4, help="processes at once (nodes)")
  ap.add_argument("--devices", type=int, default=2, help="devices per process")
  ap.add_argument("--chunk-size", type=int, default=16)
  ap.add_argument("--whole-buffer", action="store_true", help="topk_chunks(per_tensor=False)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    print(one(args.chunk_size, not args.whole_buffer, args.reps), flush=True)
    return 0
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
  cmd = [sys.executable, __file__, "--child", "--chunk-size", str(args.chunk_size),
         "--reps", str(args.reps)] + (["--whole-buffer"] if args.whole_buffer else [])
  procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
           for _ in range(args.procs)]
  seconds = [float(p.communicate(timeout=600)[0].split()[-1]) for p in procs]
  print(f"top-k local work per step, chunk size {args.chunk_size}, "
        f"{'whole buffer' if args.whole_buffer else 'per tensor'}, {args.procs} process(es) x "
        f"{args.devices} devices at once: median {1e3 * statistics.median(seconds):.2f} ms "
        f"(each process: {', '.join(f'{1e3 * s:.2f}' for s in seconds)} ms)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
