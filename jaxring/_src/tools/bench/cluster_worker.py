"""Worker of ``jaxring bench cluster``: runs inside every process of a job on the emulated cluster.

``--mode jax``: one process per node (``jaxring cluster run --procs-per-node 1
--devices-per-proc D``); times ``lax.psum`` (gloo) over the global (node, local) mesh and jaxring's
``hierarchical`` all-reduce and the flat ``ring``, uncompressed and with a codec on the node
level, and ``auto`` (also with ``check_vma=False``) after ``jaxring.calibrate`` has measured the
plans in this job (its time and the plan ``auto`` chose are reported).
``--mode mpi``: one MPI rank per device (``--transport mpi``); times ``MPI_Allreduce`` (mpi4py,
numpy buffers), then jaxring's hierarchical and ring all-reduces over the MPI transport
(mpi4jax) with each codec of ``--codecs`` on the node level (its error against MPICH's result),
then each codec's inter-node step alone (the node-level ring on the shard left by the local
reduce-scatter), and ``auto`` after calibrating over the MPI transport.

Each contender: ``--warmup`` calls; then ``--reps`` rounds, each timing every contender in turn,
a quick one several times, its calls spread among the others' (:func:`time_rounds`: load from
elsewhere on the shared cores falls on all of them alike). Around each timed call
the node's link counter (``/sys/class/net/<iface>/statistics/tx_bytes`` inside the node's
namespace) is read by one process per node. Results are printed as lines ``JRB <json>``: one per
(contender, node) with that node's tx bytes, and the times measured by that process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

from jaxring._src.extras import require
from jaxring._src.timing import call_seconds, spread
from jaxring._src.tools.bench import common

MARK = "JRB "


def tx_bytes(interface: str) -> int:
  with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
    return int(f.read())


def emit(**rec) -> None:
  # one write: hydra's -prepend-rank tags each write, and print() writes the newline separately
  sys.stdout.write(MARK + json.dumps(rec) + "\n")
  sys.stdout.flush()


#: The axes as the README writes them (levels fast -> slow): the order in which lax's replica
#: group crosses a node link at every hop. Rows with it time what a user gets without a profile.
README_AXES = ("local", "node")
README_LABEL = "(local, node)"


def uncalibrated(body):
  """``body`` traced as on a fresh install: no calibrated profile for ``auto`` to read."""
  from jaxring._src import profiles

  def traced(v):
    with profiles.use_profile(None):
      return body(v)
  return traced


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
    elif kind == "gloo-readme":
      body = lambda v: jax.lax.psum(v, README_AXES)
    elif kind == "default":
      body = uncalibrated(lambda v: jaxring.psum(v, README_AXES))
    else:
      codec = jaxring.codecs.parse(codec_name)
      comp = None if codec is None else {"node": codec}
      body = lambda v: jaxring.psum(v, axes, algorithm=kind, compression=comp)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(),
                                 check_vma=check_vma))

  codecs = [c for c in args.codecs.split(",") if c]
  contenders = [("gloo lax.psum", "gloo", "none"),
                 (f"gloo lax.psum {README_LABEL}", "gloo-readme", "none"),
                 (f"jaxring default none {README_LABEL}, no profile", "default", "none")] + [
      (f"jaxring {a} {c}", a, c) for a in args.algorithms.split(",") for c in codecs]
  # check_vma=False (train_step's mode, and pmap's): the same program as check_vma=True since
  # the in-process gather types its result invariant; kept as a check that they time alike
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
    plans.update({f"jaxring auto {c} (check_vma=False)": picks[c] for c in codecs})
    contenders += [(f"jaxring auto {c}", "auto", c) for c in codecs]
    contenders += [(f"jaxring auto {c} (check_vma=False)", "auto/check_vma=False", c)
                   for c in codecs]
  ref, ready, warm = None, [], {}
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
      call = lambda f=f: jax.block_until_ready(f(x))   # noqa: E731
      warm[label] = call_seconds(call, args.warmup - 1)   # in no row
      ready.append((label, call, dict(first_call_s=compile_s, head=first, rel_err=rel_err,
                                      plan=plans.get(label))))
    except Exception as exc:  # noqa: BLE001 - report, then stop: the others would wait for us
      emit(contender=label, node=me, rank=me, error=f"{type(exc).__name__}: {str(exc)[:500]}")
      raise
  barrier = lambda name: jaxring.distributed.barrier(name, timeout_s=300)

  def agree(values):   # each value's largest over the processes
    from jax.experimental import multihost_utils
    return np.max(np.asarray(multihost_utils.process_allgather(np.asarray(values))), axis=0)

  for label, times, tx, extra in time_rounds(ready, args, barrier, iface, agree, warm):
    emit(contender=label, node=me, rank=me, times=times, median=statistics.median(times),
         tx_per_call=tx, **extra)
  sizes = [common.parse_size(s) for s in args.probe_sizes.split(",") if s]
  # top-k is the native all-reduce plus a dense plan: the model composes it from those
  dense = [c for c in codecs if getattr(jaxring.codecs.parse(c), "per_hop", True)]
  for algorithm, codec_name, nbytes, tx in probe_link(mesh, axes, sizes, dense,
                                                      args.algorithms.split(","), barrier, iface):
    emit(probe=True, node=me, algorithm=algorithm, codec=codec_name, nbytes=nbytes,
         tx_per_call=tx)
  jaxring.distributed.barrier("done", timeout_s=120)
  return 0


def probe_link(mesh, axes, sizes, codecs, algorithms, barrier, iface, calls: int = 5):
  """Bytes this node puts on its link per call of small all-reduces, beyond what the timed rows
  show at 32 MiB: every call costs link bytes of its own (gloo's messages), which at a slow
  link rate and with many small reductions a step (one per gradient tensor) decide the step
  time. Yields ``(algorithm, codec, bytes per device, tx bytes per call)``; ``xla`` is
  ``lax.psum`` (gloo)."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  plans = [("xla", "none")] + [(a, c) for a in algorithms for c in codecs]
  per_proc = mesh.shape["local"]
  for algorithm, codec_name in plans:
    codec = jaxring.codecs.parse(codec_name)
    comp = None if codec is None else {"node": codec}
    body = ((lambda v: jax.lax.psum(v, axes)) if algorithm == "xla" else
            (lambda v, a=algorithm, c=comp: jaxring.psum(v, axes, algorithm=a, compression=c)))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P()))
    for nbytes in sizes:
      x = jax.make_array_from_process_local_data(
          NamedSharding(mesh, P(axes)), np.ones((per_proc, max(1, nbytes // 4)), np.float32))
      jax.block_until_ready(f(x))
      barrier(f"probe-{algorithm}-{codec_name}-{nbytes}")
      b0 = tx_bytes(iface)
      for _ in range(calls):
        jax.block_until_ready(f(x))
      yield algorithm, codec_name, nbytes, (tx_bytes(iface) - b0) / calls


#: Seconds of calls a contender gets per round after the first, at most MAX_CALLS_PER_ROUND: a
#: quick one is called several times a round, so that its median rests on more calls. Top-k's
#: calls at 32 MiB (~30 ms) spread over 25-34 ms between quartiles on the emulated cluster: with
#: 41 calls a row, rows of one compiled program differed by up to 15%; the median's error shrinks
#: as the square root of the calls (docs/benchmarks.md, "Multi-node all-reduce on the emulated
#: cluster").
ROUND_BUDGET_S = 1.0
MAX_CALLS_PER_ROUND = 30
#: Calls a contender gets per round after the first, at least: a call over ROUND_BUDGET_S / 2
#: (MPICH's all-reduce, the uncompressed plans) would otherwise have one a round. MPICH's calls
#: at 32 MiB fall in two groups (209 calls over 41 runs: quartiles 731-887 ms, most at 680-800
#: and 840-960), and a median of 5 could land in the upper one: the calibration's point was
#: 15-26% below the row in 11 of those runs (docs/design.md, "Investigations").
MIN_CALLS_PER_ROUND = 2


def round_order(n: int, r: int) -> list[int]:
  """The order contenders are called in round ``r``: a permutation drawn from ``r`` alone, so
  the same on every process (the calls are collective), and different from round to round, so
  that no contender always follows the same one (a slow neighbour's after-effects, the drift of
  load through a round) and rows of one program differ only by chance.

  Example:
    >>> round_order(4, 1) == round_order(4, 1) and sorted(round_order(4, 1)) == [0, 1, 2, 3]
    True
  """
  return random.Random(r).sample(range(n), n)


def time_rounds(ready, args, barrier, iface, agree=None, warm=None):
  """Times every contender once per round, ``--reps`` rounds, so that all of them see the same
  machine: load that comes and goes (the 2 cores are shared) spreads over every contender instead
  of falling on whichever ran then, and ``auto`` is compared with its rivals under equal terms.
  Each round calls the contenders in its own order (:func:`round_order`), a contender's calls
  spread evenly among the others' (``jaxring._src.timing.spread``, as calibration times its plans).
  ``agree(times) -> the largest of each over every process``: after the first round a contender
  is called as often as fits in :data:`ROUND_BUDGET_S` per round (at least
  :data:`MIN_CALLS_PER_ROUND`, at most :data:`MAX_CALLS_PER_ROUND`; the same count on every
  process, the calls being collective), its time per call the quickest of its first round's call
  and its warm-up calls (``warm[label]``, seconds): one slow call must not cost a row most of its
  calls (in the MPI shape `auto`'s top-k row once got 9 calls against the other rows' 101, after
  a first timed call of 352 ms where the others took 22-48).
  Yields (label, times, tx bytes per call, extra) per contender, in the order given."""
  times = {label: [] for label, _, _ in ready}
  tx = dict.fromkeys(times, 0)
  calls = dict.fromkeys(times, 1)
  for r in range(args.reps):
    # a quick contender's calls are spread over the round, not made in a row: a slow phase of
    # the machine (on the emulated cluster, MPI-shape top-k calls ran at 75 ms instead of 22 for
    # a second at a time) then falls on every contender alike
    made = [0] * len(ready)
    for k in spread([calls[label] for label, _, _ in ready], round_order(len(ready), r)):
      label, call, _ = ready[k]
      barrier(f"r{r}-{k}-{made[k]}")
      made[k] += 1
      b0 = tx_bytes(iface)
      t = time.perf_counter()
      call()
      times[label].append(time.perf_counter() - t)
      tx[label] += tx_bytes(iface) - b0
    if r == 0 and agree is not None:
      slowest = agree([min([times[label][0], *(warm or {}).get(label, ())]) for label in times])
      calls = {label: min(MAX_CALLS_PER_ROUND, max(MIN_CALLS_PER_ROUND,
                                                  int(ROUND_BUDGET_S / max(t, 1e-6) + 1e-9)))
               for label, t in zip(times, slowest)}
  for label, _, extra in ready:
    yield label, times[label], tx[label] / len(times[label]), extra


def run_mpi(args) -> int:
  MPI = require("mpi4py.MPI", "mpi", "jaxring bench cluster's MPI ranks need MPICH and mpi4py")
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  node = int(rank // args.procs_per_node)
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  n = args.mib * (1 << 20) // 4
  send = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
  recv = np.empty_like(send)
  mpich = ("MPICH MPI_Allreduce", lambda: comm.Allreduce(send, recv, op=MPI.SUM),
           dict(head=lambda: recv[:4].tolist()))
  comm.Allreduce(send, recv, op=MPI.SUM)
  ready = [mpich]
  if args.codecs:
    ready += _jaxring_mpi(args, comm, send, recv.astype(np.float64))
  _time_mpi(ready, args, comm, iface, node)
  comm.Barrier()
  return 0


def _time_mpi(ready, args, comm, iface, node) -> None:
  """Times the contenders ``(label, call, extra)`` in rounds (:func:`time_rounds`); one rank per
  node reports its node's link bytes."""
  warm = {label: call_seconds(call, args.warmup) for label, call, _ in ready}   # in no row
  # the Barriers between calls add a few hundred bytes; negligible next to 32 MiB
  agree = lambda values: np.max(comm.allgather(np.asarray(values)), axis=0)   # noqa: E731
  for label, times, tx, extra in time_rounds(ready, args, lambda name: comm.Barrier(), iface,
                                             agree, warm):
    if comm.Get_rank() % args.procs_per_node == 0:
      emit(contender=label, node=node, rank=comm.Get_rank(), times=times,
           median=statistics.median(times), tx_per_call=tx, size=comm.Get_size(),
           **{k: (v() if callable(v) else v) for k, v in extra.items()})


def _jaxring_mpi(args, comm, send, ref) -> list:
  """jaxring's hierarchical all-reduce over the MPI transport, one rank per device, checked against
  MPICH's result ``ref``; then the inter-node step alone: the ring over the node level on the
  1/local share each rank holds after the local reduce-scatter, every rank of a node at once (the
  node's link carries what it carries inside the hierarchical all-reduce). The namespaces share
  one hostname, so the levels are given: ranks of a node are consecutive. Returns the contenders
  ``(label, call, extra)``, compiled and checked, for :func:`_time_mpi`."""
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
  runs = [("default", "none")] + [(a, c) for a in args.algorithms.split(",") for c in codecs]
  runs += [("auto", c) for c in codecs if args.auto]
  ready = []
  for algorithm, codec_name in runs:
    codec = jaxring.codecs.parse(codec_name)
    comp = None if codec is None else {"node": codec}
    body = (lambda v, comp=comp, a=algorithm: jaxring.psum(v, "mpi", algorithm=a,
                                                           compression=comp))
    if algorithm == "default":   # the README's call on a fresh install (one axis name here)
      body = uncalibrated(lambda v: jaxring.psum(v, "mpi"))
    f = jax.jit(body)
    got = np.asarray(f(x), np.float64)  # every rank: the call is collective
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    # the codec is the label's third word (bench cluster reads it there)
    label = ("jaxring default none (no profile, MPI transport)" if algorithm == "default" else
             f"jaxring {algorithm} {codec_name} (MPI transport)")
    ready.append((label,
                  lambda f=f: jax.block_until_ready(f(x)),
                  dict(head=got[:4].tolist(), rel_err=rel,
                       plan=plans.get(codec_name) if algorithm == "auto" else None)))
  for codec_name in codecs:
    g = jax.jit(lambda v, c=jaxring.codecs.parse(codec_name): jaxring.psum(
        v, "node", algorithm="ring", compression=c))
    jax.block_until_ready(g(shard))
    ready.append((f"jaxring node-ring {codec_name} (inter-node step alone, MPI transport)",
                  lambda g=g: jax.block_until_ready(g(shard)), dict(head=[])))
  return ready


def main(argv=None) -> int:
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", choices=("jax", "mpi"), required=True)
  ap.add_argument("--mib", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--codecs", default=",".join(sweep()),
                  help=f"node-level codecs, comma-separated (default %(default)s); "
                  f"spellings: {grammar()}")
  ap.add_argument("--algorithms", default="hierarchical,ring",
                  help="jaxring plans timed, each with every codec (both modes)")
  ap.add_argument("--no-auto", dest="auto", action="store_false",
                  help="jax mode: skip calibrating and timing algorithm='auto'")
  ap.add_argument("--procs-per-node", type=int, default=1)
  ap.add_argument("--probe-sizes", default="4,64,1KiB,16KiB,256KiB",
                  help="jax mode: bytes per device of the small calls whose link bytes are "
                  "counted (empty: none)")
  ap.add_argument("--node-pieces", type=int, default=1,
                  help="sub-chunks per node-level ring hop (mpi mode)")
  args = ap.parse_args(argv)
  return run_jax(args) if args.mode == "jax" else run_mpi(args)


if __name__ == "__main__":
  sys.exit(main())
