"""``jaxring cluster``: namespaces, shaped links, jobs run inside them, clean tear-down (root).

One 2-node cluster with 100 Mbit/s links (brought up with ``--quickack``) is shared by the tests
of this module and always torn down at the end, even when a test fails.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import multiproc as mp

pytestmark = pytest.mark.netns

RATE = "100mbit"
RATE_BYTES = 100e6 / 8
NAME = f"jrt{os.getpid() % 100000}"
CLI = [sys.executable, "-m", "jaxring._src.tools.cluster"]


def _skip_reason() -> str | None:
  if sys.platform != "linux":
    return "network namespaces are Linux-only"
  if os.geteuid() != 0:
    return "creating network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "iproute2 (ip, tc) is not installed"
  if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
    return "`ip netns` is not available here"
  return None


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
  return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                        env=mp.clean_env())


def namespaces() -> set[str]:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def cluster():
  if reason := _skip_reason():
    pytest.skip(reason)
  from jaxring._src.tools.cluster import netns
  try:
    up = cli("up", "--name", NAME, "--nodes", "2", "--link", RATE, "--quickack")
    assert up.returncode == 0, up.stdout + up.stderr
    yield netns.load_state(NAME)
  finally:
    cli("down", "--name", NAME)


@pytest.mark.timeout(60)
def test_up_creates_namespaces_links_and_qdiscs(cluster):
  assert {f"{NAME}-br", f"{NAME}-n0", f"{NAME}-n1"} <= namespaces()
  for node in range(2):
    ns = f"{NAME}-n{node}"
    addr = subprocess.run(["ip", "-n", ns, "-brief", "addr", "show", "dev", "jreth0"],
                          capture_output=True, text=True).stdout
    assert cluster.address(node) in addr and "UP" in addr, addr
    lo = subprocess.run(["ip", "-n", ns, "-brief", "link", "show", "dev", "lo"],
                        capture_output=True, text=True).stdout
    assert "UNKNOWN" in lo or "UP" in lo, lo
    qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "jreth0"],
                           capture_output=True, text=True).stdout
    assert re.search(r"tbf .*rate 100Mbit", qdisc), qdisc
    route = subprocess.run(["ip", "-n", ns, "route", "show", "dev", "jreth0"],
                           capture_output=True, text=True).stdout
    assert re.search(r"quickack 1", route), route   # --quickack: no delayed ACKs
  bridge_side = subprocess.run(["tc", "-n", f"{NAME}-br", "qdisc", "show"], capture_output=True,
                               text=True).stdout
  assert len(re.findall(r"tbf .*rate 100Mbit", bridge_side)) == 2, bridge_side
  status = cli("status", "--name", NAME)
  assert status.returncode == 0 and "MISSING" not in status.stdout, status.stdout
  assert "ACKs at once" in status.stdout, status.stdout


@pytest.mark.timeout(60)
def test_link_between_namespaces_is_shaped(cluster):
  from jaxring._src.tools.cluster import netns
  nbytes, port = 8 << 20, 23456
  before = netns.interface_counters(f"{NAME}-n0")
  recv = subprocess.Popen(["ip", "netns", "exec", f"{NAME}-n1", *mp.python_worker(
      "tcp_rate.py", "recv", str(port), str(nbytes))], stdout=subprocess.PIPE, text=True)
  try:
    assert recv.stdout.readline().strip() == "listening"
    subprocess.run(["ip", "netns", "exec", f"{NAME}-n0", *mp.python_worker(
        "tcp_rate.py", "send", cluster.address(1), str(port), str(nbytes))], check=True,
                   timeout=30)
    out = recv.communicate(timeout=30)[0]
  finally:
    if recv.poll() is None:
      recv.kill()
      recv.wait(timeout=10)
  got, seconds = re.search(r"received (\d+) bytes in ([\d.]+) s", out).groups()
  assert int(got) == nbytes
  rate = nbytes / float(seconds)
  # Above the limit only by what the 256 kB burst lets through at once; far above means unshaped.
  assert rate < 1.2 * RATE_BYTES, f"{rate / 1e6:.1f} MB/s through a {RATE} link"
  assert rate > 0.5 * RATE_BYTES, f"{rate / 1e6:.1f} MB/s through a {RATE} link"
  sent = netns.interface_counters(f"{NAME}-n0")["tx_bytes"] - before["tx_bytes"]
  assert nbytes <= sent < 1.1 * nbytes, sent


@pytest.mark.timeout(60)
def test_run_timeout_kills_and_names_the_unfinished_rank(cluster):
  code = ("import os, time; r = int(os.environ['JAXRING_PROCESS_ID']); "
          "print('started', r, flush=True); time.sleep(60 if r == 1 else 0)")
  t0 = time.monotonic()
  run = cli("run", "--name", NAME, "--timeout", "3", "--", sys.executable, "-c", code)
  assert run.returncode == 124, run.stdout + run.stderr
  assert "rank(s) 1 (node 1) did not finish within --timeout 3 s" in run.stderr, run.stderr
  assert time.monotonic() - t0 < 30
  leftover = subprocess.run(["ip", "netns", "pids", f"{NAME}-n1"], capture_output=True,
                            text=True).stdout.split()
  assert not leftover, f"processes left in {NAME}-n1: {leftover}"


@pytest.mark.timeout(60)
def test_binding_is_refused_for_the_jax_transport(cluster):
  run = cli("run", "--name", NAME, "--bind-to", "core", "--", sys.executable, "-c", "pass")
  assert run.returncode == 2 and "--bind-to core places MPI ranks" in run.stderr, run.stderr


@pytest.mark.timeout(60)
def test_run_propagates_exit_status(cluster):
  code = "import os, sys; sys.exit(7 if os.environ['JAXRING_PROCESS_ID'] == '1' else 0)"
  run = cli("run", "--name", NAME, "--timeout", "30", "--", sys.executable, "-c", code)
  assert run.returncode == 7, run.stdout + run.stderr
  assert "rank 1 (node 1) ended with exit status 7" in run.stderr, run.stderr


@pytest.mark.timeout(90)
def test_run_mpi_allreduce_in_namespaces(cluster):
  mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
  if not os.path.exists(mpirun):
    pytest.skip("MPICH's mpirun is not installed next to this Python")
  code = ("from mpi4py import MPI; import numpy as np; c = MPI.COMM_WORLD; "
          "x = np.full(1 << 18, c.rank + 1.0); y = np.empty_like(x); c.Allreduce(x, y); "
          "import os, sys; cpus = sorted(os.sched_getaffinity(0)); "
          "sys.stdout.write(f'SUM {c.rank} {c.size} {y.min()} {y.max()} CPUS {cpus}\\n')")
  from jaxring._src.tools.cluster import netns
  before = [c["tx_bytes"] for c in netns.link_counters(NAME)]
  run = cli("run", "--name", NAME, "--transport", "mpi", "--procs-per-node", "2", "--timeout",
            "60", "--bind-to", "core", "--", sys.executable, "-c", code, timeout=80)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out
  assert len(re.findall(r"SUM \d 4 10.0 10.0", out)) == 4, out
  # --bind-to core (hydra's): one CPU each, the two ranks of a node on different ones where the
  # machine has two
  found = re.findall(r"SUM (\d) 4 \S+ \S+ CPUS (\[[\d, ]*\])", out)
  cpus = {int(rank): json.loads(c) for rank, c in found}
  assert all(len(c) == 1 for c in cpus.values()), cpus
  if len(os.sched_getaffinity(0)) > 1:
    assert cpus[0] != cpus[1] and cpus[2] != cpus[3], cpus
  sent = [c["tx_bytes"] - b for c, b in zip(netns.link_counters(NAME), before)]
  # 2 MiB per rank crossed between the nodes: the ranks used the links, not shared memory.
  assert all(s > 1 << 20 for s in sent), sent


@pytest.mark.timeout(90)
def test_an_mpi_job_with_the_watchdog_ends_with_every_heartbeat_received(cluster):
  """Heartbeats still in flight when a rank ends used to reach MPI_Finalize unreceived, and UCX
  printed a warning for each (~80 lines at the end of every job on 4 nodes): each rank now says
  goodbye and receives what its peers sent until their goodbye or its acknowledgement. Rank 0
  ends 1.5 s before the others. The failure timeout is far above the job's length: the test is
  about heartbeats in flight at the end (one a second whatever the timeout above 4 s), and with
  4 s a loaded CI machine once starved two ranks' heartbeat threads long enough to be declared
  dead."""
  mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
  if not os.path.exists(mpirun):
    pytest.skip("MPICH's mpirun is not installed next to this Python")
  code = ("import time, jaxring, jaxring.distributed; from mpi4py import MPI; "
          "c = MPI.COMM_WORLD; jaxring.distributed.bind_mpi_axis('mpi', c, "
          "failure_timeout_s=30); time.sleep(2.5); c.Barrier(); "
          "time.sleep(1.5 if c.rank else 0); print(f'ENDED {c.rank}', flush=True)")
  run = cli("run", "--name", NAME, "--transport", "mpi", "--procs-per-node", "2", "--timeout",
            "60", "--bind-to", "core", "--", sys.executable, "-c", code, timeout=80)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out
  assert len(re.findall(r"ENDED \d", out)) == 4, out
  assert "not matched" not in out, out


def _start_job(tmp_path, calls: int, failure_timeout: float, run_timeout: float,
               devices: int = 1):
  out = open(tmp_path / "job.log", "w")
  proc = subprocess.Popen(
      [*CLI, "run", "--name", NAME, "--procs-per-node", "1", "--devices-per-proc", str(devices),
       "--timeout", str(run_timeout), "--failure-timeout", str(failure_timeout), "--",
       *mp.python_worker("dist_allreduce.py", "--calls", str(calls), "--algorithms", "lax",
                         "--progress", "100")],
      stdout=out, stderr=subprocess.STDOUT, env=mp.clean_env(), start_new_session=True)
  return proc, tmp_path / "job.log"


def _wait_for(log, pattern: str, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if re.search(pattern, log.read_text()):
      return
    time.sleep(0.2)
  raise AssertionError(f"{pattern!r} never appeared:\n{log.read_text()[-4000:]}")


def _link(state: str) -> None:
  subprocess.run(["ip", "-n", f"{NAME}-br", "link", "set", "jrp1", state], check=state == "down")


@pytest.mark.timeout(240)
def test_run_jax_psum_across_two_nodes_through_a_link_down_for_5_s(cluster, tmp_path):
  """A JAX job across the two nodes (2 devices a process): every psum checked against float64
  NumPy, the link cut for 5 s in the middle of the run and restored; the job completes."""
  proc, log = _start_job(tmp_path, calls=1000, failure_timeout=30, run_timeout=200, devices=2)
  try:
    _wait_for(log, r"\[r1\] process 1: lax call 200\b", 150)
    _link("down")
    time.sleep(5)
    still_running = proc.poll() is None   # stalled by the cut, not finished before it
    _link("up")
    rc = proc.wait(timeout=200)
  finally:
    _link("up")
    if proc.poll() is None:
      mp._kill_session(proc)
  text = log.read_text()
  assert rc == 0, text[-4000:]
  assert still_running, text[-4000:]
  for rank in range(2):   # every call checked against a float64 NumPy sum by the worker
    assert f"[r{rank}] process {rank}/2: 2 devices, topology ('local', 'node') [2, 2]" in text, (
        text[-4000:])
    assert f"[r{rank}] process {rank}: OK lax calls=1000" in text, text[-4000:]


@pytest.mark.timeout(240)
def test_a_link_down_for_good_ends_both_sides_naming_the_other(cluster, tmp_path):
  timeout = 5.0
  proc, log = _start_job(tmp_path, calls=100000, failure_timeout=timeout, run_timeout=200)
  try:
    _wait_for(log, r"\[r1\] process 1: lax call 100\b", 150)
    _link("down")
    cut = time.monotonic()
    rc = proc.wait(timeout=120)
    took = time.monotonic() - cut
  finally:
    _link("up")
    if proc.poll() is None:
      mp._kill_session(proc)
  text = log.read_text()
  assert rc != 0, text[-4000:]
  # node 0 (the coordinator's side) names process 1; node 1 cannot reach the coordinator
  assert re.search(r"\[r0\] jaxring.distributed: process 1 of 2 \(pid \d+ on [^)]+\) died or "
                   r"hangs", text), text[-4000:]
  assert re.search(r"\[r1\] jaxring.distributed: .*(coordination service|process 0 of 2)",
                   text), text[-4000:]
  assert took < timeout + 40, f"{took:.1f} s to give up\n{text[-4000:]}"


@pytest.mark.timeout(60)
def test_down_deletes_everything_and_is_idempotent(cluster):
  down = cli("down", "--name", NAME)
  assert down.returncode == 0, down.stderr
  assert not {f"{NAME}-br", f"{NAME}-n0", f"{NAME}-n1"} & namespaces()
  assert "not up" in cli("status", "--name", NAME).stdout
  again = cli("down", "--name", NAME)
  assert again.returncode == 0 and "nothing to delete" in again.stdout, again.stdout


@pytest.mark.timeout(60)
def test_without_root_the_error_names_the_missing_capability():
  """Root with every capability dropped: what an unprivileged user lacks (the check reads the
  capabilities, not the uid). The uid stays root's so that the checkout is readable wherever it
  lives: an unprivileged uid cannot enter a checkout in a private (mode 700) folder."""
  if shutil.which("setpriv") is None or os.geteuid() != 0:
    pytest.skip("needs root and setpriv to run a command without root's capabilities")
  env = mp.clean_env(XDG_RUNTIME_DIR="/nonexistent")
  drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
  probe = subprocess.run([*drop, sys.executable, "-c", "import jaxring"], capture_output=True,
                         text=True, timeout=60, env=env)
  if probe.returncode != 0:   # e.g. a checkout owned by another user: root needs its DAC bypass
    pytest.skip("without capabilities this process cannot import jaxring from the checkout: "
                + probe.stderr.strip().splitlines()[-1])
  proc = subprocess.run([*drop, *CLI, "up", "--name", "jrnoroot", "--nodes", "2"],
                        capture_output=True, text=True, timeout=60, env=env)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "needs root" in proc.stderr and "CAP_NET_ADMIN" in proc.stderr, proc.stderr
  assert "jrnoroot-n0" not in namespaces()
