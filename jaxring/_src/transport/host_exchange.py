"""Host-side transfers: arrays summed or gathered over an MPI communicator by a host thread while
the devices run the next steps.

XLA:CPU runs no collective beside the computation of its program, and no second program beside a
running one (docs/design.md, "Investigations"): a transfer that is to overlap the steps has to
leave the programs. A program hands its arrays to :meth:`Exchange.start` through an ordered
``io_callback``, which copies them and starts a non-blocking MPI collective (``Iallreduce`` or
``Iallgather``) on the exchange's own duplicate of the communicator; a poller thread drives it
(MPICH progresses a non-blocking collective only inside MPI calls) with ``Test`` every
``poll_s``, sleeping in between, so it takes no core from the steps. A later program's
:meth:`Exchange.finish` callback waits for it, at most ``timeout_s``, and names the communicator's
members when it gives up.

Every member must start the same transfers in the same order (MPI's rule for collectives on one
communicator); the programs that call :func:`start_in_program` and :func:`finish_in_program` do,
since they run the same schedule.

A checkpoint taken between a start and its finish keeps the transfers' results
(:func:`in_flight` waits for them) and gives them back with :func:`restore`: the resumed
program's :meth:`Exchange.finish` takes the one with its key's ``part`` (a transform made anew
has another ``owner``).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Hashable

import jax
import numpy as np
from jax.experimental import io_callback

from jaxring._src.reliability.watchdog import DEFAULT_FAILURE_TIMEOUT_S, failure_timeout
from jaxring._src.transport.mpi import mpi_module

KINDS = ("sum", "gather", "alltoall")


@dataclasses.dataclass(frozen=True)
class Key:
  """A transfer's name: ``owner`` is its caller in this process (e.g. ``"diloco 3"``), ``part``
  what it moves (``"fragment 1"``), named alike by a resumed process."""

  owner: str
  part: str

  def __str__(self) -> str:
    return f"{self.owner} {self.part}"


@dataclasses.dataclass
class _Transfer:
  requests: list
  outputs: list[np.ndarray]
  inputs: list[np.ndarray]       # kept alive until MPI is done with them
  started: float
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


class Exchange:
  """Non-blocking collectives over a duplicate of ``comm``, progressed by a thread.

  Args:
    comm: an ``mpi4py`` intracommunicator (MPI initialized with ``MPI_THREAD_MULTIPLE``).
    name: what the members are, for messages (e.g. the axis name).
    timeout_s: the longest :meth:`finish` waits (default ``JAXRING_FAILURE_TIMEOUT``, else, or
      where that is 0, 120 s).
    poll_s: the poller's sleep between two ``Test`` rounds.
  """

  def __init__(self, comm, name: str, timeout_s: float | None = None, poll_s: float = 0.001):
    MPI = mpi_module()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
      raise RuntimeError("jaxring: a host-side transfer needs MPI initialized with "
                         "MPI_THREAD_MULTIPLE (mpi4py's default; check mpi4py.rc.thread_level)")
    self.comm, self.name = comm.Dup(), name
    # with the watchdog off (0) a transfer still waits no longer than the default
    self.timeout_s = failure_timeout(timeout_s) or DEFAULT_FAILURE_TIMEOUT_S
    self.poll_s = float(poll_s)
    self._open: dict[Hashable, _Transfer] = {}
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self.bytes_sent = 0
    self.waited_s = 0.0   # spent in finish, waiting: zero when the transfers were hidden
    self._thread = threading.Thread(target=self._poll, name=f"jaxring-exchange-{name}",
                                    daemon=True)
    self._thread.start()

  def start(self, key: Hashable, kind: str, arrays) -> None:
    """Starts the ``kind`` (``"sum"``: every member's arrays added; ``"gather"``: stacked, one
    row per member in rank order; ``"alltoall"``: row ``j`` of each array, one row per member,
    to member ``j``, which gets every member's in rank order) of ``arrays``; :meth:`finish` with
    ``key`` returns it."""
    if kind not in KINDS:
      raise ValueError(f"jaxring: an exchange is one of {KINDS}, got {kind!r}")
    MPI, n = mpi_module(), self.comm.Get_size()
    inputs = [np.array(a, copy=True, order="C") for a in arrays]   # the device may reuse them
    if kind == "alltoall" and any(a.shape[:1] != (n,) for a in inputs):
      raise ValueError(f"jaxring: an alltoall over {self.name!r} takes one row per member "
                       f"({n}); got shapes {[a.shape for a in inputs]}")
    if kind == "gather":
      outputs = [np.empty((n, *a.shape), a.dtype) for a in inputs]
    else:
      outputs = [np.empty_like(a) for a in inputs]
    with self._lock:
      if key in self._open:
        raise RuntimeError(f"jaxring: a host-side transfer '{key}' over {self.name!r} was started "
                           "again before the last one was finished (or by two devices of this "
                           "process: name the axes they span as diloco's fast_axes)")
      start = {"sum": lambda a, o: self.comm.Iallreduce(a, o, op=MPI.SUM),
               "gather": self.comm.Iallgather, "alltoall": self.comm.Ialltoall}[kind]
      requests = [start(a, o) for a, o in zip(inputs, outputs)]
      self._open[key] = _Transfer(requests, outputs, inputs, time.monotonic())
      self.bytes_sent += sum(a.nbytes for a in inputs)
    self._wake.set()

  def finish(self, key: Hashable) -> list[np.ndarray]:
    """The result of the transfer started with ``key``, once every member has sent its part.

    Raises:
      KeyError: no transfer ``key`` was started, nor restored from a checkpoint.
      TimeoutError: it did not complete within ``timeout_s``: a member stopped or is behind.
    """
    with self._lock:
      transfer = self._open.get(key)
    if transfer is None:
      return _restored_result(self.name, key)
    outputs = self._wait(key, transfer)
    with self._lock:   # (kept until done: MPI may still read its inputs)
      del self._open[key]
    return outputs

  def results(self) -> dict[Key, list[np.ndarray]]:
    """Every open transfer's result, waited for and left open (each still to be finished)."""
    with self._lock:
      open_ = dict(self._open)
    return {key: self._wait(key, t) for key, t in open_.items()}

  def _wait(self, key, transfer: _Transfer) -> list[np.ndarray]:
    t0 = time.monotonic()
    left = transfer.started + self.timeout_s - t0
    done = transfer.done.wait(max(left, 0.0))
    self.waited_s += time.monotonic() - t0
    if not done:
      raise TimeoutError(
          f"jaxring: the host-side transfer '{key}' over {self.name!r} (rank "
          f"{self.comm.Get_rank()} of {self.comm.Get_size()}) started "
          f"{time.monotonic() - transfer.started:.0f} s ago has not completed: a member of "
          f"{self.name!r} stopped or is behind (JAXRING_FAILURE_TIMEOUT sets this wait)")
    return transfer.outputs

  def _poll(self) -> None:
    MPI = mpi_module()
    while True:
      with self._lock:
        waiting = [t for t in self._open.values() if not t.done.is_set()]
        for t in waiting:
          if MPI.Request.Testall(t.requests):
            t.done.set()
      if not waiting:
        self._wake.wait(0.1)
        self._wake.clear()
      else:
        time.sleep(self.poll_s)


_exchanges: dict[tuple, Exchange | tuple[Exchange, ...]] = {}
_restored: dict[str, dict[Key, list[np.ndarray]]] = {}   # by exchange name: from a checkpoint


def in_flight() -> dict[tuple[str, Key], list[np.ndarray]]:
  """The results of this process's transfers started and not yet finished, by (exchange name,
  key), waited for: what a checkpoint taken now keeps."""
  return {(e.name, k): v for e in _all_exchanges() for k, v in e.results().items()}


def restore(name: str, key: Key, outputs) -> None:
  """Gives back a transfer's result a checkpoint kept: the next ``finish`` of ``key.part`` over
  the exchange ``name`` returns it."""
  _restored.setdefault(name, {})[key] = [np.asarray(o) for o in outputs]


def _restored_result(name: str, key) -> list[np.ndarray]:
  kept = _restored.get(name, {})
  same = [k for k in kept if k == key or (isinstance(key, Key) and k.part == key.part)]
  if len(same) != 1:
    raise KeyError(f"jaxring: no host-side transfer '{key}' over {name!r} is in flight"
                   + (f" (a checkpoint restored {len(same)} of its part)" if same else
                      " nor was restored with a checkpoint"))
  return kept.pop(same[0])


def exchange_for(binding, members: int = 1):
  """The exchange of an MPI-bound axis (``transport.mpi_axis.MpiAxis``), made on first use:
  collective over its communicator, as the first trace of a program is on every member. With
  ``members > 1`` (the devices of one process that each move their own share: JAX's shape),
  a tuple of that many exchanges, one per device's index, each on its own duplicate."""
  made = _exchanges.get((id(binding), members))
  if made is None:
    made = Exchange(binding.comm, str(binding.name)) if members == 1 else tuple(
        Exchange(binding.comm, f"{binding.name} member {j}") for j in range(members))
    _exchanges[(id(binding), members)] = made
  return made


def _all_exchanges() -> list[Exchange]:
  return [e for made in list(_exchanges.values())
          for e in (made if isinstance(made, tuple) else (made,))]


def waited_s() -> float:
  """Seconds this process's exchanges spent in :meth:`Exchange.finish` waiting, in all."""
  return sum(e.waited_s for e in _all_exchanges())


def _pick(exchange, where) -> Exchange:
  """The exchange a callback's device uses: ``where`` is None (one exchange) or ``(its index
  among the process's devices, its index along the slow axis, -1 where no mesh axis is)``."""
  if where is None:
    return exchange
  ex = exchange[int(where[0])]
  if int(where[1]) >= 0 and int(where[1]) != ex.comm.Get_rank():
    raise ValueError(f"jaxring: a device at index {int(where[1])} of the slow axis runs in MPI "
                     f"rank {ex.comm.Get_rank()} of {ex.name!r}: launch one process per member "
                     "of the slow axis, rank = its index (the mesh's rows in process order)")
  return ex


def start_in_program(exchange, key: Hashable, kind: str, arrays, where=None) -> None:
  """Inside a traced program: hands ``arrays`` to ``exchange.start`` when the program runs there
  (an ordered ``io_callback``: once, in program order). ``exchange`` may be a tuple of them, one
  per device of the process, with ``where`` (traced, see :func:`_pick`) naming this device's."""
  def start(*values):
    ex, values = (exchange, values) if where is None else (_pick(exchange, values[0]), values[1:])
    ex.start(key, kind, values)
  io_callback(start, None, *(() if where is None else (where,)), *arrays, ordered=True)


def finish_in_program(exchange, key: Hashable, kind: str, like, where=None) -> list:
  """Inside a traced program: the result of the transfer ``key`` (see :meth:`Exchange.start`),
  for arrays shaped like ``like``, waited for when the program runs there (``exchange`` and
  ``where`` as in :func:`start_in_program`)."""
  n = (exchange if where is None else exchange[0]).comm.Get_size()
  shapes = [jax.ShapeDtypeStruct((n, *np.shape(a)) if kind == "gather" else np.shape(a), a.dtype)
            for a in like]
  operands = () if where is None else (where,)
  return list(io_callback(lambda *w: _pick(exchange, w[0] if w else None).finish(key), shapes,
                          *operands, ordered=True))
