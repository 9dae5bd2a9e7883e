"""Turns (axes, message size, topology, codec, algorithm) into a plan: which algorithm, which groups.

``auto`` picks the plan a measured profile of these axes says is fastest (``jaxring calibrate``,
jaxring._src.profiles.find_profile). Without one it keeps the native collective for lossless
reductions (the only choice that is never slower than the user's ``lax.psum``), and for a lossy
codec the ring, hierarchical over several levels (the native collectives cannot compress).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxring._src import profiles
from jaxring._src import topology as topo_mod
from jaxring._src.algorithms import base
from jaxring._src.algorithms.base import Plan, PlanRequest
from jaxring._src.algorithms.hierarchical import one_level_in_process
from jaxring._src.codecs.base import Codec, accum_dtype, for_dtype
from jaxring._src.transport.binding import mesh_axis_names
from jaxring._src.transport.groups import (
  Group,
  Hierarchy,
  check_factorization,
  whole_group,
)
from jaxring._src.transport.inprocess import INPROCESS
from jaxring._src.transport.xla import XLA

#: What a level of a per-level ``algorithm=`` dict may run: ``xla`` the native collective of the
#: job's transport (lax's over a mesh), ``ring`` jaxring's ring over it, ``inprocess`` the
#: in-process transport's collectives (members of this process read each other's buffers).
LEVEL_ALGORITHMS = ("auto", "xla", "ring", INPROCESS.name)
#: Old per-level spellings still accepted, with a DeprecationWarning: old -> new.
DEPRECATED_LEVEL_ALGORITHMS = {"shm": INPROCESS.name}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def algorithms() -> tuple[str, ...]:
  """Every name ``algorithm=`` accepts: ``auto``, ``xla`` and each registered algorithm."""
  return ("auto", "xla", *base.names())


def validate_algorithm(algorithm) -> None:
  if isinstance(algorithm, dict):
    bad = {k: v for k, v in algorithm.items()
           if v not in LEVEL_ALGORITHMS and v not in DEPRECATED_LEVEL_ALGORITHMS}
    if bad:
      raise ValueError(f"per-level algorithm must be one of {LEVEL_ALGORITHMS}, got {bad}")
    return
  if algorithm not in algorithms():
    raise ValueError(f"algorithm must be one of {algorithms()} or a dict level->algorithm, "
                     f"got {algorithm!r}")


def _respelled(algorithm):
  """A per-level dict with its deprecated spellings replaced (in the same key order), warning
  where it had any; anything else as it is."""
  if not isinstance(algorithm, dict):
    return algorithm
  old = {k: v for k, v in algorithm.items()
         if isinstance(v, str) and v in DEPRECATED_LEVEL_ALGORITHMS}
  if not old:
    return algorithm
  new = {k: DEPRECATED_LEVEL_ALGORITHMS[v] for k, v in old.items()}
  warnings.warn(f"per-level algorithm {old} is deprecated: the in-process level is a transport "
                f"now, not an algorithm; write {new} (the in-process transport's collectives, "
                f"the same plan)", DeprecationWarning, stacklevel=_caller_stacklevel())
  return {k: new.get(k, v) for k, v in algorithm.items()}


def _caller_stacklevel() -> int:
  """The ``stacklevel`` that attributes a warning raised by this function's caller to the first
  frame outside jaxring: the user's line, and Python shows a DeprecationWarning by default only
  where it is attributed to ``__main__``."""
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  return level


def _level_params(names: tuple[str, ...], sizes: tuple[int, ...]) -> list[topo_mod.Level]:
  topo = topo_mod.default_topology()
  known = {lv.name: lv for lv in topo.levels}
  out = []
  for i, (name, size) in enumerate(zip(names, sizes)):
    if name in known:
      out.append(dataclasses.replace(known[name], size=size))
    elif jax.process_count() > 1 and i > 0:
      out.append(topo_mod.Level(name, size, topo_mod.NETWORK_BANDWIDTH, topo_mod.NETWORK_LATENCY))
    else:
      out.append(topo_mod.Level(name, size))
  return out


def level_order(axes: tuple, mesh_names: tuple | None = None) -> tuple:
  """Several axes as levels, fast -> slow, whatever order the caller named them in.

  The default topology's order where it names every axis (``local``, ``node``); else the mesh's
  (``mesh_names``, default the mesh in context), its last (innermost) axis the fastest, as
  ``jax.make_mesh`` lays a process's devices out along it; else (no mesh) the order given.

  Example:
    >>> level_order(("node", "local"))  # two processes: the topology's order  # doctest: +SKIP
    ('local', 'node')
  """
  names = tuple(axes)
  topo_names = topo_mod.default_topology().names
  if set(names) <= set(topo_names):
    return tuple(n for n in topo_names if n in names)
  mesh_names = mesh_axis_names() if mesh_names is None else tuple(mesh_names)
  if set(names) <= set(mesh_names):
    return tuple(n for n in reversed(mesh_names) if n in names)
  return names


def native_axes(axes: tuple, plan: Plan) -> tuple:
  """The axes in the order the native all-reduce of ``plan`` names them: the slowest level
  outermost (first), as ``lax.psum(x, ("node", "local"))`` over a mesh laid out node by node.

  The native collective's replica group lists the members in the order of the names (the first
  most significant); gloo's and NCCL's rings follow that list, so a fast level named first sends
  every hop across the slow links: ``lax.psum(g, ("local", "node"))`` took 2.0x the time of
  ``("node", "local")`` on the emulated cluster (docs/design.md, "Native axis order"). The sum is
  the same on every member whatever the order; only its rounding may differ from lax's for the
  order the caller wrote.

  Example:
    >>> native_axes(("local", "node"), plan)  # doctest: +SKIP
    ('node', 'local')
  """
  ordered = [a for g in reversed(plan.groups) for a in g.axes]
  ordered = list(dict.fromkeys(ordered)) + [a for a in axes if a not in ordered]
  return tuple(ordered) if set(ordered) == set(axes) else tuple(axes)


def levels_for(axes: tuple, sizes: tuple[int, ...], order: tuple | None = None, *,
               mesh_names: tuple | None = None):
  """Groups and per-level parameters of the hierarchy the axes span, fast -> slow.

  Several axes: one level per axis, in ``order`` if given (a per-level dict's key order), else
  :func:`level_order`'s (``mesh_names``: the mesh's axes, default the mesh in context). One axis:
  factorized by the default topology when its size matches and it has several levels.
  """
  if len(axes) > 1:
    names = tuple(order) if order is not None else level_order(axes, mesh_names)
    size_of = dict(zip(axes, sizes))
    # linear index over `axes` as given: row-major, the first axis most significant
    weight = {a: math.prod(sizes[i + 1:]) for i, a in enumerate(axes)}
    # a size-1 axis is no level (all_reduce_flat still types the result invariant over it)
    names = tuple(n for n in names if size_of[n] > 1) or names[:1]
    groups = [whole_group((n,), size_of[n], n) for n in names]
    return groups, _level_params(names, tuple(size_of[n] for n in names)), [weight[n] for n in names]
  total = sizes[0]
  topo = topo_mod.default_topology().without_trivial_levels()
  if len(topo.levels) > 1 and topo.size == total:
    check_factorization([lv.size for lv in topo.levels], total)
    groups = [Group(tuple(axes), lv.size, st, total, lv.name)
              for lv, st in zip(topo.levels, topo.strides())]
    return groups, list(topo.levels), list(topo.strides())
  g = whole_group(tuple(axes), total, str(axes[0]))
  return [g], _level_params((str(axes[0]),), (total,)), [1]


def codec_for(compression, level_name: str, dtype) -> Codec:
  if isinstance(compression, dict):
    return for_dtype(compression.get(level_name), dtype)
  return for_dtype(compression, dtype)


def make_plan(axes: tuple, sizes: tuple[int, ...], nbytes: int, dtype, algorithm, compression,
              *, multi_process: bool | None = None, hierarchy: Hierarchy | None = None) -> Plan:
  """The plan for reducing ``nbytes`` of ``dtype`` over ``axes`` (already validated, all bound).

  ``hierarchy`` gives the levels of axes bound outside ``shard_map`` (an MPI communicator); the
  axes' own levels (mesh axes, default topology) otherwise.
  """
  if hierarchy is not None:
    plan = _plan(axes, sizes, nbytes, dtype, algorithm, compression, True, list(hierarchy.groups),
                 list(hierarchy.levels), list(hierarchy.strides), hierarchy.whole,
                 hierarchy.transport)
    return dataclasses.replace(plan, whole=hierarchy.whole)
  if multi_process is None:
    multi_process = jax.process_count() > 1
  order = tuple(algorithm) if isinstance(algorithm, dict) else None
  if order is not None and len(axes) > 1 and set(order) != set(axes):
    raise ValueError(f"per-level algorithm keys {order} must name exactly the axes {axes}")
  groups, levels, strides = levels_for(axes, sizes, order)
  whole = groups[0] if len(groups) == 1 else whole_group(tuple(axes), math.prod(sizes))
  return _plan(axes, sizes, nbytes, dtype, algorithm, compression, multi_process, groups, levels,
               strides, whole, XLA)


def _plan(axes, sizes, nbytes, dtype, algorithm, compression, multi_process, groups, levels,
          strides, whole, transport) -> Plan:
  algorithm = _respelled(algorithm)
  for what, arg in (("compression", compression), ("algorithm", algorithm)):
    # a size-1 axis is no level, yet a per-level dict over several axes may name it
    unknown = set(arg) - {g.name for g in groups} - set(axes) if isinstance(arg, dict) else ()
    if unknown:
      raise ValueError(f"{what} names levels {sorted(map(str, unknown))} that are not among the "
                       f"levels {[g.name for g in groups]} of axes {axes}")
  codecs = [codec_for(compression, g.name, dtype) for g in groups]
  lossy = any(c.lossy for c in codecs)
  kind = algorithm if isinstance(algorithm, str) else "hierarchical"
  if kind == "xla":
    if lossy:
      raise ValueError("algorithm='xla' is the native collective and cannot compress; use "
                       "algorithm='ring', 'hierarchical' or 'auto' with compression")
    return Plan("xla", tuple(groups), transport=transport)
  request = PlanRequest(tuple(axes), tuple(sizes), tuple(groups), tuple(levels), tuple(strides),
                        tuple(codecs), whole, transport, algorithm, multi_process, dtype)
  if kind == "auto":
    kind = choose(nbytes, len(groups), codecs, lossy,
                  find_profile_for(axes, sizes, transport.name), dtype, transport)
    if kind == "xla" and one_level_in_process(request):
      kind = "hierarchical"   # lax's collective would cross gloo's loopback (docs/design.md)
  if kind == "xla":
    return Plan("xla", tuple(groups), transport=transport)
  return base.get(kind).plan(request)


def codec_key(codecs) -> tuple[str, ...]:
  """How a profile names the codecs of a plan's levels (a name already, a string, is kept)."""
  return tuple(c if isinstance(c, str) else repr(c) for c in codecs)


def dense_codecs(codecs, dtype):
  """What the levels carry once a sparsifying codec has chosen its chunks, decided here only.

  ``codecs`` is a plan's codecs (a sequence: a list back), or a ``compression`` argument (None, a
  codec, or a dict level -> codec: the same form back); each codec that wraps a whole
  all-reduce is replaced by the per-hop codec of its chosen chunks (``TopKChunks.dense_codec``:
  its ``inner`` for ``dtype``, the codec :func:`make_plan` makes of ``inner`` itself).
  """
  swap = lambda c: c if c is None or c.per_hop else c.dense_codec(dtype)
  if isinstance(codecs, dict):
    return {k: swap(c) for k, c in codecs.items()}
  if isinstance(codecs, (list, tuple)):
    return [swap(c) for c in codecs]
  return swap(codecs)


def _packed_bytes(codecs, nbytes: float, dtype) -> float:
  """Bytes per member of the dense buffer a sparsifying codec hands to the plan (its chunks)."""
  wrapper = next(c for c in codecs if not c.per_hop)
  itemsize = np.dtype(dtype).itemsize
  n = max(1, int(nbytes // itemsize))
  return wrapper.num_selected(n) * wrapper.chunk_size * np.dtype(accum_dtype(dtype)).itemsize


def predict(profile, algorithm: str, codecs, nbytes: float, dtype=jnp.float32) -> float | None:
  """Seconds the profile predicts for ``algorithm`` over levels carrying ``codecs`` (None: not
  measured).

  A sparsifying codec (top-k chunks) runs the same work around any plan -- chunk norms, their
  native all-reduce, packing, and scattering the sum back into a buffer of ``nbytes`` -- and only
  the all-reduce of the packed chunks depends on the algorithm. So ``t(a) = t(a0) - d(a0) + d(a)``
  with ``t(a0)`` the top-k plan that was timed and ``d`` the dense codec's measured plans at the
  packed size. Measured on the emulated cluster (docs/benchmarks.md): the ring and hierarchical
  top-k plans differ by what their dense plans differ by at the packed size, while the shared
  part is most of the time and most of its noise; a line through the top-k timings alone chose
  the slower plan in both shapes.

  Example:
    >>> predict(profile, "hierarchical", [none, int8], 32 << 20)  # doctest: +SKIP
    0.2514
  """
  key = codec_key(codecs)
  if all(isinstance(c, str) for c in codecs) or all(c.per_hop for c in codecs):
    fit = profile.fit(algorithm, key)
    return None if fit is None else fit.predict(nbytes)
  dense_key, packed = codec_key(dense_codecs(codecs, dtype)), _packed_bytes(codecs, nbytes, dtype)
  d = {f.algorithm: f.predict(packed) for f in profile.fits if f.codecs == dense_key}
  own = profile.fit(algorithm, key)
  if own is not None:
    return own.predict(nbytes)
  if algorithm not in d:
    return None
  timed = [f for f in profile.fits if f.codecs == key and f.algorithm in d]
  if not timed:
    return None
  return max(0.0, timed[0].predict(nbytes) - d[timed[0].algorithm] + d[algorithm])


def choose(nbytes: int, num_levels: int, codecs, lossy: bool, profile, dtype=jnp.float32,
           transport=None) -> str:
  """``xla`` or an algorithm's name for a message of ``nbytes`` per member.

  The default, where nothing was measured: the native collective for a lossless reduction (never
  slower than ``lax.psum``), else the ring (hierarchical over several levels); over several
  levels of a ``transport`` whose native all-reduce loses to the ring from some size on
  (``native_all_reduce_loses_from``: MPI), the hierarchical plan from that size. A profile moves
  ``auto`` off the default only for a measured gain above :data:`MARGIN`: timings on a shared
  machine are noisy, and the alpha-beta formulas alone chose hierarchical at 1.41x gloo's time
  on the emulated cluster (docs/design.md, "Planner"). ``codecs`` are the levels' codecs (or
  their :func:`codec_key` strings, without the sparsifying rule of :func:`predict`).

  Example:
    >>> choose(32 << 20, 2, [none, none], False, profile)  # doctest: +SKIP
    'xla'
  """
  default = ("hierarchical" if num_levels > 1 else "ring") if lossy else "xla"
  loses_from = getattr(transport, "native_all_reduce_loses_from", None)
  if not lossy and num_levels > 1 and loses_from is not None and nbytes >= loses_from:
    default = "hierarchical"
  if profile is None:
    return default
  candidates = base.candidates(num_levels) if lossy else ("xla", *base.candidates(num_levels))
  seconds = {a: t for a in candidates
             if (t := predict(profile, a, codecs, nbytes, dtype)) is not None}
  if not seconds:
    return default
  best = min(seconds, key=seconds.get)
  if default in seconds and seconds[best] > (1 - MARGIN) * seconds[default]:
    return default
  return best


def reduction_seconds(axes: tuple, sizes: tuple[int, ...], nbytes: int, dtype, algorithm,
                      compression, *, hierarchy: Hierarchy | None = None,
                      profile=None) -> tuple[str, float | None]:
  """The algorithm a reduction of ``nbytes`` of ``dtype`` runs, and the seconds ``profile``
  predicts for it (None where that plan was not measured). ``algorithm="auto"`` is resolved as
  :func:`make_plan` resolves it, from the same profile.

  Example:
    >>> reduction_seconds(("node", "local"), (4, 2), 8 << 20, jnp.float32, "auto", None,
    ...                   profile=profile)  # doctest: +SKIP
    ('xla', 0.1351)
  """
  if hierarchy is not None:
    groups = list(hierarchy.groups)
  else:
    order = tuple(algorithm) if isinstance(algorithm, dict) else None
    groups = levels_for(tuple(axes), tuple(sizes), order)[0]
  codecs = [codec_for(compression, g.name, dtype) for g in groups]
  lossy = any(c.lossy for c in codecs)
  kind = algorithm if isinstance(algorithm, str) else "hierarchical"
  if kind == "auto":
    kind = choose(nbytes, len(groups), codecs, lossy, profile, dtype,
                  None if hierarchy is None else hierarchy.transport)
  seconds = None if profile is None else predict(profile, kind, codecs, nbytes, dtype)
  return kind, seconds


def find_profile_for(axes: tuple, sizes: tuple[int, ...], transport: str = "xla"):
  """The profile ``auto`` reads for these axes (``profiles.find_profile``), or None."""
  key = profiles.profile_key(axes, sizes, transport, jax.process_count(), jax.default_backend())
  return profiles.find_profile(key)


#: The measured gain a profile must show before ``auto`` leaves its default plan. It is also the
#: most ``auto`` gives away to a better plan when calibration is exact: kept under the 5% that
#: repeated timings of one program differ by on the emulated cluster (docs/benchmarks.md).
MARGIN = 0.025
