"""Cross-process fingerprints: every process must plan the same collectives, or all of them say so.

In a multi-process job (``jax.distributed``, or one rank per device under ``mpirun``) every
process traces the program itself. If one of them
calls a collective with another shape, dtype, codec or algorithm (a config that differs, a branch
on ``process_index``), or skips one, the collectives meet wrongly: gloo hangs, or returns values
reduced with the wrong layout. Here each jaxring collective, when it is planned (once per trace,
never per call), publishes what it is about to do in the coordination service's key-value store
under its sequence number in this process (the coordination service's key-value store; over MPI,
messages on a duplicate of the axis's communicator), and reads every other process's entry for
that number. A difference raises :class:`CollectiveMismatchError` on every process, naming the
processes and fields that differ; a process that never publishes the entry is named by
:class:`FingerprintTimeoutError` after the failure timeout. ``JAXRING_FINGERPRINT=0`` turns the
check off.
"""
from __future__ import annotations

import itertools
import json
import os
import threading

from jaxring._src.reliability import flight_recorder, launches
from jaxring._src.reliability.watchdog import failure_timeout

ENV_FINGERPRINT = "JAXRING_FINGERPRINT"
_PREFIX = "jaxring/fp/"
_FIELDS = ("op", "axes", "axis_sizes", "shape", "dtype", "algorithm", "plan", "codecs")


class CollectiveMismatchError(RuntimeError):
  """Processes called the n-th collective differently.

  Attributes:
    seq: the collective's number (in the order every process planned its collectives).
    differing: process id -> the fields in which it differs from this process.
  """

  def __init__(self, message: str, seq: int, differing: dict[int, tuple[str, ...]]):
    super().__init__(message)
    self.seq, self.differing = seq, differing


class FingerprintTimeoutError(TimeoutError):
  """Some processes never planned the n-th collective (they skipped it, or hang before it)."""

  def __init__(self, message: str, seq: int, missing: tuple[int, ...]):
    super().__init__(message)
    self.seq, self.missing = seq, missing


_counter = itertools.count()
_mpi_counters: dict[int, itertools.count] = {}
_lock = threading.Lock()
_TAG = 0x7A13


def _client_and_ids():
  from jax._src import distributed as jax_distributed
  state = jax_distributed.global_state
  if state.client is None or not state.num_processes or state.num_processes < 2:
    return None
  return state.client, state.process_id, state.num_processes


def describe(record: dict) -> str:
  """One line for a fingerprint record.

  Example:
    >>> describe({"op": "psum", "axes": ["node"], "dtype": "float32", "shape": [4],
    ...           "algorithm": "auto", "plan": "xla"})
    'psum over (node) of float32[4] (algorithm auto -> xla)'
  """
  shape = ",".join(map(str, record.get("shape", ())))
  return (f"{record.get('op')} over ({', '.join(map(str, record.get('axes', ())))}) of "
          f"{record.get('dtype')}[{shape}] (algorithm {record.get('algorithm')} -> "
          f"{record.get('plan')})")


def _exchange_kv(client, me: int, n: int, seq: int, mine: str, timeout: float):
  client.key_value_set(f"{_PREFIX}{seq}/{me}", mine, allow_overwrite=True)
  others, missing = {}, []
  for p in range(n):
    if p == me:
      continue
    try:
      others[p] = json.loads(client.blocking_key_value_get(f"{_PREFIX}{seq}/{p}",
                                                           int(timeout * 1000)))
    except Exception:  # noqa: BLE001 - jax raises DEADLINE_EXCEEDED as a JaxRuntimeError
      missing.append(p)
  return others, missing


def _exchange_mpi(comm, mine: str, timeout: float):
  """Every rank's record over ``comm`` (messages keep their order per rank, so the n-th received
  from a rank is its n-th collective), polling so that a rank that never sends is named."""
  import time
  me, n = comm.Get_rank(), comm.Get_size()
  sends = [comm.isend(mine, dest=p, tag=_TAG) for p in range(n) if p != me]
  recvs = {p: comm.irecv(source=p, tag=_TAG) for p in range(n) if p != me}
  others, deadline = {}, time.monotonic() + timeout
  while recvs and time.monotonic() < deadline:
    for p in list(recvs):
      done, value = recvs[p].test()
      if done:
        others[p] = json.loads(value)
        del recvs[p]
    if recvs:
      time.sleep(0.001)
  for req in sends:
    req.wait()   # small messages go eagerly: completes without the receiver
  return others, sorted(recvs)


def check(record: dict, binding=None):
  """Publishes this process's ``record`` for its next collective and compares it with the others'.

  A no-op outside a multi-process job. ``binding`` is the axes' binding: an MPI-bound axis
  compares over its control communicator; otherwise the ``jax.distributed`` job's processes
  compare through the coordination service.

  Returns:
    the function the collective's operands (a pytree) go through, which ties its launch marker
    to them (``reliability/launches.py``); the identity where nothing is marked.

  Raises:
    CollectiveMismatchError: another process's record for the same collective differs.
    FingerprintTimeoutError: another process did not publish it within the failure timeout.
  """
  control = getattr(binding, "control", None)
  record = {k: record.get(k) for k in _FIELDS}
  off = os.environ.get(ENV_FINGERPRINT, "1").lower() in ("0", "off", "false")
  ids = None if control is not None or off else _client_and_ids()
  if off or (control is None and ids is None) or (control is not None and
                                                  control.Get_size() < 2):
    flight_recorder.record(flight_recorder.next_seq(), record)
    return launches.unmarked
  mine = json.dumps(record, sort_keys=True, default=str)
  timeout = failure_timeout(None) or 120.0
  with _lock:
    counter = (_mpi_counters.setdefault(id(control), itertools.count()) if control is not None
               else _counter)
    seq = next(counter)
  flight_recorder.record(seq, record)
  if control is not None:
    me, n = control.Get_rank(), control.Get_size()
    others, missing = _exchange_mpi(control, mine, timeout)
  else:
    client, me, n = ids
    others, missing = _exchange_kv(client, me, n, seq, mine, timeout)
  if missing:
    raise FingerprintTimeoutError(
        f"jaxring: collective #{seq}, {describe(record)}, was planned by process {me} but "
        f"process(es) {missing} of {n} did not plan it within {timeout:g} s: they skipped it, "
        "called fewer collectives before it, or hang", seq, tuple(missing))
  mine_rec = json.loads(mine)
  differing = {p: tuple(f for f in _FIELDS if rec.get(f) != mine_rec.get(f))
               for p, rec in others.items()}
  differing = {p: fields for p, fields in differing.items() if fields}
  if differing:
    lines = [f"process {p}: " + ", ".join(f"{f}={others[p].get(f)!r} (here {mine_rec.get(f)!r})"
                                          for f in fields) for p, fields in differing.items()]
    raise CollectiveMismatchError(
        f"jaxring: processes disagree on collective #{seq}; process {me} of {n} plans "
        f"{describe(mine_rec)}, and\n  " + "\n  ".join(lines) +
        "\nEvery process must call the same collectives in the same order with the same "
        "shapes, dtypes, algorithm and compression.", seq, differing)
  return launches.marker(str(seq) if control is None else f"{seq}@{binding.name}", n)
