"""Worker for tests/test_mpi.py, under ``mpirun -n 2``: ranks that plan a psum differently.

``--case codec``: rank 1 compresses, rank 0 does not. ``same``: both alike. Each rank prints
``RAISED <type>: <message>`` (exit 3) or ``OK`` (exit 0).
"""
import argparse
import sys


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", choices=("same", "codec"), required=True)
  args = ap.parse_args()
  from mpi4py import MPI
  import jax
  import jax.numpy as jnp

  import jaxring
  import jaxring.distributed

  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  jaxring.distributed.bind_mpi_axis("data", comm)
  comp = jaxring.codecs.int8() if args.case == "codec" and rank == 1 else None
  try:
    out = jax.jit(lambda v: jaxring.psum(v, "data", algorithm="ring", compression=comp))(
        jnp.ones(1000, jnp.float32))
    jax.block_until_ready(out)
  except jaxring.distributed.CollectiveMismatchError as e:
    print(f"rank {rank}: RAISED {type(e).__name__}: {e}", flush=True)
    return 3
  print(f"rank {rank}: OK {float(out[0])}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
