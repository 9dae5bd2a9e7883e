"""Worker for tests/test_distributed.py: cross-process all-gather and reduce-scatter.

Every process builds the global mesh ``("node", "local")`` = (processes, devices per process) and
compares ``jaxring.all_gather`` / ``jaxring.psum_scatter`` (hierarchical: the local level in
shared memory, the node level across processes; uncompressed and int8 on the node level) with
``lax``'s on the same rows, for several sizes (some not a multiple of the codec's block). Prints
one ``OK`` line per case, or exits non-zero with the first mismatch. Prints which custom calls
each compiled program holds, so the test can check that the local level ran in shared memory.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", default="8,1003,4096")
  args = ap.parse_args()

  import jaxring.distributed
  jaxring.distributed.initialize()   # everything from JAXRING_* variables

  import jax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring

  me = jax.process_index()
  mesh = jaxring.distributed.process_mesh()
  per_proc, p = mesh.shape["local"], mesh.devices.size
  axes = ("node", "local")
  sharding = NamedSharding(mesh, P(axes))
  int8 = {"node": jaxring.codecs.int8()}

  def program(body):
    return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P(axes),
                                 out_specs=P(axes), check_vma=False))

  for size in map(int, args.sizes.split(",")):
    rng = np.random.default_rng((me, size))
    for op in ("all_gather", "psum_scatter"):
      rows = size if op == "all_gather" else size * p
      x = jax.make_array_from_process_local_data(
          sharding, rng.standard_normal((per_proc, rows)).astype(np.float32))
      if op == "all_gather":
        ref_body = lambda v: lax.all_gather(v, axes, tiled=True)
        ours = lambda comp: (lambda v: jaxring.all_gather(v, axes, tiled=True,
                                                          algorithm="hierarchical",
                                                          compression=comp))
      else:
        ref_body = lambda v: lax.psum_scatter(v, axes, tiled=True)
        ours = lambda comp: (lambda v: jaxring.psum_scatter(v, axes, tiled=True,
                                                            algorithm="hierarchical",
                                                            compression=comp))
      want = np.asarray(program(ref_body)(x).addressable_data(0), np.float64)
      for name, comp in (("none", None), ("int8", int8)):
        f = program(ours(comp))
        hlo = f.lower(x).compile().as_text()
        calls = sorted({t for t in ("jaxring_local_all_gather", "jaxring_local_reduce_scatter")
                        if t in hlo})
        got = np.asarray(f(x).addressable_data(0), np.float64)
        err = float(np.max(np.abs(got - want)))
        # int8: half a quantization step of each block's max, summed over the p summands
        tol = 1e-5 * (1 + np.max(np.abs(want))) if comp is None else \
            (p if op == "psum_scatter" else 1) * 4.5 / 127 * (1 + np.max(np.abs(want)))
        if got.shape != want.shape or not err <= tol:
          print(f"process {me}: MISMATCH {op} {name} size={size}: shapes {got.shape} "
                f"{want.shape}, max |err| {err:.3g} > {tol:.3g}", file=sys.stderr, flush=True)
          return 3
        print(f"process {me}: OK {op} {name} size={size} max_err={err:.3g} "
              f"calls={','.join(calls) or '-'}", flush=True)
  jaxring.distributed.barrier("done", timeout_s=60)
  return 0


if __name__ == "__main__":
  sys.exit(main())
