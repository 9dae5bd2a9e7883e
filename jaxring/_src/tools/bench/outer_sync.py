"""``jaxring bench outer-sync``: whether DiLoCo's outer sync hides behind the inner steps, on the
emulated cluster (root), at each ``--links`` rate.

One MPI rank per device (``jaxring cluster run --transport mpi``, ``--nodes`` x
``--devices-per-node``, one compute thread each); every rank trains bench tta's GroupNorm ResNet
(``resnet_gn``) on ``--batch`` random 16x16 images a step with momentum SGD. Contenders:

* ``compute alone``: the step with no collective at all (each rank its own model);
* ``per-step pmean none`` / ``int8``: synchronous data parallel, ``jaxring.pmean`` of the
  gradients over the ranks bound as ``(local, node)`` every step (int8 on the node level);
* ``local pmean only``: the gradients averaged over ``local`` and no outer sync ever: the step
  DiLoCo would take if its outer sync cost nothing;
* ``diloco H=.. P=.. in program``: ``jaxring.diloco(every=H, fragments=P, fast_axes="local")``,
  gradients averaged over ``local``, each fragment's sync inside the step's program (XLA:CPU
  runs it in the step), each rank averaging its node's half over ``node``;
* ``diloco H=.. P=.. host d=..`` (and ``int8``): ``transfer="host", delay=d``, the same halves
  moved by a host thread over MPI during the next ``d`` steps;
* ``diloco H=.. P=.. in program topk``: the program's sync with ``--topk`` and error feedback
  (top-k wraps the whole all-reduce, so it has no host form; SparseLoCo's sparsity).

Contenders take turns of ``H`` steps each (every fragment syncs once a turn, and with the host
transfer a turn starts ``d`` steps after a send, so none is in flight across turns: ``d`` must be
below ``H / P``), ``--reps`` turns; a turn's time is the slowest rank's, after a barrier. Reported:
mean ms per step (median over turns), compute utilization (``compute alone``'s step time over the
contender's, median of the per-turn ratios), the same against ``local pmean only`` (what is left
of the outer sync's cost), the time the host transfers were waited for, and the bytes each node
put on its link per step (``tx_bytes`` of its interface, all turns' bytes over all their steps)
and how many times fewer than ``per-step pmean none``'s; the same of the bytes a row adds to
``local pmean only``'s (the bench's own per-turn coordination crosses the links too).

Example:
  sudo jaxring bench outer-sync                         # 10mbit, 100mbit and 1gbit links
  sudo jaxring bench outer-sync --links 10mbit --reps 2 --every 50
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


def names(every: int, fragments: int, delay: int) -> dict:
  """Contender name -> (kind, codec name)."""
  base = f"diloco H={every} P={fragments}"
  return {ALONE: ("alone", None), PMEAN: ("pmean", None), "per-step pmean int8": ("pmean", "int8"),
          LOCAL: ("local", None), f"{base} in program": ("program", None),
          f"{base} host d={delay}": ("host", None), f"{base} host d={delay} int8": ("host", "int8"),
          f"{base} in program topk": ("program", "topk")}


def worker(args) -> int:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                             "false intra_op_parallelism_threads=1").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jaxring
  import jaxring.distributed as jd
  from jaxring._src.tools.bench import cluster_worker
  from jaxring._src.tools.bench.models import MODELS
  from jaxring._src.transport import host_exchange

  MPI = require("mpi4py.MPI", "mpi", "jaxring bench outer-sync's ranks need MPICH and mpi4py")
  comm = MPI.COMM_WORLD
  rank, per = comm.Get_rank(), args.devices_per_node
  node, local = divmod(rank, per)
  levels = jaxring.Topology((jaxring.Level("local", per),
                             jaxring.Level("node", comm.Get_size() // per)))
  jd.bind_mpi_axis("data", comm, levels)
  jd.bind_mpi_axis("local", comm.Split(node, rank))
  jd.bind_mpi_axis("node", comm.Split(local, rank))
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  init, logits_fn = MODELS["resnet_gn"]
  params0 = init(jax.random.key(0))
  rng = np.random.default_rng(rank)
  batch = {"x": jnp.asarray(rng.standard_normal((args.batch, 16, 16, 3)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 16, args.batch), jnp.int32)}

  def loss(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, b["x"]), b["y"]).mean()

  inner = optax.sgd(0.03, momentum=0.9)
  codecs = {None: None, "int8": jaxring.codecs.int8(), "topk": jaxring.codecs.parse(args.topk)}

  def make(kind, codec):
    if kind in ("alone", "pmean"):
      tx = inner
      reduce = {"alone": lambda g: g, "pmean": lambda g: jaxring.pmean(
          g, "data", compression=None if codec is None else {"node": codecs[codec]})}[kind]
    elif kind == "local":
      tx, reduce = inner, lambda g: jaxring.pmean(g, "local")   # noqa: E731
    else:
      tx = jaxring.diloco(inner, axis="node", every=args.every, fragments=args.fragments,
                          delay=0 if kind == "program" else args.delay,
                          transfer="program" if kind == "program" else "host",
                          fast_axes="local", compression=codecs[codec])
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

  contenders = names(args.every, args.fragments, args.delay)
  steps, carries = {}, {}
  for name, (kind, codec) in contenders.items():
    steps[name], carries[name] = make(kind, codec)
    t0 = time.perf_counter()
    # aligned so that a turn holds every send and its arrival (module docstring)
    carries[name] = run(steps[name], carries[name], args.delay if kind == "host" else 1)
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
      tx[name].append(float(np.mean(comm.allgather(b1 - b0)[::per])))  # one rank per node
    if rank == 0:
      print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
          f"{n} {times[n][-1] / args.every * 1e3:.0f} ms" for n in contenders), flush=True)
  if rank == 0:
    for name, (kind, codec) in contenders.items():
      cluster_worker.emit(contender=name, kind=kind, codec=codec or "none", every=args.every,
                          fragments=args.fragments, delay=args.delay, steps=args.every,
                          turn_seconds=times[name], tx_per_turn=tx[name],
                          waited_per_turn=waited[name],
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
  common.job_args(ap, 1800, "seconds per link's job")
  return ap


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.worker:
    return worker(args)
  if args.delay < 1 or args.delay * args.fragments >= args.every:
    print(f"jaxring bench outer-sync: --delay {args.delay} must be >= 1 and below --every / "
          f"--fragments = {args.every / args.fragments:g} (a turn holds each send's arrival)",
          file=sys.stderr)
    return 2
  if common.lacks_root("outer-sync"):
    return 2
  from jaxring._src.tools.bench.cluster import _run_job
  from jaxring._src.tools.cluster import netns
  name, rows, failed = "jro", [], []
  worker_args = common.worker_argv(args, ("links", "nodes"))
  for link in filter(None, args.links.split(",")):
    if netns.load_state(name) is not None:
      netns.down(name)
    netns.up(name, args.nodes, rate=link)
    try:
      rc, recs, log = _run_job(name, args.nodes, args.devices_per_node, None, "mpi",
                               worker_args, args.timeout, worker=WORKER)
    finally:
      netns.down(name)
    if rc != 0 or not recs:
      print(f"--- link {link}: the job exited {rc}; its output:\n{log[-4000:]}", file=sys.stderr)
      failed.append(link)
      continue
    rows += rows_of(recs, link)
  common.print_table(rows, [("link", "link", "s"), ("contender", "contender", "s"),
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
