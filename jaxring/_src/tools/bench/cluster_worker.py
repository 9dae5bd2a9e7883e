"""Worker of ``jaxring bench cluster``: runs inside every process of a job on the emulated cluster.

``--mode jax``: one process per node (``jaxring cluster run --procs-per-node 1
--devices-per-proc D``); times ``lax.psum`` (gloo) over the global (node, local) mesh and jaxring's
``hierarchical`` all-reduce, uncompressed and with a codec on the node level, the uncompressed
ring, and ``auto`` after ``jaxring.calibrate`` has measured the plans in this job (its time and
the plan ``auto`` chose are reported).
``--mode mpi``: one MPI rank per device (``--transport mpi``); times ``MPI_Allreduce`` (mpi4py,
numpy buffers), then jaxring's hierarchical all-reduce over the MPI transport (mpi4jax) with each
codec of ``--codecs`` on the node level (its error against MPICH's result), then each codec's
inter-node step alone (the node-level ring on the shard left by the local reduce-scatter), and
``auto`` after calibrating over the MPI transport.

Each contender: ``--warmup`` calls, then ``--reps`` individually timed calls. Around the timed calls
the node's link counter (``/sys/class/net/<iface>/statistics/tx_bytes`` inside the node's
namespace) is read by one process per node. Results are printed as lines ``JRB <json>``: one per
(contender, node) with that node's tx bytes, and the times measured by that process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

MARK = "JRB "


def tx_bytes(interface: str) -> int:
  with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
    return int(f.read())


def emit(**rec) -> None:
  # one write: hydra's -prepend-rank tags each write, and print() writes the newline separately
  sys.stdout.write(MARK + json.dumps(rec) + "\n")
  sys.stdout.flush()


def run_jax(args) -> int:
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring

  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  me = jax.process_index()
  mesh = jaxring.distributed.process_mesh()
  per_proc = mesh.shape["local"]
  axes = ("node", "local")
  n = args.mib * (1 << 20) // 4
  sharding = NamedSharding(mesh, P(axes))
  rng = np.random.default_rng(me)
  local = rng.standard_normal((per_proc, n), dtype=np.float32)
  x = jax.make_array_from_process_local_data(sharding, local)
  del local

  def reducer(kind, codec_name):
    check_vma = not kind.endswith("/check_vma=False")
    kind = kind.split("/")[0]
    if kind == "gloo":
      body = lambda v: jax.lax.psum(v, axes)
    else:
      codec = jaxring.codecs.parse(codec_name)
      comp = None if codec is None else {"node": codec}
      body = lambda v: jaxring.psum(v, axes, algorithm=kind, compression=comp)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(),
                                 check_vma=check_vma))

  codecs = [c for c in args.codecs.split(",") if c]
  contenders = [("gloo lax.psum", "gloo", "none")] + [
      (f"jaxring {a} {c}", a, c) for a in args.algorithms.split(",") for c in codecs
      if a != "ring" or c == "none"]
  # check_vma=False (train_step's mode, and pmap's): the all-gather back over the in-process
  # level may run in shared memory too, nothing having to be typed invariant
  contenders += [(f"jaxring hierarchical {c} (check_vma=False)", "hierarchical/check_vma=False",
                  c) for c in codecs if "hierarchical" in args.algorithms.split(",")]
  plans = {}
  if args.auto:
    # auto's choice comes from a profile measured here, in this job, like a user's first run
    t0 = time.perf_counter()
    profile = jaxring.calibrate(mesh, axes, reuse=False, codecs=codecs)
    emit(calibration=True, node=me, seconds=time.perf_counter() - t0,
         profile=json.loads(profile.to_json()))
    from jaxring._src.calibrate import choices
    picks = choices(profile, [n * 4], codecs)[n * 4]
    plans.update({f"jaxring auto {c}": picks[c] for c in codecs})
    contenders += [(f"jaxring auto {c}", "auto", c) for c in codecs]
  ref = None
  for label, kind, codec_name in contenders:
    try:
      f = reducer(kind, codec_name)
      t0 = time.perf_counter()
      y = f(x)
      jax.block_until_ready(y)
      compile_s = time.perf_counter() - t0
      got = np.asarray(y.addressable_data(0), np.float64).reshape(-1)
      first = got[:4].tolist()
      if ref is None:   # gloo lax.psum runs first: the reference of the others
        ref = got
      rel_err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      del y, got
      for _ in range(max(0, args.warmup - 1)):
        jax.block_until_ready(f(x))
      jaxring.distributed.barrier(f"pre-{label}", timeout_s=300)
      b0 = tx_bytes(iface)
      times = []
      for _ in range(args.reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
      b1 = tx_bytes(iface)
      jaxring.distributed.barrier(f"post-{label}", timeout_s=300)
      emit(contender=label, node=me, rank=me, times=times, median=statistics.median(times),
           tx_per_call=(b1 - b0) / args.reps, first_call_s=compile_s, head=first,
           rel_err=rel_err, plan=plans.get(label))
    except Exception as exc:  # noqa: BLE001 - report and go on with the next contender
      emit(contender=label, node=me, rank=me, error=f"{type(exc).__name__}: {str(exc)[:500]}")
      raise
  jaxring.distributed.barrier("done", timeout_s=120)
  return 0


def run_mpi(args) -> int:
  from mpi4py import MPI
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  node = int(rank // args.procs_per_node)
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  n = args.mib * (1 << 20) // 4
  send = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
  recv = np.empty_like(send)
  _time_mpi("MPICH MPI_Allreduce", lambda: comm.Allreduce(send, recv, op=MPI.SUM), args, comm,
            iface, node, head=lambda: recv[:4].tolist())
  if args.codecs:
    _run_jaxring_mpi(args, comm, send, recv.astype(np.float64), iface, node)
  comm.Barrier()
  return 0


def _time_mpi(label, call, args, comm, iface, node, head, rel_err=None, plan=None) -> None:
  for _ in range(args.warmup):
    call()
  comm.Barrier()
  b0 = tx_bytes(iface)
  times = []
  for _ in range(args.reps):
    comm.Barrier()
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
  comm.Barrier()
  b1 = tx_bytes(iface)
  # the Barriers between calls add a few hundred bytes; negligible next to 32 MiB
  if comm.Get_rank() % args.procs_per_node == 0:
    emit(contender=label, node=node, rank=comm.Get_rank(), times=times,
         median=statistics.median(times), tx_per_call=(b1 - b0) / args.reps,
         size=comm.Get_size(), head=head(), rel_err=rel_err, plan=plan)


def _run_jaxring_mpi(args, comm, send, ref, iface, node) -> None:
  """jaxring's hierarchical all-reduce over the MPI transport, one rank per device, checked against
  MPICH's result ``ref``; then the inter-node step alone: the ring over the node level on the
  1/local share each rank holds after the local reduce-scatter, every rank of a node at once (the
  node's link carries what it carries inside the hierarchical all-reduce). The namespaces share
  one hostname, so the levels are given: ranks of a node are consecutive."""
  import jax

  import jaxring
  import jaxring.distributed
  local, nodes = args.procs_per_node, comm.Get_size() // args.procs_per_node
  node_level = jaxring.Level("node", nodes, 1e9 / 8, 1e-4, pieces=args.node_pieces)
  jaxring.distributed.bind_mpi_axis(
      "mpi", comm, jaxring.Topology((jaxring.Level("local", local), node_level)))
  ring_comm = comm.Split(comm.Get_rank() % local, comm.Get_rank())
  jaxring.distributed.bind_mpi_axis("node", ring_comm, jaxring.Topology((node_level,)))
  x = jax.device_put(send)
  shard = jax.device_put(send[: send.shape[0] // local])
  codecs = [c for c in args.codecs.split(",") if c]
  plans = {}
  if args.auto:
    from jaxring._src.calibrate import choices
    t0 = time.perf_counter()
    profile = jaxring.calibrate(axes="mpi", reuse=False, codecs=codecs)
    if comm.Get_rank() == 0:
      emit(calibration=True, node=0, seconds=time.perf_counter() - t0,
           profile=json.loads(profile.to_json()))
    plans = choices(profile, [send.nbytes], codecs)[send.nbytes]
  runs = [("hierarchical", c) for c in codecs] + [("auto", c) for c in codecs if args.auto]
  for algorithm, codec_name in runs:
    codec = jaxring.codecs.parse(codec_name)
    comp = None if codec is None else {"node": codec}
    f = jax.jit(lambda v, comp=comp, a=algorithm: jaxring.psum(v, "mpi", algorithm=a,
                                                               compression=comp))
    got = np.asarray(f(x), np.float64)  # every rank: the call is collective
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    _time_mpi(f"jaxring {algorithm} {codec_name} (MPI transport)",
              lambda f=f: jax.block_until_ready(f(x)), args, comm, iface, node,
              head=lambda got=got: got[:4].tolist(), rel_err=rel,
              plan=plans.get(codec_name) if algorithm == "auto" else None)
  for codec_name in args.codecs.split(","):
    g = jax.jit(lambda v, c=jaxring.codecs.parse(codec_name): jaxring.psum(
        v, "node", algorithm="ring", compression=c))
    jax.block_until_ready(g(shard))
    _time_mpi(f"jaxring node-ring {codec_name} (inter-node step alone, MPI transport)",
              lambda g=g: jax.block_until_ready(g(shard)), args, comm, iface, node,
              head=lambda: [])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", choices=("jax", "mpi"), required=True)
  ap.add_argument("--mib", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--codecs", default="none,bf16,int8,topk")
  ap.add_argument("--algorithms", default="hierarchical,ring",
                  help="jaxring plans timed in jax mode (ring: uncompressed only)")
  ap.add_argument("--no-auto", dest="auto", action="store_false",
                  help="jax mode: skip calibrating and timing algorithm='auto'")
  ap.add_argument("--procs-per-node", type=int, default=1)
  ap.add_argument("--node-pieces", type=int, default=1,
                  help="sub-chunks per node-level ring hop (mpi mode)")
  args = ap.parse_args(argv)
  return run_jax(args) if args.mode == "jax" else run_mpi(args)


if __name__ == "__main__":
  sys.exit(main())
