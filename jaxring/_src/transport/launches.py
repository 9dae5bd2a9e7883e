"""Launch markers: which collectives each process has launched, for the stuck-peer check.

Heartbeats name a peer that died or froze; fingerprints name one that never *plans* a collective.
A peer that planned it, is alive and heartbeating, but never launches the program again (stuck
in Python between two steps, a deadlock in the input pipeline) leaves its peers blocked inside a
launched program, and neither gloo nor MPI says for whom. So every process counts, per
collective, how many times it has launched a program that contains it; the peer watchdog
(``transport/watchdog.py``) publishes the counts with its heartbeats and compares them:

* a process that launched collective ``#s`` for the ``k``-th time more than the timeout ago
  names the peers whose count for ``#s`` is still below ``k`` (they never launched it);
* a process that sees a peer ahead of it for more than the timeout says that it is the one stuck.

Both then exit (the watchdog's usual way out), so the job ends non-zero.

How a launch is seen: each jaxring collective of a multi-process job, when it is planned (with its
fingerprint, once per trace), stages a host callback into the program under the name scope
``jaxring_launch_<key>``, behind a branch that is never taken (so it never runs). A program with a host callback is dispatched by jax's Python path
(``pxla.ExecuteReplicated.__call__``), which :func:`install` wraps: on the first launch of an
executable it reads the keys from its HLO's op names, and every launch counts them, on the host,
before the program is enqueued. Counting at dispatch rather than inside the program matters: XLA
may schedule an operand-free callback after the collective it was traced with (measured with a
native psum: it ran after the all-reduce, so a blocked process never counted its launch).
Markers are staged only while a watchdog runs (:func:`enable`): multi-process jobs with
``JAXRING_FAILURE_TIMEOUT`` > 0, unless ``JAXRING_LAUNCH_MARKERS=0``. Cost: the Python dispatch
instead of jax's C++ one, 0.1-0.3 ms per launch (an 8-device ring psum of 4 KB on a loaded
2-core machine: 1.42-1.47 against 1.19-1.22 ms per call).
"""
from __future__ import annotations

import collections
import os
import re
import threading
import time

ENV_MARKERS = "JAXRING_LAUNCH_MARKERS"   # 0: no markers (no stuck peer is named then)

# the most recent collectives whose counts are kept and published (eager loops over MPI plan a
# new collective per call: the table must stay bounded)
KEEP = 256

_lock = threading.Lock()
_counts: collections.OrderedDict[str, int] = collections.OrderedDict()
_latest: list = [None]   # (key, launch number, time.monotonic() at its start)
_world = [0]             # processes watched by the running watchdog; 0: markers off
_version = [0]           # bumped at every start: heartbeats publish only what changed


def enable(processes: int) -> None:
  """Stage launch markers into collectives over ``processes`` processes planned from now on
  (the watchdog calls this with its job's size when it starts, with 0 when it stops)."""
  if processes > 1 and (os.environ.get(ENV_MARKERS, "1").lower() in ("0", "off", "false")
                        or not install()):
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


def _scope(key: str) -> str:
  return "jaxring_launch_" + key.encode().hex()


_SCOPE = re.compile(r"jaxring_launch_([0-9a-f]+)")


def _noop() -> None:
  pass


def mark(key: str, processes: int | None = None) -> None:
  """Stages "collective ``key`` launches" into the program being traced (no-op unless enabled).

  Args:
    key: the collective's name common to every process (its fingerprint sequence number).
    processes: how many processes take part (None: all of the job). A collective over fewer
      processes than the watchdog watches is not marked: the others never launch it.
  """
  if _world[0] < 2 or (processes is not None and processes != _world[0]):
    return
  import jax
  import jax.numpy as jnp
  from jax._src import core
  if core.trace_state_clean():   # an eager collective: it runs now
    _started((key,))
    return
  from jax import lax
  # the callback is never run: its presence gives the program jax's Python dispatch (where the
  # launch is counted) and its name scope the key. Run on every device at every launch, it cost
  # 3 ms per launch of an 8-device psum (measured: 6.4 against 3.3 ms); behind a predicate XLA
  # cannot fold (an optimization barrier), it costs a branch.
  never = lax.optimization_barrier(jnp.zeros((), bool))
  with jax.named_scope(_scope(key)):
    lax.cond(never, lambda: jax.debug.callback(_noop), lambda: None)


_programs: collections.OrderedDict[int, tuple] = collections.OrderedDict()


def _keys_of(executable) -> tuple[str, ...]:
  """The collectives marked in a compiled program (read once per executable)."""
  hit = _programs.get(id(executable))
  if hit is not None and hit[0] is executable:
    return hit[1]
  try:
    text = "".join(m.to_string() for m in executable.xla_executable.hlo_modules())
    keys = tuple(dict.fromkeys(bytes.fromhex(h).decode() for h in _SCOPE.findall(text)))
  except Exception:  # noqa: BLE001 - no HLO to read: nothing to count
    keys = ()
  _programs[id(executable)] = (executable, keys)   # held, so that its id is not reused
  while len(_programs) > 4 * KEEP:
    _programs.popitem(last=False)
  return keys


def install() -> bool:
  """Counts launches at jax's Python dispatch of compiled programs; False where this jax has no
  such point (then no stuck peer is named)."""
  try:
    from jax._src.interpreters import pxla
    cls = pxla.ExecuteReplicated
  except (ImportError, AttributeError):
    return False
  if getattr(cls.__call__, "_jaxring_launches", False):
    return True
  original = cls.__call__

  def call(self, *args):
    if self.has_host_callbacks and _world[0] > 1:
      keys = _keys_of(self)
      if keys:
        _started(keys)
    return original(self, *args)

  call._jaxring_launches = True
  cls.__call__ = call
  return True


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
  with _lock:
    return dict(_counts)


def version() -> int:
  return _version[0]


def latest() -> tuple[str, int, float] | None:
  """The last collective this process started: (key, launch number, monotonic time)."""
  return _latest[0]


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
