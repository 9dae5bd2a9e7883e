"""In-process transport: members of one process meet in shared memory (CPU, custom calls).

The devices of one process share its memory. A level whose members all live in this process
(``local`` in the one-process-per-node shape, every level of a single-process job) reduce-scatters
and all-gathers with the ``jaxring_local_*`` custom calls (xla_ext/cpu_inprocess.cc): each device's
instance rendezvouses with its group under (execution, call site, group), the call site being the
custom-call instruction (a jitted function called twice in one program meets twice), reads the
others' buffers directly and completes once every member has finished reading. XLA:CPU would
otherwise run these steps of a multi-process program over gloo's loopback TCP. A member that
arrives before the others completes asynchronously (its call returns a pending ``ffi::Future``):
XLA's executor goes on with the device's other ready operations, so devices that reach
independent collectives in different orders do not wait for each other in the wrong one. A
member that does not arrive within ``JAXRING_INPROCESS_TIMEOUT`` seconds (default 60) is named
in the error.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import vma
from jaxring._src.transport.groups import Group, axis_arg

ENV_TIMEOUT = "JAXRING_INPROCESS_TIMEOUT"


def available() -> bool:
  """Whether the in-process collectives can run here: the CPU backend, the extension built, and
  every axis of the mesh in context manual. Inside a ``shard_map`` that leaves some axes to the
  compiler (``axis_names=`` a subset), devices that differ only along those axes would meet
  under the same member and group ids."""
  if jax.default_backend() != "cpu":
    return False
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no mesh in context
    names = ()
  if not set(names) <= set(_bound_axes()):
    return False
  from jaxring._src.ext import loader
  return loader.LOAD_ERROR is None and loader.INPROCESS_ERROR is None


def _bound_axes() -> tuple:
  """The mesh axes bound here (manual inside ``shard_map``); none under ``pmap``."""
  try:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no mesh in context
    return ()
  bound = []
  for a in names:
    try:
      lax.axis_size(a)
    except NameError:
      continue
    bound.append(a)
  return tuple(bound)


def _member(group: Group):
  """[rank in the group, index of the group], the index unique among the level's groups."""
  idx = lax.axis_index(axis_arg(group.axes))
  within = (idx // (group.stride * group.size)) * group.stride + idx % group.stride
  others = tuple(a for a in _bound_axes() if a not in group.axes)
  outer = lax.axis_index(axis_arg(others)) if others else 0
  gid = outer * (group.axes_size // group.size) + within
  return jnp.stack([jnp.asarray(group.rank(), jnp.int32), jnp.asarray(gid, jnp.int32)])


def _order(order, size: int) -> np.ndarray:
  """The row order as the custom call takes it (identity: one row per member)."""
  return np.arange(size, dtype=np.int64) if order is None else np.asarray(order, np.int64)


def _call(target: str, result, x, group: Group, invariant: tuple = (), order=None, *,
          more: tuple = (), **attrs):
  member = _member(group)
  operands = (x,) + tuple(more)
  axes = tuple(sorted(set().union(vma.varying_axes(member), *map(vma.varying_axes, operands)),
                      key=str))
  operands, member = tuple(vma.pvary(a, axes) for a in operands), vma.pvary(member, axes)
  timeout_ms = int(float(os.environ.get(ENV_TIMEOUT) or 60) * 1000)
  # No side effect declared: jax.checkpoint refuses effects (FSDP rematerializes its loss), and
  # none is needed. Every device of the process runs the same program, so XLA keeps or drops a
  # call alike on all of them (its executor may order independent calls differently per device:
  # the calls complete asynchronously for that). Each instruction is a call site of its own: XLA
  # numbers it when it instantiates the call (xla_ext/cpu_inprocess.cc, CallSite).
  out = jax.ffi.ffi_call(f"jaxring_{target}", result, vmap_method="sequential")(
      *operands, member, size=group.size, timeout_ms=timeout_ms,
      order=_order(order, group.size), **attrs)
  # The custom call's result is typed invariant (its ShapeDtypeStruct names no axes), so it is
  # marked varying over every axis except those the caller knows it is the same across.
  return vma.pvary(out, tuple(a for a in axes if a not in invariant))


def reduce_scatter(x, group: Group, order=None):
  """Member ``i`` of ``group`` gets the sum of chunk ``i`` of ``x`` (f32, length divisible).

  ``order``: ``x`` is read as ``len(order)`` rows permuted by ``base.permute_rows(rows, order)``
  (without the copy: the members read the rows where they lie).
  """
  if group.size == 1 and order is None:
    return x
  return _call("local_reduce_scatter", jax.ShapeDtypeStruct((x.shape[0] // group.size,),
                                                            jnp.float32), x, group, order=order)


def all_gather(payload: tuple, group: Group, invariant: tuple = (), order=None) -> tuple:
  """Every member's arrays, concatenated in member order (any dtype).

  ``order``: the result's rows (``len(order)`` of them, each member's array an equal number)
  placed as ``base.permute_rows(rows, order)`` places them, as they are copied.

  ``invariant``: mesh axes over which the result is the same on every device (the last gather of
  an all-reduce, over all of its axes), typed invariant over them as ``all_gather_invariant``
  types its result, so that ``shard_map(check_vma=True)`` can return it with ``out_specs=P()``.
  Naming an axis the result varies over makes that output wrong.
  """
  if group.size == 1 and order is None:
    return payload
  return tuple(_call("local_all_gather", jax.ShapeDtypeStruct((a.shape[0] * group.size,),
                                                              a.dtype), a, group, invariant, order)
               for a in payload)


#: Payloads :func:`all_gather_decode` reads: int8 codes with f32 block scales, 16-bit floats.
DECODABLE = (jnp.dtype(jnp.int8), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def all_gather_decode(payload: tuple, group: Group, *, block_size: int = 0,
                      invariant: tuple = (), order=None):
  """:func:`all_gather` of an encoded payload and its decoding to f32 in one pass: the members
  read each other's codes and write decoded rows (no gathered copy of the codes).

  ``payload``: ``(codes, scales)``, int8 codes with one f32 scale per ``block_size`` values
  (``codecs.int8``'s wire format; each row holds whole blocks), or ``(values,)`` in bf16 or f16
  (widened exactly). ``order`` and ``invariant`` as for :func:`all_gather`.
  """
  values = payload[0]
  scales = payload[1] if len(payload) > 1 else jnp.zeros((0,), jnp.float32)
  result = jax.ShapeDtypeStruct((values.shape[0] * group.size,), jnp.float32)
  return _call("local_all_gather_decode", result, values, group, invariant, order,
               more=(scales,), block_size=int(block_size))


class InProcessTransport:
  """The members of a level that lives in this process, meeting in shared memory: a transport
  whose native collectives are the custom calls above (``hierarchical`` puts it on such a level;
  per-level ``algorithm={"local": "inprocess"}`` asks for it).

  It reads and writes rows where they lie, so an algorithm hands it the row ``order`` instead of
  permuting a copy first (``takes_order``). It has no ring step (its members meet in one call);
  its all-reduce serves a reduction over this one level alone (a level below others is
  reduce-scattered and all-gathered by ``hierarchical``).
  """

  name = "inprocess"
  #: reduce-scatter and all-gathers take ``order`` (rows read or written in place, no copy)
  takes_order = True
  #: every member is a device of this process (its reduce-scatter is sound in a multi-process job)
  spans_processes = False
  has_reduce_scatter = True

  def available(self) -> bool:
    """Whether it can run here (:func:`available`)."""
    return available()

  def reduce_scatter(self, x, group: Group, order=None):
    """:func:`reduce_scatter`: member ``i`` gets the sum of chunk ``i`` of ``x``'s rows in
    ``order``."""
    return reduce_scatter(x, group, order=order)

  def all_gather(self, payload: tuple, group: Group, order=None, invariant: tuple = ()) -> tuple:
    """:func:`all_gather`: every member's arrays, rows placed in ``order``, typed invariant over
    ``invariant``."""
    return all_gather(payload, group, invariant=invariant, order=order)

  def all_gather_decode(self, payload: tuple, group: Group, *, block_size: int = 0,
                        invariant: tuple = (), order=None):
    """:func:`all_gather_decode`: the gathered payload decoded to f32 as it is copied."""
    return all_gather_decode(payload, group, block_size=block_size, invariant=invariant,
                             order=order)

  def shift(self, payload: tuple, group: Group, offset: int = 1) -> tuple:
    """Not offered: the members meet in one call, there is no ring step to take."""
    raise NotImplementedError(f"jaxring in-process transport: no ring step over level "
                              f"{group.name!r} (its members read each other's buffers in one "
                              f"call); a ring on that level runs over XLA (algorithm 'ring')")

  def all_reduce(self, x, group: Group):
    """The sum over ``group`` on every member: its reduce-scatter, then its all-gather (one
    level that is the whole reduction, in a multi-process job where XLA:CPU would send it over
    gloo's loopback TCP). ``x``: f32, length divisible by the group's size."""
    shard = reduce_scatter(x, group)
    return all_gather((shard,), group, invariant=tuple(group.axes))[0]


INPROCESS = InProcessTransport()
