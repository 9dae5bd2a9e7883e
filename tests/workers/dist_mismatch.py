"""Worker for tests/test_distributed.py: processes that plan a collective differently.

``--case codec|shape|skip|absent|diloco``: process 1 compresses where process 0 does not, passes
one element more, skips the first of two collectives, plans none at all (it only sleeps, alive and
heartbeating), or compresses the pseudo-gradients of a ``jaxring.diloco`` outer sync. Every process prints ``RAISED <type>: <message>`` (exit 3) or ``OK`` (exit 0).
"""
from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", choices=("same", "codec", "shape", "skip", "absent", "diloco"), required=True)
  args = ap.parse_args()

  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring

  me = jax.process_index()
  odd = me == 1
  mesh = jaxring.distributed.process_mesh()
  axes = ("node", "local")
  size = 1003 + (1 if odd and args.case == "shape" else 0)
  comp = jaxring.codecs.int8() if odd and args.case == "codec" else None
  x = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(axes)), jnp.ones((mesh.shape["local"], size), jnp.float32))

  def outer_sync(v):   # one DiLoCo update: its sync (traced in its cond) is the first collective
    import optax
    tx = jaxring.diloco(optax.sgd(0.1), axis="node", every=2,
                        compression=jaxring.codecs.int8() if odd else None)
    params = {"w": v[0]}
    updates, _ = tx.update(params, tx.init(params), params)
    return updates["w"][None]

  def program(skip_first: bool):
    if args.case == "diloco":
      return jax.jit(jax.shard_map(outer_sync, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))

    def body(v):
      total = 0.0 if skip_first else jaxring.psum(v, axes, algorithm="ring",
                                                  compression=comp).sum()
      return jaxring.all_gather(v, axes, tiled=True, algorithm="ring") + total
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))

  if odd and args.case == "absent":
    time.sleep(12)
    print("OK (slept)", flush=True)
    return 0
  try:
    jax.block_until_ready(program(odd and args.case == "skip")(x))
  except (jaxring.distributed.CollectiveMismatchError,
          jaxring.distributed.FingerprintTimeoutError) as e:
    print(f"RAISED {type(e).__name__}: {e}", flush=True)
    jaxring.distributed.dump(reason=type(e).__name__)   # JAXRING_FLIGHT_DIR: the test's folder
    return 3
  print("OK", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
