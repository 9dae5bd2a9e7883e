"""The device hierarchy seen by the collectives: levels ordered fast -> slow.

A level is one tier of the network (devices in one process or joined by NVLink; hosts joined by
Ethernet or InfiniBand). Each level has a size (members per group), a bandwidth (bytes/s per member
link, one direction) and a latency (seconds per message). The planner (``algorithm="auto"``) and
the hierarchical algorithm read these; nothing here moves data.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

# Defaults for the two tiers jaxring can detect on its own. In-process collectives are memory
# copies (~14 GB/s measured on the CI machine, see docs/benchmarks.md); between processes we assume
# commodity 1 Gbit/s Ethernet unless told otherwise (the emulated cluster's links).
LOCAL_BANDWIDTH = 10e9
LOCAL_LATENCY = 20e-6
NETWORK_BANDWIDTH = 1e9 / 8
NETWORK_LATENCY = 100e-6


@dataclasses.dataclass(frozen=True)
class Level:
  """One tier of the hierarchy.

  Attributes:
    name: the level's name; also the mesh axis name when the level is a mesh axis, and the key of
      per-level ``compression``/``algorithm`` dicts.
    size: members in one group of this level (e.g. devices per node for ``local``).
    bandwidth: bytes per second one member can send to the next (one direction).
    latency: seconds per message (the alpha of the alpha-beta model).
    pieces: sub-chunk transfers per ring hop on this level. With more than one, piece ``j + 1``
      can be on the wire while piece ``j`` is decoded, added and re-encoded, where the runtime
      runs a collective beside computation (XLA:GPU's asynchronous collectives). XLA:CPU runs
      them in turn, and each piece pays the latency once more, so the default is 1 (measured on
      the emulated cluster: docs/benchmarks.md).
    in_process: every group of this level lives in one process (``local`` of
      :meth:`Topology.from_processes`): its reduce-scatter can run in shared memory.
  """

  name: str
  size: int
  bandwidth: float = LOCAL_BANDWIDTH
  latency: float = LOCAL_LATENCY
  pieces: int = 1
  in_process: bool = False

  def __post_init__(self):
    if not isinstance(self.size, (int, np.integer)) or self.size < 1:
      raise ValueError(f"Level {self.name!r}: size must be a positive integer, got {self.size!r}")
    if not self.bandwidth > 0:
      raise ValueError(f"Level {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
    if not self.latency >= 0:
      raise ValueError(f"Level {self.name!r}: latency must be >= 0 s, got {self.latency!r}")
    if not isinstance(self.pieces, (int, np.integer)) or self.pieces < 1:
      raise ValueError(f"Level {self.name!r}: pieces must be a positive integer, got "
                       f"{self.pieces!r}")


@dataclasses.dataclass(frozen=True)
class Topology:
  """Levels of the device hierarchy, ordered fastest first.

  Device ``i`` of a flat axis of size ``prod(level sizes)`` sits at position
  ``(i // stride_k) % size_k`` in level ``k``, where ``stride_k`` is the product of the sizes of the
  faster levels: the fastest level varies fastest (devices of one node are contiguous).

  Example:
    >>> topo = Topology((Level("local", 4, 300e9, 5e-6), Level("node", 2, 12.5e9, 20e-6)))
    >>> topo.size, topo.strides()
    (8, (1, 4))
  """

  levels: tuple[Level, ...]

  def __post_init__(self):
    levels = tuple(self.levels)
    if not levels:
      raise ValueError("Topology needs at least one level")
    names = [lv.name for lv in levels]
    if len(set(names)) != len(names):
      raise ValueError(f"Topology level names must be unique, got {names}")
    object.__setattr__(self, "levels", levels)

  @property
  def size(self) -> int:
    return math.prod(lv.size for lv in self.levels)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(lv.name for lv in self.levels)

  def strides(self) -> tuple[int, ...]:
    out, s = [], 1
    for lv in self.levels:
      out.append(s)
      s *= lv.size
    return tuple(out)

  def level(self, name: str) -> Level:
    for lv in self.levels:
      if lv.name == name:
        return lv
    raise KeyError(f"no level named {name!r} in topology {self.names}")

  def without_trivial_levels(self) -> "Topology":
    kept = tuple(lv for lv in self.levels if lv.size > 1)
    return Topology(kept or self.levels[:1])

  @classmethod
  def from_processes(cls, devices: Sequence[jax.Device] | None = None, *,
                     local_bandwidth: float = LOCAL_BANDWIDTH, local_latency: float = LOCAL_LATENCY,
                     network_bandwidth: float = NETWORK_BANDWIDTH,
                     network_latency: float = NETWORK_LATENCY) -> "Topology":
    """Two levels from process boundaries: ``local`` (devices of one process), ``node`` (processes).

    Example:
      >>> Topology.from_processes().names  # one process: a single level
      ('local',)
    """
    devices = list(jax.devices() if devices is None else devices)
    by_proc: dict[int, int] = {}
    for d in devices:
      by_proc[d.process_index] = by_proc.get(d.process_index, 0) + 1
    counts = set(by_proc.values())
    if len(counts) != 1:
      raise ValueError(f"processes hold different numbers of devices: {by_proc}; jaxring's "
                       "hierarchy needs the same number of devices in every process")
    local = Level("local", counts.pop(), local_bandwidth, local_latency, in_process=True)
    if len(by_proc) == 1:
      return cls((local,))
    return cls((local, Level("node", len(by_proc), network_bandwidth, network_latency)))

  @classmethod
  def from_mesh(cls, mesh: jax.sharding.Mesh, *, local_bandwidth: float = LOCAL_BANDWIDTH,
                local_latency: float = LOCAL_LATENCY,
                network_bandwidth: float = NETWORK_BANDWIDTH,
                network_latency: float = NETWORK_LATENCY) -> "Topology":
    """One level per mesh axis: axes whose devices span processes are network levels.

    Levels are ordered fast -> slow: in-process axes first, and within a tier the mesh's last
    (innermost) axis first.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
      >>> Topology.from_mesh(mesh).names
      ('local', 'node')
    """
    devs = np.asarray(mesh.devices)
    procs = np.vectorize(lambda d: d.process_index)(devs)
    levels = []
    for ax, name in enumerate(mesh.axis_names):
      crosses = bool((np.diff(procs, axis=ax) != 0).any()) if devs.shape[ax] > 1 else False
      if crosses:
        levels.append((1, -ax, Level(name, devs.shape[ax], network_bandwidth, network_latency)))
      else:
        levels.append((0, -ax, Level(name, devs.shape[ax], local_bandwidth, local_latency)))
    return cls(tuple(lv for *_, lv in sorted(levels, key=lambda t: t[:2])))


_default: list[Topology | None] = [None]


def set_default_topology(topology: Topology | None) -> None:
  """Sets the topology ``auto`` and ``hierarchical`` use when none is given (None: detect)."""
  if topology is not None and not isinstance(topology, Topology):
    raise TypeError(f"expected a jaxring.Topology or None, got {type(topology).__name__}")
  _default[0] = topology


def default_topology() -> Topology:
  """The topology set by :func:`set_default_topology`, else one detected from processes."""
  return _default[0] if _default[0] is not None else Topology.from_processes()


@contextlib.contextmanager
def use_topology(topology: Topology):
  """Within the block (at trace time), ``auto`` and ``hierarchical`` use ``topology``.

  The topology is read when a function is traced: a function jitted and called before the block
  keeps the plan it was traced with (jit's cache does not see the topology). Trace inside the
  block, or set it once with :func:`set_default_topology` before the first call.

  Example:
    >>> topo = Topology((Level("local", 4), Level("node", 2, 1.25e8, 1e-4)))
    >>> with use_topology(topo):
    ...   y = f(x)  # jaxring.psum(..., "data", algorithm="hierarchical") inside f: 2 nodes x 4
  """
  prev = _default[0]
  set_default_topology(topology)
  try:
    yield topology
  finally:
    _default[0] = prev
