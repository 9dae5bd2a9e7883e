"""Processes for ``jaxring bench faults``: spawned in sessions of their own, logged to files, timed.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from jaxring._src.tools import ports
from jaxring._src.tools.cluster.launch import USER_SETTINGS

WORKER = "jaxring._src.tools.bench.fault_worker"


@dataclasses.dataclass
class Proc:
  rank: int
  returncode: int | None   # None: still running when the row's hard limit killed it
  output: str
  ended_at: float          # unix time
  named_at: float | None = None   # when the first "jaxring.distributed:" line appeared, if watched


def child_env(**extra) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXRING_", "JAX_", "XLA_", "PMI_", "OMPI_")) or k in USER_SETTINGS}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.update({k: str(v) for k, v in extra.items()})
  return env


def kill_group(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  try:
    p.wait(timeout=10)
  except subprocess.TimeoutExpired:
    pass


def spawn(commands: list[list[str]], envs: list[dict], limit: float,
          done=None) -> list[Proc]:
  """Runs the processes (each its own session) until all end, ``done(procs)`` or ``limit`` s."""
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="jr-faults-") as tmp:
    logs = [open(os.path.join(tmp, f"{i}.log"), "w+") for i in range(len(commands))]
    procs = [subprocess.Popen(c, env=e, stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
             for c, e, f in zip(commands, envs, logs)]
    ended: dict[int, float] = {}
    try:
      while len(ended) < len(procs) and time.monotonic() - start < limit:
        for i, p in enumerate(procs):
          if i not in ended and p.poll() is not None:
            ended[i] = time.time()
        if done is not None and done(procs):
          break
        time.sleep(0.05)
    finally:
      for p in procs:
        if p.poll() is None:
          kill_group(p)
    out = []
    for i, (p, f) in enumerate(zip(procs, logs)):
      f.seek(0)
      out.append(Proc(i, p.returncode if i in ended else None, f.read(), ended.get(i, time.time())))
      f.close()
  return out


def local_job(n: int, devices: int, worker_args: list[str], failure_timeout: float,
              limit: float, done=None) -> list[Proc]:
  """``n`` processes of the fault worker on 127.0.0.1, ``devices`` CPU devices each."""
  port = ports.free_port()
  cmd = [sys.executable, "-m", WORKER, *worker_args]
  envs = [child_env(JAXRING_COORDINATOR=f"127.0.0.1:{port}", JAXRING_NUM_PROCESSES=n,
                    JAXRING_PROCESS_ID=i, JAXRING_LOCAL_DEVICE_COUNT=devices,
                    JAXRING_FAILURE_TIMEOUT=failure_timeout) for i in range(n)]
  return spawn([cmd] * n, envs, limit, done)


def fault_time(text: str) -> float | None:
  m = re.search(r"FAULT \S+ at=([\d.]+)", text)
  return float(m.group(1)) if m else None


