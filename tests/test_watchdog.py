"""The one peer watchdog's judgement, over an in-process channel (the transports' channels run in
tests/test_distributed.py and tests/test_mpi.py with real processes)."""
import time

from jaxring._src.reliability.watchdog import Watchdog, failure_timeout


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


# --- live peers stuck between collectives (reliability/launches.py) --------------------------------


def _launch_dog(timeout, tables, failed=None):
  from jaxring._src.reliability import launches
  launches.reset()
  hb = BoardHeartbeats(Board(), 0)
  hb.launches = tables
  if failed is not None:
    hb.failed = lambda: failed
  dog = Watchdog(hb, me=0, n=3, timeout=timeout,
                 names={p: f" (pid {100 + p} on h{p})" for p in range(3)})
  dog.beat()
  return launches, dog


def test_a_peer_that_never_launched_the_collective_we_wait_in_is_named():
  launches, dog = _launch_dog(0.3, {1: {"7": 2}, 2: {"7": 1}})
  launches._started(("7",))
  launches._started(("7",))     # our second launch of collective #7
  assert dog.stuck() is None    # not before the timeout
  time.sleep(0.35)
  dog.last_seen.update({1: time.monotonic(), 2: time.monotonic()})   # both heartbeat
  problem = dog.stuck()
  assert problem is not None and problem.startswith(
      "collective #7 (launch 2) started here"), problem
  assert "process 2 of 3 (pid 102 on h2) launched it 1 time(s)" in problem
  assert "process 1" not in problem
  launches.reset()


def test_a_peer_waiting_in_an_earlier_collective_of_the_launch_is_not_named_with_the_stuck_one():
  # our markers of #7 and #8 ran in our first launch (#8's before #7 completed); peer 2 launched
  # the program too and waits in #7, peer 1 never launched it: only peer 1 is named
  launches, dog = _launch_dog(0.2, {1: {}, 2: {"7": 1}})
  launches._started(("7",))
  launches._started(("8",))
  time.sleep(0.25)
  dog.last_seen.update({1: time.monotonic(), 2: time.monotonic()})
  problem = dog.stuck()
  assert problem is not None and problem.startswith("collective #8 (launch 1)"), problem
  assert "process 1 of 3 (pid 101 on h1) launched it 0 time(s)" in problem
  assert "process 2" not in problem
  # where every late peer is inside the launch, they are all named (nobody is left out)
  launches, dog = _launch_dog(0.2, {1: {"7": 1}, 2: {"7": 1}})
  launches._started(("7",))
  launches._started(("8",))
  time.sleep(0.25)
  dog.last_seen.update({1: time.monotonic(), 2: time.monotonic()})
  problem = dog.stuck()
  assert "process 1 of 3" in problem and "process 2 of 3" in problem, problem
  launches.reset()


def test_peers_as_far_as_us_are_never_reported_however_long_we_idle():
  launches, dog = _launch_dog(0.2, {1: {"7": 1, "8": 1}, 2: {"7": 3, "8": 1}})
  launches._started(("7", "8"))
  time.sleep(0.25)
  assert dog.stuck() is None    # a finished program, then host work: nobody is behind
  launches.reset()


def test_a_process_behind_its_peers_says_it_is_the_stuck_one():
  launches, dog = _launch_dog(0.2, {1: {"3@data": 5}, 2: {"3@data": 4}})
  for _ in range(4):
    launches._started(("3@data",))
  assert dog.stuck() is None    # a peer one launch ahead is normal, for a while
  time.sleep(0.25)
  problem = dog.stuck()
  assert problem == ("process 0 of 3 is stuck: it has launched collective #3 over axis 'data' "
                     "4 time(s), but process 1 of 3 (pid 101 on h1) launched it 5 time(s) and "
                     f"has waited in it for at least {problem.split('at least ')[1][:3]} s "
                     "(failure timeout 0.2 s)"), problem
  launches._started(("3@data",))   # we caught up: the clock starts again
  assert dog.stuck() is None
  launches.reset()


def test_a_peer_that_published_its_failure_ends_this_process_too():
  launches, dog = _launch_dog(5.0, {}, failed={1: "ValueError: bad batch"})
  assert dog.check() == "process 1 of 3 (pid 101 on h1) failed: ValueError: bad batch"
  launches.reset()


def test_a_marked_collective_counts_each_launch_once_before_it_runs_without_a_jax_effect():
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxring._src.reliability import launches
  launches.reset()
  launches.enable(2)
  try:
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    body = lambda v: lax.psum(launches.marker("41")(v), "d")   # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))
    for _ in range(3):
      jax.block_until_ready(f(x))
    assert launches.table() == {"41": 3}   # once per launch, not once per device
    key, k, at = launches.latest()
    assert (key, k) == ("41", 3) and 0 <= time.monotonic() - at < 60   # Python's clock
    # the marker runs before the collective: its result is held by the barrier the psum reads
    hlo = f.lower(x).as_text()
    assert (hlo.index("@jaxring_launch_mark") < hlo.index("optimization_barrier")
            < hlo.index("all_reduce")), hlo
    # no JAX effect and no host callback: the program keeps jax's C++ dispatch
    assert not jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                                            out_specs=P()))(x).effects
    assert "callback" not in hlo
    # run eagerly, a collective is counted as it starts
    assert launches.marker("43")(7) == 7 and launches.table()["43"] == 1
    assert launches.marker("42", processes=5)(7) == 7   # over fewer/more processes: not marked
    assert "42" not in launches.table()
  finally:
    launches.enable(0)
    launches.reset()
  assert launches.table() == {} and launches.marker("44")(7) == 7   # off: nothing staged


def test_a_peer_behind_that_also_went_quiet_is_left_to_the_silence_check():
  launches, dog = _launch_dog(0.2, {1: {"7": 1}, 2: {"7": 0}})
  launches._started(("7",))
  time.sleep(0.25)
  dog.last_seen[1] = time.monotonic()   # 1 heartbeats, 2 has been quiet for 0.25 s (> 3 beats)
  assert dog.stuck() is None            # not called "alive (heartbeating)"
  dog.last_seen[2] = time.monotonic()
  assert "process 2 of 3 (pid 102 on h2) launched it 0 time(s)" in dog.stuck()
  launches.reset()
