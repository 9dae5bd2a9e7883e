"""A peer watchdog for MPI jobs: a rank that dies or hangs is named, never waited for silently.

When a rank exits, ``mpirun`` (hydra) normally kills the job at once, but names the dead process
unreliably (its report gives one pid of the job, not always the dead one's), and a rank that hangs
(a deadlock, a frozen host, ``-disable-auto-cleanup``) leaves its peers blocked in ``MPI_Sendrecv``
for good. Here every rank sends an empty heartbeat message to every other rank every ``interval``
seconds on a communicator of its own (and a last "finished" message at exit, so that a rank that
ends normally is never reported), from a daemon thread (MPICH grants ``MPI_THREAD_MULTIPLE``,
mpi4py's default); a peer silent for ``timeout`` seconds by this rank's clock is named (rank, pid,
host) on stderr, and this rank exits instead of hanging in a collective that cannot complete.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

_TAG = 0x7A11   # "I am alive"
_BYE = 0x7A12   # "I have finished": stop watching me


class MpiWatchdog:
  """Heartbeats among the ranks of ``comm``; see the module docstring."""

  def __init__(self, comm, timeout: float):
    from mpi4py import MPI
    self.comm = comm.Dup()
    self.comm.Set_errhandler(MPI.ERRORS_RETURN)   # a send to a dead peer must not abort us
    self.me, self.n = self.comm.Get_rank(), self.comm.Get_size()
    self.who = self.comm.allgather((os.getpid(), socket.gethostname()))
    self.timeout, self.interval = timeout, min(1.0, timeout / 4)
    now = time.monotonic()
    self.last_seen = {q: now for q in range(self.n) if q != self.me}
    self.stop_event = threading.Event()
    self.lock = threading.Lock()
    self.pending: dict = {}   # peer -> our last heartbeat to it, until it is received
    self.thread = threading.Thread(target=self._run, name="jaxring-mpi-watchdog", daemon=True)
    self.thread.start()
    # atexit runs last-registered first: this goes before mpi4py's MPI_Finalize
    atexit.register(self.stop)

  def stop(self) -> None:
    """Stops heartbeating and tells every peer this rank finished (so none reports it silent).

    The heartbeats still in flight are released, not waited for: a finished peer never
    receives them, and MPI completes a released send on its own.
    """
    if self.stop_event.is_set():
      return
    self.stop_event.set()
    self.thread.join(timeout=2 * self.interval + 1)
    with self.lock:
      try:
        byes = [self.comm.Isend(b"", dest=q, tag=_BYE) for q in self.last_seen]
        for req in [*self.pending.values(), *byes]:
          req.Free()
      except Exception:  # noqa: BLE001 - a dead peer: nothing left to tell it
        pass
      self.pending.clear()

  def _beat(self) -> None:
    from mpi4py import MPI
    # empty messages go eagerly (complete locally, never wait for the receiver); still at most one
    # outstanding per peer, so that a dead peer's connection does not pile them up
    for q in self.last_seen:
      if q not in self.pending or self.pending[q].Test():
        self.pending[q] = self.comm.Isend(b"", dest=q, tag=_TAG)
    status = MPI.Status()
    while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
      q, tag = status.Get_source(), status.Get_tag()
      self.comm.Recv(bytearray(0), source=q, tag=tag)
      if tag == _BYE:
        self.last_seen.pop(q, None)
        old = self.pending.pop(q, None)
        if old is not None:
          old.Free()
      elif q in self.last_seen:
        self.last_seen[q] = time.monotonic()

  def _run(self) -> None:
    while not self.stop_event.wait(self.interval):
      try:
        with self.lock:
          if self.stop_event.is_set():
            return
          self._beat()
      except Exception as exc:  # noqa: BLE001 - MPI reports a failed peer as an error too
        problem = f"heartbeat failed: {str(exc).splitlines()[0] if str(exc) else type(exc)}"
      else:
        now = time.monotonic()
        silent = {q: now - t for q, t in self.last_seen.items() if now - t > self.timeout}
        if not silent:
          continue
        problem = "; ".join(
            f"rank {q} of {self.n} (pid {self.who[q][0]} on {self.who[q][1]}) died or hangs: no "
            f"heartbeat for {age:.1f} s (failure timeout {self.timeout:g} s)"
            for q, age in sorted(silent.items()))
      sys.stdout.flush()
      sys.stderr.write(f"jaxring.distributed: {problem}. Rank {self.me} exits so that the job "
                       "does not hang in a collective that cannot complete.\n")
      sys.stderr.flush()
      os._exit(1)
