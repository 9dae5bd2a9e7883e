"""psum / pmean / psum_scatter / all_gather: jax.lax's contract, jaxring's algorithms.

This module is the contract: argument handling mirrors ``jax.lax`` (pytrees, Python constants,
bool -> int32 for the reductions and bool kept by all_gather, tuple axis names, ``NameError`` for
an unbound axis, ``ValueError`` for a repeated one, lax's shape errors). What follows is the
engine's (jaxring._src.algorithms.engine): each dtype's leaves fused into one flat buffer and
reduced by the planned algorithm, ``xla`` (the native collective), ``ring`` or ``hierarchical``,
with ``compression`` deciding what travels, over whichever transport the axis name is bound to
(``shard_map``/``pmap``: XLA collectives; ``jaxring.distributed.mpi_axis``: MPI through mpi4jax).
Whatever the algorithm and codec, derivatives are lax's (jaxring._src.algorithms.linear).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import native, vma
from jaxring._src.algorithms import engine
from jaxring._src.algorithms.planner import validate_algorithm
from jaxring._src.codecs.base import Codec

AxisName = Any


def axis_names(axis_name) -> tuple:
  """``axis_name`` (one name, or a tuple or list of them) as a tuple of names.

  Example:
    >>> axis_names("data"), axis_names(["node", "local"])
    (('data',), ('node', 'local'))
  """
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _positional(axis_name) -> bool:
  return any(isinstance(a, (int, np.integer)) for a in axis_names(axis_name))


def _lax_only(axes: tuple, x, op: str) -> bool:
  """Calls only lax's own collective can make: over a ``vmap`` axis (no devices, lax batches
  the collective), of values typed unreduced over the axes (``lax.pcast(..., to="unreduced")``),
  or of values typed reduced over any axis (``lax.all_gather(..., to="reduced")``): lax's
  collective carries that typing to its result, which a ring's ppermutes do not."""
  if getattr(engine.bind(axes, op), "batched", False):
    return True
  return any(vma.unreduced_axes(leaf) & set(axes) or vma.reduced_axes(leaf)
             for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, jax.Array))


def _axes(axis_name, op: str) -> tuple:
  """The axis names as a tuple, refused as lax refuses them (with lax's message in ours)."""
  axes = axis_names(axis_name)
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


def validate_compression(compression) -> None:
  """Raises TypeError unless ``compression`` is None, a codec, or a dict level name -> codec.

  Example:
    >>> validate_compression({"node": jaxring.codecs.int8(), "local": None})  # accepted
  """
  if compression is None or isinstance(compression, Codec):
    return
  if isinstance(compression, dict) and all(isinstance(c, (Codec, type(None)))
                                           for c in compression.values()):
    return
  hint = (f" (a codec's spelling: jaxring.codecs.parse({compression!r}) makes the codec)"
          if isinstance(compression, str) else "")
  raise TypeError("compression must be None, a jaxring.codecs codec, or a dict level name -> codec;"
                  f" got {compression!r}{hint}")


def is_lossy(compression) -> bool:
  """Whether ``compression`` (None, a codec or a dict level -> codec) loses anything on the wire.

  Example:
    >>> is_lossy({"node": jaxring.codecs.int8(), "local": None})
    True
  """
  if isinstance(compression, dict):
    return any(c is not None and c.lossy for c in compression.values())
  return compression is not None and compression.lossy


def _check_groups(algorithm, compression, op: str, axes: tuple) -> None:
  if axes:
    engine.bind(axes, op).check_index_groups(op)
  if algorithm not in ("auto", "xla") or is_lossy(compression):
    raise NotImplementedError(
        f"jaxring.{op}: axis_index_groups is supported only by algorithm='xla' (and 'auto', which "
        f"then uses it) without lossy compression; got algorithm={algorithm!r}, "
        f"compression={compression!r}")


def _prep(x):
  leaves, treedef = jax.tree_util.tree_flatten(x)
  leaves = [lax.convert_element_type(l, np.int32) if jnp.result_type(l) == np.bool_ else l
            for l in leaves]
  return leaves, treedef


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
  validate_compression(compression)
  if _positional(axis_name):  # lax sums over the array dimensions an int names
    return native.psum(x, axis_name, axis_index_groups=axis_index_groups)
  axes = _axes(axis_name, op)
  if not axes:
    return x
  if axis_index_groups is not None:
    _check_groups(algorithm, compression, op, axes)
    return native.psum(x, axis_name, axis_index_groups=axis_index_groups)
  if _lax_only(axes, x, op):
    return native.psum(x, axis_name)
  leaves, treedef = _prep(x)
  out = engine.all_reduce(leaves, engine.bind(axes, op), algorithm, compression)
  return jax.tree_util.tree_unflatten(treedef, out)


def _group_size(axes, axis_index_groups) -> int:
  if axis_index_groups is not None:
    return len(axis_index_groups[0])
  return engine.bind(axes, "pmean").size


def pmean(x, axis_name: AxisName, *, axis_index_groups=None, algorithm="auto", compression=None):
  """All-reduce mean over ``axis_name`` (``jax.lax.pmean``'s contract); arguments as :func:`psum`.

  Example:
    >>> f = jax.shard_map(lambda v: jaxring.pmean(v, "i"), mesh=jax.make_mesh((8,), ("i",)),
    ...                   in_specs=P("i"), out_specs=P())
    >>> f(jnp.arange(8.0))
    Array([3.5], dtype=float32)
  """
  if _positional(axis_name):
    return native.pmean(x, axis_name, axis_index_groups=axis_index_groups)
  s = _psum(x, axis_name, axis_index_groups, algorithm, compression, "pmean")
  n = _group_size(_axes(axis_name, "pmean"), axis_index_groups)
  return jax.tree_util.tree_map(lambda v: v / n, s)


def _native_only(op: str, axes: tuple, algorithm, compression, axis_index_groups, x) -> bool:
  """Validates the arguments; True when the call is lax's own (groups, ``xla``, no axes, a
  ``vmap`` axis, unreduced values)."""
  validate_algorithm(algorithm)
  validate_compression(compression)
  if axis_index_groups is not None:
    _check_groups(algorithm, compression, op, axes)
  if algorithm == "xla" and is_lossy(compression):
    raise ValueError(f"jaxring.{op}: algorithm='xla' is the native collective and cannot compress;"
                     " use algorithm='ring', 'hierarchical' or 'auto' with compression")
  if axis_index_groups is not None or not axes:
    return True
  return engine.lax_suffices(axes, algorithm, op) or _lax_only(axes, x, op)


class DimensionError(ValueError, IndexError):
  """A dimension out of range: lax.all_gather raises ValueError, lax.psum_scatter IndexError."""


def _canon_dim(d: int, ndim: int, what: str) -> int:
  if not -ndim <= d < ndim:
    # lax.all_gather's wording (numpy's); lax.psum_scatter only fails with an IndexError
    raise DimensionError(f"axis {d} is out of bounds for array of dimension {ndim} "
                         f"({what}={d})")
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
  for leaf in jax.tree_util.tree_leaves(x):   # lax itself only fails with an IndexError
    _canon_dim(scatter_dimension, np.ndim(leaf), "scatter_dimension")
  if _native_only("psum_scatter", axes, algorithm, compression, axis_index_groups, x):
    return native.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                               axis_index_groups=axis_index_groups, tiled=tiled)
  binding = engine.bind(axes, "psum_scatter")
  p = binding.size
  leaves, treedef = jax.tree_util.tree_flatten(x)
  out = []
  for leaf in leaves:  # lax checks the shape first, then the dtype
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
  if any(jnp.result_type(leaf) == np.bool_ for leaf in leaves):
    # unlike psum, lax.psum_scatter does not sum bools as int32: it refuses them
    raise TypeError("jaxring.psum_scatter: add does not accept dtype bool at position 0. Accepted "
                    "dtypes at position 0 are subtypes of integer, floating, complexfloating. "
                    "(as lax.psum_scatter: cast bools to an integer dtype first)")
  for leaf in leaves:
    d = _canon_dim(scatter_dimension, np.ndim(leaf), "scatter_dimension")
    out.append(engine.reduce_scatter(leaf, d, tiled, binding, algorithm, compression))
  return jax.tree_util.tree_unflatten(treedef, out)


def all_gather(x, axis_name: AxisName, *, axis_index_groups=None, axis: int = 0,
               tiled: bool = False, to: str = "varying", algorithm="auto", compression=None):
  """All-gather (``jax.lax.all_gather``'s contract), optionally compressed on the wire.

  ``to`` other than ``"varying"`` (lax's typing of the result under ``check_vma=True``:
  ``"invarying"``, ``"reduced"``) is lax's own all-gather, which cannot compress.

  Example:
    >>> f = jax.shard_map(lambda v: jaxring.all_gather(v, "i", tiled=True, algorithm="ring"),
    ...                   mesh=jax.make_mesh((8,), ("i",)), in_specs=P("i"), out_specs=P("i"))
    >>> f(jnp.arange(8.0)).shape
    (64,)
  """
  axes = _axes(axis_name, "all_gather")
  if to != "varying":
    validate_algorithm(algorithm)
    validate_compression(compression)
    if is_lossy(compression):
      raise ValueError(f"jaxring.all_gather: to={to!r} is lax's own all-gather, which cannot "
                       "compress; use to='varying' (the default) with compression")
    return native.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                             tiled=tiled, to=to)
  if _native_only("all_gather", axes, algorithm, compression, axis_index_groups, x):
    return native.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                             tiled=tiled)
  binding = engine.bind(axes, "all_gather")
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
    out.append(engine.all_gather(leaf, ax, tiled, binding, algorithm, compression))
  return jax.tree_util.tree_unflatten(treedef, out)
