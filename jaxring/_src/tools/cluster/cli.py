"""``jaxring cluster``: up / run / status / down / counters for the emulated cluster.

Example:
  sudo jaxring cluster up --nodes 4 --link 1gbit
  sudo jaxring cluster run --procs-per-node 2 --devices-per-proc 2 -- python bench.py
  sudo jaxring cluster run --transport mpi --procs-per-node 2 -- python mpi_bench.py
  sudo jaxring cluster down
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from jaxring._src.tools.cluster import launch, netns


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="jaxring cluster", description="An emulated multi-node cluster on one Linux machine: "
      "network namespaces joined by veth links shaped with tc tbf (needs root).")
  sub = ap.add_subparsers(dest="command", required=True)

  def named(p):
    p.add_argument("--name", default=netns.DEFAULT_NAME,
                   help="cluster name, jr prefix; namespaces are NAME-n<i> and NAME-br "
                   f"(default {netns.DEFAULT_NAME})")
    return p

  up = named(sub.add_parser("up", help="create K nodes and their shaped links"))
  up.add_argument("--nodes", type=int, required=True)
  up.add_argument("--link", default="1gbit", help="tc rate of every node link (default 1gbit)")
  up.add_argument("--burst", default="256kb", help="tc tbf burst (default 256kb)")
  up.add_argument("--latency", default="50ms", help="tc tbf latency (queue limit, default 50ms)")
  up.add_argument("--quickack", action="store_true",
                  help="acknowledge every TCP segment at once inside the nodes (route option "
                  "quickack; default: Linux's delayed ACKs; see docs/benchmarks.md)")
  up.add_argument("--subnet", default=netns.DEFAULT_SUBNET,
                  help="private subnet used only inside the namespaces "
                  f"(default {netns.DEFAULT_SUBNET})")

  run = named(sub.add_parser("run", help="run a command as a multi-process job: run [opts] -- CMD"))
  run.add_argument("--nodes", type=int, default=None, help="nodes to use (default: all)")
  run.add_argument("--procs-per-node", type=int, default=1)
  run.add_argument("--devices-per-proc", type=int, default=None,
                   help="CPU devices each process emulates (JAXRING_LOCAL_DEVICE_COUNT)")
  run.add_argument("--transport", choices=("jax", "mpi"), default="jax")
  run.add_argument("--timeout", type=float, default=None,
                   help="seconds; then every process is killed and the job exits 124")
  run.add_argument("--grace", type=float, default=30.0,
                   help="seconds the other ranks get after one fails (default 30)")
  run.add_argument("--failure-timeout", type=float, default=None,
                   help="seconds without a heartbeat before jaxring.distributed declares a "
                   "process dead (JAXRING_FAILURE_TIMEOUT)")
  run.add_argument("--bind-to", choices=("none", "core"), default="none",
                   help="--transport mpi: leave the ranks' placement to the scheduler (default), "
                   "or bind each rank of a node to a core of its own (hydra's -bind-to core)")
  run.add_argument("--no-prefix", action="store_true", help="do not prefix output with [rN]")
  run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

  named(sub.add_parser("down", help="delete what `up` created (idempotent)"))
  named(sub.add_parser("status", help="show what exists"))
  counters = named(sub.add_parser("counters", help="bytes sent/received on each node's link"))
  counters.add_argument("--json", action="store_true")
  return ap


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``jaxring cluster``; returns the process exit status.

  Example:
    >>> main(["status", "--name", "jr0"])  # doctest: +SKIP
    cluster 'jr0': not up (no state file /run/jaxring-cluster/jr0.json)
    0
  """
  args = _parser().parse_args(argv)
  try:
    return _dispatch(args)
  except netns.ClusterError as exc:
    print(f"jaxring cluster {args.command}: error: {exc}", file=sys.stderr)
    return 2


def _terminate(signum, frame):
  raise SystemExit(128 + signum)   # unwinds through launch.run, which kills the job's processes


def _dispatch(args) -> int:
  if args.command == "up":
    state = netns.up(args.name, args.nodes, rate=args.link, burst=args.burst,
                     latency=args.latency, subnet=args.subnet,
                     quickack=args.quickack)
    print(netns.describe(state.name))
    return 0
  if args.command == "down":
    deleted = netns.down(args.name)
    print(f"cluster {args.name!r}: deleted {', '.join(deleted)}" if deleted
          else f"cluster {args.name!r}: nothing to delete")
    return 0
  if args.command == "status":
    print(netns.describe(args.name))
    return 0
  if args.command == "counters":
    counters = netns.link_counters(args.name)
    if args.json:
      print(json.dumps(counters))
    else:
      for node, c in enumerate(counters):
        print(f"node {node}: tx {c['tx_bytes']} B, rx {c['rx_bytes']} B")
    return 0
  state = netns.load_state(args.name)
  if state is None:
    raise netns.ClusterError(f"cluster {args.name!r} is not up; run `jaxring cluster up` first")
  netns.require_privileges()
  signal.signal(signal.SIGTERM, _terminate)
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  return launch.run(state, cmd, nodes=args.nodes, procs_per_node=args.procs_per_node,
                    devices_per_proc=args.devices_per_proc, transport=args.transport,
                    timeout=args.timeout, grace=args.grace, failure_timeout=args.failure_timeout,
                    prefix=not args.no_prefix, bind=args.bind_to)
