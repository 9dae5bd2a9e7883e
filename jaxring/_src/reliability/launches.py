"""Launch markers: which collectives each process has launched, for the stuck-peer check.

Heartbeats name a peer that died or froze; fingerprints name one that never *plans* a collective.
A peer that planned it, is alive and heartbeating, but never launches the program again (stuck
in Python between two steps, a deadlock in the input pipeline) leaves its peers blocked inside a
launched program, and neither gloo nor MPI says for whom. So every process counts, per
collective, how many times it has launched a program that contains it; the peer watchdog
(``reliability/watchdog.py``) publishes the counts with its heartbeats and compares them:

* a process that launched collective ``#s`` for the ``k``-th time more than the timeout ago
  names the peers whose count for ``#s`` is still below ``k`` (they never launched it);
* a process that sees a peer ahead of it for more than the timeout says that it is the one stuck.

Both then exit (the watchdog's usual way out), so the job ends non-zero.

How a launch is seen: each jaxring collective of a multi-process job, when it is planned (with its
fingerprint, once per trace), stages the custom call ``jaxring_launch_mark`` (xla_ext/launches.cc)
and ties its result to the collective's input with an optimization barrier, so that the program
runs it before the collective: when a process blocks inside a collective, it has counted that
launch. The devices of one process share the launch's run id and count it once. The custom call
has no JAX effect (XLA keeps it as a side-effecting call), so the program keeps jax's C++
dispatch; a collective run eagerly is counted in Python when it starts. Markers are staged only
while a watchdog runs (:func:`enable`): multi-process jobs with ``JAXRING_FAILURE_TIMEOUT`` > 0,
unless ``JAXRING_LAUNCH_MARKERS=0`` or jaxring's extension did not load. The handler runs on the
host and is registered for CPU and CUDA; on other platforms the marker is a constant and counts
nothing (no stuck peer is named there).
"""
from __future__ import annotations

import collections
import functools
import os
import threading
import time

import numpy as np

ENV_MARKERS = "JAXRING_LAUNCH_MARKERS"   # 0: no markers (no stuck peer is named then)

# the most recent collectives whose counts are kept and published (eager loops over MPI plan a
# new collective per call: the table must stay bounded); xla_ext/launches.h keeps as many
KEEP = 256

_lock = threading.Lock()
_counts: collections.OrderedDict[str, int] = collections.OrderedDict()   # eager launches
_latest: list = [None]   # (key, launch number, time.monotonic() at its start), eager launches
_world = [0]             # processes watched by the running watchdog; 0: markers off
_version = [0]           # bumped at every start: heartbeats publish only what changed


def _ext():
  """jaxring's extension, which counts the launches of compiled programs; None if not loaded."""
  from jaxring._src.ext import loader
  return loader._ext if loader.LOAD_ERROR is None else None


def enable(processes: int) -> None:
  """Stage launch markers into collectives over ``processes`` processes planned from now on
  (the watchdog calls this with its job's size when it starts, with 0 when it stops)."""
  if processes > 1 and (os.environ.get(ENV_MARKERS, "1").lower() in ("0", "off", "false")
                        or _ext() is None):
    return
  _world[0] = int(processes)


def enabled() -> bool:
  return _world[0] > 1


def _started(keys) -> None:
  now = time.monotonic()
  with _lock:
    for key in keys:
      count = _counts.pop(key, 0) + 1
      _counts[key] = count   # most recent last
      _latest[0] = (key, count, now)
    while len(_counts) > KEEP:
      _counts.popitem(last=False)
    _version[0] += 1


@functools.cache
def _mark_p():
  """The primitive that stages ``jaxring_launch_mark``: no operands, a placeholder int32 scalar
  (never written), no JAX effect; lowered as a side-effecting custom call on CPU and CUDA."""
  import jax
  from jax.core import ShapedArray
  from jax.extend.core import Primitive
  from jax.interpreters import batching, mlir

  p = Primitive("jaxring_launch_mark")
  p.def_abstract_eval(lambda *, key: ShapedArray((), np.int32))
  p.def_impl(lambda *, key: (_started((key,)), np.int32(0))[1])   # run eagerly (under vmap)
  batching.primitive_batchers[p] = lambda args, dims, **kw: (p.bind(**kw), batching.not_mapped)
  mlir.register_lowering(p, lambda ctx, *, key: [mlir.ir_constant(np.int32(0))])
  rule = jax.ffi.ffi_lowering("jaxring_launch_mark", has_side_effect=True)
  for platform in ("cpu", "cuda"):
    mlir.register_lowering(p, rule, platform=platform)
  return p


def unmarked(operands):
  """What :func:`marker` returns where nothing is marked: the operands unchanged."""
  return operands


def marker(key: str, processes: int | None = None):
  """Stages "collective ``key`` launches" into the program being traced; returns the function
  that ties it to the collective's operands (a pytree), which must go through it. Identity
  unless markers are enabled.

  Args:
    key: the collective's name common to every process (its fingerprint sequence number).
    processes: how many processes take part (None: all of the job). A collective over fewer
      processes than the watchdog watches is not marked: the others never launch it.
  """
  if _world[0] < 2 or (processes is not None and processes != _world[0]):
    return unmarked
  from jax._src import core
  if core.trace_state_clean():   # an eager collective: it runs now
    _started((key,))
    return unmarked
  from jax import lax
  token = _mark_p().bind(key=key)
  return lambda operands: lax.optimization_barrier((operands, token))[0]


def describe(key: str) -> str:
  """How a key reads in messages.

  Example:
    >>> describe("12"), describe("3@data")
    ('#12', "#3 over axis 'data'")
  """
  seq, _, axis = key.partition("@")
  return f"#{seq}" + (f" over axis {axis!r}" if axis else "")


def table() -> dict[str, int]:
  """Collective key -> how many times this process has launched it."""
  ext = _ext()
  out = dict(ext.launch_table()) if ext is not None else {}
  with _lock:
    out.update(_counts)
  return out


def version() -> int:
  ext = _ext()
  return _version[0] + (ext.launch_version() if ext is not None else 0)


def latest() -> tuple[str, int, float] | None:
  """The last collective this process started: (key, launch number, monotonic time)."""
  ext = _ext()
  found = [x for x in (_latest[0], ext.launch_latest() if ext is not None else None) if x]
  return max(found, key=lambda x: x[2]) if found else None


def behind(key: str, k: int, peers: dict[int, dict[str, int]]) -> dict[int, int]:
  """The peers that have launched ``key`` fewer than ``k`` times: id -> their count.

  A key missing from a peer's table counts as 0, unless the table is full (it may have been
  dropped as old: unknown, not behind).

  Example:
    >>> behind("7", 3, {1: {"7": 3}, 2: {"7": 2}, 3: {}})
    {2: 2, 3: 0}
  """
  out = {}
  for p, t in peers.items():
    count = t.get(key)
    if count is None and len(t) >= KEEP:
      continue
    if (count or 0) < k:
      out[p] = count or 0
  return out


def ahead(peers: dict[int, dict[str, int]]) -> dict[str, tuple[int, int]]:
  """Collectives some peer has launched more often than this process: key -> (peer, its count).

  Example:
    >>> ahead({1: {}})
    {}
  """
  mine = table()
  out: dict[str, tuple[int, int]] = {}
  for p, t in sorted(peers.items()):
    for key, count in t.items():
      if count > mine.get(key, 0) and (key in mine or len(mine) < KEEP):
        if key not in out or count > out[key][1]:
          out[key] = (p, count)
  return out


def reset() -> None:
  """Forgets every count (tests)."""
  with _lock:
    _counts.clear()
    _latest[0] = None
    _version[0] += 1
  ext = _ext()
  if ext is not None:
    ext.launch_reset()
