"""``jaxring bench outer-sync``: whether DiLoCo's outer sync hides behind the inner steps, on the
emulated cluster (root), at each ``--links`` rate, in each of ``--shapes``:

* ``jax``: one process per node (``jax.distributed`` under ``mpirun``) driving its
  ``--devices-per-node`` CPU devices, a ``("node", "local")`` mesh and ``@jaxring.train_step(
  axis_name=("node", "local"), grad_axes="local")`` (bench tta's DiLoCo contenders), ``node``
  also bound to MPI for the host transfers: how one trains on GPUs;
* ``mpi``: one MPI rank per device (``--nodes`` x ``--devices-per-node``, one compute thread
  each), the axes bound to MPI communicators, the transform called in a plain ``jax.jit`` step.

Every device trains bench tta's GroupNorm ResNet (``resnet_gn``) on ``--batch`` random 16x16
images a step with momentum SGD. Contenders:

* ``compute alone``: the step with no collective at all (each device its own model);
* ``per-step pmean none`` / ``int8``: synchronous data parallel, the gradients averaged over
  ``(local, node)`` every step (int8 on the node level);
* ``local pmean only``: the gradients averaged over ``local`` and no outer sync ever (``mpi``:
  the inner optimizer alone; ``jax``: a diloco whose sync never comes): the step DiLoCo would
  take if its outer sync cost nothing;
* ``diloco H=.. P=.. in program``: ``jaxring.diloco(every=H, fragments=P)``, gradients averaged
  over ``local``, each fragment's sync inside the step's program (XLA:CPU runs it in the step),
  each device averaging its node's half over ``node`` (the fast axes ``local``);
* ``diloco H=.. P=.. host d=..`` (and ``int8``): ``transfer="host", delay=d``, the same halves
  moved by a host thread over MPI during the next ``d`` steps;
* ``diloco H=.. P=.. in program topk``: the program's sync with ``--topk`` and error feedback
  (top-k wraps the whole all-reduce, so it has no host form; SparseLoCo's sparsity).

Contenders take turns of ``H`` steps each (every fragment syncs once a turn, and with the host
transfer a turn starts ``d`` steps after a send, so none is in flight across turns: ``d`` must be
below ``H / P``; a diloco's first turn is untimed: ``warm_steps``), ``--reps`` turns; a turn's
time is the slowest rank's, after a barrier. Reported: mean ms per step (median over turns),
compute utilization (``compute alone``'s step time over the contender's, median of the per-turn
ratios), the same against ``local pmean only`` (what is left of the outer sync's cost), the time
the host transfers were waited for (the slowest rank's: a member ahead waits at an arrival for
those behind), and the bytes each node put on its link per step (``tx_bytes`` of its interface,
all turns' bytes over all their steps) and how many times fewer than ``per-step pmean none``'s;
the same of the bytes a row adds to ``local pmean only``'s (the bench's own per-turn
coordination crosses the links too).

Example:
  sudo jaxring bench outer-sync                     # 10mbit, 100mbit and 1gbit; both shapes
  sudo jaxring bench outer-sync --links 10mbit --shapes jax --reps 2 --every 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from jaxring._src.extras import require
from jaxring._src.tools.bench import common

WORKER = "jaxring._src.tools.bench.outer_sync"
ALONE = "compute alone"
PMEAN = "per-step pmean none"
LOCAL = "local pmean only (no outer sync)"
SHAPES = ("jax", "mpi")


def names(every: int, fragments: int, delay: int) -> dict:
  """Contender name -> (kind, codec name)."""
  base = f"diloco H={every} P={fragments}"
  return {ALONE: ("alone", None), PMEAN: ("pmean", None), "per-step pmean int8": ("pmean", "int8"),
          LOCAL: ("local", None), f"{base} in program": ("program", None),
          f"{base} host d={delay}": ("host", None), f"{base} host d={delay} int8": ("host", "int8"),
          f"{base} in program topk": ("program", "topk")}


def _mpi_shape(args, comm):
  """One rank per device: ``(make, run, node_stride, params)`` of the MPI shape (module
  docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jaxring
  import jaxring.distributed as jd
  from jaxring._src.tools.bench.models import MODELS

  rank, per = comm.Get_rank(), args.devices_per_node
  node, local = divmod(rank, per)
  levels = jaxring.Topology((jaxring.Level("local", per),
                             jaxring.Level("node", comm.Get_size() // per)))
  jd.bind_mpi_axis("data", comm, levels)
  jd.bind_mpi_axis("local", comm.Split(node, rank))
  jd.bind_mpi_axis("node", comm.Split(local, rank))
  init, logits_fn = MODELS["resnet_gn"]
  params0 = init(jax.random.key(0))
  rng = np.random.default_rng(rank)
  batch = {"x": jnp.asarray(rng.standard_normal((args.batch, 16, 16, 3)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 16, args.batch), jnp.int32)}

  def loss(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, b["x"]), b["y"]).mean()

  def make(kind, codec, tx):
    if kind in ("alone", "pmean"):
      reduce = {"alone": lambda g: g, "pmean": lambda g: jaxring.pmean(
          g, "data", compression=None if codec is None else {"node": codec})}[kind]
    else:
      reduce = lambda g: jaxring.pmean(g, "local")   # noqa: E731

    @jax.jit
    def step(params, state):
      g = reduce(jax.grad(loss)(params, batch))
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    return step, (params0, tx.init(params0))

  def run(step, carry, n):
    for _ in range(n):
      carry = step(*carry)
    return jax.block_until_ready(carry)

  return make, run, per, params0


def _jax_shape(args, comm):
  """One process per node driving its ``--devices-per-node`` devices, a ``("node", "local")``
  mesh, ``@jaxring.train_step`` (bench tta's DiLoCo contenders): ``(make, run, 1, params)``."""
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring._src.tools.bench import tta
  from jaxring._src.tools.bench.models import MODELS

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.asarray(devices).reshape(jax.process_count(), -1), ("node", "local"),
              axis_types=(AxisType.Auto,) * 2)
  params0 = MODELS["resnet_gn"][0](jax.random.key(0))
  rng, n = np.random.default_rng(comm.Get_rank()), args.batch * len(jax.local_devices())
  sharded = NamedSharding(mesh, P(("node", "local")))
  batch = {k: jax.make_array_from_process_local_data(sharded, v) for k, v in (
      ("x", rng.standard_normal((n, 16, 16, 3)).astype(np.float32)),
      ("y", rng.integers(0, 16, n).astype(np.int32)))}

  def alone(state, b):   # each device its own model: no collective, not even in the process
    grads = jax.grad(tta._loss)(state.params, b, "resnet_gn")
    return state.apply_gradients(grads=grads), {}

  def make(kind, codec, tx):
    if kind == "alone":
      step = jax.jit(jax.shard_map(alone, mesh=mesh, in_specs=(P(), P(("node", "local"))),
                                   out_specs=(P(), P()), check_vma=False), donate_argnums=(0,))
    elif kind == "pmean":
      step = tta.decorated(mesh, "resnet_gn", axis_name=("node", "local"),
                           compression=None if codec is None else {"node": codec})
    else:   # local (diloco never syncing), program, host
      step = tta.decorated(mesh, "resnet_gn", axis_name=("node", "local"), grad_axes="local")
    state = jt.TrainState.create(apply_fn=None, params=params0, tx=tx)
    state = (step.prepare(state) if hasattr(step, "prepare") else
             jax.device_put(jax.tree.map(np.copy, state), NamedSharding(mesh, P())))
    return (lambda s: step(s, batch)[0]), state

  def run(step, state, n):
    for _ in range(n):   # one step in flight, as bench tta (its docstring: gloo's deadlock)
      state = jax.block_until_ready(step(state))
    return state

  return make, run, 1, params0


def warm_steps(kind: str, every: int, delay: int) -> int:
  """The untimed steps before a contender's turns: one compiles; a diloco's first ``every`` (its
  fragment ``p`` first syncs at inner step ``p * every / P + every``), so that every turn holds
  each fragment's sync, and with the host transfer ``delay`` more, so that it holds each send's
  arrival too (and the step's two programs are compiled, MPI's connections made)."""
  return {"program": every, "host": every + delay}.get(kind, 1)


def worker(args) -> int:
  flags = " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
  if args.shape == "mpi":   # one compute thread per rank
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
  else:
    import jaxring.distributed as jd
    jd.initialize()
    jd.bind_mpi_axis("node")   # COMM_WORLD: a rank per node, for the host transfers
  import jax
  import numpy as np
  import optax

  import jaxring
  from jaxring._src.tools.bench import cluster_worker
  from jaxring._src.transport import host_exchange

  MPI = require("mpi4py.MPI", "mpi", "jaxring bench outer-sync's ranks need MPICH and mpi4py")
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  make, run, stride, params0 = (_mpi_shape if args.shape == "mpi" else _jax_shape)(args, comm)
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  inner = optax.sgd(0.03, momentum=0.9)
  codecs = {None: None, "int8": jaxring.codecs.int8(), "topk": jaxring.codecs.parse(args.topk)}
  fast = "local" if args.shape == "mpi" else None   # JAX's shape: train_step's grad_axes

  def tx_of(kind, codec):
    # local: the inner optimizer (MPI's shape) or, as train_step needs one, a diloco never syncing
    if kind in ("alone", "pmean") or (kind, args.shape) == ("local", "mpi"):
      return inner
    every = 1 << 30 if kind == "local" else args.every
    return jaxring.diloco(inner, axis="node", every=every, fragments=args.fragments,
                          delay=args.delay if kind == "host" else 0,
                          transfer="host" if kind == "host" else "program", fast_axes=fast,
                          compression=codecs[codec])

  contenders = names(args.every, args.fragments, args.delay)
  steps, carries = {}, {}
  for name, (kind, codec) in contenders.items():
    steps[name], carries[name] = make(kind, codecs[codec], tx_of(kind, codec))
    t0 = time.perf_counter()
    carries[name] = run(steps[name], carries[name], warm_steps(kind, args.every, args.delay))
    comm.Barrier()
    if rank == 0:
      print(f"{name}: compiled and warmed in {time.perf_counter() - t0:.1f} s", flush=True)
  times: dict[str, list[float]] = {n: [] for n in contenders}
  tx: dict[str, list[float]] = {n: [] for n in contenders}
  waited: dict[str, list[float]] = {n: [] for n in contenders}
  for rep in range(args.reps):
    for name in contenders:
      comm.Barrier()
      w0 = host_exchange.waited_s()
      b0, t0 = cluster_worker.tx_bytes(iface), time.perf_counter()
      carries[name] = run(steps[name], carries[name], args.every)
      seconds, b1 = time.perf_counter() - t0, cluster_worker.tx_bytes(iface)
      comm.Barrier()
      times[name].append(float(max(comm.allgather(seconds))))
      waited[name].append(float(max(comm.allgather(host_exchange.waited_s() - w0))))
      tx[name].append(float(np.mean(comm.allgather(b1 - b0)[::stride])))  # one rank per node
    if rank == 0:
      print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
          f"{n} {times[n][-1] / args.every * 1e3:.0f} ms" for n in contenders), flush=True)
  if rank == 0:
    for name, (kind, codec) in contenders.items():
      cluster_worker.emit(contender=name, kind=kind, codec=codec or "none", every=args.every,
                          fragments=args.fragments, delay=args.delay, steps=args.every,
                          turn_seconds=times[name], tx_per_turn=tx[name],
                          waited_per_turn=waited[name], shape=args.shape,
                          params=int(sum(np.size(x) for x in jax.tree.leaves(params0))))
  comm.Barrier()
  return 0


def rows_of(recs: list[dict], link: str) -> list[dict]:
  """The table's rows of one link's records (module docstring)."""
  by = {r["contender"]: r for r in recs}
  alone, base = by.get(ALONE), by.get(PMEAN)
  rows = []
  for name, r in by.items():
    n = r["steps"]
    ms = statistics.median(r["turn_seconds"]) / n * 1e3
    # bytes: all turns' over all their steps (a sync is one event: which turn its bytes land
    # in depends on where the link's queue is when a turn ends)
    row = {"link": link, "contender": name, "ms_per_step": ms,
           "bytes_per_step": statistics.fmean(r["tx_per_turn"]) / n,
           "tx_per_turn": list(r["tx_per_turn"])}
    for key, ref in (("utilization", alone), ("of_local_only", by.get(LOCAL))):
      if ref is not None:
        row[key] = statistics.median(a / c for a, c in zip(ref["turn_seconds"], r["turn_seconds"]))
    row["waited_ms_per_step"] = statistics.median(r.get("waited_per_turn") or [0.0]) / n * 1e3
    if base is not None and row["bytes_per_step"] > 0:
      row["fewer_bytes"] = statistics.fmean(base["tx_per_turn"]) / n / row["bytes_per_step"]
    rows.append(row)
  return with_sync_ratios(rows)


def with_sync_ratios(rows: list[dict]) -> list[dict]:
  """Adds ``fewer_sync_bytes`` to one link's rows that sync the nodes: the bytes each adds to
  ``local pmean only``'s (the same step with no outer sync; what is left is the bench's own
  per-turn coordination), against what the per-step pmean adds to it."""
  by = {r["contender"]: r for r in rows}
  if LOCAL not in by or PMEAN not in by:
    return rows
  idle = by[LOCAL]["bytes_per_step"]
  for r in rows:
    if r["contender"] not in (ALONE, LOCAL) and r["bytes_per_step"] > idle:
      r["fewer_sync_bytes"] = (by[PMEAN]["bytes_per_step"] - idle) / (r["bytes_per_step"] - idle)
  return rows


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring bench outer-sync", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--links", default="10mbit,100mbit,1gbit", help="tc rates, comma-separated")
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--devices-per-node", type=int, default=2)
  ap.add_argument("--batch", type=int, default=16, help="images per rank and step")
  ap.add_argument("--every", type=int, default=100, help="H: inner steps between syncs")
  ap.add_argument("--fragments", type=int, default=4, help="P: streaming fragments")
  ap.add_argument("--delay", type=int, default=20, help="d: steps a host transfer may take")
  ap.add_argument("--topk", default="topk:0.01:64+bf16",
                  help="the top-k contender's codec (a node's half of a fragment holds 4.6k-7k "
                  "values: 64-value chunks let 1%% of them be chosen; their values in bf16, "
                  "the error feedback keeping the rounding)")
  ap.add_argument("--reps", type=int, default=3, help="turns of H steps per contender")
  ap.add_argument("--shapes", default="jax,mpi",
                  help="comma-separated: jax (a process per node driving its devices through "
                  "@jaxring.train_step, the node axis also bound to MPI), mpi (a rank a device)")
  ap.add_argument("--shape", choices=SHAPES, default="jax", help=argparse.SUPPRESS)   # a job's
  common.job_args(ap, 1800, "seconds per link's job")
  return ap


def job_argv(args, shape: str) -> list[str]:
  """The command line of one shape's ranks: every option but the driver's."""
  return common.worker_argv(argparse.Namespace(**{**vars(args), "shape": shape}),
                            ("links", "nodes", "shapes"))


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.worker:
    return worker(args)
  if args.delay < 1 or args.delay * args.fragments >= args.every:
    print(f"jaxring bench outer-sync: --delay {args.delay} must be >= 1 and below --every / "
          f"--fragments = {args.every / args.fragments:g} (a turn holds each send's arrival)",
          file=sys.stderr)
    return 2
  shapes = [x for x in args.shapes.split(",") if x]
  if not shapes or set(shapes) - set(SHAPES):
    print(f"jaxring bench outer-sync: --shapes takes {', '.join(SHAPES)}, got {args.shapes!r}",
          file=sys.stderr)
    return 2
  if common.lacks_root("outer-sync"):
    return 2
  from jaxring._src.tools.bench.cluster import _run_job
  from jaxring._src.tools.cluster import netns
  name, rows, failed = "jro", [], []
  for link in filter(None, args.links.split(",")):
    for shape in shapes:
      procs, devices = (args.devices_per_node, None) if shape == "mpi" else (1,
                                                                            args.devices_per_node)
      if netns.load_state(name) is not None:
        netns.down(name)
      netns.up(name, args.nodes, rate=link)   # a fresh cluster: its byte counters from 0
      try:
        rc, recs, log = _run_job(name, args.nodes, procs, devices, "mpi",
                                 job_argv(args, shape), args.timeout, worker=WORKER)
      finally:
        netns.down(name)
      if rc != 0 or not recs:
        print(f"--- link {link}, shape {shape}: the job exited {rc}; its output:\n"
              f"{log[-4000:]}", file=sys.stderr)
        failed.append(f"{link} {shape}")
        continue
      rows += [{"shape": shape, **r} for r in rows_of(recs, link)]
  common.print_table(rows, [("link", "link", "s"), ("shape", "shape", "s"),
                            ("contender", "contender", "s"),
                            ("ms_per_step", "ms/step", ".1f"),
                            ("utilization", "utilization", ".3f"),
                            ("of_local_only", "of local-only", ".3f"),
                            ("waited_ms_per_step", "waited ms/step", ".2f"),
                            ("bytes_per_step", "node link B/step", ".0f"),
                            ("fewer_bytes", "x fewer bytes", ".0f"),
                            ("fewer_sync_bytes", "x fewer, the sync's", ".0f")])
  path = common.write_json("outer-sync", {"machine": common.machine(), "args": vars(args),
                                          "rows": rows, "failed": failed}, args.out_dir)
  print(f"wrote {path}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
