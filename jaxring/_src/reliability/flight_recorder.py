"""A flight recorder: the last collectives this process planned, dumped when something goes wrong.

Every jaxring collective, when planned, is recorded here with its sequence number, op, axes,
shape, dtype, plan and the time (host-side, a dict in a bounded deque: ``JAXRING_FLIGHT_RECORDER``
entries, default 256, ``0`` turns it off). The record is written as JSON, one file per process
(``flight-<process>.json`` in ``JAXRING_FLIGHT_DIR``, default ``./jaxring-flight``), when the
peer watchdog gives up, on ``SIGUSR1`` (outside ``mpirun``, whose MPICH owns that signal), and on
:func:`dump` (``jaxring.distributed.dump()``).
Each dump also merges the files already in the folder into ``summary.json``, which names the
first sequence number at which the processes' records differ or one process has none.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import json
import os
import pathlib
import signal
import socket
import threading
import time

ENV_SIZE = "JAXRING_FLIGHT_RECORDER"
ENV_DIR = "JAXRING_FLIGHT_DIR"
_COMPARED = ("op", "axes", "axis_sizes", "shape", "dtype", "algorithm", "plan", "codecs")

_lock = threading.Lock()
_entries: collections.deque = collections.deque(maxlen=int(os.environ.get(ENV_SIZE) or 256))
_identity = {"process": 0, "processes": 1}


def set_identity(process: int, processes: int) -> None:
  """Which process of how many this is (set by the multi-process transports at start-up)."""
  _identity.update(process=int(process), processes=int(processes))


def record(seq: int, entry: dict) -> None:
  """Appends one planned collective (cheap: no I/O)."""
  if _entries.maxlen == 0:
    return
  with _lock:
    _entries.append({"seq": seq, "time": time.time(), **entry})


_own = itertools.count()


def next_seq() -> int:
  """A sequence number for a collective no other process compares (single-process jobs)."""
  return next(_own)


def entries() -> list[dict]:
  with _lock:
    return list(_entries)


def _folder(directory) -> pathlib.Path:
  return pathlib.Path(directory or os.environ.get(ENV_DIR) or "jaxring-flight")


def dump(directory=None, reason: str = "requested") -> pathlib.Path:
  """Writes this process's record and the merged summary; returns this process's file.

  Example:
    >>> jaxring.distributed.dump("/tmp/flight")  # doctest: +SKIP
  """
  folder = _folder(directory)
  folder.mkdir(parents=True, exist_ok=True)
  me = _identity["process"]
  path = folder / f"flight-{me}.json"
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps({"process": me, "processes": _identity["processes"],
                             "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
                             "dumped_at": time.time(), "entries": entries()}, indent=1))
  os.replace(tmp, path)
  summarize(folder)
  return path


@contextlib.contextmanager
def _folder_lock(folder: pathlib.Path):
  """Serializes the processes' summaries: each writes its own file, then merges under the lock,
  so the last merge reads every file written before it (without the lock a merge that read one
  file could overwrite a later merge that read both)."""
  with open(folder / ".lock", "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def summarize(directory) -> dict:
  """Merges the folder's ``flight-*.json`` into ``summary.json``: the first divergence."""
  folder = _folder(directory)
  with _folder_lock(folder):
    return _summarize(folder)


def _summarize(folder: pathlib.Path) -> dict:
  records = {}
  for f in sorted(folder.glob("flight-*.json")):
    try:
      d = json.loads(f.read_text())
    except ValueError:
      continue
    records[d["process"]] = {e["seq"]: e for e in d["entries"]}
  summary = {"processes": sorted(records), "first_divergence": None}
  # compare from where every process still holds its record (the deques are bounded)
  lo = max((min(r) for r in records.values() if r), default=0)
  seqs = sorted(s for s in set().union(*records.values()) if s >= lo) if records else []
  for seq in seqs:
    have = {p: r.get(seq) for p, r in records.items()}
    missing = [p for p, e in have.items() if e is None]
    views = {json.dumps({k: e.get(k) for k in _COMPARED}, sort_keys=True, default=str)
             for e in have.values() if e is not None}
    if missing or len(views) > 1:
      summary["first_divergence"] = {
          "seq": seq, "missing_on": missing,
          "by_process": {p: ({k: e.get(k) for k in _COMPARED} if e else None)
                         for p, e in have.items()}}
      break
  tmp = folder / f"summary.json.tmp{os.getpid()}"
  tmp.write_text(json.dumps(summary, indent=1, default=str))
  os.replace(tmp, folder / "summary.json")
  return summary


def install_signal_handler() -> None:
  """``kill -USR1 <pid>`` dumps the record, where nobody else handles SIGUSR1 from Python.

  Not installed for MPI: MPICH's launcher signals SIGUSR1 to the ranks left when one exits, and
  MPICH handles it in C, which Python's ``getsignal`` does not see. Under ``mpirun`` the record
  is dumped by the watchdog and by :func:`dump`.
  """
  if threading.current_thread() is not threading.main_thread():
    return
  if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
    signal.signal(signal.SIGUSR1, lambda *_: dump(reason="SIGUSR1"))
