"""A TCP roll call on the coordinator's port before ``jax.distributed`` starts.

Why: when a process never comes, ``jax.distributed.initialize`` does not raise. Its client's
``connect()`` times out inside XLA, whose default error handler ends the process with SIGABRT
("Terminating process because the JAX distributed service detected fatal errors"), naming neither
the missing process nor the address. Nothing in Python can catch that.

So every process first checks in with process 0 over plain TCP, on the port the coordination
service will use a moment later: process 0 listens there, each other process connects and says who
it is, and once all ``num_processes`` have checked in process 0 answers ``GO`` to each, closes the
port and only then starts the coordination service. If someone is missing at the deadline, process
0 raises :class:`StartupTimeoutError` naming them, and tells those who came, who raise the same
error; a process that cannot reach process 0 raises it naming process 0 and the address.

The protocol is one line each way: ``JAXRING-ROLLCALL 1 <num_processes> <process_id>`` from a
peer; ``GO`` or ``FAIL <json>`` from process 0. Connections that do not speak it are dropped.
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import time

_HELLO = "JAXRING-ROLLCALL 1"
_MAX_LINE = 4096
# How long process 0 waits for peers to close first after GO: the side that closes first keeps the
# port in TIME_WAIT, and it should not be the one about to bind it again for the coordinator.
_CLOSE_GRACE_S = 2.0
# How much longer than its own deadline a peer that has checked in waits for process 0's verdict:
# processes launched together start their clocks up to a few seconds apart (imports on a loaded
# machine), and the verdict, naming who is missing, comes at process 0's deadline.
_VERDICT_GRACE_S = 3.0


class StartupTimeoutError(TimeoutError):
  """Raised by :func:`jaxring.distributed.initialize` when processes did not arrive in time.

  Attributes:
    missing: ids of the processes that had not checked in at the deadline.
    coordinator_address: the ``host:port`` of process 0 the processes were to meet at.
  """

  def __init__(self, message: str, missing: tuple[int, ...], coordinator_address: str):
    super().__init__(message)
    self.missing = missing
    self.coordinator_address = coordinator_address


def _split_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"coordinator address must be host:port, got {address!r}")
  return host.strip("[]"), int(port)


def _who(ids) -> str:
  ids = sorted(ids)
  return f"process {ids[0]}" if len(ids) == 1 else f"processes {ids}"


def _listen(port: int) -> socket.socket:
  # All interfaces, as jax's coordination service binds "[::]:port" by default.
  if socket.has_dualstack_ipv6():
    try:
      return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError:
      pass
  return socket.create_server(("0.0.0.0", port))


def _bind_port(coordinator_address: str) -> int:
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")  # where jax will bind, if it is set
  return _split_address(bind or coordinator_address)[1]


def roll_call(coordinator_address: str, num_processes: int, process_id: int,
              timeout_s: float) -> None:
  """Returns once all ``num_processes`` processes have checked in; raises naming who did not.

  Raises:
    StartupTimeoutError: after ``timeout_s`` seconds without every process.
    ValueError: processes disagree on ``num_processes``, or two claim the same id.
    ConnectionError: process 0 closed the connection without an answer.
  """
  if num_processes <= 1:
    return
  deadline = time.monotonic() + timeout_s
  if process_id == 0:
    _coordinate(coordinator_address, num_processes, timeout_s, deadline)
  else:
    _check_in(coordinator_address, num_processes, process_id, timeout_s, deadline)


class _Peer:
  def __init__(self, conn: socket.socket, addr):
    self.conn, self.addr, self.buffer, self.pid = conn, addr, b"", None


def _coordinate(address: str, n: int, timeout_s: float, deadline: float) -> None:
  listener = _listen(_bind_port(address))
  listener.setblocking(False)
  sel = selectors.DefaultSelector()
  sel.register(listener, selectors.EVENT_READ)
  arrived: dict[int, _Peer] = {}
  try:
    while len(arrived) < n - 1:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        missing = tuple(sorted(set(range(1, n)) - set(arrived)))
        message = (f"jaxring.distributed.initialize: {_who(missing)} of {n} did not arrive "
                   f"within {timeout_s:g} s at the coordinator {address} (process 0); "
                   f"arrived: {sorted({0, *arrived})}")
        _tell(arrived.values(), "FAIL " + json.dumps({"missing": missing, "message": message}))
        raise StartupTimeoutError(message, missing, address)
      for key, _ in sel.select(min(remaining, 0.5)):
        if key.fileobj is listener:
          try:
            conn, addr = listener.accept()
          except BlockingIOError:
            continue
          conn.setblocking(False)
          sel.register(conn, selectors.EVENT_READ, _Peer(conn, addr))
        else:
          _read_hello(sel, key.data, arrived, address, n)
    _tell(arrived.values(), "GO")
    _wait_for_close(sel, arrived.values())
  finally:
    for key in list(sel.get_map().values()):
      key.fileobj.close()
    sel.close()


def _read_hello(sel, peer: _Peer, arrived: dict[int, _Peer], address: str, n: int) -> None:
  """Reads from ``peer``; records it in ``arrived`` once its line is complete and valid."""
  try:
    data = peer.conn.recv(_MAX_LINE)
  except (BlockingIOError, InterruptedError):
    return
  except OSError:
    data = b""
  if not data:  # gone: a peer that left before GO is no longer counted
    if peer.pid is not None and arrived.get(peer.pid) is peer:
      del arrived[peer.pid]
    sel.unregister(peer.conn)
    peer.conn.close()
    return
  if peer.pid is not None:
    return
  peer.buffer += data
  if b"\n" not in peer.buffer:
    if len(peer.buffer) > _MAX_LINE:
      sel.unregister(peer.conn)
      peer.conn.close()
    return
  line = peer.buffer.split(b"\n", 1)[0].decode("utf-8", "replace")
  fields = line[len(_HELLO):].split() if line.startswith(_HELLO + " ") else []
  if len(fields) != 2 or not all(f.isdigit() for f in fields):
    sel.unregister(peer.conn)  # not one of ours (a port scan, a stale client): ignore it
    peer.conn.close()
    return
  their_n, pid = map(int, fields)
  problem = None
  if their_n != n:
    problem = (f"process {pid} at {peer.addr[0]} expects {their_n} processes, the coordinator "
               f"{address} (process 0) expects {n}")
  elif not 0 < pid < n:
    problem = f"a process at {peer.addr[0]} claims id {pid}, outside [1, {n})"
  elif pid in arrived:
    problem = (f"two processes claim id {pid}: one at {arrived[pid].addr[0]}, one at "
               f"{peer.addr[0]}")
  if problem:
    message = f"jaxring.distributed.initialize: {problem}"
    _tell([peer, *arrived.values()], "FAIL " + json.dumps({"missing": [], "message": message}))
    raise ValueError(message)
  peer.pid = pid
  arrived[pid] = peer


def _tell(peers, line: str) -> None:
  for peer in peers:
    try:
      peer.conn.setblocking(True)
      peer.conn.settimeout(1.0)
      peer.conn.sendall(line.encode() + b"\n")
    except OSError:
      pass  # it is gone; it will find out on its own


def _wait_for_close(sel, peers) -> None:
  open_peers = {p.conn for p in peers}
  for conn in open_peers:
    conn.setblocking(False)
  end = time.monotonic() + _CLOSE_GRACE_S
  while open_peers and time.monotonic() < end:
    for key, _ in sel.select(0.05):
      if key.fileobj in open_peers:
        try:
          if key.fileobj.recv(_MAX_LINE):
            continue
        except (BlockingIOError, InterruptedError):
          continue
        except OSError:
          pass
        open_peers.discard(key.fileobj)
        sel.unregister(key.fileobj)
        key.fileobj.close()


def _check_in(address: str, n: int, pid: int, timeout_s: float, deadline: float) -> None:
  host, port = _split_address(address)
  conn = _connect(host, port, deadline)
  if conn is None:
    raise StartupTimeoutError(
        f"jaxring.distributed.initialize: process 0 (the coordinator, {address}) did not answer "
        f"within {timeout_s:g} s; process {pid} of {n} could not connect to it", (0,), address)
  with conn:
    conn.sendall(f"{_HELLO} {n} {pid}\n".encode())
    reply = _read_line(conn, deadline + _VERDICT_GRACE_S)
  if reply is None:
    raise StartupTimeoutError(
        f"jaxring.distributed.initialize: process {pid} of {n} checked in at the coordinator "
        f"{address} (process 0) but got no answer within {timeout_s:g} s", (), address)
  if reply == "":
    raise ConnectionError(f"jaxring.distributed.initialize: the coordinator {address} (process "
                          f"0) closed the connection before every process had arrived")
  if reply == "GO":
    return
  verdict = json.loads(reply[len("FAIL "):])
  missing = tuple(verdict["missing"])
  if missing:
    raise StartupTimeoutError(verdict["message"], missing, address)
  raise ValueError(verdict["message"])


def _connect(host: str, port: int, deadline: float) -> socket.socket | None:
  """Connects, retrying until ``deadline``: process 0 may not be listening yet."""
  while True:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      return None
    try:
      return socket.create_connection((host, port), timeout=min(remaining, 2.0))
    except OSError:
      time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


def _read_line(conn: socket.socket, deadline: float) -> str | None:
  """The next line, ``""`` at EOF, or None at the deadline."""
  buffer = b""
  while b"\n" not in buffer:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      return None
    conn.settimeout(remaining)
    try:
      data = conn.recv(_MAX_LINE)
    except socket.timeout:
      return None
    except OSError:
      return ""
    if not data:
      return ""
    buffer += data
  return buffer.split(b"\n", 1)[0].decode("utf-8", "replace")
