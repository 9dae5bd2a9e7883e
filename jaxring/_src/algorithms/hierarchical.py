"""BlueConnect (Cho et al., 2019): an all-reduce decomposed onto each level of the hierarchy.

For levels ordered fast -> slow with sizes p_1..p_k: reduce-scatter on each level from the fastest
(the buffer shrinks by p_i at each), all-reduce of the remaining 1/(p_1...p_{k-1}) shard on the
slowest level, then all-gather back from slow to fast. The slow level carries n/(p_1...p_{k-1})
instead of n: that factor is the win. Each level has its own algorithm, codec and transport: the
plan's (XLA, MPI), or the in-process one (transport/inprocess.py) on a level of devices in this
process, whose native collectives read the members' buffers in shared memory.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxring._src import vma
from jaxring._src.algorithms import ring
from jaxring._src.algorithms.base import (
  Plan,
  PlanRequest,
  permute_flat,
  permute_rows,
  register,
)
from jaxring._src.codecs.base import Codec
from jaxring._src.transport.groups import Group
from jaxring._src.transport.inprocess import INPROCESS


def _in_place(algo: str, transport) -> bool:
  """Whether a level runs its transport's native collective reading rows where they lie (the
  in-process transport): it takes the row order and the invariant axes itself."""
  return algo == "xla" and transport.takes_order


def _level_reduce_scatter(x, group, codec, algo, dtype, transport, want_error, pieces=1,
                          order=None):
  """One level's reduce-scatter of ``permute_flat(x, order)`` over that level's ``transport``:
  ``(shard, error or None)``."""
  if _in_place(algo, transport):   # no permuted copy: the members read the rows in `order`
    return (transport.reduce_scatter(x, group, order=order),
            (jnp.zeros_like(x) if want_error else None))
  x = permute_flat(x, order)
  if algo == "xla" and transport.has_reduce_scatter:
    # a transport without a native reduce-scatter (MPI through mpi4jax) runs the ring instead
    return transport.reduce_scatter(x, group), (jnp.zeros_like(x) if want_error else None)
  return ring.reduce_scatter(x, group, codec, dtype, transport, want_error=want_error,
                             pieces=pieces)


def _slow_level_all_reduce(x, group, codec, algo, dtype, transport, want_error, pieces=1):
  """The slowest level's all-reduce: ``(payload, carrier, error)``, the result still encoded by
  ``carrier`` (``payload`` is ``(x,)`` and ``carrier`` None after a native all-reduce)."""
  if algo == "xla":
    return (transport.all_reduce(x, group),), None, (jnp.zeros_like(x) if want_error else None)
  payload, err = ring.all_reduce_payload(x, group, codec, dtype, transport, want_error=want_error,
                                         pieces=pieces)
  return payload, codec, err


def _passes_through(codec: Codec) -> bool:
  """Whether a level's all-gather may carry a slower level's payload as it is: its own codec is
  the identity, so decoding once after the gather gives what decoding before it would have."""
  return type(codec) is Codec



def _add_error(err, offset, e):
  """``err`` with ``e`` (one level's compression error, over the shard that starts at
  ``offset``, possibly traced) added where that shard lies."""
  e = e.astype(err.dtype)
  return lax.dynamic_update_slice(err, lax.dynamic_slice(err, (offset,), (e.shape[0],)) + e,
                                  (offset,))

def all_reduce(flat, groups: list[Group], codecs: list[Codec], algos: list[str], dtype, transport,
               *, want_error=False, pieces=None, transports=None):
  """Hierarchical all-reduce of ``flat`` (length a multiple of prod(sizes) * every codec's align).

  Returns ``(result, error)``; ``error`` (when asked) is this member's compression error laid out
  like ``flat``. An error made while encoding a shard that ``m`` members hold identically (the
  all-gather phase of a faster level) is split between them, so the errors of all members sum to
  the total error exactly once. ``pieces[i]``: sub-chunk transfers per ring hop on level ``i``;
  ``transports[i]``: level ``i``'s transport (default ``transport`` on every level).
  """
  n = flat.shape[0]
  pieces = list(pieces or [1] * len(groups))
  transports = list(transports or [transport] * len(groups))
  axes = tuple(dict.fromkeys(a for g in groups for a in g.axes))
  x = vma.pvary(flat, axes)
  if vma.is_varying(x, axes) and not all(g.whole for g in groups):
    return _all_reduce_flat_finish(x, groups, codecs, algos, dtype, transport, axes, want_error,
                                   pieces, transports)
  err = jnp.zeros((n,), flat.dtype) if want_error else None
  offsets = [0]  # offset of x within flat, per depth
  for g, cd, al, pc, t in zip(groups[:-1], codecs[:-1], algos[:-1], pieces, transports):
    c = x.shape[0] // g.size
    x, e = _level_reduce_scatter(x, g, cd, al, dtype, t, want_error, pc)
    if want_error:
      err = _add_error(err, offsets[-1], e)
    offsets.append(offsets[-1] + g.rank() * c)
  payload, carrier, e = _slow_level_all_reduce(x, groups[-1], codecs[-1], algos[-1], dtype,
                                                transports[-1], want_error, pieces[-1])
  if want_error:
    err = _add_error(err, offsets[-1], e)
  # The all-gathers keep the slow level's encoding through identity-codec levels and decode once
  # at the end: same values, and the fast levels move the narrow payload (int8: a quarter).
  replicas = groups[-1].size
  for depth in range(len(groups) - 2, -1, -1):
    g, cd, t = groups[depth], codecs[depth], transports[depth]
    if carrier is None or not _passes_through(cd):
      x = payload[0] if carrier is None else carrier.decode(payload, dtype)
      payload, carrier = cd.encode(x, dtype), cd
      if want_error:
        e = (x - cd.decode(payload, dtype)) / replicas
        err = _add_error(err, offsets[depth + 1], e)
    if _in_place(algos[depth], t) and (depth == 0 or not vma.is_varying(payload[0], g.axes)):
      # in-process; the last gather leaves every member of every level the same result, so it
      # is typed invariant over all the axes (check_vma=True) as lax.psum's result is. A middle
      # level's result still varies over the faster levels: the plan's native collective types it.
      block = None if carrier is None or depth else carrier.in_process_decode(dtype)
      if block is not None:  # the last gather decodes as it copies
        return t.all_gather_decode(payload, g, block_size=block, invariant=axes), err
      payload = t.all_gather(payload, g, invariant=axes if depth == 0 else ())
    else:
      payload = ring.all_gather_payload(payload, g, transport if t.takes_order else t)
    replicas *= g.size
  return (payload[0] if carrier is None else carrier.decode(payload, dtype)), err


def _all_reduce_flat_finish(flat, groups, codecs, algos, dtype, transport, axes, want_error,
                            pieces, transports):
  """Levels carved out of one axis, vma checked: reduce-scatter level by level, then one native
  all-gather over the whole axis, the only collective that types the result invariant (a
  grouped one cannot). It moves (p-1)/p of the buffer instead of the per-level all-gathers'
  share on the slow level: the price of check_vma=True on a Topology-split axis."""
  n = flat.shape[0]
  perm = chunk_permutation(groups, [g.stride for g in groups])
  p = math.prod(g.size for g in groups)
  shard, err = flat, (jnp.zeros_like(flat) if want_error else None)
  offset = 0
  for g, cd, al, pc, t in zip(groups, codecs, algos, pieces, transports):
    c = shard.shape[0] // g.size
    shard, e = _level_reduce_scatter(shard, g, cd, al, dtype, t, want_error, pc)
    if want_error:
      err = _add_error(err, offset, e)
    offset = offset + g.rank() * c
  cd = codecs[-1]
  payload = cd.encode(shard, dtype)
  if want_error:
    e = shard - cd.decode(payload, dtype)
    err = _add_error(err, offset, e)
  whole = Group(axes, p, 1, p, "/".join(map(str, axes)))
  gathered = transport.all_gather(payload, whole)
  rows = cd.decode(gathered, dtype).reshape(p, -1)  # row i: member i's chunk, chunk perm^-1[i]
  return permute_rows(rows, perm).reshape(n), err


def chunk_permutation(groups: list[Group], strides: list[int]) -> list[int]:
  """Chunk order that makes hierarchical reduce-scatter hand member ``i`` chunk ``i``.

  ``strides[l]`` is level l's weight in the member's linear index (as ``lax.psum_scatter`` numbers
  members). Hierarchical reduce-scatter hands out chunks in mixed radix with the first (fastest)
  level most significant; ``perm[j]`` is the linear chunk index that must sit at position ``j``.
  """
  sizes = [g.size for g in groups]
  perm = []
  for j in range(math.prod(sizes)):
    digits, rem = [], j
    for p in reversed(sizes):
      digits.append(rem % p)
      rem //= p
    digits.reverse()
    perm.append(sum(d * s for d, s in zip(digits, strides)))
  return perm


def reduce_scatter(flat, groups: list[Group], codecs: list[Codec], algos: list[str], dtype,
                   transport, pieces=None, *, want_error=False, order=None, transports=None):
  """Hierarchical reduce-scatter of ``permute_flat(flat, order)`` (``order``: None when the chunks
  are already in :func:`chunk_permutation`'s order). A first level whose transport takes the
  order (in-process) reads the chunks where they lie, without the permuting copy.

  Returns ``(shard, error)``; ``error`` (when asked) is this member's compression error laid out
  like the permuted ``flat``: each level's error sits where that level's input sat within it.
  """
  x, offset = flat, 0
  err = jnp.zeros_like(flat) if want_error else None
  transports = list(transports or [transport] * len(groups))
  if jax.process_count() > 1:  # no native reduce-scatter across processes (docs/design.md)
    algos = ["ring" if a == "xla" and t.spans_processes else a for a, t in zip(algos, transports)]
  for g, cd, al, pc, t in zip(groups, codecs, algos, pieces or [1] * len(groups), transports):
    c = x.shape[0] // g.size
    x, e = _level_reduce_scatter(x, g, cd, al, dtype, t, want_error, pc, order)
    order = None
    if want_error:
      err = _add_error(err, offset, e)
    offset = offset + g.rank() * c
  return x, err


def all_gather(payload: tuple, groups: list[Group], algos: list[str], transport,
               order=None, decode: tuple | None = None, transports=None):
  """Hierarchical all-gather of encoded chunks, slowest level first (inverse of reduce_scatter),
  each array's rows then placed as ``permute_flat(array, order)`` places them; with ``decode =
  (codec, dtype)``, the decoded result instead of the payload.

  A level on the in-process transport (``transports[i]``, default ``transport`` on every level)
  gathers in shared memory, the last one straight into ``order`` (and decoding as it copies
  where the codec's payload allows: ``Codec.in_process_decode``); the others use the native
  all-gather where a level is whole axes (gloo's and NCCL's are rings already), a ppermute ring
  otherwise. The result is typed varying, as lax.all_gather's is, and the derivative is
  lax.all_gather's whatever moves the bytes (linear.all_gather)."""
  transports = list(transports or [transport] * len(groups))
  for i, (g, al, t) in enumerate(zip(reversed(groups), reversed(algos), reversed(transports))):
    last = i == len(groups) - 1
    if _in_place(al, t) and last and decode is not None and (
        block := decode[0].in_process_decode(decode[1])) is not None:
      return vma.pvary(t.all_gather_decode(payload, g, block_size=block, order=order), g.axes)
    if _in_place(al, t):
      gathered = t.all_gather(payload, g, order=order if last else None)
      order = None if last else order
    else:
      gathered = ring.all_gather_payload(payload, g, t)
    payload = tuple(vma.pvary(x, g.axes) for x in gathered)
  payload = tuple(permute_flat(a, order) for a in payload)
  return payload if decode is None else decode[0].decode(payload, decode[1])


def _shared_memory(r: PlanRequest, level, codec: Codec, last: bool = False) -> bool:
  """Whether the in-process transport can serve a level: its members in this process (every
  level of a one-process job; ``local`` of one process per node), lossless f32 sums on the CPU,
  XLA's devices (not MPI ranks), and not the slowest level (whose all-reduce is one step)."""
  return (not last and r.transport.name == "xla" and not codec.lossy and
          jnp.dtype(r.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                 jnp.dtype(jnp.float16)) and
          (not r.multi_process or getattr(level, "in_process", False)) and INPROCESS.available())


def one_level_in_process(r: PlanRequest) -> bool:
  """Whether a reduction over one whole level of this process's devices, in a multi-process job,
  runs on the in-process transport: XLA:CPU would send it over gloo's loopback TCP. Asked as
  ``auto`` or ``hierarchical``; ``{level: "inprocess"}`` asks for it in a one-process job too
  (where lax's collective stays in the process: the default keeps it)."""
  if len(r.groups) != 1 or not r.groups[0].whole:
    return False
  a = r.algorithm
  a = a.get(r.groups[0].name, "auto") if isinstance(a, dict) else a
  asked = a == INPROCESS.name or (r.multi_process and a in ("auto", "hierarchical"))
  return asked and _shared_memory(r, r.levels[0], r.codecs[0])


class Hierarchical:
  """BlueConnect over the levels the axes span; one level is a ring."""

  name = "hierarchical"
  min_levels = 2

  def plan(self, r: PlanRequest) -> Plan:
    if len(r.groups) == 1:
      if one_level_in_process(r):   # the level's own all-reduce, in shared memory
        return Plan("hierarchical", tuple(r.groups), tuple(r.codecs), ("xla",), tuple(r.strides),
                    transport=r.transport, pieces=(r.levels[0].pieces,),
                    level_transports=(INPROCESS,))
      return ring.Ring().plan(r)
    algos, transports = [], []
    for i, (g, c) in enumerate(zip(r.groups, r.codecs)):
      a = r.algorithm.get(g.name, "auto") if isinstance(r.algorithm, dict) else "auto"
      last = i == len(r.groups) - 1
      if a == "auto":
        # native per level only where it is exact and proven: lossless, a whole axis, and inside
        # one process (lax.psum_scatter across processes over gloo returned corrupt results, see
        # docs/design.md); the slowest level's all-reduce is native when lossless and the
        # transport's native all-reduce beats its ring (gloo/NCCL yes, MPICH no: docs/design.md).
        native_ok = r.transport.native_all_reduce_wins if last else not r.multi_process
        a = "xla" if (not c.lossy and g.whole and native_ok) else "ring"
        if not last and _shared_memory(r, r.levels[i], c):
          a = INPROCESS.name
      if a == INPROCESS.name and not _shared_memory(r, r.levels[i], c, last=last):
        raise ValueError(f"level {g.name!r} cannot use {INPROCESS.name!r} (the in-process "
                         "transport): it needs the CPU backend, the extension, float32 sums, no "
                         "codec, members in one process, and a level below the slowest; use "
                         "'auto' or 'ring' on that level")
      if a == "xla" and (c.lossy or not g.whole):
        why = "it cannot compress" if c.lossy else "the level is part of one axis (a Topology split)"
        raise ValueError(f"level {g.name!r} cannot use algorithm 'xla': {why}")
      # a level named by its transport runs that transport's native collective
      algos.append("xla" if a == INPROCESS.name else a)
      transports.append(INPROCESS if a == INPROCESS.name else r.transport)
    return Plan("hierarchical", tuple(r.groups), tuple(r.codecs), tuple(algos), tuple(r.strides),
                transport=r.transport, pieces=tuple(lv.pieces for lv in r.levels),
                level_transports=tuple(transports))

  def all_reduce(self, buf, plan: Plan, dtype, *, want_error: bool):
    return all_reduce(buf, list(plan.groups), list(plan.codecs), list(plan.algos), dtype,
                      plan.transport, want_error=want_error, pieces=list(plan.pieces),
                      transports=list(plan.transports))

  def reduce_scatter(self, buf, plan: Plan, dtype, order=None):
    return self.reduce_scatter_with_error(buf, plan, dtype, want_error=False, order=order)[0]

  def reduce_scatter_with_error(self, buf, plan: Plan, dtype, *, want_error: bool = True,
                                order=None):
    return reduce_scatter(buf, list(plan.groups), list(plan.codecs), list(plan.algos), dtype,
                          plan.transport, pieces=list(plan.pieces), want_error=want_error,
                          order=order, transports=list(plan.transports))

  def all_gather(self, payload: tuple, plan: Plan, order=None) -> tuple:
    return all_gather(payload, list(plan.groups), list(plan.algos), plan.transport, order,
                      transports=list(plan.transports))

  def all_gather_decoded(self, payload: tuple, plan: Plan, codec: Codec, dtype, order=None):
    return all_gather(payload, list(plan.groups), list(plan.algos), plan.transport, order,
                      (codec, dtype), list(plan.transports))

  def chunk_order(self, plan: Plan) -> tuple[int, ...] | None:
    return tuple(chunk_permutation(list(plan.groups), list(plan.strides)))


register(Hierarchical())
