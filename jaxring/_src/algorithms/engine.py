"""The reduction engine: all-reduce, reduce-scatter and all-gather by a plan, over any transport.

The planner (jaxring._src.algorithms.planner) decides; this module executes. It is the one place
that switches on a plan's kind: ``xla`` (the transport's native collective) or a registered
algorithm (``base.get(plan.kind)``: ``ring``, ``hierarchical``), with ``topk_chunks`` wrapping a
whole all-reduce (:func:`sparse_all_reduce`, its one orchestration). The axes arrive bound
(jaxring._src.transport.binding): names bound by ``shard_map``/``pmap`` move their bytes with XLA
collectives and take lax's derivatives (jaxring._src.algorithms.linear); a name bound to an MPI
communicator moves them with mpi4jax, runs on stop_gradient'ed inputs and carries the MPI rules.

The ring and hierarchical algorithms work on flat accumulator-dtype buffers of ``p`` equal chunks.
Per leaf, reduce-scatter and all-gather move the scatter dimension (or gather axis) to the front,
pad its rows to the codecs' alignment, permute them into the order the plan hands chunks out, and
put the result back where ``lax.psum_scatter`` / ``lax.all_gather`` would.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import fuse, native
from jaxring._src.algorithms import base, linear, ring
from jaxring._src.algorithms.base import Plan
from jaxring._src.algorithms.planner import dense_codecs, make_plan, native_axes
from jaxring._src.codecs.base import accum_dtype
from jaxring._src.reliability import fingerprint
from jaxring._src.transport.binding import bind as bind
from jaxring._src.transport.groups import axis_arg


def lax_suffices(axes: tuple, algorithm, op: str) -> bool:
  """Whether lax's own collective is the whole call: ``algorithm="xla"`` over names lax binds."""
  return algorithm == "xla" and bind(axes, op).lax_bound


def plan_for(binding, nbytes: int, dtype, algorithm, compression) -> Plan:
  """The planner's plan for ``nbytes`` of ``dtype`` over ``binding``'s axes and levels."""
  return make_plan(binding.axes, binding.sizes, nbytes, dtype, algorithm, compression,
                   hierarchy=binding.hierarchy)


def _fingerprint(op: str, binding, shape, dtype, algorithm, plan: Plan):
  """Every process of a multi-process job must plan this collective alike (reliability/fingerprint).
  Returns the function its operands go through (their launch marker's tie)."""
  return fingerprint.check({
      "op": op, "axes": [str(a) for a in binding.axes], "axis_sizes": list(binding.sizes),
      "shape": [int(d) for d in shape], "dtype": str(jnp.dtype(dtype)),
      "algorithm": algorithm if isinstance(algorithm, str) else dict(algorithm),
      "plan": plan.kind, "codecs": [repr(c) for c in plan.codecs]}, binding)


def _pad_to(flat, multiple: int):
  n = flat.shape[0]
  m = -(-max(n, 1) // multiple) * multiple
  return jnp.pad(flat, (0, m - n)) if m != n else flat


def _is_traced(leaf) -> bool:
  return isinstance(leaf, jax.core.Tracer)


def _native_all_reduce(x, axes: tuple, plan: Plan):
  """The transport's own all-reduce over every member (``lax.psum`` over mesh axes, named
  slowest level first: :func:`~jaxring._src.algorithms.planner.native_axes`)."""
  if plan.whole is None:
    return native.psum(x, axis_arg(native_axes(axes, plan)))
  return plan.transport.all_reduce(x, plan.whole)


def _check_per_hop(plan: Plan, op: str) -> None:
  bad = [c for c in plan.codecs if not c.per_hop]
  if bad:
    raise NotImplementedError(
        f"jaxring.{op}: {bad[0].name} wraps a whole all-reduce and has no reduce-scatter or "
        "all-gather form; use it with psum, pmean or reduce_gradients")


def _check_block_order(plan: Plan, binding, op: str) -> None:
  if plan.kind == "hierarchical" and not binding.contiguous:
    raise NotImplementedError(
        f"jaxring.{op} with a hierarchical plan over MPI axis {binding.axes[0]!r}: the ranks are "
        "not laid out host by host (rank = local rank + local size * node), so blocks would not go "
        "in rank order; use algorithm='ring', or bind the axis with an explicit topology")


# --- all-reduce ----------------------------------------------------------------------------------


def segment_sizes(arrays) -> tuple[int, ...]:
  """The sizes of ``arrays`` fused one after the other into a flat buffer: its ``segments``,
  among which a per-tensor ``topk_chunks`` shares its chunks (``TopKChunks.quotas``)."""
  return tuple(int(np.size(a)) for a in arrays)


def _all_reduce_planned(flat, dtype, binding, plan: Plan, want_error: bool, segments=None):
  """Reduces a flat accumulator-dtype buffer over ``binding`` by a ring or hierarchical plan:
  (sum, error).

  ``segments``: the sizes of the tensors fused into ``flat`` (a per-tensor top-k chooses within
  them), or None."""
  axes = binding.axes
  wrapper = next((c for c in plan.codecs if not c.per_hop), None)
  if wrapper is not None:  # topk_chunks: chooses what to send, then runs the plan on that
    return sparse_all_reduce(flat, dtype, binding, wrapper, plan, want_error=want_error,
                             segments=segments)[:2]
  n = flat.shape[0]
  buf = _pad_to(flat, plan.size * plan.align)
  out, err = base.get(plan.kind).all_reduce(buf, plan, dtype, want_error=want_error)
  out = out[:n]
  if plan.whole is None:
    covered = {a for g in plan.groups for a in g.axes}
    trivial = tuple(a for a in axes if a not in covered)
    if trivial:  # size-1 axes: a no-op all-reduce, but it types the result invariant over them
      out = native.psum(out, trivial)
  return out, (None if err is None else err[:n])


def all_reduce_flat(flat, dtype, binding, algorithm, compression, *, want_error: bool = False,
                    segments=None):
  """Sum of a flat accumulator-dtype buffer over ``binding``, by the planned algorithm.

  Args:
    flat: this member's buffer (the accumulator dtype of ``dtype``).
    dtype: the values' own dtype (the codec's wire format may depend on it).
    binding: the bound axes (:func:`bind`).
    algorithm: as in :func:`jaxring.psum`.
    compression: as in :func:`jaxring.psum`.
    want_error: also return this member's compression error, laid out like ``flat``.
    segments: the sizes of the tensors fused into ``flat``, or None (one tensor): a per-tensor
      ``topk_chunks`` shares its chunks between them.

  Returns:
    ``(sum, error)``; ``error`` is None unless asked for, and None after a native all-reduce
    (exact: nothing to carry). No derivative rule is attached (error feedback runs on gradients).

  Example:
    >>> total, err = all_reduce_flat(flat, jnp.bfloat16, bind(("data",), "psum"), "ring",
    ...                              jaxring.codecs.int8(), want_error=True)  # doctest: +SKIP
  """
  plan = plan_for(binding, flat.shape[0] * jnp.dtype(dtype).itemsize, dtype, algorithm,
                  compression)
  flat = _fingerprint("all_reduce", binding, flat.shape, dtype, algorithm, plan)(flat)
  if plan.kind == "xla" or binding.size == 1:  # one member: exact, nothing travels or compresses
    return _native_all_reduce(flat, binding.axes, plan), None
  return _all_reduce_planned(flat, dtype, binding, plan, want_error, segments)


def sum_norms(norms, binding):
  """A sparsifying codec's chunk norms (f32) summed over ``binding``, identically on every
  member, by the lossless plan ``auto`` picks for their size: the native all-reduce without a
  measured profile; with one, what it measured fastest (on the emulated cluster's (node,
  local) mesh, the hierarchical plan: docs/simulations.md, "Validation against measurement on
  the emulated cluster"). Where that is XLA's all-reduce of a few norms over one mesh axis
  across processes, the ring's gather (``ring.GATHER_BELOW``) sums them: gloo's all-reduce of
  a few hundred bytes put 10.3 KB on a node's link, its all-gather 6.3 KB (docs/design.md)."""
  nbytes = norms.shape[0] * norms.dtype.itemsize
  algorithm = "auto"
  if (binding.lax_bound and len(binding.axes) == 1 and jax.process_count() > 1
      and (binding.size - 1) * nbytes < ring.GATHER_BELOW
      and plan_for(binding, nbytes, norms.dtype, "auto", None).kind == "xla"):
    algorithm = "ring"
  return all_reduce_flat(norms, norms.dtype, binding, algorithm, None)[0]


def sparse_all_reduce(flat, dtype, binding, codec, dense, *, want_error: bool = False,
                      segments=None, density: float | None = None):
  """A sparsifying codec's all-reduce, top-k's one orchestration: ``(sum, error, chunks sent)``.

  Every member's chunk norms are summed over ``binding`` (:func:`sum_norms`), ``codec`` picks
  the same chunks on every member (``TopKChunks.select``), and their packed buffer is reduced
  densely, with :func:`~jaxring._src.algorithms.planner.dense_codecs`, and added back in place
  (``TopKChunks.reduce_selected``). psum, pmean and reduce_gradients reach it through
  :func:`all_reduce_flat`; the compressed optimizers (jaxring._src.optim.sparse) call it.

  Args:
    flat, dtype, binding, want_error, segments: as in :func:`all_reduce_flat`.
    codec: the sparsifying codec (``topk_chunks``).
    dense: how the packed buffer is planned. A ``Plan``: the whole call's own (planned and
      fingerprinted once, for the whole buffer's size), run with its codecs made dense. Or
      ``(algorithm, compression)``: the packed buffer planned for its own size as an
      all-reduce of its own (:func:`all_reduce_flat`), for a caller that chooses chunks without
      planning the whole buffer (the optimizers). The two differ under ``auto``: planned
      afresh, a lossless packed buffer goes by the native all-reduce (or what a profile
      measured fastest at its size), where psum's keeps the ring its top-k call planned.
    density: None, or a density that replaces the codec's (the optimizers' warm-up).

  Returns:
    The sum and error as in :func:`all_reduce_flat`, and the chunks sent (ascending int32;
    ``codec.sent_mask`` makes them a mask: momentum masking).
  """
  if density is not None:
    codec = dataclasses.replace(codec, density=density)
  if isinstance(dense, Plan):
    plan = dataclasses.replace(dense, codecs=tuple(dense_codecs(dense.codecs, dtype)))
    reduce_dense = lambda buf, want: _all_reduce_planned(buf, dtype, binding, plan, want)
  else:
    algorithm, compression = dense[0], dense_codecs(dense[1], dtype)
    reduce_dense = lambda buf, want: all_reduce_flat(buf, dtype, binding, algorithm, compression,
                                                     want_error=want)
  idx = codec.select(flat, lambda v: sum_norms(v, binding), segments)
  total, err = codec.reduce_selected(flat, idx, reduce_dense=reduce_dense, want_error=want_error)
  return total, err, idx


def all_reduce(leaves: list, binding, algorithm, compression) -> list:
  """The sum of every leaf over ``binding``: the leaves of one dtype fused, one plan per dtype.

  Over mesh axes a constant (untraced) leaf is lax's to fold (size * x) and the result has
  lax.psum's derivative. Over MPI every process's values are reduced (constants too: unlike
  shard_map's members, processes hold different ones), on stop_gradient'ed inputs, and
  :func:`linear.summed` gives the result lax.psum's derivative.
  """
  if binding.lax_bound:
    return _sum_by_dtype(leaves, binding, algorithm, compression)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  sums = _sum_by_dtype([lax.stop_gradient(leaf) for leaf in leaves], binding, algorithm,
                       compression)
  return [linear.summed(x, lax.stop_gradient(y)) for x, y in zip(leaves, sums)]


def _sum_by_dtype(leaves: list, binding, algorithm, compression) -> list:
  leaves, out = list(leaves), list(leaves)
  travels = lambda leaf: binding.size > 1 and np.size(leaf) > 0 and (
      _is_traced(leaf) or not binding.lax_bound)
  groups = fuse.by_dtype(leaves, travels)
  if binding.lax_bound:
    for i, leaf in enumerate(leaves):
      if not travels(leaf):   # constants: size * x, as lax folds them
        out[i] = native.psum(leaf, axis_arg(binding.axes))
  for dtype, idxs in groups.items():
    nbytes = sum(np.size(leaves[i]) for i in idxs) * dtype.itemsize
    plan = plan_for(binding, nbytes, dtype, algorithm, compression)
    tie = _fingerprint("psum", binding, (nbytes // dtype.itemsize,), dtype, algorithm, plan)
    for i, leaf in zip(idxs, tie([leaves[i] for i in idxs])):
      leaves[i] = leaf
    if plan.kind == "xla":
      for i in idxs:
        out[i] = _native_all_reduce(leaves[i], binding.axes, plan)
      continue
    flat = fuse.concat(leaves, idxs, accum_dtype(dtype))
    sizes = segment_sizes(leaves[i] for i in idxs)
    reduce = lambda v, plan=plan, dtype=dtype, sizes=sizes: _all_reduce_planned(
        v, dtype, binding, plan, False, sizes)[0]
    if binding.lax_bound and linear.differentiable(dtype):
      # the tangents' native all-reduce in the plan's order; over MPI they carry none
      reduce = linear.psum(reduce, native_axes(binding.axes, plan))
    for i, piece in zip(idxs, fuse.split(reduce(flat), leaves, idxs, dtype)):
      out[i] = piece
  return out


# --- reduce-scatter and all-gather of one leaf ---------------------------------------------------


def reduce_scatter(leaf, d: int, tiled: bool, binding, algorithm, compression):
  """``lax.psum_scatter(leaf, scatter_dimension=d, tiled=tiled)`` over ``binding`` by a plan.

  The shapes are already checked (jaxring._src.collectives). A transport without a native
  reduce-scatter runs the ring where the plan says ``xla``.
  """
  dtype = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.result_type(leaf)
  nbytes = np.size(leaf) * dtype.itemsize
  plan = _reduce_scatter_plan(binding, nbytes, dtype, algorithm, compression)
  leaf = _fingerprint("psum_scatter", binding, np.shape(leaf), dtype, algorithm, plan)(leaf)
  _check_block_order(plan, binding, "psum_scatter")
  p = binding.size
  if not binding.lax_bound:
    leaf = jnp.asarray(leaf)
    block = _reduce_scatter_leaf(lax.stop_gradient(leaf), d, tiled, p, dtype, plan)
    return linear.not_differentiable("psum_scatter")(leaf, lax.stop_gradient(block))
  if plan.kind == "xla" or p == 1 or np.size(leaf) == 0:
    return native.psum_scatter(leaf, axis_arg(binding.axes), scatter_dimension=d, tiled=tiled)
  scatter = functools.partial(_reduce_scatter_leaf, d=d, tiled=tiled, p=p, dtype=dtype, plan=plan)
  if linear.differentiable(dtype):
    scatter = linear.psum_scatter(scatter, binding.axes, d, tiled)
  return scatter(jnp.asarray(leaf))


def all_gather(leaf, ax: int, tiled: bool, binding, algorithm, compression):
  """``lax.all_gather(leaf, axis=ax, tiled=tiled)`` over ``binding`` by a plan (shapes checked)."""
  dtype = jnp.dtype(leaf.dtype)
  p = binding.size
  nbytes = leaf.size * dtype.itemsize * p
  plan = plan_for(binding, nbytes, dtype, algorithm, compression)
  leaf = _fingerprint("all_gather", binding, leaf.shape, dtype, algorithm, plan)(leaf)
  _check_per_hop(plan, "all_gather")
  _check_block_order(plan, binding, "all_gather")
  if not binding.lax_bound:
    held = lax.stop_gradient(leaf)
    if plan.kind == "xla":
      rows = plan.transport.all_gather((jnp.ravel(held),), plan.whole)[0]
      gathered = _place_rows(rows.reshape((p,) + leaf.shape), ax, tiled)
    else:
      gathered = _all_gather_leaf(held, ax, tiled, p, dtype, plan)
    return linear.not_differentiable("all_gather")(leaf, lax.stop_gradient(gathered))
  if plan.kind == "xla" or p == 1 or leaf.size == 0:
    return native.all_gather(leaf, axis_arg(binding.axes), axis=ax, tiled=tiled)
  gather = functools.partial(_all_gather_leaf, ax=ax, tiled=tiled, p=p, dtype=dtype, plan=plan)
  if linear.differentiable(dtype):
    gather = linear.all_gather(gather, binding.axes, ax, tiled)
  return gather(leaf)


def reduce_scatter_flat(flat, dtype, binding, algorithm, compression, *, want_error=False):
  """Member ``i`` gets the sum of row ``i`` of ``flat`` viewed as ``(p, m)``, by a plan.

  ``lax.psum_scatter(flat, scatter_dimension=0, tiled=True)`` over mesh axes, plus what error
  feedback needs: with ``want_error``, this member's compression error laid out like ``flat``
  (None after an exact reduction). No derivative rule (it runs on gradients, inside a backward
  rule: jaxring._src.train).

  Example:
    >>> shard, err = reduce_scatter_flat(flat, jnp.float32, bind(("data",), "psum_scatter"),
    ...     "ring", jaxring.codecs.int8(), want_error=True)  # doctest: +SKIP
  """
  if not binding.lax_bound:
    raise NotImplementedError("reduce_scatter_flat: mesh axes only (a sharded train step)")
  p = binding.size
  plan = _reduce_scatter_plan(binding, flat.shape[0] * jnp.dtype(dtype).itemsize, dtype,
                              algorithm, compression)
  flat = _fingerprint("psum_scatter", binding, flat.shape, dtype, algorithm, plan)(flat)
  if plan.kind == "xla" or p == 1:
    return native.psum_scatter(flat, axis_arg(binding.axes), scatter_dimension=0, tiled=True), None
  return _reduce_scatter_rows(flat.reshape(p, -1), p, dtype, plan, want_error)


def _order(algorithm, plan: Plan):
  """The algorithm's chunk order, or None where it is the identity (no permuting copy)."""
  order = algorithm.chunk_order(plan)
  return None if order is None or tuple(order) == tuple(range(len(order))) else order


def _reduce_scatter_plan(binding, nbytes: int, dtype, algorithm, compression) -> Plan:
  """The plan of a reduce-scatter. The native one only where it is sound: a transport that has
  one, and, unless the caller named ``"xla"``, not across processes (``lax.psum_scatter`` over
  gloo intermittently returned wrong sums there: docs/design.md); the ring otherwise."""
  plan = plan_for(binding, nbytes, dtype, algorithm, compression)
  _check_per_hop(plan, "psum_scatter")
  if plan.kind == "xla" and (not plan.transport.has_reduce_scatter or (
      algorithm != "xla" and jax.process_count() > 1)):
    plan = plan_for(binding, nbytes, dtype, "ring", None)
  return plan


def _reduce_scatter_rows(rows, p, dtype, plan: Plan, want_error: bool):
  """Member ``i`` gets the sum of ``rows[i]`` (accumulator dtype): ``(shard, error or None)``,
  the error laid out like ``rows``, flat."""
  m = rows.shape[1]
  m_pad = -(-max(m, 1) // plan.align) * plan.align
  rows = jnp.pad(rows, ((0, 0), (0, m_pad - m)))
  algorithm = base.get(plan.kind)
  order = _order(algorithm, plan)  # the algorithm reads the rows in it (without a copy if it can)
  if not want_error:
    return algorithm.reduce_scatter(rows.reshape(-1), plan, dtype, order=order)[:m], None
  with_error = getattr(algorithm, "reduce_scatter_with_error", None)
  if with_error is None:
    raise NotImplementedError(f"algorithm {plan.kind!r} has no reduce_scatter_with_error: error "
                              "feedback on its reduce-scatter is not available")
  shard, err = with_error(rows.reshape(-1), plan, dtype, order=order)
  err = err.reshape(p, m_pad)
  if order is not None:
    err = base.permute_rows(err, np.argsort(np.asarray(order)))
  return shard[:m], err[:, :m].reshape(-1)


def _reduce_scatter_leaf(leaf, d, tiled, p, dtype, plan: Plan):
  """``lax.psum_scatter(leaf, scatter_dimension=d, tiled=tiled)`` over the ``p`` members of a
  ring or hierarchical ``plan``; ``dtype`` is the leaf's."""
  moved = jnp.moveaxis(leaf, d, 0)
  rest = moved.shape[1:]
  rows = moved.reshape(p, -1).astype(accum_dtype(dtype))
  block = _reduce_scatter_rows(rows, p, dtype, plan, False)[0].astype(dtype)
  if tiled:
    return jnp.moveaxis(block.reshape((moved.shape[0] // p,) + tuple(rest)), 0, d)
  return block.reshape(rest)


def _all_gather_leaf(leaf, ax, tiled, p, dtype, plan: Plan):
  """``lax.all_gather(leaf, axis=ax, tiled=tiled)`` over the ``p`` members of a ring or
  hierarchical ``plan``. Each value crosses every level once, encoded by one codec (the slowest
  level's)."""
  codec = plan.codecs[-1]
  n = leaf.size
  flat = _pad_to(jnp.ravel(leaf).astype(accum_dtype(dtype)), plan.align)
  algorithm = base.get(plan.kind)
  order = _order(algorithm, plan)  # back to member order, on the narrow payload
  inverse = None if order is None else np.argsort(np.asarray(order))
  payload = codec.encode(flat, dtype)
  if (decoded := getattr(algorithm, "all_gather_decoded", None)) is not None:
    rows = decoded(payload, plan, codec, dtype, order=inverse)
  else:
    rows = codec.decode(algorithm.all_gather(payload, plan, order=inverse), dtype)
  rows = rows.reshape(p, -1)
  return _place_rows(rows[:, :n].astype(dtype).reshape((p,) + leaf.shape), ax, tiled)


def _place_rows(stacked, ax, tiled):
  """``stacked[i]`` is member i's value: lax.all_gather's layout along ``ax``."""
  moved = jnp.moveaxis(stacked, 0, ax)  # (..., p, d_ax, ...)
  if not tiled:
    return moved
  shape = list(stacked.shape[1:])
  shape[ax] *= stacked.shape[0]
  return moved.reshape(shape)
