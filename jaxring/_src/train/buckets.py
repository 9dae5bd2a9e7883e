"""Gradient buckets: which parameters are reduced together, in the order their gradients appear.

A bucket is the unit of communication: its gradients are flattened into one buffer and reduced by
one collective, so many small tensors (biases, norms) share one latency instead of paying one each
(PyTorch DDP's buckets, Li et al. 2020; Horovod's tensor fusion).

Order: backprop visits operations in reverse, so a parameter's gradient is complete once the
backward pass has passed the parameter's *first* use in the forward pass. We find first uses by
tracing the loss function once to a jaxpr (at compile time, no run-time cost). The pytree flatten
order is a poor proxy: Flax stores parameters in dicts whose keys flatten alphabetically
("BatchNorm_0" before "Conv_0", "Dense_10" before "Dense_2"), unrelated to the order of layers.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

# Ops that only re-type or re-shape a parameter: its real use is whatever consumes their output
# (a bf16 policy casts every parameter up front; that cast is not where the layer runs).
_PASS_THROUGH = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "transpose", "squeeze",
    "expand_dims", "copy", "copy_p", "reduce_precision",
})


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Leaves (indices into the flattened differentiated arguments) reduced by one collective."""

  indices: tuple[int, ...]
  dtype: Any
  numel: int

  @property
  def nbytes(self) -> int:
    return self.numel * jnp.dtype(self.dtype).itemsize


def _single_subjaxpr(eqn):
  """The one sub-jaxpr whose inputs mirror the equation's (pjit, remat, custom_jvp, scan)."""
  subs = []
  for value in eqn.params.values():
    if isinstance(value, jex_core.ClosedJaxpr):
      subs.append(value.jaxpr)
    elif isinstance(value, jex_core.Jaxpr):
      subs.append(value)
  if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
    return subs[0]
  return None


def _first_uses(jaxpr, n_leaves: int) -> dict[int, int]:
  first: dict[int, int] = {}
  counter = itertools.count()

  def walk(jx, alias: dict):
    for eqn in jx.eqns:
      pos = next(counter)
      hits = {alias[v] for v in eqn.invars if isinstance(v, jex_core.Var) and v in alias}
      if not hits:
        continue
      sub = _single_subjaxpr(eqn)
      if sub is not None:
        walk(sub, {inner: alias[outer] for outer, inner in zip(eqn.invars, sub.invars)
                   if isinstance(outer, jex_core.Var) and outer in alias})
        continue
      if eqn.primitive.name in _PASS_THROUGH and len(hits) == 1 and len(eqn.outvars) == 1:
        alias[eqn.outvars[0]] = next(iter(hits))
        continue
      for i in hits:
        first.setdefault(i, pos)

  walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])})
  return first


def use_order(f: Callable, leaves: Sequence) -> list[int]:
  """Indices of ``leaves`` in the order ``f(*leaves)`` first uses them (unused ones last).

  Example:
    >>> use_order(lambda a, b: jnp.sin(b) * 2 + a, [jnp.ones(2), jnp.ones(2)])
    [1, 0]
  """
  closed = jax.make_jaxpr(f)(*leaves)
  first = _first_uses(closed.jaxpr, len(leaves))
  return sorted(range(len(leaves)), key=lambda i: (first.get(i, math.inf), i))


def make_buckets(leaves: Sequence, forward_order: Sequence[int], bucket_bytes: int) -> list[Bucket]:
  """Groups leaves into buckets of about ``bucket_bytes``, listed in backward (reduction) order.

  Leaves are taken in reverse ``forward_order`` (the order their gradients complete); each dtype
  fills its own bucket, which closes once it holds ``bucket_bytes`` or more.

  Example:
    >>> [b.indices for b in make_buckets([jnp.ones(4)] * 3, [0, 1, 2], bucket_bytes=32)]
    [(2, 1), (0,)]
  """
  open_: dict[Any, list[int]] = {}
  closed: list[tuple[int, Bucket]] = []
  position = {i: k for k, i in enumerate(reversed(list(forward_order)))}

  def close(dtype):
    idx = tuple(open_.pop(dtype))
    numel = sum(int(np.size(leaves[i])) for i in idx)
    closed.append((max(position[i] for i in idx), Bucket(idx, dtype, numel)))

  for i in reversed(list(forward_order)):
    dtype = jnp.dtype(leaves[i].dtype)
    open_.setdefault(dtype, []).append(i)
    nbytes = sum(int(np.size(leaves[j])) for j in open_[dtype]) * dtype.itemsize
    if nbytes >= bucket_bytes:
      close(dtype)
  for dtype in list(open_):
    close(dtype)
  # a bucket is ready when its last leaf is: reduce in that order
  return [b for _, b in sorted(closed, key=lambda t: t[0])]


# --- bucket_bytes="auto" ------------------------------------------------------------------------
#
# The bucket size trades latency against overlap: small buckets pay the per-call cost (measured:
# ~10-25 ms per all-reduce of 64 KiB on the emulated cluster) many times, large ones start late
# and leave the last reduction exposed after backprop ends. The same measured profile that `auto`
# plans with predicts each bucket's reduction, so the size and each bucket's algorithm are chosen
# together, by one model.

#: ``bucket_bytes`` where nothing was measured (PyTorch DDP's default).
DEFAULT_BUCKET_BYTES = 25 << 20
#: The sizes ``bucket_bytes="auto"`` considers: powers of two from 256 KiB to 64 MiB, and 25 MiB.
BUCKET_CANDIDATES = tuple(sorted({1 << k for k in range(18, 27)} | {DEFAULT_BUCKET_BYTES}))


@dataclasses.dataclass(frozen=True)
class BucketChoice:
  """What :func:`auto_bucket_bytes` chose, and what the model predicts for it.

  Attributes:
    bucket_bytes: the size to pass to :func:`make_buckets`.
    algorithms: each bucket's algorithm, in reduction order (``auto`` resolved per bucket, as the
      planner resolves it when the step is traced); empty without a profile.
    finish_s: predicted seconds from the start of backprop to the end of the last reduction
      (None without a profile).
    exposed_s: the part of ``finish_s`` after backprop ends (reductions not hidden).
    measured: False when no profile was found (``bucket_bytes`` is then the default).
  """
  bucket_bytes: int
  algorithms: tuple[str, ...] = ()
  finish_s: float | None = None
  exposed_s: float | None = None
  measured: bool = False


def bucket_timeline(ready_s: Sequence[float], cost_s: Sequence[float]) -> float:
  """End of the last reduction: bucket ``k`` starts once it is ready and the network is free
  (one reduction at a time, in order, as the token chain between buckets issues them).

  Example:
    >>> bucket_timeline([1.0, 2.0], [1.5, 0.5])   # the second waits for the first: 2.5 + 0.5
    3.0
  """
  end = 0.0
  for ready, cost in zip(ready_s, cost_s):
    end = max(end, ready) + cost
  return end


def _resolve_axes(axes, axis_sizes, transport):
  """(axes, sizes, hierarchy, transport name): given, or from the axes bound where this runs."""
  if axis_sizes is not None:
    return tuple(axes), tuple(int(s) for s in axis_sizes), None, transport or "xla"
  from jaxring._src.algorithms import engine
  binding = engine.bind(tuple(axes), "value_and_grad")
  hierarchy = binding.hierarchy
  name = hierarchy.transport.name if hierarchy is not None else "xla"
  return tuple(binding.axes), tuple(binding.sizes), hierarchy, name


def auto_bucket_bytes(leaves: Sequence, forward_order: Sequence[int], axes, *,
                      algorithm: Any = "auto", compression: Any = None,
                      backward_seconds: float | None = None, overlap: bool = True,
                      axis_sizes: Sequence[int] | None = None, transport: str | None = None,
                      profile: Any = "find",
                      candidates: Sequence[int] = BUCKET_CANDIDATES) -> BucketChoice:
  """Chooses ``bucket_bytes`` (and each bucket's algorithm) from the measured profile.

  The model, for each candidate size: the leaves are bucketed exactly as :func:`make_buckets`
  buckets them; a leaf's gradient is ready once backprop has done the work of the leaves before
  it in backward order, the work taken proportional to their bytes over ``backward_seconds``; a
  bucket is ready with its last leaf; its reduction costs what the profile predicts for its
  bytes, dtype and codec under the algorithm ``auto`` picks at that size (or ``algorithm`` if
  fixed; ``jaxring._src.algorithms.planner.reduction_seconds``); reductions run one at a time,
  in order (:func:`bucket_timeline`). The size with the earliest predicted end of the last
  reduction wins; the default is kept unless it ends earlier by more than the planner's margin
  (2.5%) of the default's predicted reduction time, as ``auto`` keeps its default plan.

  Args:
    leaves: the differentiated leaves (arrays or ``jax.ShapeDtypeStruct``), flattened.
    forward_order: indices of ``leaves`` in order of first use (:func:`use_order`).
    axes: the axis name(s) the gradients are reduced over.
    algorithm, compression: as given to ``train_step``.
    backward_seconds: how long backprop takes; None: unknown, no overlap is credited and the
      reductions' total time decides.
    overlap: whether buckets are reduced inside backprop (``train_step(overlap=...)``).
    axis_sizes, transport: the axes' sizes and transport name; None: read from the axes bound
      where this is called (inside the step's ``shard_map``, or an MPI-bound name).
    profile: a ``profiles.Profile``, None for none, or ``"find"``: the one ``auto`` reads.
    candidates: the bucket sizes considered (bytes).

  Returns:
    A :class:`BucketChoice`; without a profile, the default 25 MiB.

  Example:
    >>> leaves = [jax.ShapeDtypeStruct((1 << 20,), jnp.float32)] * 8
    >>> auto_bucket_bytes(leaves, range(8), "data", axis_sizes=(8,), profile=None).bucket_bytes
    26214400
  """
  from jaxring._src.algorithms import planner
  if isinstance(axes, str):
    axes = (axes,)
  axes, sizes, hierarchy, transport = _resolve_axes(axes, axis_sizes, transport)
  if isinstance(profile, str):
    profile = planner.find_profile_for(axes, sizes, transport)
  if profile is None:
    return BucketChoice(DEFAULT_BUCKET_BYTES)
  order = list(forward_order)
  nbytes = {i: int(np.size(leaves[i])) * jnp.dtype(leaves[i].dtype).itemsize for i in order}
  total = sum(nbytes.values()) or 1
  work = float(backward_seconds or 0.0)
  ready, done = {}, 0
  for i in reversed(order):
    done += nbytes[i]
    ready[i] = work * done / total if overlap else work

  def evaluate(bucket_bytes: int):
    algos, costs, when = [], [], []
    for b in make_buckets(leaves, order, bucket_bytes):
      kind, t = planner.reduction_seconds(axes, sizes, b.nbytes, b.dtype, algorithm, compression,
                                          hierarchy=hierarchy, profile=profile)
      if t is None:
        return None
      algos.append(kind)
      costs.append(t)
      when.append(max(ready[i] for i in b.indices))
    return tuple(algos), max(work, bucket_timeline(when, costs)), sum(costs)

  results = {b: r for b in dict.fromkeys([DEFAULT_BUCKET_BYTES, *candidates])
             if (r := evaluate(int(b))) is not None}
  if not results:
    return BucketChoice(DEFAULT_BUCKET_BYTES)
  best = min(results, key=lambda b: (results[b][1], -b))
  default = results.get(DEFAULT_BUCKET_BYTES)
  # the predictions err in proportion to the reductions they add up, not to the compute
  if default is not None and default[1] - results[best][1] <= planner.MARGIN * default[2]:
    best = DEFAULT_BUCKET_BYTES
  algos, finish, _ = results[best]
  return BucketChoice(int(best), algos, finish, finish - work, True)
