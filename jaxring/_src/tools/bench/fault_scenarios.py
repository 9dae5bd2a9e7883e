"""The rows of ``jaxring bench faults``: how each fault is injected and what must follow.

A row is a dict: ``name``; ``outcome`` (what the matrix says when it held); ``run()`` -> (processes,
fault time); ``expect``: process index -> (``"ok"`` | ``"fail"``, a regex its output must match);
optionally ``completes`` (no detection time: the job must finish correctly), ``requires()`` (why
the row cannot run here, or None) and ``check(procs)`` (more problems, a list).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import threading
import time

from jaxring._src.tools.bench.fault_jobs import (
  WORKER,
  Proc,
  child_env,
  fault_time,
  kill_group,
  local_job,
  spawn,
)

CLUSTER = "jrflt"
_cluster_up = [False]


def _named(p: int, n: int) -> str:
  return rf"process {p} of {n} \(pid \d+ on [^)]+\) died or hangs"


def _raised(kind: str) -> str:
  return rf"{kind}: jaxring: "


def _local(n: int, devices: int, timeout: float, *worker_args: str, done=None):
  def run():
    procs = local_job(n, devices, list(worker_args), timeout, limit=4 * timeout + 90, done=done)
    return procs, min(filter(None, (fault_time(p.output) for p in procs)), default=None)
  return run


def _others_done(faulty: int):
  return lambda procs: all(p.poll() is not None for i, p in enumerate(procs) if i != faulty)


# --- mpirun ----------------------------------------------------------------------------------


def _mpirun() -> str:
  here = os.path.join(os.path.dirname(sys.executable), "mpirun")
  return here if os.path.exists(here) else "mpirun"


def _mpi_missing() -> str | None:
  import shutil

  from jaxring._src.extras import install_hint
  from jaxring._src.transport.mpi import mpi4jax_module
  if not os.path.exists(_mpirun()) and shutil.which("mpirun") is None:
    return f"no mpirun ({install_hint('mpi')})"
  try:
    mpi4jax_module()
  except ImportError as exc:
    return str(exc)
  return None


def _mpi_job(n: int, timeout: float, *worker_args: str):
  def run():
    # -disable-auto-cleanup: hydra leaves every rank to end by itself (else it kills the rest as
    # soon as one exits, and which one names the culprit is a race)
    cmd = [_mpirun(), "-disable-auto-cleanup", "-n", str(n), sys.executable, "-m", WORKER,
           "--mpi", *worker_args]
    env = child_env(JAXRING_FAILURE_TIMEOUT=timeout,
                    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    procs = spawn([cmd], [env], 4 * timeout + 90)
    return procs, fault_time(procs[0].output)
  return run


# --- the emulated cluster ------------------------------------------------------------------------


def _cluster_missing() -> str | None:
  if os.geteuid() != 0:
    return "needs root (network namespaces)"
  if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
    return "`ip netns` is not available"
  return None


def _loss_missing() -> str | None:
  if why := _cluster_missing():
    return why
  from jaxring._src.tools.cluster import netns
  return netns.loss_unsupported()


def _cluster():
  from jaxring._src.tools.cluster import netns
  if not _cluster_up[0]:
    if netns.load_state(CLUSTER) is not None:
      netns.down(CLUSTER)
    netns.up(CLUSTER, 2, rate="100mbit")
    _cluster_up[0] = True
  return netns


def cleanup() -> None:
  """Deletes the cluster the rows created, if any."""
  if _cluster_up[0]:
    from jaxring._src.tools.cluster import netns
    netns.down(CLUSTER)
    _cluster_up[0] = False


def _cluster_job(timeout: float, worker_args: list[str], during=None, limit: float = 300):
  """A 2-node job under ``jaxring cluster run``; ``during(log_path)`` injects the fault and
  returns its time."""
  netns = _cluster()
  cmd = [sys.executable, "-m", "jaxring", "cluster", "run", "--name", CLUSTER,
         "--procs-per-node", "1", "--devices-per-proc", "1", "--timeout", str(limit),
         "--failure-timeout", str(timeout), "--", sys.executable, "-m", WORKER, *worker_args]
  with tempfile.TemporaryDirectory(prefix="jr-faults-") as tmp:
    log_path = os.path.join(tmp, "job.log")
    with open(log_path, "w") as log:
      p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                           start_new_session=True)
    fault_at, seen = None, {}

    def watch():   # when the job first names a culprit (its exit can come later: a coordinator
      while p.poll() is None and "at" not in seen:   # waits for the others' exit messages)
        if "jaxring.distributed:" in open(log_path).read():
          seen["at"] = time.time()
        time.sleep(0.1)
    threading.Thread(target=watch, daemon=True).start()
    try:
      if during is not None:
        fault_at = during(netns, log_path, p)
      p.wait(timeout=limit + 60)
    except subprocess.TimeoutExpired:
      pass
    finally:
      for node in range(2):
        netns.set_link(CLUSTER, node, True)
      if p.poll() is None:
        kill_group(p)
    text = open(log_path).read()
  return ([Proc(0, p.returncode, text, time.time(), seen.get("at"))],
          fault_at or fault_time(text))


def _wait_for(log_path: str, needle: str, p, limit: float = 150) -> None:
  deadline = time.monotonic() + limit
  while time.monotonic() < deadline and p.poll() is None:
    if needle in open(log_path).read():
      return
    time.sleep(0.2)
  raise RuntimeError(f"{needle!r} never appeared in the job's output")


def _link_down(seconds: float | None):
  def during(netns, log_path, p):
    _wait_for(log_path, "[r1] process 1: call 200", p)
    netns.set_link(CLUSTER, 1, False)
    cut = time.time()
    if seconds is not None:
      time.sleep(seconds)
      netns.set_link(CLUSTER, 1, True)
    return cut
  return during


def _with_loss(percent: float, timeout: float, calls: int):
  dropped = {}

  def run():
    netns = _cluster()
    netns.set_loss(CLUSTER, 1, percent)
    try:
      procs, _ = _cluster_job(timeout, ["--calls", str(calls), "--size", "65536",
                                        "--progress", "50"])
      dropped["n"] = netns.dropped_packets(CLUSTER, 1)
    finally:
      netns.set_loss(CLUSTER, 1, 0)
    procs[0].output += f"\ndropped packets: {dropped.get('n')}\n"
    return procs, None
  return (run, lambda procs: ([] if dropped.get("n") else ["no packet was dropped"]),
          lambda: f"{dropped.get('n')} packets dropped")


# --- a checkpoint save killed half-way -----------------------------------------------------------


def _checkpoint_row():
  tmp = tempfile.mkdtemp(prefix="jr-faults-ckpt-")
  directory, expected = os.path.join(tmp, "ckpt"), os.path.join(tmp, "expected.npz")

  def run():
    cmd = [sys.executable, "-m", WORKER, "--case", "ckpt", "--dir", directory,
           "--expected", expected]
    killed = {}

    def kill_mid_save(procs):
      if not killed and glob.glob(os.path.join(directory, "2.orbax-checkpoint-tmp*")):
        killed["at"] = time.time()
        os.kill(procs[0].pid, 9)
      return False
    procs = spawn([cmd], [child_env()], 180, kill_mid_save)
    return procs, killed.get("at")

  def check(procs):
    import jax
    import numpy as np

    import jaxring.train as jt
    from jaxring._src.tools.bench.fault_worker import checkpoint_state
    problems = []
    if "COMMITTED 1" not in procs[0].output or "SAVED 2" in procs[0].output:
      problems.append("the worker did not commit step 1 and die saving step 2")
    ckpt = jt.Checkpointer(directory, max_to_keep=2, async_save=False)
    if ckpt.latest_step != 1:
      problems.append(f"latest committed step {ckpt.latest_step}, expected 1")
    state, _ = ckpt.restore(checkpoint_state())
    want = np.load(expected)
    for k in ("big", "small"):
      if not np.array_equal(np.asarray(jax.device_get(state.params[k])), want[k]):
        problems.append(f"restored {k} differs from what was committed")
    ckpt.save(state.replace(step=state.step + 1), step=2)   # the lost step can be redone
    ckpt.close()
    if jt.Checkpointer(directory).all_steps() != [1, 2]:
      problems.append("step 2 could not be saved again after the restart")
    return problems
  return run, check


# --- the rows ------------------------------------------------------------------------------------


def rows(timeout: float) -> list[dict]:
  t = timeout
  ckpt_run, ckpt_check = _checkpoint_row()
  loss0, _, _ = _with_loss(0.0, max(t, 30.0), 300)
  loss1, loss1_check, loss1_note = _with_loss(1.0, max(t, 30.0), 300)
  loss5, loss5_check, loss5_note = _with_loss(5.0, max(t, 30.0), 300)
  stuck_named = (r"collective #\d+ \(launch \d+\) started here [\d.]+ s ago and cannot "
                 r"complete: process 1 of 2 \(pid \d+ on [^)]+\) launched it \d+ time")
  return [
      dict(name="kill -9 of one process mid all-reduce", outcome="named by both others",
           run=_local(3, 1, t, "--case", "kill", "--calls", "1000"),
           expect={0: ("fail", _named(1, 3)), 2: ("fail", _named(1, 3))}),
      dict(name="SIGSTOP of one process", outcome="named by the other",
           run=_local(2, 2, t, "--case", "stop", "--calls", "1000", done=_others_done(1)),
           expect={0: ("fail", _named(1, 2))}),
      dict(name="stuck between collectives (alive, heartbeating)",
           outcome="named, with the collective, by every process",
           run=_local(2, 2, t, "--case", "stuck", "--calls", "1000"),
           expect={0: ("fail", stuck_named), 1: ("fail", r"process 1 of 2 is stuck")}),
      dict(name="stuck after planning (compiled, never launched)",
           outcome="named, with the collective, by every process",
           run=_local(2, 2, t, "--case", "plan-stuck", "--at", "0", "--calls", "1000"),
           expect={0: ("fail", stuck_named), 1: ("fail", r"process 1 of 2 is stuck")}),
      dict(name="never plans the collective", outcome="FingerprintTimeoutError names it",
           run=_local(2, 2, t, "--case", "absent", "--at", "0", done=_others_done(1)),
           expect={0: ("fail", _raised("FingerprintTimeoutError") + r".*process\(es\) \[1\]")}),
      dict(name="skips a collective", outcome="CollectiveMismatchError on every process (op)",
           run=_local(2, 2, t, "--case", "skip", "--at", "0"),
           expect={p: ("fail", _raised("CollectiveMismatchError")) for p in (0, 1)}),
      dict(name="mismatched shapes", outcome="CollectiveMismatchError on every process (shape)",
           run=_local(2, 2, t, "--case", "shape", "--at", "0"),
           expect={p: ("fail", _raised("CollectiveMismatchError")) for p in (0, 1)}),
      dict(name="mismatched codecs", outcome="CollectiveMismatchError on every process (codecs)",
           run=_local(2, 2, t, "--case", "codec", "--at", "0"),
           expect={p: ("fail", _raised("CollectiveMismatchError")) for p in (0, 1)}),
      dict(name="mismatched algorithms",
           outcome="CollectiveMismatchError on every process (algorithm)",
           run=_local(2, 2, t, "--case", "algorithm", "--at", "0"),
           expect={p: ("fail", _raised("CollectiveMismatchError")) for p in (0, 1)}),
      dict(name="coordinator (process 0) killed", outcome="both others end, naming it",
           run=_local(3, 1, t, "--case", "kill", "--rank", "0", "--calls", "1000"),
           expect={p: ("fail", r"leader|process 0\b|coordination service") for p in (1, 2)}),
      dict(name="mpirun: kill -9 of one rank mid all-reduce", requires=_mpi_missing,
           outcome="hydra ends the job at once, exit non-zero (it reports signal 9, not the rank)",
           run=_mpi_job(3, t, "--case", "kill", "--calls", "1000"),
           expect={0: ("fail", r"Killed \(signal 9\)|rank 1 of 3 \(pid \d+ on [^)]+\) died")}),
      dict(name="mpirun: one rank stuck between collectives", requires=_mpi_missing,
           outcome="mpirun exits non-zero, every rank says who",
           run=_mpi_job(3, t, "--case", "stuck", "--calls", "1000"),
           expect={0: ("fail", r"cannot complete: rank 1 of 3 [\s\S]*cannot complete: rank 1 of 3 "
                               r"[\s\S]*Rank 1 exits|Rank 1 exits[\s\S]*cannot complete: rank 1 "
                               r"of 3[\s\S]*cannot complete: rank 1 of 3")}),
      dict(name="SIGKILL during a checkpoint save, then restart",
           outcome="step 1 restored bit for bit; step 2 saved again", run=ckpt_run,
           expect={0: ("fail", r"COMMITTED 1")}, completes=True, check=ckpt_check),
      dict(name="cluster: stuck between collectives (jaxring cluster run)",
           outcome="job exits non-zero, both ranks say who", requires=_cluster_missing,
           run=lambda: _cluster_job(t, ["--case", "stuck", "--calls", "1000"], limit=120),
           expect={0: ("fail", r"\[r0\] jaxring.distributed: collective #\d+ \(launch \d+\)"
                               r"[^\n]*process 1 of 2[\s\S]*\[r1\] jaxring.distributed: process"
                               r" 1 of 2 is stuck|\[r1\] jaxring.distributed: process 1 of 2 is "
                               r"stuck[\s\S]*\[r0\] jaxring.distributed: collective #")}),
      dict(name="cluster: link down 5 s, then restored", requires=_cluster_missing,
           outcome="completes; every call matches float64 NumPy", completes=True,
           run=lambda: _cluster_job(max(t, 30.0), ["--calls", "2000", "--progress", "100"],
                                    _link_down(5.0)),
           expect={0: ("ok", r"\[r1\] process 1: OK calls=2000")}),
      dict(name="cluster: link down for good", requires=_cluster_missing,
           outcome="both sides end non-zero, each naming the other",
           run=lambda: _cluster_job(t, ["--calls", "100000", "--progress", "100"],
                                    _link_down(None)),
           expect={0: ("fail", r"\[r0\] jaxring.distributed: process 1 of 2 \(pid \d+ on [^)]+\)"
                               r" died or hangs")}),
      dict(name="cluster: no fault (time of the loss rows' job without loss)",
           requires=_cluster_missing, outcome="completes; every call matches float64 NumPy",
           completes=True, run=loss0, expect={0: ("ok", r"\[r1\] process 1: OK calls=300")}),
      dict(name="cluster: 1% packet loss on one link (iptables statistic)",
           requires=_loss_missing, outcome="completes; every call matches float64 NumPy",
           completes=True, run=loss1, check=loss1_check, note=loss1_note,
           expect={0: ("ok", r"\[r1\] process 1: OK calls=300")}),
      dict(name="cluster: 5% packet loss on one link (iptables statistic)",
           requires=_loss_missing, outcome="completes; every call matches float64 NumPy",
           completes=True, run=loss5, check=loss5_check, note=loss5_note,
           expect={0: ("ok", r"\[r1\] process 1: OK calls=300")}),
  ]

