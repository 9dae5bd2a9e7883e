"""One peer watchdog for every multi-process transport: a peer that dies or hangs is named.

A collective blocked on a dead or frozen peer never returns, and neither gloo nor MPI says which
peer it waits for. Every process therefore heartbeats to every other one through a side channel
that does not depend on the collectives (the coordination service's key-value store for
``jax.distributed``, a duplicate communicator for MPI), from a daemon thread. A peer silent for
``timeout`` seconds by this process's own clock (so clock skew between hosts does not matter) is
named on stderr by every other process, which then exits instead of waiting for good. A peer that
ends normally says so first, so processes finishing at different times are never reported.

The detection (who is silent, for how long, what to print, when to give up on the channel) lives
here once; each transport supplies only its channel, a :class:`Heartbeats`.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from jaxring._src.reliability import flight_recorder, launches

ENV_FAILURE_TIMEOUT = "JAXRING_FAILURE_TIMEOUT"
DEFAULT_FAILURE_TIMEOUT_S = 120.0


def failure_timeout(value: float | None) -> float:
  """``value``, else ``JAXRING_FAILURE_TIMEOUT``, else 120 s; ``0`` means no watchdog.

  Example:
    >>> failure_timeout(5.0)
    5.0
  """
  if value is None:
    value = float(os.environ.get(ENV_FAILURE_TIMEOUT) or DEFAULT_FAILURE_TIMEOUT_S)
  return float(value)


class Heartbeats(Protocol):
  """The side channel a transport heartbeats over."""

  medium: str   # what a failing channel is called in messages, e.g. "the coordination service"
  # peer id -> its launch counts (reliability/launches.py), as last received with its heartbeats
  launches: dict[int, dict[str, int]]

  def beat(self) -> tuple[Iterable[int], Iterable[int]]:
    """Sends this process's heartbeat; returns (peers heard from, peers that said they finished).

    Raises when the channel itself fails (the watchdog tolerates that for ``timeout`` seconds).
    """

  def finish(self) -> None:
    """Tells every peer that this process finished normally (so none reports it silent)."""

  def leave(self, message: str, watchdog: Watchdog) -> None:
    """Prints ``message`` and ends the process (never returns)."""


class _Beat:
  """One heartbeat in a daemon thread: ``done`` once it returned or raised (``error``)."""

  def __init__(self, watchdog: "Watchdog"):
    self.done, self.error = threading.Event(), None

    def run():
      try:
        watchdog.beat()
      except Exception as exc:  # noqa: BLE001 - judged by the watchdog
        self.error = exc
      finally:
        self.done.set()
    threading.Thread(target=run, name="jaxring-heartbeat", daemon=True).start()


class Watchdog:
  """Watches the peers ``0..n-1`` (but ``me``) over ``heartbeats``; see the module docstring.

  Args:
    heartbeats: the channel.
    me, n: this process's id and the number of processes.
    timeout: seconds of silence after which a peer is declared dead or hung.
    noun: what a peer is called in messages ("process", "rank").
    names: extra words per peer id, e.g. ``{2: " (pid 41 on node2)"}``.
  """

  def __init__(self, heartbeats: Heartbeats, *, me: int, n: int, timeout: float,
               noun: str = "process", names: dict[int, str] | None = None):
    self.heartbeats, self.me, self.n, self.timeout = heartbeats, me, n, timeout
    self.noun = noun
    self.names = {} if names is None else names   # shared: a channel may learn names later
    self.interval = min(1.0, timeout / 4)
    now = time.monotonic()
    self.last_seen = {p: now for p in range(n) if p != me}
    self.failing_since: float | None = None
    self._ahead_since: dict[tuple[str, int], float] = {}   # (key, our count) -> first seen
    self._pending: tuple[float, _Beat] | None = None   # a heartbeat in flight, since when
    self.lock = threading.Lock()
    self.stop_event = threading.Event()
    self.thread = threading.Thread(target=self._run, name=f"jaxring-{noun}-watchdog",
                                   daemon=True)

  def start(self) -> Watchdog:
    """One heartbeat now (a channel that does not work raises here), then one per interval."""
    self.beat()
    launches.enable(self.n)
    self.thread.start()
    return self

  def beat(self) -> None:
    """One heartbeat: send ours, record whom we heard and who finished."""
    with self.lock:
      heard, finished = self.heartbeats.beat()
      now = time.monotonic()
      for p in heard:
        if p in self.last_seen:
          self.last_seen[p] = now
      for p in finished:
        self.last_seen.pop(p, None)

  def silent(self) -> dict[int, float]:
    """Watched peers silent for longer than the timeout: id -> seconds since last heard."""
    now = time.monotonic()
    return {p: now - t for p, t in self.last_seen.items() if now - t > self.timeout}

  def describe(self, silent: dict[int, float]) -> str:
    """The message naming silent peers.

    Example:
      >>> w = Watchdog(None, me=0, n=4, timeout=5.0, names={2: " (pid 41 on node2)"})
      >>> w.describe({2: 5.2})
      'process 2 of 4 (pid 41 on node2) died or hangs: no heartbeat for 5.2 s (failure timeout 5 s)'
    """
    return "; ".join(
        f"{self.noun} {p} of {self.n}{self.names.get(p, '')} died or hangs: no heartbeat for "
        f"{age:.1f} s (failure timeout {self.timeout:g} s)" for p, age in sorted(silent.items()))

  def check(self) -> str | None:
    """One round: heartbeat, then what is wrong (a silent peer, a dead channel) or None.

    The heartbeat runs in a thread of its own: a channel can block instead of failing (an RPC to
    a coordinator behind a dead link waits for its own, much longer, deadline), and a watchdog
    that blocks with it would never give up.
    """
    now = time.monotonic()
    if self._pending is None:
      self._pending = (now, _Beat(self))
    started, beat = self._pending
    beat.done.wait(min(self.interval, self.timeout))
    now = time.monotonic()
    if not beat.done.is_set():
      if now - started <= self.timeout:
        return None
      return (f"{self.heartbeats.medium} has not answered a heartbeat for {now - started:.1f} s"
              f" (failure timeout {self.timeout:g} s)")
    self._pending = None
    if beat.error is not None:
      exc = beat.error
      self.failing_since = self.failing_since or started
      if now - self.failing_since <= self.timeout:
        return None   # a silent channel is judged like a silent peer: after the timeout
      first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
      return (f"{self.heartbeats.medium} has been unreachable for "
              f"{now - self.failing_since:.1f} s: {first}")
    self.failing_since = None
    silent = self.silent()
    if silent:
      return self.describe(silent)
    failed = {p: m for p, m in getattr(self.heartbeats, "failed", dict)().items() if p != self.me}
    if failed:   # the job cannot go on: say so here too rather than wait in a collective
      return "; ".join(f"{self.noun} {p} of {self.n}{self.names.get(p, '')} failed: {m.strip()}"
                       for p, m in sorted(failed.items()))
    return self.stuck()

  def stuck(self, *, gone: bool = False) -> str | None:
    """A live peer that never launched a collective this process waits in, or this process
    behind its peers, for longer than the timeout (``reliability/launches.py``); else None.

    ``gone``: the collective already failed because a peer left; a peer behind is named even if
    it has since gone quiet (it was heartbeating while it held the collective up).
    """
    peers = {p: t for p, t in getattr(self.heartbeats, "launches", {}).items()
             if p in self.last_seen}
    now = time.monotonic()
    latest = launches.latest()
    if latest is not None and now - latest[2] > self.timeout:
      key, k, since = latest
      late = launches.behind(key, k, peers)
      # a peer level with this process on another collective it launched k times is inside the
      # launch, waiting in an earlier collective whose marker ran before this one's: not the
      # one stuck before launching (unless every late peer is)
      mine = [c for c, n in launches.table().items() if n == k and c != key]
      inside = {p for p in late if any(peers[p].get(c, 0) >= k for c in mine)}
      late = {p: c for p, c in late.items() if p not in inside} or late
      # a peer behind that has also gone quiet is frozen or dead, not stuck: the silence check
      # names it (within the timeout of its last heartbeat), with the right words
      quiet = {p for p in late if now - self.last_seen.get(p, now) > 3 * self.interval}
      if late and (gone or not quiet):
        who = ", ".join(f"{self.noun} {p} of {self.n}{self.names.get(p, '')} launched it "
                        f"{c} time(s)" for p, c in sorted(late.items()))
        return (f"collective {launches.describe(key)} (launch {k}) started here "
                f"{now - since:.1f} s ago and cannot complete: {who}; alive (heartbeating) but "
                f"stuck before launching it (failure timeout {self.timeout:g} s)")
    mine = launches.table()
    seen = set()
    for key, (p, count) in launches.ahead(peers).items():
      seen.add((key, mine.get(key, 0)))
      first = self._ahead_since.setdefault((key, mine.get(key, 0)), now)
      if now - first > self.timeout:
        return (f"{self.noun} {self.me} of {self.n} is stuck: it has launched collective "
                f"{launches.describe(key)} {mine.get(key, 0)} time(s), but {self.noun} {p} of "
                f"{self.n}{self.names.get(p, '')} launched it {count} time(s) and has waited "
                f"in it for at least {now - first:.1f} s (failure timeout {self.timeout:g} s)")
    for old in set(self._ahead_since) - seen:
      del self._ahead_since[old]
    return None

  def fail(self, problem: str) -> None:
    """Names the problem, dumps the flight recorder, and ends this process (through the
    channel, which may wait a little)."""
    self.stop_event.set()
    try:
      flight_recorder.dump(reason=problem)
    except Exception:  # noqa: BLE001 - a full disk must not keep a dead job alive
      pass
    self.heartbeats.leave(
        f"jaxring.distributed: {problem}. {self.noun.capitalize()} {self.me} exits so that the "
        "job does not hang in a collective that cannot complete.", self)

  def stop(self, *, tell_peers: bool = True) -> None:
    """Stops heartbeating; with ``tell_peers``, peers stop watching this process."""
    launches.enable(0)
    if self.stop_event.is_set() and not self.thread.is_alive():
      return
    self.stop_event.set()
    if self.thread.is_alive() and threading.current_thread() is not self.thread:
      self.thread.join(timeout=2 * self.interval + 1)
    # a heartbeat blocked on a dead channel holds the lock: then there is nobody to tell
    if tell_peers and self.lock.acquire(timeout=2 * self.interval + 1):
      try:
        self.heartbeats.finish()
      except Exception:  # noqa: BLE001 - a dead channel: nothing left to tell
        pass
      finally:
        self.lock.release()

  def _run(self) -> None:
    while not self.stop_event.wait(self.interval):
      problem = self.check()
      if problem and not self.stop_event.is_set():
        self.fail(problem)
