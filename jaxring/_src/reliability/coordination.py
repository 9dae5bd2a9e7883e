"""The XLA transport across processes: ``jax.distributed``'s coordination service and gloo.

Two things jaxring adds below :func:`jaxring.distributed.initialize`:

* gloo bound to one network interface: gloo advertises the hostname by default, which resolves to
  127.0.0.1 inside a network namespace, so processes in different namespaces cannot connect;
* the peer watchdog's channel (``reliability/watchdog.py``): heartbeat counters in the coordination
  service's key-value store, plus what a failing process tells the others (``failed: ...``) so
  that the process that raised first is named with its error, not only the one that went silent,
  and what a process said as it left (``said``), which a peer whose collective then broke repeats.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time

from jaxring._src.reliability import flight_recorder, launches
from jaxring._src.reliability.watchdog import Watchdog

_KV_PREFIX = "jaxring/peer/"
_PREFIX = "jaxring.distributed: "   # of every line this module prints for a failing job


def global_state():
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state


def use_gloo_interface(interface: str) -> None:
  """Makes the CPU backend create its gloo collectives bound to ``interface``.

  jax 0.10's CPU backend factory calls ``make_gloo_tcp_collectives(distributed_client=...)``
  without an interface; we register a factory that passes one. It runs when the backend first
  starts, after ``jax.distributed`` has its client.
  """
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  if not hasattr(_jax, "make_gloo_tcp_collectives"):
    raise RuntimeError("jaxring.distributed: this jaxlib has no make_gloo_tcp_collectives; cannot "
                       f"bind gloo to interface {interface!r}")

  def make_cpu_client():
    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=global_state().client, interface=interface)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


class CoordinationHeartbeats:
  """Heartbeat counters under ``jaxring/peer/hb/<id>`` in the coordination service.

  A peer that published a state (``exiting``, or ``failed: <error>``) is no longer watched.
  Launch counts (``reliability/launches.py``) go under ``jaxring/peer/launch/<id>`` when they
  changed since the last heartbeat.
  """

  medium = "the coordination service (hosted by process 0)"

  def __init__(self, client, me: int):
    self.client, self.me = client, me
    self.count = 0
    self.last_count: dict[int, str] = {}
    self.states: dict[int, str] = {}
    self.exited: set[int] = set()
    self.said: dict[int, str] = {}   # peer -> the message it printed as it left
    self.who: dict[int, str] = {}
    self.launches: dict[int, dict[str, int]] = {}
    self.sent_version = -1
    self.client.key_value_set(f"{_KV_PREFIX}who/{me}",
                              f" (pid {os.getpid()} on {socket.gethostname()})",
                              allow_overwrite=True)

  def beat(self):
    self.count += 1
    version = launches.version()
    if version != self.sent_version:
      self.client.key_value_set(f"{_KV_PREFIX}launch/{self.me}", json.dumps(launches.table()),
                                allow_overwrite=True)
      self.sent_version = version
    self.client.key_value_set(f"{_KV_PREFIX}hb/{self.me}", str(self.count), allow_overwrite=True)
    heard = set()
    for key, value in self.client.key_value_dir_get(_KV_PREFIX):
      kind, _, pid = key[len(_KV_PREFIX):].partition("/")
      if not pid.isdigit():
        continue
      p = int(pid)
      if kind == "hb" and self.last_count.get(p) != value:
        self.last_count[p] = value
        heard.add(p)
      elif kind == "state":
        self.states[p] = value
      elif kind == "exit":
        self.exited.add(p)
      elif kind == "said":
        self.said[p] = value
      elif kind == "who":
        self.who[p] = value
      elif kind == "launch" and p != self.me:
        self.launches[p] = json.loads(value)
    return heard, set(self.states)

  def publish_state(self, state: str) -> None:
    self.client.key_value_set(f"{_KV_PREFIX}state/{self.me}", state[:2000], allow_overwrite=True)

  def finish(self) -> None:
    self.publish_state("exiting")

  def failed(self) -> dict[int, str]:
    return {p: s[len("failed:"):] for p, s in self.states.items() if s.startswith("failed:")}

  def leave(self, message: str, watchdog: Watchdog) -> None:
    """Prints ``message`` and exits now, skipping jax's shutdown barrier.

    The process hosting the coordination service leaves last: when it goes, jax's client in every
    other process aborts at once with its own message, which would hide ours. Telling the others
    runs in a thread with a deadline: behind a dead link the RPC would block for good.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()

    def tell_and_wait():
      try:
        # before the exit mark: a peer whose collective breaks when this process is gone reads
        # why it left (otherwise it sees only a closed connection)
        self.client.key_value_set(f"{_KV_PREFIX}said/{self.me}", message[:2000],
                                  allow_overwrite=True)
        self.client.key_value_set(f"{_KV_PREFIX}exit/{self.me}", "1", allow_overwrite=True)
        if global_state().service is not None:
          deadline = time.monotonic() + watchdog.timeout + 2 * watchdog.interval
          others = set(range(watchdog.n)) - {self.me}
          while time.monotonic() < deadline:
            watchdog.beat()
            if others <= self.exited | set(watchdog.silent()):
              break
            time.sleep(watchdog.interval / 4)
          time.sleep(0.2)   # the last process to mark its exit is still on its way out
      except Exception:  # noqa: BLE001 - nothing left to coordinate with
        pass

    helper = threading.Thread(target=tell_and_wait, daemon=True)
    helper.start()
    helper.join(watchdog.timeout + 3 * watchdog.interval + 1)
    os._exit(1)


_watchdog: list[Watchdog | None] = [None]


def start_watchdog(timeout: float) -> Watchdog:
  """Starts the peer watchdog of this ``jax.distributed`` job (one per process)."""
  state = global_state()
  flight_recorder.set_identity(state.process_id, state.num_processes)
  flight_recorder.install_signal_handler()
  heartbeats = CoordinationHeartbeats(state.client, state.process_id)
  watchdog = Watchdog(heartbeats, me=state.process_id, n=state.num_processes, timeout=timeout,
                      names=heartbeats.who)
  _watchdog[0] = watchdog.start()
  atexit.register(_at_exit)   # runs before jax's own exit hook, registered at import
  return watchdog


def stop_watchdog() -> None:
  """Peers stop watching this process (it leaves normally)."""
  watchdog, _watchdog[0] = _watchdog[0], None
  if watchdog is not None:
    watchdog.stop()


def _diagnose_and_exit(watchdog: Watchdog) -> None:
  """At exit after an uncaught exception: publish it, name a dead peer if there is one, exit.

  A collective that fails because a peer died usually raises here first (gloo: "Connection closed
  by peer [addr]:port", which names no process). Waiting up to the failure timeout lets the
  heartbeats tell which process it was. Exiting directly also skips jax's shutdown barrier, which
  would wait for the dead peer for ``shutdown_timeout_seconds``.
  """
  heartbeats: CoordinationHeartbeats = watchdog.heartbeats
  exc = sys.last_value
  text = str(exc).strip()
  summary = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
  watchdog.stop(tell_peers=False)
  # a transport error means a peer is probably gone: publishing it at once made the other
  # survivors name this process, not the dead one (a race with their own silence check), so it
  # is published once the heartbeats have had their chance to say who died
  lost_peer = _LOST_PEER.search(text) is not None
  if not lost_peer:
    _publish_failure(heartbeats, summary)
  deadline = time.monotonic() + watchdog.timeout + 2 * watchdog.interval
  lines = []
  # the peer may have left because its own watchdog spoke before ours (both judge the same stuck
  # collective): what this process saw of it still holds
  if lost_peer and (seen := watchdog.stuck(gone=True)):
    lines.append(seen)
  others = set(range(watchdog.n)) - {watchdog.me}
  while time.monotonic() < deadline:
    try:
      watchdog.beat()
    except Exception as e:  # noqa: BLE001
      lines.append(f"{heartbeats.medium} is unreachable: {str(e).splitlines()[0]}")
      break
    if silent := watchdog.silent():
      lines.append(watchdog.describe(silent))
      break
    if others <= set(heartbeats.states) | heartbeats.exited:
      break
    time.sleep(watchdog.interval)
  failed = {p: m for p, m in heartbeats.failed().items() if p != watchdog.me}
  lines += [f"process {p} failed: {msg}" for p, msg in sorted(failed.items())]
  lines += [f"process {p} left saying: {_said(msg)}" for p, msg in sorted(heartbeats.said.items())
            if p != watchdog.me and p not in failed]
  if lost_peer:
    _publish_failure(heartbeats, "; ".join([summary, *lines[:1]]))
  lines = lines or ["no other process reported a failure"]
  heartbeats.leave("\n".join(f"{_PREFIX}{line}" for line in
                             [f"process {watchdog.me} of {watchdog.n} raised {summary}", *lines]),
                   watchdog)


# what a collective raises when a peer's connection is gone (gloo over TCP, MPI)
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused|"
                        r"connection (closed|reset)", re.IGNORECASE)


def _said(message: str) -> str:
  """A peer's parting message on one line, without the prefix of each of its lines.

  Example:
    >>> _said("jaxring.distributed: process 1 of 2 is stuck.\\njaxring.distributed: more")
    'process 1 of 2 is stuck.; more'
  """
  lines = (line.strip() for line in message.splitlines())
  return "; ".join(line.removeprefix(_PREFIX) for line in lines if line)


def _publish_failure(heartbeats, summary: str) -> None:
  try:
    heartbeats.publish_state("failed:" + summary)
  except Exception:  # noqa: BLE001 - the coordinator itself may be gone
    pass


def _at_exit() -> None:
  watchdog = _watchdog[0]
  if watchdog is None:
    return
  if getattr(sys, "last_value", None) is not None:
    _diagnose_and_exit(watchdog)
  import jax
  stop_watchdog()
  jax.distributed.shutdown()
