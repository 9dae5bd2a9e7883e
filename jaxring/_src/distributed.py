"""Multi-process start-up: ``jax.distributed`` plus what an emulated or real cluster needs.

:func:`initialize` wraps :func:`jax.distributed.initialize` and adds four things jaxring relies on:

* the number of CPU devices per process (``jax_num_cpu_devices``), set before the backend starts;
* gloo bound to one network interface: gloo advertises the hostname by default, which resolves to
  127.0.0.1 inside a network namespace, so processes in different namespaces cannot connect;
* a peer watchdog: every process publishes a heartbeat counter in the coordination service's
  key-value store, and a process that stops (killed, crashed, hung) is named by every other process,
  which then exits instead of hanging in a collective that will never complete;
* the :class:`~jaxring._src.topology.Topology` of the job, installed as jaxring's default.

``jaxring cluster run`` passes its settings in ``JAXRING_*`` environment variables, so a script
launched by it calls ``jaxring.distributed.initialize()`` without arguments.
"""
from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from typing import Any

import jax

from jaxring._src import topology as topology_lib
from jaxring._src.transport.rendezvous import StartupTimeoutError as StartupTimeoutError
from jaxring._src.transport.rendezvous import roll_call

ENV_COORDINATOR = "JAXRING_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRING_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRING_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXRING_LOCAL_DEVICE_COUNT"
ENV_INTERFACE = "JAXRING_INTERFACE"
ENV_FAILURE_TIMEOUT = "JAXRING_FAILURE_TIMEOUT"
ENV_NETWORK_BANDWIDTH = "JAXRING_NETWORK_BANDWIDTH"

DEFAULT_FAILURE_TIMEOUT_S = 120.0
_KV_PREFIX = "jaxring/peer/"


class BarrierTimeoutError(TimeoutError):
  """Raised by :func:`barrier` when some processes did not arrive in time.

  Attributes:
    missing: process ids that had not reached the barrier when it timed out.
  """

  def __init__(self, message: str, missing: tuple[int, ...]):
    super().__init__(message)
    self.missing = missing


def _client():
  from jax._src import distributed as jax_distributed
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jaxring.distributed: not initialized; call "
                       "jaxring.distributed.initialize() first")
  return client


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else None


def _launcher_process_count() -> int | None:
  """Process count announced by a launcher JAX does not detect by itself (MPICH's hydra)."""
  for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
    if (value := _env_int(name)) is not None:
      return value
  return None


def _use_gloo_interface(interface: str) -> None:
  """Makes the CPU backend create its gloo collectives bound to ``interface``.

  jax 0.10's CPU backend factory calls ``make_gloo_tcp_collectives(distributed_client=...)``
  without an interface; we register a factory that passes one. It runs when the backend first
  starts, after ``jax.distributed`` has its client.
  """
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  if not hasattr(_jax, "make_gloo_tcp_collectives"):
    raise RuntimeError("jaxring.distributed: this jaxlib has no make_gloo_tcp_collectives; cannot "
                       f"bind gloo to interface {interface!r}")

  def make_cpu_client():
    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=jax_distributed.global_state.client, interface=interface)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


class _PeerWatchdog:
  """Heartbeats through the coordination service; names and outlives failed peers.

  Each process bumps a counter under ``jaxring/peer/hb/<id>`` every ``interval`` seconds and reads
  everyone's. A counter that has not moved for ``timeout`` seconds (by this process's own clock, so
  clock skew between hosts does not matter) means that process died or hangs: this process prints
  which one and exits, because the collective it may be blocked in would never return.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout: float):
    self.client, self.me, self.n, self.timeout = client, process_id, num_processes, timeout
    self.interval = min(1.0, timeout / 4)
    self.stop_event = threading.Event()
    now = time.monotonic()
    self.last_count: dict[int, str] = {}
    self.last_seen = {p: now for p in range(num_processes)}
    self.states: dict[int, str] = {}
    self.exited: set[int] = set()
    self.kv_error_since: float | None = None
    self.count = 0
    self.thread = threading.Thread(target=self._run, name="jaxring-peer-watchdog", daemon=True)

  def start(self) -> None:
    self.poll()
    self.thread.start()

  def stop(self) -> None:
    self.stop_event.set()
    if self.thread.is_alive() and threading.current_thread() is not self.thread:
      self.thread.join(timeout=5 * self.interval)

  def publish_state(self, state: str) -> None:
    self.client.key_value_set(f"{_KV_PREFIX}state/{self.me}", state[:2000], allow_overwrite=True)

  def poll(self) -> None:
    """One heartbeat: publish ours, read everyone's; raises if the coordinator is unreachable."""
    self.count += 1
    self.client.key_value_set(f"{_KV_PREFIX}hb/{self.me}", str(self.count), allow_overwrite=True)
    now = time.monotonic()
    for key, value in self.client.key_value_dir_get(_KV_PREFIX):
      kind, _, pid = key[len(_KV_PREFIX):].partition("/")
      if not pid.isdigit():
        continue
      p = int(pid)
      if kind == "hb" and self.last_count.get(p) != value:
        self.last_count[p], self.last_seen[p] = value, now
      elif kind == "state":
        self.states[p] = value
      elif kind == "exit":
        self.exited.add(p)

  def silent(self) -> dict[int, float]:
    """Peers (not exiting or failed) whose heartbeat is older than the timeout: id -> age (s)."""
    now = time.monotonic()
    return {p: now - t for p, t in self.last_seen.items()
            if p != self.me and p not in self.states and now - t > self.timeout}

  def failed(self) -> dict[int, str]:
    return {p: s[len("failed:"):] for p, s in self.states.items() if s.startswith("failed:")}

  def _kv_unreachable(self, exc: BaseException) -> str | None:
    now = time.monotonic()
    self.kv_error_since = self.kv_error_since or now
    if now - self.kv_error_since <= self.timeout:
      return None
    return (f"the coordination service (hosted by process 0) has been unreachable for "
            f"{now - self.kv_error_since:.1f} s: {str(exc).splitlines()[0]}")

  def _run(self) -> None:
    while not self.stop_event.wait(self.interval):
      try:
        self.poll()
        self.kv_error_since = None
        problem = None
        if silent := self.silent():
          problem = describe_silent(silent, self.n, self.timeout)
      except Exception as exc:  # noqa: BLE001 - any RPC failure means the coordinator is in trouble
        problem = self._kv_unreachable(exc)
      if problem and not self.stop_event.is_set():
        self.leave(f"jaxring.distributed: {problem}. Process {self.me} exits so that the job "
                   "does not hang in a collective that cannot complete.")

  def leave(self, message: str, code: int = 1) -> None:
    """Prints ``message`` and exits the process now, skipping jax's shutdown barrier.

    The process hosting the coordination service leaves last: when it goes, jax's client in every
    other process aborts at once with its own message, which would hide ours.
    """
    self.stop_event.set()
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
      self.client.key_value_set(f"{_KV_PREFIX}exit/{self.me}", "1", allow_overwrite=True)
      if _hosts_coordination_service():
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while time.monotonic() < deadline:
          self.poll()
          if set(range(self.n)) - {self.me} <= self.exited | set(self.silent()):
            break
          time.sleep(self.interval / 4)
        time.sleep(0.2)   # the last process to mark its exit is still on its way out
    except Exception:  # noqa: BLE001 - nothing left to coordinate with
      pass
    os._exit(code)


def describe_silent(silent: dict[int, float], num_processes: int, timeout: float) -> str:
  """The message naming peers whose heartbeats stopped.

  Example:
    >>> describe_silent({2: 5.2}, 4, 5.0)
    'process 2 of 4 died or hangs: no heartbeat for 5.2 s (failure timeout 5 s)'
  """
  ids = sorted(silent)
  who = f"process {ids[0]}" if len(ids) == 1 else f"processes {ids}"
  ages = ", ".join(f"{silent[p]:.1f}" for p in ids)
  return (f"{who} of {num_processes} died or hangs: no heartbeat for {ages} s "
          f"(failure timeout {timeout:g} s)")


def _hosts_coordination_service() -> bool:
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.service is not None


_watchdog: list[_PeerWatchdog | None] = [None]


def _diagnose_and_exit(watchdog: _PeerWatchdog) -> None:
  """At exit after an uncaught exception: publish it, name a dead peer if there is one, exit.

  A collective that fails because a peer died usually raises here first (gloo: "Connection closed
  by peer [addr]:port", which names no process). Waiting up to the failure timeout lets the
  heartbeats tell which process it was. Exiting directly also skips jax's shutdown barrier, which
  would wait for the dead peer for ``shutdown_timeout_seconds``.
  """
  exc = sys.last_value
  text = str(exc).strip()
  summary = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
  watchdog.stop()
  try:
    watchdog.publish_state("failed:" + summary)
  except Exception:  # noqa: BLE001 - the coordinator itself may be gone
    pass
  deadline = time.monotonic() + watchdog.timeout + 2 * watchdog.interval
  lines = []
  while time.monotonic() < deadline:
    try:
      watchdog.poll()
    except Exception as e:  # noqa: BLE001
      lines.append(f"the coordination service (process 0) is unreachable: {str(e).splitlines()[0]}")
      break
    if silent := watchdog.silent():
      lines.append(describe_silent(silent, watchdog.n, watchdog.timeout))
      break
    others = set(range(watchdog.n)) - {watchdog.me}
    if others <= set(watchdog.states):
      break
    time.sleep(watchdog.interval)
  lines += [f"process {p} failed: {msg}" for p, msg in sorted(watchdog.failed().items())
            if p != watchdog.me]
  lines = lines or ["no other process reported a failure"]
  watchdog.leave("\n".join(f"jaxring.distributed: {line}" for line in
                           [f"process {watchdog.me} of {watchdog.n} raised {summary}", *lines]))


def _at_exit() -> None:
  watchdog = _watchdog[0]
  if watchdog is None:
    return
  if getattr(sys, "last_value", None) is not None:
    _diagnose_and_exit(watchdog)
  shutdown()


def _check_ids(num_processes, process_id) -> None:
  if not isinstance(num_processes, int) or not isinstance(process_id, int):
    raise TypeError(f"jaxring.distributed.initialize: num_processes and process_id must be ints, "
                    f"got {num_processes!r} and {process_id!r}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"jaxring.distributed.initialize: process_id must be in [0, num_processes), "
                     f"got process_id={process_id}, num_processes={num_processes}")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None,
               interface: str | None = None, timeout_s: float = 300.0,
               failure_timeout_s: float | None = None,
               **topology_kwargs: Any) -> topology_lib.Topology:
  """Starts the multi-process runtime and returns (and installs) the job's topology.

  Arguments left as ``None`` come from the ``JAXRING_*`` variables set by ``jaxring cluster run``,
  else from JAX's own detection (Slurm, Open MPI, TPU; MPICH through mpi4py). With none of
  these, the job is a single process and ``jax.distributed`` is not started.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: number of processes in the job.
    process_id: this process's id in ``[0, num_processes)``.
    local_device_count: CPU devices this process emulates (``jax_num_cpu_devices``); must be
      given before anything has started a JAX backend.
    interface: network interface gloo binds to (e.g. the veth inside a network namespace).
    timeout_s: how long start-up waits for every process to connect. Before
      ``jax.distributed`` starts, every process checks in with process 0 on the coordinator's
      port, so that a process that never comes is named instead of ending the others with
      jax's fatal abort.
    failure_timeout_s: seconds without a heartbeat after which a peer is declared dead and every
      other process exits naming it (default ``JAXRING_FAILURE_TIMEOUT`` or 120 s; ``0`` turns the
      watchdog off). JAX's own heartbeat timeout is set above it, as a backstop.
    **topology_kwargs: passed to :meth:`Topology.from_processes` (``network_bandwidth=`` etc.).

  Returns:
    The :class:`~jaxring._src.topology.Topology` built from the processes, also installed with
    :func:`~jaxring._src.topology.set_default_topology`.

  Raises:
    StartupTimeoutError: (a ``TimeoutError``) some processes did not arrive within ``timeout_s``;
      its ``missing`` lists their ids and the message names them and the coordinator address.
    ValueError: processes disagree on ``num_processes`` or two claim the same ``process_id``.

  Example:
    >>> import jaxring.distributed
    >>> topo = jaxring.distributed.initialize("10.0.0.1:1234", 2, 0,
    ...                                       local_device_count=4)  # doctest: +SKIP
    >>> topo.names  # doctest: +SKIP
    ('local', 'node')
  """
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge

  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if local_device_count is None:
    local_device_count = _env_int(ENV_LOCAL_DEVICE_COUNT)
  interface = interface or os.environ.get(ENV_INTERFACE) or None
  if failure_timeout_s is None:
    failure_timeout_s = float(os.environ.get(ENV_FAILURE_TIMEOUT) or DEFAULT_FAILURE_TIMEOUT_S)
  if ENV_NETWORK_BANDWIDTH in os.environ and "network_bandwidth" not in topology_kwargs:
    topology_kwargs["network_bandwidth"] = float(os.environ[ENV_NETWORK_BANDWIDTH])

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("jaxring.distributed.initialize() must run before anything starts a JAX "
                       "backend (jax.devices(), jnp arrays, jit calls, ...)")
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))

  launcher_count = _launcher_process_count()
  multi_process = (coordinator_address is not None or (num_processes or 0) > 1 or
                   (launcher_count or 0) > 1)
  if multi_process and jax_distributed.global_state.client is None:
    kwargs: dict[str, Any] = {}
    if coordinator_address is None and "PMI_RANK" in os.environ:
      kwargs["cluster_detection_method"] = "mpi4py"   # MPICH: JAX detects it only through mpi4py
    elif "PMI_RANK" in os.environ and process_id is None:
      process_id = int(os.environ["PMI_RANK"])
      num_processes = num_processes or _env_int("PMI_SIZE")
    jax_heartbeat = max(100, math.ceil(2 * failure_timeout_s + 5)) if failure_timeout_s else 100
    if None not in (coordinator_address, num_processes, process_id):
      _check_ids(num_processes, process_id)
      # jax's own start-up ends the process with SIGABRT when a peer never comes: find out first
      roll_call(coordinator_address, num_processes, process_id, timeout_s)
    if interface is not None:
      _use_gloo_interface(interface)
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id,
        initialization_timeout=max(1, math.ceil(timeout_s)),
        heartbeat_timeout_seconds=jax_heartbeat,
        shutdown_timeout_seconds=max(10, math.ceil(timeout_s)), **kwargs)
    if failure_timeout_s and failure_timeout_s > 0:
      client = jax_distributed.global_state.client
      watchdog = _PeerWatchdog(client, jax_distributed.global_state.process_id,
                               jax_distributed.global_state.num_processes, failure_timeout_s)
      watchdog.start()
      _watchdog[0] = watchdog
      atexit.register(_at_exit)   # runs before jax's own exit hook, registered at import

  topo = topology_lib.Topology.from_processes(**topology_kwargs)
  topology_lib.set_default_topology(topo)
  return topo


def process_mesh(axis_names: tuple[str, str] = ("node", "local")) -> jax.sharding.Mesh:
  """The global mesh with one row per process and that process's devices along the row.

  The shape that :func:`initialize`'s Topology describes in JAX's model (one process per node
  driving all its devices): the first axis crosses processes, the second stays inside one.
  Both axes are ``Explicit``.

  Raises:
    ValueError: the processes have different numbers of devices.

  Example:
    >>> jaxring.distributed.initialize()  # doctest: +SKIP
    >>> mesh = jaxring.distributed.process_mesh()  # doctest: +SKIP
    >>> mesh.shape  # doctest: +SKIP
    {'node': 4, 'local': 2}
  """
  import numpy as np
  from jax.sharding import AxisType, Mesh
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  nproc = jax.process_count()
  if len(devices) % nproc or any(
      sum(d.process_index == i for d in devices) != len(devices) // nproc for i in range(nproc)):
    counts = [sum(d.process_index == i for d in devices) for i in range(nproc)]
    raise ValueError(f"jaxring.distributed.process_mesh: processes have different numbers of "
                     f"devices {counts}; the mesh needs the same number in every process")
  return Mesh(np.array(devices).reshape(nproc, len(devices) // nproc), tuple(axis_names),
              axis_types=(AxisType.Explicit,) * 2)


def shutdown() -> None:
  """Leaves the job cleanly: peers stop watching this process, then ``jax.distributed`` shuts down.

  Called automatically at exit; call it yourself to leave earlier.

  Example:
    >>> jaxring.distributed.shutdown()  # doctest: +SKIP
  """
  watchdog, _watchdog[0] = _watchdog[0], None
  if watchdog is not None:
    watchdog.stop()
    try:
      watchdog.publish_state("exiting")
    except Exception:  # noqa: BLE001 - nothing left to tell if the coordinator is gone
      pass
  jax.distributed.shutdown()
  topology_lib.set_default_topology(None)


def is_initialized() -> bool:
  """Whether ``jax.distributed`` is running in this process.

  Example:
    >>> import jaxring.distributed
    >>> jaxring.distributed.is_initialized()
    False
  """
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client is not None


_barrier_counts: dict[str, int] = {}


def barrier(name: str, timeout_s: float = 300.0) -> None:
  """Waits until every process reaches the barrier ``name``; names the ones that did not.

  Every process must call barriers in the same order (each name keeps a call count, so one name
  can be reused). In a single-process job this returns at once.

  Raises:
    BarrierTimeoutError: after ``timeout_s`` seconds, listing the process ids that never arrived.

  Example:
    >>> jaxring.distributed.barrier("after_checkpoint", timeout_s=60)  # doctest: +SKIP
  """
  if not is_initialized():
    return
  client = _client()
  me, n = jax.process_index(), jax.process_count()
  seq = _barrier_counts[name] = _barrier_counts.get(name, 0) + 1
  key = f"jaxring/barrier/{name}/{seq}/"
  client.key_value_set(f"{key}{me}", "arrived", allow_overwrite=True)
  try:
    client.wait_at_barrier(f"jaxring:{name}:{seq}", max(1, int(timeout_s * 1000)))
  except Exception as exc:  # noqa: BLE001 - jax raises JaxRuntimeError(DEADLINE_EXCEEDED)
    arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(key)}
    missing = tuple(sorted(set(range(n)) - arrived))
    raise BarrierTimeoutError(
        f"jaxring.distributed.barrier({name!r}) #{seq}: process {me} waited {timeout_s:g} s; "
        f"process(es) {list(missing)} of {n} did not arrive", missing) from exc
