"""The MPI transport's heartbeat channel for the peer watchdog (``reliability/watchdog.py``).

When a rank exits, ``mpirun`` (hydra) normally kills the job at once, but names the dead process
unreliably (its report gives one pid of the job, not always the dead one's), and a rank that hangs
(a deadlock, a frozen host, ``-disable-auto-cleanup``) leaves its peers blocked in ``MPI_Sendrecv``
for good. Every rank sends an empty message to every other rank per heartbeat, on a duplicate of
the communicator, from the watchdog's thread (MPICH grants ``MPI_THREAD_MULTIPLE``, mpi4py's
default), and a last "finished" message when it ends normally. A heartbeat carries this rank's
launch counts (``reliability/launches.py``, JSON) when they changed since the last one it sent to
that peer; otherwise it is empty.

Ending: a rank sends "finished" to its peers, then receives what they still send until each has
sent its own "finished" or acknowledged ours (a peer that is still running answers at its next
heartbeat and sends nothing after), for at most 3 s (:meth:`MpiHeartbeats.finish`). Messages
left unreceived at ``MPI_Finalize`` make UCX print a warning for each (about 80 at the end of a
job of 8 ranks on 4 nodes).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time

from jaxring._src.reliability import launches
from jaxring._src.extras import require
from jaxring._src.reliability.watchdog import Watchdog

_TAG = 0x7A11   # "I am alive"
_BYE = 0x7A12   # "I have finished": stop watching me
_ACK = 0x7A13   # "I have heard that you finished": nothing more comes from me to you


class MpiHeartbeats:
  """Heartbeats among the ranks of a duplicate of ``comm``."""

  medium = "MPI"

  def __init__(self, comm):
    self.MPI = MPI = require("mpi4py.MPI", "mpi", "jaxring's MPI heartbeats need mpi4py")
    self.comm = comm.Dup()
    self.comm.Set_errhandler(MPI.ERRORS_RETURN)   # a send to a dead peer must not abort us
    self.me, self.n = self.comm.Get_rank(), self.comm.Get_size()
    self.peers = [q for q in range(self.n) if q != self.me]
    self.pending: dict = {}   # peer -> our last heartbeat to it, until it is received
    self.sent_version: dict[int, int] = {}   # peer -> launch counts' version it last got
    self.launches: dict[int, dict[str, int]] = {}

  def beat(self):
    # empty messages go eagerly (complete locally, never wait for the receiver); still at most one
    # outstanding per peer, so that a dead peer's connection does not pile them up
    version, counts = launches.version(), None
    for q in self.peers:
      try:
        if q not in self.pending or self.pending[q].Test():
          payload = b""
          if self.sent_version.get(q) != version:
            counts = counts if counts is not None else json.dumps(launches.table()).encode()
            payload, self.sent_version[q] = counts, version
          self.pending[q] = self.comm.Isend(payload, dest=q, tag=_TAG)
      except Exception:  # noqa: BLE001 - a dead peer: its silence names it
        pass
    heard, finished = set(), set()
    for q, tag in self._received():
      (finished if tag == _BYE else heard).add(q)
    for q in finished:
      if q in self.peers:
        self.peers.remove(q)
        self.comm.Isend(b"", dest=q, tag=_ACK).Free()   # the last message from us to q
      if (old := self.pending.pop(q, None)) is not None:
        old.Free()
    return heard, finished

  def _received(self):
    """Receives every message that has arrived: yields ``(peer, tag)``."""
    MPI = self.MPI
    status = MPI.Status()
    while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
      q, tag = status.Get_source(), status.Get_tag()
      buf = bytearray(status.Get_count(MPI.BYTE))
      self.comm.Recv(buf, source=q, tag=tag)
      if buf:
        self.launches[q] = json.loads(bytes(buf))
      yield q, tag

  def finish(self, timeout: float = 3.0) -> None:
    """Says goodbye, then receives what the peers still send until each has said goodbye too or
    acknowledged ours, for at most ``timeout`` seconds (a peer that hangs never answers). The
    heartbeats still in flight are released, not waited for (MPI completes a released send)."""
    byes = [self.comm.Isend(b"", dest=q, tag=_BYE) for q in self.peers]
    waiting, deadline = set(self.peers), time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
      got = list(self._received())
      waiting -= {q for q, tag in got if tag in (_BYE, _ACK)}
      if not got:
        time.sleep(0.005)
    for req in [*self.pending.values(), *byes]:
      req.Free()
    self.pending.clear()

  def leave(self, message: str, watchdog: Watchdog) -> None:
    del watchdog
    sys.stdout.flush()
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(1)


def start_watchdog(comm, timeout: float) -> Watchdog:
  """Starts the watchdog over ``comm`` (collective: every rank calls it) and stops it at exit."""
  heartbeats = MpiHeartbeats(comm)
  who = heartbeats.comm.allgather((os.getpid(), socket.gethostname()))
  watchdog = Watchdog(heartbeats, me=heartbeats.me, n=heartbeats.n, timeout=timeout, noun="rank",
                      names={q: f" (pid {pid} on {host})" for q, (pid, host) in enumerate(who)})
  # atexit runs last-registered first: this goes before mpi4py's MPI_Finalize
  atexit.register(watchdog.stop)
  return watchdog.start()
