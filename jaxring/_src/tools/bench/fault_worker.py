"""One process of a ``jaxring bench faults`` job (``python -m jaxring._src.tools.bench.fault_worker``).

Started with ``JAXRING_*`` variables, exactly as ``jaxring cluster run`` starts a job. Every process
builds the global mesh ``("node", "local")``, feeds each device a row drawn from
``default_rng((call, device))`` and checks each call's ``jaxring.psum`` against a float64 NumPy
sum of every row. Process ``--rank`` injects the fault of ``--case`` at call ``--at``, after
printing ``FAULT at=<unix time>``:

* ``kill`` / ``stop``: SIGKILL / SIGSTOP itself;
* ``stuck``: sleeps in Python (alive, heartbeating) instead of launching the call;
* ``plan-stuck``: plans and compiles the call (its fingerprint published), never launches it
  (use ``--at 0``: a program planned before is not planned again);
* ``absent``: never plans the call;
* ``skip`` / ``shape`` / ``codec`` / ``algorithm``: plans it differently (skips the psum before an
  all-gather, one element more, int8 compression, hierarchical instead of ring; use ``--at 0``,
  so that every process plans its program at the same call);
* ``none``: no fault (the link and packet-loss rows inject theirs from outside).

Prints ``OK calls=N`` and exits 0, or ``MISMATCH`` and exits 4; jaxring's errors are left
uncaught, as in a user's program (``jaxring.distributed`` then publishes them and exits 1). With ``--mpi`` (under ``mpirun``) every rank binds the axis ``data`` to ``MPI.COMM_WORLD`` and
runs the same calls (cases ``none``, ``kill``, ``stuck``). A checkpoint case (``--case ckpt``, one process, no job) commits step 1, then writes
step 2 with orbax's final rename replaced by a sleep, so that the parent's SIGKILL lands mid-save.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

CASES = ("none", "kill", "stop", "stuck", "plan-stuck", "absent", "skip", "shape", "codec",
         "algorithm")


def rows(call: int, devices, size: int) -> np.ndarray:
  return np.stack([np.random.default_rng((call, g)).standard_normal(size) for g in devices])


def fault_now(case: str) -> None:
  print(f"FAULT {case} at={time.time():.3f}", flush=True)


def checkpoint_state():
  """The train state the checkpoint case commits (and the bench restores into)."""
  import jax.numpy as jnp
  import optax

  import jaxring.train as jt
  rng = np.random.RandomState(0)
  params = {"big": jnp.asarray(rng.randn(512, 1024).astype(np.float32)),
            "small": jnp.asarray(rng.randn(7).astype(np.float32))}
  return jt.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, momentum=0.9))


def checkpoint_case(directory: str, expected: str) -> int:
  import jax
  from orbax.checkpoint._src.path import atomicity

  import jaxring.train as jt
  state = checkpoint_state()
  ckpt = jt.Checkpointer(directory, max_to_keep=2, async_save=False)
  ckpt.save(state, step=1)
  ckpt.wait_until_finished()
  np.savez(expected, **jax.tree.map(np.asarray, state.params))
  print("COMMITTED 1", flush=True)

  async def never_commit(self):
    print(f"FINALIZING at={time.time():.3f}", flush=True)
    time.sleep(600)
  atomicity.AtomicRenameTemporaryPath.finalize = never_commit
  state = state.replace(params=jax.tree.map(lambda p: p + 1.0, state.params), step=state.step + 1)
  ckpt.save(state, step=2)
  print("SAVED 2 (should not happen)", flush=True)
  return 1


def job(args) -> int:
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring

  me = jax.process_index()
  mesh = jaxring.distributed.process_mesh()
  per_proc, axes = mesh.shape["local"], ("node", "local")
  sharding = NamedSharding(mesh, P(axes))
  faulty = me == args.rank
  case = args.case if faulty else "none"

  def program(call: int):
    size = args.size + (1 if case == "shape" and call >= args.at else 0)
    comp = jaxring.codecs.int8() if case == "codec" and call >= args.at else None
    algorithm = "hierarchical" if case == "algorithm" and call >= args.at else "ring"
    skip = case == "skip" and call >= args.at

    def body(v):
      total = jaxring.psum(v, axes, algorithm=algorithm, compression=comp) if not skip else v
      return jaxring.all_gather(total[:, :1], axes, tiled=True, algorithm="ring"), total
    return size, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes),
                                       out_specs=(P(axes), P(axes))))

  mine = range(me * per_proc, (me + 1) * per_proc)
  everyone = range(mesh.size)
  compiled = {}
  for call in range(args.calls):
    if args.progress and call % args.progress == 0:
      print(f"process {me}: call {call}", flush=True)
    if call == args.at and case != "none":
      fault_now(case)
      if case in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if case == "kill" else signal.SIGSTOP)
      if case == "stuck" or case == "absent":
        time.sleep(10 ** 6)
    key = case in ("shape", "codec", "algorithm", "skip") and call >= args.at
    if key not in compiled:
      compiled[key] = program(call)
    size, f = compiled[key]
    local = rows(call, mine, size).astype(np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)
    if case == "plan-stuck" and call == args.at:
      f.lower(x).compile()   # planned, fingerprint published; never launched
      time.sleep(10 ** 6)
    _, total = f(x)
    y = np.asarray(total.addressable_data(0), np.float64).reshape(-1)
    want = rows(call, everyone, size).astype(np.float32).astype(np.float64).sum(axis=0)
    err = float(np.max(np.abs(y - want)))
    if not err <= 1e-5 * (1 + float(np.max(np.abs(want)))):
      print(f"process {me}: MISMATCH at call {call}: max |err| {err:.3g}", flush=True)
      return 4
  print(f"process {me}: OK calls={args.calls}", flush=True)
  jaxring.distributed.barrier("done", timeout_s=60)
  return 0


def mpi_job(args) -> int:
  """The same calls over MPI (``--mpi``, under ``mpirun``: one rank per device)."""
  import jax

  import jaxring
  import jaxring.distributed
  from jaxring._src.transport.mpi import mpi_module

  comm = mpi_module().COMM_WORLD
  me, p = comm.Get_rank(), comm.Get_size()
  jaxring.distributed.bind_mpi_axis("data", comm)   # the watchdog: JAXRING_FAILURE_TIMEOUT
  f = jax.jit(lambda v: jaxring.psum(v, "data", algorithm="ring"))
  for call in range(args.calls):
    if me == args.rank and call == args.at and args.case != "none":
      fault_now(args.case)
      if args.case == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(10 ** 6)
    y = np.asarray(f(rows(call, [me], args.size)[0].astype(np.float32)), np.float64)
    want = rows(call, range(p), args.size).astype(np.float32).astype(np.float64).sum(axis=0)
    if not np.max(np.abs(y - want)) <= 1e-5 * (1 + float(np.max(np.abs(want)))):
      print(f"rank {me}: MISMATCH at call {call}", flush=True)
      return 4
  print(f"rank {me}: OK calls={args.calls}", flush=True)
  comm.Barrier()
  return 0


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", choices=(*CASES, "ckpt"), default="none")
  ap.add_argument("--rank", type=int, default=1, help="the faulty process")
  ap.add_argument("--at", type=int, default=5, help="the call at which it misbehaves")
  ap.add_argument("--calls", type=int, default=30)
  ap.add_argument("--size", type=int, default=1003)
  ap.add_argument("--progress", type=int, default=0, help="print every N calls")
  ap.add_argument("--dir", help="ckpt: the checkpoint folder")
  ap.add_argument("--expected", help="ckpt: where the committed parameters go (.npz)")
  ap.add_argument("--mpi", action="store_true", help="run under mpirun (cases none, kill, stuck)")
  args = ap.parse_args()
  if args.mpi:
    return mpi_job(args)
  if args.case == "ckpt":
    return checkpoint_case(args.dir, args.expected)
  return job(args)


if __name__ == "__main__":
  sys.exit(main())
