"""Worker for tests/test_mpi.py, run by ``mpirun -n P``: the MPI streaming ring (xla_ext/mpi_ring.cc).

``--check identical``: for every wire (f32, bf16 input, bf16, fp16, int8 with 256- and 64-value
blocks), several sizes and piece counts, the streaming ring's gathered payload must equal the
Sendrecv ring's (mpi4jax) bit for bit, on inputs with mixed magnitudes, signed zeros and (f32)
infinities; and the streaming path must really be taken. Prints ``rank R: OK identical cases=N``.

``--check timeout``: rank ``--absent`` never joins; every other rank's streaming call must fail
within ``--timeout`` seconds (plus slack) with an error that names a rank it waited for. Prints
``rank R: FAILED AS EXPECTED in S s: <message>``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", choices=("identical", "timeout"), required=True)
  ap.add_argument("--absent", type=int, default=1)
  ap.add_argument("--timeout", type=float, default=2.0)
  args = ap.parse_args(argv)
  from mpi4py import MPI
  import jax
  import jax.numpy as jnp
  from jaxring import codecs
  from jaxring._src.algorithms import ring
  from jaxring._src.ext import mpi_ring
  from jaxring._src.transport.mpi import MPI_TRANSPORT, MpiGroup

  comm = MPI.COMM_WORLD
  r, p = comm.Get_rank(), comm.Get_size()
  assert mpi_ring.AVAILABLE, mpi_ring.LOAD_ERROR
  plain = MpiGroup(comm.Dup(), "w")
  stream = MpiGroup(comm.Dup(), "w", comm.Dup(), args.timeout)

  if args.check == "timeout":
    if r == args.absent:
      time.sleep(args.timeout + 8)
      print(f"rank {r}: absent rank leaves", flush=True)
      return 0
    x = jnp.ones((p * 256 * 4,), jnp.float32)
    t0 = time.monotonic()
    try:
      jax.block_until_ready(mpi_ring.ring_all_reduce_payload(
          x, stream.stream_comm.py2f(), jnp.int8, block_size=256, pieces=2,
          timeout_s=args.timeout))
    except Exception as exc:  # noqa: BLE001 - the error is what is checked
      print(f"rank {r}: FAILED AS EXPECTED in {time.monotonic() - t0:.1f} s: {exc}", flush=True)
      return 0
    print(f"rank {r}: the call returned although rank {args.absent} never joined", flush=True)
    return 3

  cases = [("f32", codecs.none(), jnp.float32), ("bf16-input", codecs.none(), jnp.bfloat16),
           ("bf16", codecs.bf16(), jnp.float32), ("fp16", codecs.fp16(), jnp.float32),
           ("int8", codecs.int8(), jnp.float32), ("int8/64", codecs.int8(64), jnp.float32)]
  done = 0
  for name, codec, dtype in cases:
    for m, pieces in ((1, 1), (6, 3), (8, 16), (64, 1)):
      n = p * 256 * m
      rng = np.random.default_rng((r, m, pieces))
      v = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, n)
      v[::97] = -0.0
      if name == "f32":
        v[5] = np.inf
      x = jnp.asarray(v)
      direct = MPI_TRANSPORT.ring_all_reduce_payload(x, stream, codec, dtype, pieces)
      assert direct is not None, f"{name}: the streaming ring did not apply"
      f_plain = jax.jit(lambda u: ring.all_reduce_payload(u, plain, codec, dtype, MPI_TRANSPORT,
                                                          pieces=pieces)[0])
      f_stream = jax.jit(lambda u: ring.all_reduce_payload(u, stream, codec, dtype, MPI_TRANSPORT,
                                                           pieces=pieces)[0])
      want, got = f_plain(x), f_stream(x)
      assert len(want) == len(got), name
      for a, b in zip(want, got):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
          bad = np.flatnonzero(a.view(np.uint8) != b.view(np.uint8))[:5]
          print(f"rank {r}: MISMATCH {name} n={n} pieces={pieces}: {a.dtype}{a.shape} vs "
                f"{b.dtype}{b.shape}, first differing bytes {bad}", flush=True)
          return 3
      done += 1
  print(f"rank {r}: OK identical cases={done}", flush=True)
  comm.Barrier()
  return 0


if __name__ == "__main__":
  sys.exit(main())
