"""``jaxring bench faults``: every fault of docs/reliability.md's matrix, injected for real, timed.

Each row starts a real job (processes on localhost through ``jax.distributed``, or ``mpirun``, or
``jaxring cluster run`` on an emulated cluster created here and deleted at the end), injects its
fault (``bench/fault_worker.py`` documents the cases; links are cut and packets dropped from here),
and checks the outcome the row promises: the job **completes** with every call matching a float64
NumPy sum, or every live process **ends non-zero naming** the culprit (or raising the named error).
Detection time is from the fault (the worker prints its time) to the last expected process's end.
A row passes when its outcome holds and detection took at most the failure timeout + 10 s.

    jaxring bench faults                      # every row this machine can run
    jaxring bench faults --only stuck,skip    # rows whose name contains one of the words

Rows that need root (network namespaces), ``iptables`` with the ``statistic`` match (packet loss)
or ``mpirun`` are skipped, with the reason, where these are missing.
"""
from __future__ import annotations

import argparse
import os
import re
import time

from jaxring._src.tools.bench import common, fault_scenarios

SLACK_S = 10.0


def judge(row: dict, procs: list, fault_at: float | None, timeout: float) -> dict:
  """The row's outcome: whether every expectation held, and detection time."""
  expect = row["expect"]        # rank -> (exit predicate name, regex or None)
  problems = []
  for rank, (status, pattern) in expect.items():
    p = procs[rank]
    if status == "ok" and p.returncode != 0:
      problems.append(f"process {rank} exited {p.returncode}, expected 0")
    if status == "fail" and p.returncode in (0, None):
      problems.append(f"process {rank} {'still ran' if p.returncode is None else 'exited 0'}")
    if pattern and not re.search(pattern, p.output):
      problems.append(f"process {rank} did not print /{pattern}/")
  ends = [procs[r].ended_at for r in expect]
  detection = (max(ends) - fault_at) if fault_at is not None and not row.get("completes") else None
  named = [procs[r].named_at for r in expect if procs[r].named_at is not None]
  if detection is not None and named:   # a job under one launcher: when it first named someone
    detection = max(named) - fault_at
  if detection is not None and detection > timeout + SLACK_S:
    problems.append(f"detection took {detection:.1f} s > timeout {timeout:g} + {SLACK_S:g} s")
  if fault_at is None and not row.get("completes") and not row.get("no_fault_time"):
    problems.append("the fault was never injected")
  return {"passed": not problems, "detection_s": detection, "problems": problems}


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring bench faults", description=__doc__.splitlines()[0])
  ap.add_argument("--failure-timeout", type=float, default=5.0,
                  help="JAXRING_FAILURE_TIMEOUT of every job (default 5 s)")
  ap.add_argument("--only", default="", help="comma list: run rows whose name has one of these")
  ap.add_argument("--skip", default="", help="comma list: skip rows whose name has one of these")
  ap.add_argument("--out-dir", default=None)
  return ap


def _wanted(name: str, only: list[str], skip: list[str]) -> bool:
  return (not only or any(w in name for w in only)) and not any(w in name for w in skip)


def _run_rows(rows: list[dict], only, skip, timeout: float, results: list) -> None:
  for row in rows:
    if not _wanted(row["name"], only, skip):
      continue
    why_not = row.get("requires", lambda: None)()
    if why_not:
      results.append({"name": row["name"], "outcome": "skipped: " + why_not, "passed": None,
                      "detection_s": None, "seconds": 0.0})
      print(f"-- {row['name']}: skipped ({why_not})", flush=True)
      continue
    print(f"-- {row['name']} ...", flush=True)
    t0 = time.monotonic()
    try:
      procs, fault_at = row["run"]()
      verdict = judge(row, procs, fault_at, timeout)
      extra = row.get("check", lambda procs: [])(procs)
      verdict["problems"] += extra
      verdict["passed"] = verdict["passed"] and not extra
      tails = {p.rank: p.output[-3000:] for p in procs}
    except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
      verdict = {"passed": False, "detection_s": None, "problems": [f"{type(exc).__name__}: {exc}"]}
      tails = {}
    seconds = time.monotonic() - t0
    outcome = row["outcome"] if verdict["passed"] else "FAILED: " + "; ".join(verdict["problems"])
    results.append({"name": row["name"], "outcome": outcome, "passed": verdict["passed"],
                    "detection_s": verdict["detection_s"], "seconds": seconds,
                    "note": row.get("note", lambda: "")(),
                    "problems": verdict["problems"], "output_tails": tails})
    det = verdict["detection_s"]
    print(f"   {'ok' if verdict['passed'] else 'FAILED'} in {seconds:.1f} s"
          + (f", detected after {det:.1f} s" if det is not None else ""), flush=True)
    if not verdict["passed"]:
      for rank, tail in tails.items():
        print(f"   --- process {rank}:\n" + "\n".join("   " + x for x in tail.splitlines()[-15:]))



def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  only = [w for w in args.only.split(",") if w]
  skip = [w for w in args.skip.split(",") if w]
  timeout = args.failure_timeout
  results = []
  try:
    _run_rows(fault_scenarios.rows(timeout), only, skip, timeout, results)
  finally:
    fault_scenarios.cleanup()

  print(f"\nfault matrix, failure timeout {timeout:g} s (a row passes within timeout + "
        f"{SLACK_S:g} s)")
  common.print_table(results, [("name", "fault", ""), ("outcome", "outcome", ""),
                               ("detection_s", "detected after s", ".1f"),
                               ("seconds", "row s", ".0f"), ("note", "note", "")])
  import jax
  payload = {"bench": "faults", "args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "commit": common.git_commit() or "", "jax": jax.__version__,
             "cpu_count": os.cpu_count(), "kernel": os.uname().release, "rows": results}
  path = common.write_json("faults", payload, args.out_dir)
  print(f"wrote {path}")
  return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
  raise SystemExit(main())
