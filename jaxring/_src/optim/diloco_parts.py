"""The parts of :func:`jaxring.diloco` that are not its step: how the parameters are cut into
fragments, what a train step tells the transformation (the axes its model spans, those it leaves
to the sync) and what it reads back (the plan), and where the outer state is kept."""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from jaxring._src.transport import mpi_axis

PLAN_ATTR = "diloco_plan"   # on update: its slow axes and schedule, for a train step
MEMORIES = ("device", "host")

_spanned: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxring_diloco_spans",
                                                                 default=((), ()))
_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxring_diloco_quiet",
                                                              default=False)


@contextlib.contextmanager
def spanning(axes: tuple, slow: tuple = ()):
  """Inside, a diloco sync averages over ``axes`` too (as its ``fast_axes``), and must sync
  ``slow``: a train step says so of the fast axes its replicated model spans and of those it
  leaves unreduced."""
  token = _spanned.set((tuple(axes), tuple(slow)))
  try:
    yield
  finally:
    _spanned.reset(token)


@contextlib.contextmanager
def without_host_transfers():
  """Inside, a ``transfer="host"`` diloco traces its step without the transfers' callbacks: the
  program of the steps its plan's ``host_steps(count)`` says start and finish none. A program
  with a callback has effects, which take jax's dispatch off its C++ path onto Python's
  (~10 us a state leaf: 5 ms a step with bench outer-sync's state on 2 cores, jax 0.10.2)."""
  token = _quiet.set(True)
  try:
    yield
  finally:
    _quiet.reset(token)


def host_transfers_traced() -> bool:
  return not _quiet.get()


def check_slow(axes: tuple) -> None:
  """A train step leaves its slow axes to the diloco it runs: ``axes`` must be those."""
  fast, slow = spanned()
  if slow and set(axes) != set(slow):
    missing = tuple(a for a in slow if a not in axes)
    raise ValueError(
        f"train_step: the step leaves {slow} to jaxring.diloco (grad_axes={fast}), but the "
        f"state's jaxring.diloco syncs axis={axes}: "
        + (f"nothing would sync {missing}; " if missing else "")
        + f"give jaxring.diloco(..., axis={slow if len(slow) > 1 else slow[0]!r}) or "
        "grad_axes= the other axes of the step")


def fragment_of(params, fragments: int) -> list[int]:
  """Each leaf's fragment: whole leaves in tree order, a leaf in the fragment its bytes' middle
  falls in (``fragments`` equal shares of the total)."""
  leaves = jax.tree_util.tree_leaves(params)
  sizes = [int(np.size(x)) * jnp.dtype(jnp.result_type(x)).itemsize for x in leaves]
  total, done, out = max(sum(sizes), 1), 0, []
  for s in sizes:
    out.append(min(fragments - 1, int((done + s / 2) * fragments / total)))
    done += s
  return out


def spanned() -> tuple[tuple, tuple]:
  """(the fast axes a train step's replicated model spans, the slow axes it leaves unreduced)."""
  return _spanned.get()


def plan_of(tx) -> dict | None:
  """A :func:`jaxring.diloco` transformation's slow ``axes`` and ``syncs(count)``: whether the
  step after ``count`` inner steps is a warm-up step or syncs fragment 0; with
  ``transfer="host"``, ``host_steps(count)`` (a Python int): whether that step starts or finishes
  a host transfer (None otherwise); None for any other ``tx``."""
  return getattr(getattr(tx, "update", None), PLAN_ATTR, None)


def check_memory(memory: str, axes: tuple, host: bool = False) -> None:
  """``outer_memory="host"`` needs the sync's ``axes`` bound by ``shard_map``/``pmap`` and the
  sync in the program: a program with an ordered effect (an MPI-bound axis's collectives, the
  host transfer's callbacks) and a move between memory spaces fails to lower in jax (0.10 to
  0.11.1 at least: its lowering pairs the effects' tokens with the results' memory kinds one list
  out of step)."""
  mpi = tuple(a for a in axes if mpi_axis.lookup((a,)) is not None)
  if memory == "host" and (host or mpi):
    raise NotImplementedError(
        "diloco(outer_memory='host'): "
        + ("transfer='host' moves the sync by ordered callbacks" if host else
           f"the axes {mpi} are bound to MPI, whose collectives are ordered effects")
        + ", which jax cannot lower beside a move to host memory (its lowering raises "
        "'safe_zip() argument 1 has length ...'); keep outer_memory='device' there (an MPI "
        "rank's device is host memory already), or sync over shard_map's axes in the program")


def placed(tree, memory: str):
  """``tree``'s arrays in ``memory`` (``"host"``: the host memory beside the device, pinned where
  the platform has it; ``"device"``), inside a program or out of one."""
  space = jax.memory.Space.Host if memory == "host" else jax.memory.Space.Device
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, space), tree)
