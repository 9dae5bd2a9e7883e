"""Worker for tests/test_distributed.py and tests/test_cluster.py: repeated cross-process psums.

Every process builds the same global mesh ``("node", "local")`` = (processes, devices per
process), feeds each device a row drawn from ``default_rng((seed, call, global_device))`` and checks
every call's all-reduce against a float64 NumPy sum of all those rows (``local``: of this
process's rows, and the in-process custom calls its program runs are printed). Prints one ``OK``
line per algorithm, or exits non-zero with the first mismatch.

With ``--die-at CALL --die-rank R`` process R kills itself (``--die-how kill``: SIGKILL) or freezes
(``stop``: SIGSTOP) at that call, or stays alive but never launches the call (``stuck``: sleeps in
Python, its watchdog thread still heartbeating), so the test can check that the others name it and
exit.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time

import numpy as np


def rows(seed: int, call: int, devices: range, size: int) -> np.ndarray:
  return np.stack([np.random.default_rng((seed, call, g)).standard_normal(size) for g in devices])


TOPK_DENSITY, TOPK_CHUNK = 0.25, 16


def topk_sum(parts: np.ndarray) -> np.ndarray:
  """The members' sum in the chunks of largest summed norm (float64), zeros elsewhere."""
  n = parts.shape[1]
  nc = -(-n // TOPK_CHUNK)
  xs = np.pad(parts, ((0, 0), (0, nc * TOPK_CHUNK - n))).reshape(len(parts), nc, TOPK_CHUNK)
  score = np.sqrt((xs ** 2).sum(2)).sum(0)
  chosen = np.argsort(-score, kind="stable")[:int(np.ceil(TOPK_DENSITY * nc - 1e-9))]
  want = np.zeros((nc, TOPK_CHUNK))
  want[chosen] = xs[:, chosen].sum(0)
  return want.reshape(-1)[:n]


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--size", type=int, default=1003)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--algorithms", default="lax",
                  help="comma list: lax, xla, ring, hierarchical, local (jaxring.psum over "
                  "this process's devices alone), node-topk (top-k over the processes alone)")
  ap.add_argument("--die-rank", type=int, default=-1)
  ap.add_argument("--die-at", type=int, default=-1)
  ap.add_argument("--die-how", choices=("kill", "stop", "stuck"), default="kill")
  ap.add_argument("--progress", type=int, default=0, help="print every N calls")
  args = ap.parse_args()

  import jaxring.distributed
  topo = jaxring.distributed.initialize()   # everything from JAXRING_* variables

  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  me, nproc = jax.process_index(), jax.process_count()
  mesh = jaxring.distributed.process_mesh()
  per_proc = mesh.shape["local"]
  axes = ("node", "local")
  sharding = NamedSharding(mesh, P(axes))
  print(f"process {me}/{nproc}: {per_proc} devices, topology {topo.names} "
        f"{[lv.size for lv in topo.levels]}", flush=True)

  def reducer(algorithm):
    if algorithm == "lax":
      body = lambda v: jax.lax.psum(v, axes)
    elif algorithm == "local":   # this process's devices alone (auto: the in-process transport)
      import jaxring
      return jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "local"), mesh=mesh,
                                   in_specs=P(axes), out_specs=P("node")))
    elif algorithm == "node-topk":   # over the processes alone, top-k: its few bytes gathered
      import jaxring
      codec = jaxring.codecs.topk_chunks(TOPK_DENSITY, TOPK_CHUNK)
      return jax.jit(jax.shard_map(lambda v: jaxring.psum(v, "node", compression=codec),
                                   mesh=mesh, in_specs=P(axes), out_specs=P("local")))
    else:
      import jaxring
      body = lambda v: jaxring.psum(v, axes, algorithm=algorithm)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P()))

  mine = range(me * per_proc, (me + 1) * per_proc)
  everyone = range(nproc * per_proc)
  for algorithm in args.algorithms.split(","):
    f = reducer(algorithm)
    summed = {"local": mine, "node-topk": range(0, nproc * per_proc, per_proc)}.get(algorithm,
                                                                                   everyone)
    if algorithm == "node-topk":
      from jaxring._src.tools.hlo_bytes import compiled_wire_bytes
      ops = [c.op for c in compiled_wire_bytes(f, jax.make_array_from_process_local_data(
          sharding, np.zeros((per_proc, args.size), np.float32))).collectives]
      print(f"process {me}: node-topk collectives {ops}", flush=True)
    if algorithm == "local":   # which collectives the compiled program runs
      hlo = f.lower(jax.make_array_from_process_local_data(
          sharding, np.zeros((per_proc, args.size), np.float32))).compile().as_text()
      print(f"process {me}: local custom calls "
            f"{sorted(set(re.findall(r'jaxring_local_[a-z_]+', hlo)))}", flush=True)
    worst, t0 = 0.0, time.perf_counter()
    for call in range(args.calls):
      if args.progress and call % args.progress == 0:
        print(f"process {me}: {algorithm} call {call}", flush=True)
      if me == args.die_rank and call == args.die_at:
        print(f"process {me}: dying ({args.die_how}) at call {call} at={time.time():.3f}",
              flush=True)
        if args.die_how == "stuck":
          time.sleep(10 ** 6)
        os.kill(os.getpid(), signal.SIGKILL if args.die_how == "kill" else signal.SIGSTOP)
      local = rows(args.seed, call, mine, args.size).astype(np.float32)
      x = jax.make_array_from_process_local_data(sharding, local)
      y = np.asarray(f(x).addressable_data(0), np.float64).reshape(-1)
      want = rows(args.seed, call, summed, args.size).astype(np.float32).astype(np.float64)
      want = topk_sum(want) if algorithm == "node-topk" else want.sum(axis=0)
      err = float(np.max(np.abs(y - want)))
      tol = 1e-5 * (1 + float(np.max(np.abs(want))))
      if not err <= tol:
        bad = int(np.argmax(np.abs(y - want)))
        print(f"process {me}: MISMATCH algorithm={algorithm} call={call}: max |err| {err:.3g} > "
              f"{tol:.3g} at {bad}: got {y[bad]!r}, want {want[bad]!r}", file=sys.stderr,
              flush=True)
        return 3
      worst = max(worst, err)
    dt = (time.perf_counter() - t0) / args.calls
    print(f"process {me}: OK {algorithm} calls={args.calls} max_err={worst:.3g} "
          f"ms_per_call={dt * 1e3:.2f}", flush=True)
  jaxring.distributed.barrier("done", timeout_s=60)
  return 0


if __name__ == "__main__":
  sys.exit(main())
