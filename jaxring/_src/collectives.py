"""psum / pmean / psum_scatter / all_gather: jax.lax's contract, jaxring's algorithms.

Argument handling mirrors ``jax.lax`` (pytrees, Python constants, bool -> int32 for the reductions
and bool kept by all_gather, tuple axis names, ``NameError`` for an unbound axis, ``ValueError``
for a repeated one, lax's shape errors); then each dtype's leaves are fused into one flat buffer
and reduced by the planned algorithm: ``xla`` (the native collective), ``ring`` or
``hierarchical`` (jaxring._src.algorithms), with ``compression`` deciding what travels. Whatever
the algorithm and codec, derivatives are lax's (jaxring._src.algorithms.linear).

An axis name is bound by ``shard_map``/``pmap`` (XLA collectives move the bytes) or, outside them,
to an MPI communicator by ``jaxring.distributed.mpi_axis`` (one process per device; mpi4jax moves
the bytes, and the binding's topology gives the levels).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src.algorithms import engine, hierarchical, linear, ring
from jaxring._src.algorithms.planner import Plan, make_plan, validate_algorithm
from jaxring._src.codecs.base import Codec, accum_dtype
from jaxring._src.transport import mpi_axis

AxisName = Any


def _axes(axis_name, op: str) -> tuple:
  """The axis names as a tuple, refused as lax refuses them (with lax's message in ours)."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  for a in axes:
    if isinstance(a, (int, np.integer)):
      # lax reads an int as a positional array dimension (a vmap-style reduction), which no
      # mesh collective can implement; lax.all_gather/psum_scatter fail on it with this message
      raise ValueError(f"jaxring.{op}: axis name {a!r} is an int; jaxring's collectives take the "
                       "names of axes bound by `jax.shard_map`/`jax.pmap` (or an MPI axis), not "
                       "positional array dimensions: reduce those with jnp.sum first (lax: axis "
                       f"{a} is out of bounds for array of dimension 0)")
  repeated = sorted({str(a) for a in axes if axes.count(a) > 1})
  if repeated:
    raise ValueError(f"jaxring.{op}: axis_name {axis_name!r} names {', '.join(repeated)} more than "
                     "once; each axis may appear once (lax: repeated axis in `source` argument)")
  return axes


def _sizes(axes: tuple, op: str) -> tuple[int, ...]:
  sizes = []
  for a in axes:
    try:
      sizes.append(int(lax.axis_size(a)))
    except NameError:
      # lax's own wording first: code written against lax.psum matches on it
      raise NameError(f"Found an unbound axis name: {a}. To fix this, please call {op} under "
                      f"`jax.shard_map`. (jaxring.{op} also runs under `jax.pmap`, and over a "
                      "name bound to an MPI communicator by `jaxring.distributed.mpi_axis`.)"
                      ) from None
  return tuple(sizes)


def _bind(axes: tuple, op: str) -> tuple[tuple[int, ...], mpi_axis.MpiAxis | None]:
  """``(sizes, MPI binding)``: names bound by shard_map/pmap first (binding None), else an
  MPI-bound name; ``NameError`` for a name bound by neither."""
  try:
    return tuple(int(lax.axis_size(a)) for a in axes), None
  except NameError:
    pass
  mpi = mpi_axis.lookup(axes)
  if mpi is None:
    return _sizes(axes, op), None
  return (mpi.size,), mpi


def _plan_for(axes, sizes, mpi, nbytes, dtype, algorithm, compression) -> Plan:
  return make_plan(axes, sizes, nbytes, dtype, algorithm, compression,
                   hierarchy=None if mpi is None else mpi.hierarchy)


def _validate_compression(compression) -> None:
  if compression is None or isinstance(compression, Codec):
    return
  if isinstance(compression, dict) and all(isinstance(c, (Codec, type(None)))
                                           for c in compression.values()):
    return
  raise TypeError("compression must be None, a jaxring.codecs codec, or a dict level name -> codec;"
                  f" got {compression!r}")


def _lossy(compression) -> bool:
  if isinstance(compression, dict):
    return any(c is not None and c.lossy for c in compression.values())
  return compression is not None and compression.lossy


def _check_per_hop(plan: Plan, op: str) -> None:
  bad = [c for c in plan.codecs if not c.per_hop]
  if bad:
    raise NotImplementedError(
        f"jaxring.{op}: {bad[0].name} wraps a whole all-reduce and has no reduce-scatter or "
        "all-gather form; use it with psum, pmean or reduce_gradients")


def _check_groups(algorithm, compression, op: str, axes: tuple) -> None:
  if axes and _bind(axes, op)[1] is not None:
    raise NotImplementedError(f"jaxring.{op}: axis_index_groups over an MPI-bound axis {axes}; "
                              "bind a sub-communicator to its own axis name instead")
  if algorithm not in ("auto", "xla") or _lossy(compression):
    raise NotImplementedError(
        f"jaxring.{op}: axis_index_groups is supported only by algorithm='xla' (and 'auto', which "
        f"then uses it) without lossy compression; got algorithm={algorithm!r}, "
        f"compression={compression!r}")


def _prep(x):
  leaves, treedef = jax.tree_util.tree_flatten(x)
  leaves = [lax.convert_element_type(l, np.int32) if jnp.result_type(l) == np.bool_ else l
            for l in leaves]
  return leaves, treedef


def _is_traced(leaf) -> bool:
  return isinstance(leaf, jax.core.Tracer)


def _pad_to(flat, multiple: int):
  n = flat.shape[0]
  m = -(-max(n, 1) // multiple) * multiple
  return jnp.pad(flat, (0, m - n)) if m != n else flat


def all_reduce_flat(flat, dtype, axes: tuple, plan: Plan, *, want_error: bool = False):
  """Reduces a flat accumulator-dtype buffer by a non-``xla`` plan; returns (sum, error or None)."""
  wrapper = next((c for c in plan.codecs if not c.per_hop), None)
  if wrapper is not None:  # topk_chunks: chooses what to send, then runs the plan on that
    dense = dataclasses.replace(plan, codecs=tuple(
        c.dense_codec(dtype) if not c.per_hop else c for c in plan.codecs))
    if plan.whole is None:
      reduce_norms = lambda v: lax.psum(v, axes if len(axes) > 1 else axes[0])
    else:
      reduce_norms = lambda v: plan.transport.all_reduce(v, plan.whole)
    return wrapper.all_reduce(
        flat, dtype, reduce_norms=reduce_norms,
        reduce_dense=lambda buf, err: all_reduce_flat(buf, dtype, axes, dense, want_error=err),
        want_error=want_error)
  n = flat.shape[0]
  buf = _pad_to(flat, plan.size * plan.align)
  if plan.kind == "ring":
    out, err = ring.all_reduce(buf, plan.groups[0], plan.codecs[0], dtype, plan.transport,
                               want_error=want_error, pieces=plan.pieces[0])
  else:
    out, err = hierarchical.all_reduce(buf, list(plan.groups), list(plan.codecs), list(plan.algos),
                                       dtype, plan.transport, want_error=want_error,
                                       pieces=list(plan.pieces))
  out = out[:n]
  if plan.whole is None:
    covered = {a for g in plan.groups for a in g.axes}
    trivial = tuple(a for a in axes if a not in covered)
    if trivial:  # size-1 axes: a no-op all-reduce, but it types the result invariant over them
      out = lax.psum(out, trivial)
  return out, (None if err is None else err[:n])


def psum(x, axis_name: AxisName, *, axis_index_groups=None, algorithm="auto", compression=None):
  """All-reduce sum over ``axis_name``: ``jax.lax.psum``'s contract, jaxring's algorithms.

  Args:
    x: array, scalar or pytree of them (bools are summed as int32).
    axis_name: a mapped axis name or a tuple of them.
    axis_index_groups: as in ``lax.psum``; only ``algorithm="xla"``/``"auto"`` honour it.
    algorithm: ``"auto"`` (planner), ``"xla"`` (native), ``"ring"``, ``"hierarchical"``
      (BlueConnect, levels fast -> slow), or a dict level -> ``"xla"|"ring"|"auto"`` (hierarchical
      with that algorithm per level, levels in the dict's order, fastest first).
    compression: None, a codec from ``jaxring.codecs`` (applied to floating leaves), or a dict
      level name -> codec for ``hierarchical``.

  Returns:
    The sum, same structure, shapes and dtypes as ``x`` (bools as int32), identical on every member.

  Example:
    >>> mesh = jax.make_mesh((8,), ("i",))
    >>> f = jax.shard_map(lambda v: jaxring.psum(v, "i", algorithm="ring"), mesh=mesh,
    ...                   in_specs=P("i"), out_specs=P())
    >>> f(jnp.arange(8.0))
    Array([28.], dtype=float32)
  """
  return _psum(x, axis_name, axis_index_groups, algorithm, compression, "psum")


def _psum(x, axis_name, axis_index_groups, algorithm, compression, op: str):
  """:func:`psum`, with errors naming ``op`` (the public function called)."""
  validate_algorithm(algorithm)
  _validate_compression(compression)
  axes = _axes(axis_name, op)
  if not axes:
    return x
  if axis_index_groups is not None:
    _check_groups(algorithm, compression, op, axes)
    return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
  leaves, treedef = _prep(x)
  sizes, mpi = _bind(axes, op)
  if mpi is not None:
    return jax.tree_util.tree_unflatten(treedef, _mpi_psum(leaves, axes, mpi, algorithm,
                                                           compression))
  out = list(leaves)
  by_dtype: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if not _is_traced(leaf) or np.size(leaf) == 0 or math.prod(sizes) == 1:
      out[i] = lax.psum(leaf, axis_name)  # constants: size * x, as lax folds them
    else:
      by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
  _psum_by_dtype(leaves, out, by_dtype, axes, sizes, None, algorithm, compression)
  return jax.tree_util.tree_unflatten(treedef, out)


def _mpi_psum(leaves, axes, mpi, algorithm, compression) -> list:
  """psum over an MPI-bound axis: every process's values are reduced (constants too: unlike
  shard_map's members, processes hold different ones). The reduction runs on stop_gradient'ed
  inputs; :func:`mpi_axis.summed` gives the result lax.psum's derivative."""
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  out = [lax.stop_gradient(leaf) for leaf in leaves]
  by_dtype: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if leaf.size > 0 and mpi.size > 1:
      by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
  _psum_by_dtype(list(out), out, by_dtype, axes, (mpi.size,), mpi, algorithm, compression)
  return [mpi_axis.summed(x, lax.stop_gradient(y)) for x, y in zip(leaves, out)]


def _psum_by_dtype(leaves, out, by_dtype, axes, sizes, mpi, algorithm, compression) -> None:
  """Fills ``out[i]`` with the sum of ``leaves[i]``: the leaves of one dtype fused, one plan."""
  for dtype, idxs in by_dtype.items():
    nbytes = sum(np.size(leaves[i]) for i in idxs) * dtype.itemsize
    plan = _plan_for(axes, sizes, mpi, nbytes, dtype, algorithm, compression)
    if plan.kind == "xla":
      for i in idxs:
        out[i] = (lax.psum(leaves[i], axes if len(axes) > 1 else axes[0]) if mpi is None
                  else plan.transport.all_reduce(leaves[i], plan.whole))
      continue
    acc = accum_dtype(dtype)
    flat = jnp.concatenate([jnp.ravel(leaves[i]).astype(acc) for i in idxs])
    reduce = lambda v, plan=plan, dtype=dtype: all_reduce_flat(v, dtype, axes, plan)[0]
    if mpi is None and linear.differentiable(dtype):
      reduce = linear.psum(reduce, axes)  # over MPI the inputs are stop_gradient'ed: no tangents
    total = reduce(flat)
    offset = 0
    for i in idxs:
      size = np.size(leaves[i])
      out[i] = total[offset:offset + size].reshape(np.shape(leaves[i])).astype(dtype)
      offset += size


def _group_size(axes, axis_index_groups) -> int:
  if axis_index_groups is not None:
    return len(axis_index_groups[0])
  return math.prod(_bind(axes, "pmean")[0])


def pmean(x, axis_name: AxisName, *, axis_index_groups=None, algorithm="auto", compression=None):
  """All-reduce mean over ``axis_name`` (``jax.lax.pmean``'s contract); arguments as :func:`psum`.

  Example:
    >>> f = jax.shard_map(lambda v: jaxring.pmean(v, "i"), mesh=jax.make_mesh((8,), ("i",)),
    ...                   in_specs=P("i"), out_specs=P())
    >>> f(jnp.arange(8.0))
    Array([3.5], dtype=float32)
  """
  s = _psum(x, axis_name, axis_index_groups, algorithm, compression, "pmean")
  n = _group_size(_axes(axis_name, "pmean"), axis_index_groups)
  return jax.tree_util.tree_map(lambda v: v / n, s)


def _native_only(op: str, axes: tuple, algorithm, compression, axis_index_groups) -> bool:
  """Validates the arguments; True when the call is lax's own (groups, ``xla``, no axes)."""
  validate_algorithm(algorithm)
  _validate_compression(compression)
  if axis_index_groups is not None:
    _check_groups(algorithm, compression, op, axes)
  if algorithm == "xla" and _lossy(compression):
    raise ValueError(f"jaxring.{op}: algorithm='xla' is the native collective and cannot compress;"
                     " use algorithm='ring', 'hierarchical' or 'auto' with compression")
  if axis_index_groups is not None or not axes:
    return True
  return algorithm == "xla" and _bind(axes, op)[1] is None


def _mpi_plan(plan: Plan, axes, sizes, mpi, nbytes, dtype, op: str) -> Plan:
  """The plan of a psum_scatter/all_gather leaf over an MPI-bound axis."""
  if plan.kind == "xla" and op == "psum_scatter":
    # mpi4jax has no MPI_Reduce_scatter; the ring moves what MPICH's own would
    plan = _plan_for(axes, sizes, mpi, nbytes, dtype, "ring", None)
  if plan.kind == "hierarchical" and not mpi.contiguous:
    raise NotImplementedError(
        f"jaxring.{op} with a hierarchical plan over MPI axis {mpi.name!r}: the ranks are not laid "
        "out host by host (rank = local rank + local size * node), so blocks would not go in rank "
        "order; use algorithm='ring', or bind the axis with an explicit topology")
  return plan


def _canon_dim(d: int, ndim: int, what: str) -> int:
  if not -ndim <= d < ndim:
    raise ValueError(f"{what}={d} is out of bounds for an array of rank {ndim}")
  return d % ndim


def psum_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False, algorithm="auto", compression=None):
  """Reduce-scatter (``jax.lax.psum_scatter``'s contract): member ``i`` gets block ``i`` of the sum.

  Example:
    >>> f = jax.shard_map(lambda v: jaxring.psum_scatter(v, "i", tiled=True, algorithm="ring"),
    ...                   mesh=jax.make_mesh((8,), ("i",)), in_specs=P(), out_specs=P("i"))
    >>> f(jnp.ones(16))  # each member holds 2 elements of the sum
    Array([8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8.], dtype=float32)
  """
  axes = _axes(axis_name, "psum_scatter")
  if _native_only("psum_scatter", axes, algorithm, compression, axis_index_groups):
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                            axis_index_groups=axis_index_groups, tiled=tiled)
  sizes, mpi = _bind(axes, "psum_scatter")
  p = math.prod(sizes)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  if any(jnp.result_type(leaf) == np.bool_ for leaf in leaves):
    # unlike psum, lax.psum_scatter does not sum bools as int32: it refuses them
    raise TypeError("jaxring.psum_scatter: add does not accept dtype bool at position 0. Accepted "
                    "dtypes at position 0 are subtypes of integer, floating, complexfloating. "
                    "(as lax.psum_scatter: cast bools to an integer dtype first)")
  out = []
  for leaf in leaves:
    shape = np.shape(leaf)
    d = _canon_dim(scatter_dimension, len(shape), "scatter_dimension")
    if tiled and shape[d] % p:
      raise ValueError(f"tiled reduce_scatter operand scatter dimension size {shape[d]} must be "
                       f"divisible by shard_count {p} (jaxring.psum_scatter over {axis_name!r}, "
                       f"scatter_dimension={d})")
    if not tiled and shape[d] != p:
      raise ValueError(f"reduce_scatter operand scatter dimension size {shape[d]} must match shard "
                       f"count {p} (jaxring.psum_scatter over {axis_name!r}, scatter_dimension={d},"
                       " tiled=False)")
    dtype = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    nbytes = np.size(leaf) * dtype.itemsize
    plan = _plan_for(axes, sizes, mpi, nbytes, dtype, algorithm, compression)
    _check_per_hop(plan, "psum_scatter")
    if mpi is not None:
      plan = _mpi_plan(plan, axes, sizes, mpi, nbytes, dtype, "psum_scatter")
      leaf = jnp.asarray(leaf)
      block = engine.reduce_scatter_leaf(lax.stop_gradient(leaf), d, tiled, p, dtype, plan)
      out.append(mpi_axis.not_differentiable("psum_scatter")(leaf, lax.stop_gradient(block)))
      continue
    if plan.kind == "xla" or p == 1 or np.size(leaf) == 0:
      out.append(lax.psum_scatter(leaf, axis_name, scatter_dimension=d, tiled=tiled))
      continue
    scatter = functools.partial(engine.reduce_scatter_leaf, d=d, tiled=tiled, p=p,
                                dtype=dtype, plan=plan)
    if linear.differentiable(dtype):
      scatter = linear.psum_scatter(scatter, axes, d, tiled)
    out.append(scatter(jnp.asarray(leaf)))
  return jax.tree_util.tree_unflatten(treedef, out)


def all_gather(x, axis_name: AxisName, *, axis_index_groups=None, axis: int = 0,
               tiled: bool = False, algorithm="auto", compression=None):
  """All-gather (``jax.lax.all_gather``'s contract), optionally compressed on the wire.

  Example:
    >>> f = jax.shard_map(lambda v: jaxring.all_gather(v, "i", tiled=True, algorithm="ring"),
    ...                   mesh=jax.make_mesh((8,), ("i",)), in_specs=P("i"), out_specs=P("i"))
    >>> f(jnp.arange(8.0)).shape
    (64,)
  """
  axes = _axes(axis_name, "all_gather")
  if _native_only("all_gather", axes, algorithm, compression, axis_index_groups):
    return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis, tiled=tiled)
  sizes, mpi = _bind(axes, "all_gather")
  p = math.prod(sizes)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  out = []
  for leaf in leaves:
    leaf = jnp.asarray(leaf)
    if leaf.dtype == np.bool_:  # lax gathers bools as bools; the wire carries them as bytes
      gathered = all_gather(leaf.astype(np.uint8), axis_name, axis=axis, tiled=tiled,
                            algorithm=algorithm, compression=compression)
      out.append(gathered.astype(np.bool_))
      continue
    ndim = leaf.ndim
    ax = _canon_dim(axis, ndim if tiled else ndim + 1, "axis")
    if tiled and ndim == 0:
      raise ValueError("all_gather: tiled=True needs an array of rank >= 1, got a scalar")
    dtype = jnp.dtype(leaf.dtype)
    nbytes = leaf.size * dtype.itemsize * p
    plan = _plan_for(axes, sizes, mpi, nbytes, dtype, algorithm, compression)
    _check_per_hop(plan, "all_gather")
    if mpi is not None:
      plan = _mpi_plan(plan, axes, sizes, mpi, nbytes, dtype, "all_gather")
      held = lax.stop_gradient(leaf)
      if plan.kind == "xla":
        rows = plan.transport.all_gather((jnp.ravel(held),), plan.whole)[0]
        gathered = engine.place_rows(rows.reshape((p,) + leaf.shape), ax, tiled)
      else:
        gathered = engine.all_gather_leaf(held, ax, tiled, p, dtype, plan)
      out.append(mpi_axis.not_differentiable("all_gather")(leaf, lax.stop_gradient(gathered)))
      continue
    if plan.kind == "xla" or p == 1 or leaf.size == 0:
      out.append(lax.all_gather(leaf, axis_name, axis=ax, tiled=tiled))
      continue
    gather = functools.partial(engine.all_gather_leaf, ax=ax, tiled=tiled, p=p,
                               dtype=dtype, plan=plan)
    if linear.differentiable(dtype):
      gather = linear.all_gather(gather, axes, ax, tiled)
    out.append(gather(leaf))
  return jax.tree_util.tree_unflatten(treedef, out)
