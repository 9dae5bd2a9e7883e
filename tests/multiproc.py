"""Spawning real worker processes for multi-process tests: free port, clean env, hard timeouts.

Each worker's stdout/stderr go to files (no pipe can fill up and block it); every process is the
leader of its own session so that a timeout kills it and everything it started.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from jaxring._src.tools import ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def free_port() -> int:
  """A TCP port that was free a moment ago, outside the range connections take theirs from."""
  return ports.free_port()


def clean_env(**extra: str) -> dict[str, str]:
  """This environment without the in-process test settings (device counts, JAXRING_*), plus extra.

  The in-process tests' conftest sets 8 emulated CPU devices through XLA_FLAGS; a worker must get
  exactly the devices its test asks for.
  """
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXRING_", "JAX_", "XLA_", "PMI_", "OMPI_", "SLURM_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  for name in ("JAXRING_CACHE_DIR", "JAXRING_FLIGHT_DIR", "JAX_COMPILATION_CACHE_DIR",
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):   # conftest's (temporary folders)
    if name in os.environ:
      env[name] = os.environ[name]
  extra = {k: str(v) for k, v in extra.items()}
  # the optimization level conftest chose for the tests (0 unless XLA_FLAGS named one): the
  # workers compile the same kind of programs, and at level 2 their compiles were half the
  # multi-process tests' time
  level = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if f.startswith("--xla_backend_optimization_level")]
  flags = " ".join([extra.pop("XLA_FLAGS", "")] + level).strip()
  if flags:
    env["XLA_FLAGS"] = flags
  env.update(extra)
  return env


@dataclasses.dataclass
class Finished:
  rank: int
  returncode: int | None   # None: killed by us at the timeout
  stdout: str
  stderr: str
  seconds: float   # from the start of the group to this process's end
  ended_at: float  # time.time() at its end

  @property
  def output(self) -> str:
    return self.stdout + self.stderr


def spawn(n: int, command: Callable[[int], Sequence[str]], env: Callable[[int], dict[str, str]], *,
          timeout: float, stop_early: Callable[[list[subprocess.Popen]], bool] | None = None
          ) -> list[Finished]:
  """Starts ``n`` processes, waits at most ``timeout`` s for all, kills what is left.

  Args:
    n: number of processes; process ``i`` runs ``command(i)`` with environment ``env(i)``.
    timeout: hard limit for the whole group; survivors are killed (SIGKILL, whole session).
    stop_early: polled while waiting; returning True ends the wait (the rest is killed).

  Returns:
    One :class:`Finished` per process, in rank order.
  """
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="jr-mp-") as tmp:
    procs, files, ended = [], [], {}
    try:
      for i in range(n):
        out = open(os.path.join(tmp, f"{i}.out"), "w+")
        err = open(os.path.join(tmp, f"{i}.err"), "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(list(command(i)), env=env(i), stdout=out, stderr=err,
                                      stdin=subprocess.DEVNULL, start_new_session=True))
      while len(ended) < n and time.monotonic() - start < timeout:
        for i, p in enumerate(procs):
          if i not in ended and p.poll() is not None:
            ended[i] = time.monotonic() - start
        if stop_early is not None and stop_early(procs):
          break
        time.sleep(0.05)
    finally:
      for i, p in enumerate(procs):
        if p.poll() is None:
          _kill_session(p)
    results = []
    wall_offset = time.time() - time.monotonic()
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
      out.seek(0)
      err.seek(0)
      seconds = ended.get(i, time.monotonic() - start)
      results.append(Finished(i, p.returncode if i in ended else None, out.read(), err.read(),
                              seconds, start + seconds + wall_offset))
      out.close()
      err.close()
  return results


def _kill_session(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  p.wait(timeout=10)


def report(results: list[Finished]) -> str:
  """Every process's exit status and output, for an assertion message."""
  parts = []
  for r in results:
    status = "KILLED at timeout" if r.returncode is None else f"exit {r.returncode}"
    parts.append(f"----- rank {r.rank}: {status} after {r.seconds:.1f} s\n"
                 f"[stdout]\n{r.stdout[-4000:]}\n[stderr]\n{r.stderr[-6000:]}")
  return "\n".join(parts)


def assert_all_ok(results: list[Finished]) -> None:
  bad = [r.rank for r in results if r.returncode != 0]
  assert not bad, f"ranks {bad} did not exit 0\n" + report(results)


def python_worker(script: str, *args: str) -> list[str]:
  """The command running ``tests/workers/<script>`` with this interpreter."""
  return [sys.executable, os.path.join(WORKERS, script), *args]
