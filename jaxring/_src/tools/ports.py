"""A free TCP port for a job's coordinator, chosen where no connection will take it first."""
from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
  """The lowest port the kernel hands out on its own (to connections' local ends)."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768


def free_port() -> int:
  """A TCP port that was free on every address a moment ago, below the kernel's ephemeral range.

  A port the kernel hands out (a bind to port 0) comes from the range it also gives every
  outgoing connection's local end: between a launcher choosing it and its process binding it a
  second later, a connection of another job on the machine (gloo, MPI, a coordination service)
  took it once in CI ("Address already in use"). Below the range only an explicit bind takes a
  port.

  Example:
    >>> 1024 <= free_port() < 65536
    True
  """
  low = _ephemeral_low()
  rng = random.SystemRandom()
  for _ in range(100):
    port = rng.randrange(max(1024, low - 12000), low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("", port))
      except OSError:
        continue
      return port
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # a crowded range: any free one
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
