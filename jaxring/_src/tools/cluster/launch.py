"""Starting a job on the emulated cluster: one process per rank inside its node's namespace.

Transport ``jax``: one ``ip netns exec <node> <command>`` per process, told who it is through
``JAXRING_*`` variables (read by :func:`jaxring.distributed.initialize`).

Transport ``mpi``: MPICH's ``mpirun`` (hydra), itself started inside node 0's namespace with
``-localhost <node 0's address>`` so that the proxies on other nodes can reach it, and an ssh
launcher-exec script that runs each node's proxy through ``ip netns exec``. ``UCX_TLS=tcp``: the
namespaces share one kernel and /dev/shm, so UCX would otherwise pick shared memory between
"nodes" and bypass the shaped links.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from jaxring._src import distributed as dist_env
from jaxring._src.tools import allocator
from jaxring._src.tools.cluster.netns import ClusterError, ClusterState, sh

EXIT_TIMEOUT = 124


@dataclasses.dataclass
class Rank:
  """One process to start: its rank, node and full command line (already inside ``ip netns``)."""

  rank: int
  node: int
  argv: list[str]
  env: dict[str, str]


# jaxring settings a launched process keeps from its caller: where it writes and reads, not who
# it is (its rank, coordinator and devices are the launcher's to set)
USER_SETTINGS = ("JAXRING_FLIGHT_DIR", "JAXRING_FLIGHT_RECORDER", "JAXRING_CACHE_DIR",
                 "JAXRING_PROFILE", "JAXRING_KERNELS", "JAXRING_KERNEL_CHOICE",
                 "JAXRING_CPU_THREADS", "JAXRING_NO_TCMALLOC", "JAXRING_FAILURE_TIMEOUT",
                 "JAXRING_LAUNCH_MARKERS", "JAXRING_FINGERPRINT", "JAXRING_INPROCESS_TIMEOUT",
                 "JAXRING_CUDA_QUANTIZE_BLOCKS")


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
  """The caller's environment without settings that would give a process the wrong devices or
  the wrong identity (``USER_SETTINGS`` stay), with the fast allocator (tcmalloc where installed,
  else tuned glibc malloc: ``allocator.fast_allocator_env``)."""
  env = allocator.fast_allocator_env(os.environ if base is None else base)
  for key in [k for k in env if k.startswith(("JAXRING_", "PMI_", "OMPI_"))
              and k not in USER_SETTINGS]:
    del env[key]
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env["PYTHONUNBUFFERED"] = "1"
  return env


def free_port(state: ClusterState, node: int = 0) -> int:
  """A TCP port free inside ``node``'s namespace (where the coordinator will listen)."""
  code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
  out = sh("ip", "netns", "exec", state.node_namespace(node), sys.executable, "-c", code).stdout
  return int(out.strip())


def _job_env(state: ClusterState, nodes: int, procs_per_node: int, devices_per_proc: int | None,
             port: int, failure_timeout: float | None) -> dict[str, str]:
  env = child_env()
  env[dist_env.ENV_COORDINATOR] = f"{state.address(0)}:{port}"
  env[dist_env.ENV_NUM_PROCESSES] = str(nodes * procs_per_node)
  env[dist_env.ENV_INTERFACE] = state.interface
  env[dist_env.ENV_NETWORK_BANDWIDTH] = repr(state.bandwidth)
  env["JAXRING_CLUSTER"] = state.name
  if devices_per_proc is not None:
    env[dist_env.ENV_LOCAL_DEVICE_COUNT] = str(devices_per_proc)
  if failure_timeout is not None:
    env[dist_env.ENV_FAILURE_TIMEOUT] = repr(float(failure_timeout))
  return env


def jax_ranks(state: ClusterState, command: Sequence[str], *, nodes: int, procs_per_node: int,
              devices_per_proc: int | None, port: int,
              failure_timeout: float | None = None) -> list[Rank]:
  """The ``ip netns exec`` command and environment of every process, rank = node * M + local."""
  base = _job_env(state, nodes, procs_per_node, devices_per_proc, port, failure_timeout)
  ranks = []
  for node in range(nodes):
    for local in range(procs_per_node):
      rank = node * procs_per_node + local
      env = dict(base)
      env[dist_env.ENV_PROCESS_ID] = str(rank)
      env["JAXRING_NODE"], env["JAXRING_LOCAL_RANK"] = str(node), str(local)
      argv = ["ip", "netns", "exec", state.node_namespace(node), *command]
      ranks.append(Rank(rank, node, argv, env))
  return ranks


def launcher_script(state: ClusterState, nodes: int) -> str:
  """The hydra ``-launcher-exec`` script: ``-x HOST "CMD"`` -> ``ip netns exec NODE sh -c CMD``."""
  cases = "\n".join(f"  {state.address(i)}) ns={state.node_namespace(i)} ;;" for i in range(nodes))
  return f"""#!/bin/sh
# jaxring cluster {state.name}: hydra's ssh launcher calls this as `<script> -x HOST "COMMAND"`.
[ "$1" = "-x" ] && shift
host=$1
shift
case "$host" in
{cases}
  *) echo "jaxring cluster launcher: host $host is not a node of cluster {state.name}" >&2
     exit 1 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


def mpi_rank(state: ClusterState, command: Sequence[str], *, nodes: int, procs_per_node: int,
             devices_per_proc: int | None, port: int, script_path: str,
             failure_timeout: float | None = None, mpirun: str | None = None,
             prepend_rank: bool = True, bind: str = "none") -> Rank:
  """The single ``mpirun`` process of an MPI job (rank -1: it stands for all ranks).

  ``bind``: hydra's ``-bind-to`` (``none``: the scheduler places the ranks; ``core``: each rank
  of a node on a core of its own, wrapping round where a node has more ranks than the machine
  has cores; docs/benchmarks.md, "Multi-node all-reduce on the emulated cluster")."""
  env = _job_env(state, nodes, procs_per_node, devices_per_proc, port, failure_timeout)
  env["UCX_TLS"] = "tcp"
  if "PYTHONUNBUFFERED" not in os.environ:
    # hydra's -prepend-rank tags every write; unbuffered Python writes a line in pieces.
    env.pop("PYTHONUNBUFFERED", None)
  mpirun = mpirun or os.path.join(os.path.dirname(sys.executable), "mpirun")
  hosts = ",".join(f"{state.address(i)}:{procs_per_node}" for i in range(nodes))
  argv = ["ip", "netns", "exec", state.node_namespace(0), mpirun, "-n",
          str(nodes * procs_per_node), "-hosts", hosts, "-localhost", state.address(0),
          "-launcher", "ssh", "-launcher-exec", script_path, "-genvall", "-genv", "UCX_TLS",
          "tcp", "-bind-to", bind, *(["-prepend-rank"] if prepend_rank else []), *command]
  return Rank(-1, 0, argv, env)


class Job:
  """Started processes whose output is relayed line by line with a ``[rank]`` prefix."""

  def __init__(self, ranks: list[Rank], *, prefix: bool = True):
    self.ranks, self.prefix = ranks, prefix
    self.procs: list[subprocess.Popen] = []
    self.relays: list[threading.Thread] = []

  def start(self) -> None:
    for r in self.ranks:
      p = subprocess.Popen(r.argv, env=r.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, start_new_session=True)
      self.procs.append(p)
      tag = f"[r{r.rank}] " if self.prefix and r.rank >= 0 else ""
      for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
        t = threading.Thread(target=_relay, args=(src, dst, tag), daemon=True)
        t.start()
        self.relays.append(t)

  def wait(self, timeout: float | None, grace: float,
           before_kill: Callable[[], None] | None = None) -> dict[int, int | None]:
    """Waits for every process; returns rank -> exit status (None: killed by us).

    At ``timeout`` seconds all processes still running are killed. Once one process fails, the
    others get ``grace`` seconds to finish (they will usually fail too) before being killed.
    ``before_kill`` runs just before that, while the stragglers can still be inspected.
    """
    start = time.monotonic()
    first_failure = None
    status: dict[int, int | None] = {}
    while len(status) < len(self.procs):
      now = time.monotonic()
      for r, p in zip(self.ranks, self.procs):
        if r.rank not in status and (code := p.poll()) is not None:
          status[r.rank] = code
          if code != 0 and first_failure is None:
            first_failure = now
      expired = timeout is not None and now - start > timeout
      abandoned = first_failure is not None and now - first_failure > grace
      if len(status) < len(self.procs) and (expired or abandoned):
        if before_kill is not None:
          before_kill()
        for r, p in zip(self.ranks, self.procs):
          if r.rank not in status:
            kill_session(p)
            status[r.rank] = None
        break
      time.sleep(0.05)
    for t in self.relays:
      t.join(timeout=2)
    return status

  def kill(self) -> None:
    for p in self.procs:
      kill_session(p)


def _relay(src, dst, tag: str) -> None:
  for line in iter(src.readline, b""):
    dst.write(tag + line.decode(errors="replace"))
    dst.flush()
  src.close()


def kill_session(p: subprocess.Popen) -> None:
  """SIGKILLs the process and everything in its session (it was started as a session leader)."""
  if p.poll() is not None:
    return
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  p.wait(timeout=10)


def job_processes(state: ClusterState, nodes: int, job_id: str) -> dict[int, tuple[int, int]]:
  """Processes of one job still alive in the cluster's namespaces: pid -> (node, MPI rank or -1).

  A job's processes carry ``JAXRING_JOB_ID`` in their environment (hydra passes it on to the
  proxies and ranks it starts, which leave mpirun's session).
  """
  found = {}
  tag = b"JAXRING_JOB_ID=" + job_id.encode()
  for node in range(nodes):
    for pid in sh("ip", "netns", "pids", state.node_namespace(node), check=False).stdout.split():
      try:
        with open(f"/proc/{pid}/environ", "rb") as f:
          env = f.read().split(b"\0")
      except OSError:
        continue
      if tag in env:
        rank = next((int(kv[9:]) for kv in env if kv.startswith(b"PMI_RANK=")), -1)
        found[int(pid)] = (node, rank)
  return found


def _kill_pids(pids) -> None:
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def exit_code(status: dict[int, int | None], timed_out: bool) -> int:
  """One exit status for the job: 124 on timeout, else the lowest failed rank's (signal n: 128+n).

  Example:
    >>> exit_code({0: 0, 1: -9, 2: 3}, timed_out=False)
    137
  """
  if timed_out:
    return EXIT_TIMEOUT
  for rank in sorted(status):
    code = status[rank]
    if code not in (0, None):
      return 128 - code if code < 0 else code
  return EXIT_TIMEOUT if None in status.values() else 0


def run(state: ClusterState, command: Sequence[str], *, nodes: int | None = None,
        procs_per_node: int = 1, devices_per_proc: int | None = None, transport: str = "jax",
        timeout: float | None = None, grace: float = 30.0, failure_timeout: float | None = None,
        prefix: bool = True, bind: str = "none") -> int:
  """Runs ``command`` as a job on the cluster; returns its exit status (see :func:`exit_code`).

  Example:
    >>> run(load_state("jr0"), ["python", "train.py"], procs_per_node=2,
    ...     devices_per_proc=4, timeout=600)  # doctest: +SKIP
    0
  """
  nodes = state.nodes if nodes is None else nodes
  if not 1 <= nodes <= state.nodes:
    raise ClusterError(f"--nodes {nodes}: cluster {state.name!r} has {state.nodes} nodes")
  if procs_per_node < 1:
    raise ClusterError(f"--procs-per-node must be >= 1, got {procs_per_node}")
  if not command:
    raise ClusterError("nothing to run: put the command after `--`")
  if bind != "none" and transport != "mpi":
    raise ClusterError(f"--bind-to {bind} places MPI ranks (--transport mpi); a JAX-transport "
                       "process drives several devices whose programs run at once")
  port = free_port(state)
  job_id = f"{state.name}-{os.getpid()}-{time.time_ns()}"
  kwargs = dict(nodes=nodes, procs_per_node=procs_per_node, devices_per_proc=devices_per_proc,
                port=port, failure_timeout=failure_timeout)
  stragglers: dict[int, tuple[int, int]] = {}

  def look_before_kill():
    stragglers.update(job_processes(state, nodes, job_id))

  with tempfile.TemporaryDirectory(prefix=f"{state.name}-launch-") as tmp:
    if transport == "jax":
      ranks = jax_ranks(state, command, **kwargs)
    elif transport == "mpi":
      script = os.path.join(tmp, "netns-launcher.sh")
      with open(script, "w") as f:
        f.write(launcher_script(state, nodes))
      os.chmod(script, stat.S_IRWXU)
      ranks = [mpi_rank(state, command, script_path=script, prepend_rank=prefix, bind=bind,
                        **kwargs)]
    else:
      raise ClusterError(f"--transport must be jax or mpi, got {transport!r}")
    for r in ranks:
      r.env["JAXRING_JOB_ID"] = job_id
    job = Job(ranks, prefix=prefix)
    start = time.monotonic()
    try:
      job.start()
      status = job.wait(timeout, grace, before_kill=look_before_kill)
    finally:
      job.kill()
      _kill_pids(job_processes(state, nodes, job_id))
    elapsed = time.monotonic() - start
  timed_out = timeout is not None and None in status.values() and elapsed >= timeout
  _report(status, timed_out, timeout, transport, stragglers, ranks)
  return exit_code(status, timed_out)


def _report(status, timed_out, timeout, transport, stragglers, ranks) -> None:
  killed = sorted(r for r, c in status.items() if c is None)
  failed = {r: c for r, c in status.items() if c not in (0, None)}
  where = {r.rank: f"node {r.node}" for r in ranks}
  for r, c in sorted(failed.items()):
    what = f"signal {-c}" if c < 0 else f"exit status {c}"
    name = "mpirun" if r < 0 else f"rank {r} ({where[r]})"
    print(f"jaxring cluster run: {name} ended with {what}", file=sys.stderr)
  if not killed:
    return
  if transport == "mpi":
    mpi = sorted({(rank, node) for node, rank in stragglers.values() if rank >= 0})
    names = "MPI rank(s) " + ", ".join(f"{r} (node {n})" for r, n in mpi) if mpi else \
        "mpirun (no MPI rank was found still running)"
  else:
    names = "rank(s) " + ", ".join(f"{r} ({where[r]})" for r in killed)
  why = f"did not finish within --timeout {timeout:g} s" if timed_out else \
      "were still running after another rank failed (--grace expired)"
  print(f"jaxring cluster run: {names} {why}; killed", file=sys.stderr)
