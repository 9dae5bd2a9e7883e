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

import math
import os
from typing import Any

import jax

from jaxring._src import topology as topology_lib
from jaxring._src.reliability import coordination
from jaxring._src.reliability.rendezvous import StartupTimeoutError as StartupTimeoutError
from jaxring._src.reliability.rendezvous import roll_call
from jaxring._src.reliability.watchdog import ENV_FAILURE_TIMEOUT as ENV_FAILURE_TIMEOUT
from jaxring._src.reliability.watchdog import failure_timeout

ENV_COORDINATOR = "JAXRING_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRING_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRING_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXRING_LOCAL_DEVICE_COUNT"
ENV_INTERFACE = "JAXRING_INTERFACE"
ENV_NETWORK_BANDWIDTH = "JAXRING_NETWORK_BANDWIDTH"


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
  failure_timeout_s = failure_timeout(failure_timeout_s)
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
      coordination.use_gloo_interface(interface)
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id,
        initialization_timeout=max(1, math.ceil(timeout_s)),
        heartbeat_timeout_seconds=jax_heartbeat,
        shutdown_timeout_seconds=max(10, math.ceil(timeout_s)), **kwargs)
    if failure_timeout_s > 0:
      coordination.start_watchdog(failure_timeout_s)

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
  coordination.stop_watchdog()
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
