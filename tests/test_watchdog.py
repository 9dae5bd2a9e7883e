"""The one peer watchdog's judgement, over an in-process channel (the transports' channels run in
tests/test_distributed.py and tests/test_mpi.py with real processes)."""
import time

from jaxring._src.transport.watchdog import Watchdog, failure_timeout


class Board:
  """A shared heartbeat board: what the coordination service's key-value store is to processes."""

  def __init__(self):
    self.counts, self.finished, self.broken = {}, set(), False


class BoardHeartbeats:
  medium = "the board"

  def __init__(self, board: Board, me: int):
    self.board, self.me, self.seen, self.left = board, me, {}, []

  def beat(self):
    if self.board.broken:
      raise ConnectionError("board unplugged\nsecond line")
    self.board.counts[self.me] = self.board.counts.get(self.me, 0) + 1
    heard = {p for p, c in self.board.counts.items() if self.seen.get(p) != c}
    self.seen = dict(self.board.counts)
    return heard, set(self.board.finished)

  def finish(self):
    self.board.finished.add(self.me)

  def leave(self, message, watchdog):
    self.left.append(message)


def _pair(timeout, n=3):
  board = Board()
  dogs = [Watchdog(BoardHeartbeats(board, i), me=i, n=n, timeout=timeout,
                   names={p: f" (pid {100 + p} on h{p})" for p in range(n)}) for i in range(n)]
  return board, dogs


def test_a_silent_peer_is_named_after_the_timeout_and_not_before():
  _, (a, b, c) = _pair(timeout=0.3)
  for dog in (a, b, c):
    dog.beat()
  assert a.check() is None
  time.sleep(0.35)
  b.beat()                      # b keeps beating, c went silent
  problem = a.check()
  assert problem is not None and problem.startswith("process 2 of 3 (pid 102 on h2) died or hangs")
  assert "process 1" not in problem and "failure timeout 0.3 s" in problem


def test_a_peer_that_finished_is_never_reported():
  _, (a, b, c) = _pair(timeout=0.2)
  for dog in (a, b, c):
    dog.beat()
  c.stop()                      # says goodbye
  time.sleep(0.25)
  b.beat()
  assert a.check() is None and 2 not in a.last_seen


def test_a_dead_channel_is_tolerated_for_the_timeout_then_named():
  board, (a, b, _) = _pair(timeout=0.2, n=3)
  a.beat()
  board.broken = True
  assert a.check() is None      # not yet: a silent channel is judged like a silent peer
  time.sleep(0.25)
  problem = a.check()
  assert problem.startswith("the board has been unreachable for") and "board unplugged" in problem
  assert "second line" not in problem


def test_the_thread_fails_with_the_named_peer():
  _, (a, b) = _pair(timeout=0.2, n=2)
  a.start()
  deadline = time.monotonic() + 5
  while not a.heartbeats.left and time.monotonic() < deadline:
    time.sleep(0.05)
  a.stop(tell_peers=False)
  [message] = a.heartbeats.left
  assert message.startswith("jaxring.distributed: process 1 of 2 (pid 101 on h1) died or hangs")
  assert message.endswith("Process 0 exits so that the job does not hang in a collective that "
                          "cannot complete.")


def test_failure_timeout_reads_the_environment(monkeypatch):
  monkeypatch.setenv("JAXRING_FAILURE_TIMEOUT", "7.5")
  assert failure_timeout(None) == 7.5 and failure_timeout(0) == 0.0
  monkeypatch.delenv("JAXRING_FAILURE_TIMEOUT")
  assert failure_timeout(None) == 120.0


def test_a_channel_that_blocks_instead_of_failing_is_named_after_the_timeout():
  import threading
  board, (a, _) = _pair(timeout=0.3, n=2)
  forever = threading.Event()
  a.heartbeats.beat = lambda: forever.wait()   # an RPC to a coordinator behind a dead link
  t0 = time.monotonic()
  problem = None
  while problem is None and time.monotonic() - t0 < 5:
    problem = a.check()
  assert problem.startswith("the board has not answered a heartbeat for"), problem
  assert 0.3 <= time.monotonic() - t0 < 2
  t0 = time.monotonic()
  a.stop()   # the blocked heartbeat holds the lock: stopping must not wait for it for good
  assert time.monotonic() - t0 < 3
  forever.set()
