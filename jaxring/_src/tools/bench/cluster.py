"""``jaxring bench cluster``: gloo, MPICH and jaxring all-reduces on the emulated cluster (root).

All contenders run in one invocation, on the same shaped links, one after the other:

* ``gloo lax.psum``: ``jax.lax.psum`` over the global (node, local) mesh; one process per node with
  ``--devices-per-node`` CPU devices, cross-process traffic through gloo;
* ``MPICH MPI_Allreduce``: mpi4py on numpy buffers, one MPI rank per device (``--transport mpi``);
* ``jaxring hierarchical <codec>``: ``jaxring.psum(..., algorithm="hierarchical",
  compression={"node": codec})`` over the same mesh as gloo, codec none / bf16 / int8 /
  topk_chunks(1%);
* ``jaxring hierarchical <codec> (MPI transport)``: the same, one MPI rank per device, the ring
  over mpi4jax (``jaxring.distributed.bind_mpi_axis``);
* ``jaxring ring <codec>``: one flat ring over all devices, in both shapes;
* ``gloo lax.psum (local, node)`` and ``jaxring default none (local, node), no profile``: the axes
  in the README's order (levels fast -> slow), lax's and jaxring's default (``auto``) with no
  calibrated profile, as on a fresh install; the MPI shape's ``jaxring default`` row likewise.
  Their ratio to the faster of the shape's baselines is the "never slower than lax" check;
* ``jaxring auto <codec>``: after ``jaxring.calibrate`` in the same job, with the plan it chose,
  its time against the best contender it could have been (with a 90% bootstrap interval of that
  ratio over the two rows' calls: ``common.median_ratio_interval``), and the chosen plan's own
  row against that best.

Per contender: median of the timed calls after warm-up, in ``--reps`` rounds (every contender in
turn each round, in an order of the round's own; after the first, each is called as often as
fits in 1 s, 2 to 30 times, its calls spread evenly among the others', so its median rests on
more calls:
``cluster_worker.time_rounds``), algbw (bytes per device / time),
bytes each node put on its link per call (delta of the interface's tx counter over the timed calls,
divided by the calls), the link-rate bound T_min = 2(p-1)/p * bytes * wire ratio / link rate with
p = nodes, the ratio to the faster of gloo and MPICH, and the relative L2 error of the result against
gloo's (JAX shape) or MPICH's (MPI shape). Rows ``jaxring node-ring <codec>`` time the inter-node
step alone (MPI shape): the node-level ring on the shard each rank holds after the local
reduce-scatter, all ranks at once, so that each node link carries what it carries in the whole
all-reduce and T_min is the same bound.

Example:
  sudo jaxring bench cluster --nodes 2 --reps 3
  sudo jaxring bench cluster                      # 4 nodes, 1gbit, 2 devices per node, 32 MiB
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxring._src.tools.bench import common, plots

WORKER = "jaxring._src.tools.bench.cluster_worker"
MARK = "JRB "


def _parser() -> argparse.ArgumentParser:
  from jaxring._src.codecs.base import grammar, sweep
  ap = argparse.ArgumentParser(prog="jaxring bench cluster", description=__doc__.splitlines()[0])
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--link", default="1gbit", help="tc rate of every node link (default 1gbit)")
  ap.add_argument("--devices-per-node", type=int, default=2)
  ap.add_argument("--mib", type=int, default=32, help="MiB of f32 per device (default 32)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--codecs", default=",".join(sweep()),
                  help=f"node-level codecs of the hierarchical contender, comma-separated (default "
                  f"%(default)s); spellings: {grammar()}")
  ap.add_argument("--skip", default="", help="comma list of jobs to skip: jax, mpi")
  ap.add_argument("--name", default=None,
                  help="use this existing cluster (not brought up or down); default: bring up "
                  "'jrb' and delete it afterwards")
  ap.add_argument("--quickack", action="store_true",
                  help="bring the cluster up acknowledging every TCP segment at once "
                  "(jaxring cluster up --quickack; default: Linux's delayed ACKs)")
  ap.add_argument("--bind-to", choices=("none", "core"), default="none",
                  help="the MPI job's rank placement (jaxring cluster run --bind-to)")
  ap.add_argument("--timeout", type=float, default=900, help="seconds per job (default 900)")
  ap.add_argument("--out-dir", default=None)
  return ap


def _run_job(name: str, nodes: int, procs: int, devices: int | None, transport: str,
             worker_args: list[str], timeout: float,
             worker: str = WORKER, bind: str = "none") -> tuple[int, list[dict], str]:
  cmd = [sys.executable, "-m", "jaxring", "cluster", "run", "--name", name, "--nodes", str(nodes),
         "--procs-per-node", str(procs), "--transport", transport, "--timeout", str(timeout),
         "--grace", "20", "--bind-to", bind]
  if devices is not None:
    cmd += ["--devices-per-proc", str(devices)]
  cmd += ["--", sys.executable, "-m", worker, *worker_args]
  print(f"$ {' '.join(cmd[2:])}", flush=True)
  p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     timeout=timeout + 120)
  return p.returncode, parse_records(p.stdout), p.stdout


def parse_records(text: str) -> list[dict]:
  """Every ``JRB {json}`` in a job's output, also where ranks' writes were interleaved.

  Example:
    >>> parse_records('[2] JRB {"a": 1}[4] JRB {"a": 2}\\n[0] \\n')
    [{'a': 1}, {'a': 2}]
  """
  dec, recs, i = json.JSONDecoder(), [], text.find(MARK)
  while i >= 0:
    try:
      rec, end = dec.raw_decode(text, i + len(MARK))
      recs.append(rec)
    except json.JSONDecodeError:
      end = i + len(MARK)
    i = text.find(MARK, end)
  return recs


def probe_rows(recs: list[dict]) -> list[dict]:
  """The small calls' link bytes (``cluster_worker.probe_link``), the mean over the nodes.

  Example:
    >>> probe_rows([{"algorithm": "xla", "codec": "none", "nbytes": 64, "tx_per_call": 900.0},
    ...             {"algorithm": "xla", "codec": "none", "nbytes": 64, "tx_per_call": 1100.0}])
    [{'algorithm': 'xla', 'codec': 'none', 'nbytes': 64, 'tx_per_call': 1000.0, 'nodes': 2}]
  """
  by: dict[tuple, list[float]] = {}
  for r in recs:
    by.setdefault((r["algorithm"], r["codec"], r["nbytes"]), []).append(r["tx_per_call"])
  return [{"algorithm": a, "codec": c, "nbytes": n, "tx_per_call": sum(v) / len(v),
           "nodes": len(v)} for (a, c, n), v in by.items()]


def _wire_ratio(codec_name: str) -> float:
  """The codec's own wire-size arithmetic (``compression_ratio`` of its ``wire_bytes``)."""
  import jax.numpy as jnp

  from jaxring import codecs
  codec = codecs.parse(codec_name)
  return 1.0 if codec is None else float(codec.compression_ratio(jnp.float32, 1 << 23))


def _row_of_choice(rows: list[dict], auto: dict) -> dict | None:
  """The contender row running the plan ``auto`` chose, in its job and mode (None: not timed)."""
  mpi = "(MPI transport)" in auto["contender"]
  vma = " (check_vma=False)" if "check_vma=False" in auto["contender"] else ""
  if auto.get("plan") == "xla":
    want = "MPICH MPI_Allreduce" if mpi else "gloo lax.psum"
  else:
    want = (f"jaxring {auto.get('plan')} {auto['codec']}"
            + (" (MPI transport)" if mpi else vma))
  return next((o for o in rows if o.get("contender") == want and o.get("job") == auto["job"]
               and "ms" in o), None)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if common.lacks_root("cluster"):
    return 2
  from jaxring._src import cost_model
  from jaxring._src.tools.cluster import netns

  name = args.name or "jrb"
  own = args.name is None
  skip = set(filter(None, args.skip.split(",")))
  worker_common = ["--mib", str(args.mib), "--reps", str(args.reps), "--warmup", str(args.warmup)]
  logs: dict[str, str] = {}
  recs: list[dict] = []
  rcs: dict[str, int] = {}
  try:
    if own:
      if netns.load_state(name) is not None:
        netns.down(name)
      state = netns.up(name, args.nodes, rate=args.link, quickack=args.quickack)
    else:
      state = netns.load_state(name)
      if state is None:
        print(f"jaxring bench cluster: cluster {name!r} is not up", file=sys.stderr)
        return 2
    nodes = min(args.nodes, state.nodes)
    if "mpi" not in skip:
      rc, r, log = _run_job(name, nodes, args.devices_per_node, None, "mpi",
                            ["--mode", "mpi", "--procs-per-node", str(args.devices_per_node),
                             "--codecs", args.codecs, *worker_common], args.timeout,
                            bind=args.bind_to)
      rcs["mpi"], logs["mpi"] = rc, log
      recs += [dict(x, job="mpi") for x in r]
    if "jax" not in skip:
      rc, r, log = _run_job(name, nodes, 1, args.devices_per_node, "jax",
                            ["--mode", "jax", "--codecs", args.codecs, *worker_common],
                            args.timeout)
      rcs["jax"], logs["jax"] = rc, log
      recs += [dict(x, job="jax") for x in r]
    bandwidth = state.bandwidth
    link_rate, quickack = state.rate, state.quickack
  finally:
    if own:
      deleted = netns.down(name)
      print(f"cluster {name!r}: deleted {len(deleted)} objects", flush=True)

  for job, rc in rcs.items():
    if not any(r.get("job") == job for r in recs):
      print(f"--- job {job} (exit {rc}) reported no results; its output:\n" + logs[job][-4000:],
            file=sys.stderr)
      rcs[job] = rc or 1
    elif rc != 0:
      print(f"--- job {job} exited {rc}; last output:\n" + "\n".join(logs[job].splitlines()[-30:]),
            file=sys.stderr)

  nbytes = args.mib * (1 << 20)
  calibration = [r for r in recs if r.get("calibration")]
  link_probe = probe_rows([r for r in recs if r.get("probe")])
  recs = [r for r in recs if not r.get("calibration") and not r.get("probe")]
  order: list[str] = []
  by: dict[str, list[dict]] = {}
  for r in recs:
    if r["contender"] not in by:
      order.append(r["contender"])
    by.setdefault(r["contender"], []).append(r)
  rows = []
  for label in order:
    rs = sorted(by[label], key=lambda r: r["node"])
    err = next((r["error"] for r in rs if "error" in r), None)
    if err:
      rows.append({"contender": label, "error": err})
      continue
    r0 = rs[0]
    codec = label.split()[2] if label.startswith("jaxring") else "none"
    ratio = _wire_ratio(codec)
    tx = [r["tx_per_call"] for r in rs]
    rows.append({
        "contender": label, "ms": r0["median"] * 1e3,
        "ms_max_node": max(r["median"] for r in rs) * 1e3,
        "algbw": nbytes / r0["median"] / 1e9,
        "tx_mib": sum(tx) / len(tx) / (1 << 20), "tx_mib_max": max(tx) / (1 << 20),
        "wire_ratio": ratio,
        "t_min_ms": cost_model.link_bound(nbytes, nodes, bandwidth, ratio) * 1e3,
        "rel_err": r0.get("rel_err"), "times_ms": [t * 1e3 for t in r0["times"]],
        "nodes_reported": len(rs), "plan": r0.get("plan"), "codec": codec, "job": r0.get("job")})
  base_rows = [r for r in rows if "ms" in r and not r["contender"].startswith("jaxring")]
  base = [r["ms"] for r in base_rows]
  for r in rows:
    if "ms" in r:
      r["vs_best_baseline"] = r["ms"] / min(base) if base else None
      r["vs_t_min"] = r["ms"] / r["t_min_ms"] if r["t_min_ms"] else None
      if " default " in r["contender"]:   # the fresh install's call against the job's own baseline
        own = [o["ms"] for o in base_rows if o["job"] == r["job"]]
        r["default_vs_native"] = r["ms"] / min(own) if own else None
      # auto against every contender it could have been: the baselines when lossless, and every
      # jaxring plan of the same codec, in either check_vma mode (they compile the same program)
      if " auto " in r["contender"]:
        rivals = [o for o in rows if "ms" in o and o is not r and o["job"] == r["job"]
                  and "node-ring" not in o["contender"] and " auto " not in o["contender"]
                  and (o["codec"] == r["codec"] or (r["codec"] == "none" and o in base_rows))]
        best = min(rivals, key=lambda o: o["ms"]) if rivals else None
        r["auto_vs_best"] = r["ms"] / best["ms"] if best else None
        if best:   # whether the ratio is told apart from 1 by the calls behind the two medians
          r["auto_vs_best_90"] = common.median_ratio_interval(r["times_ms"], best["times_ms"])
          r["auto_vs_best_90_text"] = "%.3f-%.3f" % r["auto_vs_best_90"]
        # the same question without timing auto's program a second time: the row of the plan it
        # chose (where there is one) against the best row (on a loaded machine two timings of one
        # program differ by more than the plans do)
        same = _row_of_choice(rows, r)
        r["choice_vs_best"] = same["ms"] / best["ms"] if same and best else None

  acks = "ACKs at once" if quickack else "delayed ACKs"
  bound = "MPI ranks bound to cores" if args.bind_to == "core" else "MPI ranks unbound"
  print(f"\nall-reduce of {args.mib} MiB f32 per device, {nodes} nodes x {args.devices_per_node} "
        f"devices, links {link_rate} ({bandwidth * 8 / 1e9:.2f} Gbit/s, {acks}), {bound}, median "
        f"over {args.reps} rounds after {args.warmup} warm-up, allocator {common.allocator()}")
  common.print_table([r for r in rows if "ms" in r], [
      ("contender", "contender", ""), ("ms", "median ms", ".1f"), ("algbw", "algbw GB/s", ".3f"),
      ("tx_mib", "MiB/node link/call", ".2f"), ("wire_ratio", "wire", ".3f"),
      ("t_min_ms", "T_min ms", ".1f"), ("vs_t_min", "T/T_min", ".2f"),
      ("vs_best_baseline", "vs best(gloo,MPI)", ".3f"),
      ("default_vs_native", "default vs its shape's best", ".3f"), ("plan", "auto chose", ""),
      ("auto_vs_best", "auto vs best", ".3f"), ("auto_vs_best_90_text", "its 90% interval", ""),
      ("choice_vs_best", "its plan's row vs best", ".3f"),
      ("rel_err", "rel err", ".1e")])
  if link_probe:
    print("link bytes per call of small all-reduces (JAX shape; node link, mean of the nodes):")
    common.print_table(link_probe, [("algorithm", "algorithm", ""), ("codec", "codec", ""),
                                    ("nbytes", "bytes per device", "d"),
                                    ("tx_per_call", "link bytes per call", ".0f")])
  for job in dict.fromkeys(c.get("job") for c in calibration):
    took = max(c["seconds"] for c in calibration if c.get("job") == job)
    print(f"calibration ({job} job, jaxring.calibrate before the auto rows): {took:.1f} s")
  for r in rows:
    if "error" in r:
      print(f"{r['contender']}: ERROR {r['error']}")
  import jax
  payload = {"bench": "cluster", "args": vars(args), "nodes": nodes, "link": link_rate,
             "quickack": quickack,
             "bandwidth_bytes_per_s": bandwidth, "bytes_per_device": nbytes,
             "allocator": common.allocator(), "jax": jax.__version__, "cpu_count": os.cpu_count(),
             "calibration": calibration, "link_probe": link_probe,
             "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "job_exit": rcs, "rows": rows,
             "raw": recs,
             "log_tails": {k: v[-4000:] for k, v in logs.items()}}
  path = common.write_json("cluster", payload, args.out_dir)
  print(f"wrote {path}")
  png = plots.cluster(payload, path[:-5] + ".png")
  print(f"wrote {png}" if png else plots.NO_MATPLOTLIB)
  ok = rows and all("ms" in r for r in rows) and all(rc == 0 for rc in rcs.values())
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
