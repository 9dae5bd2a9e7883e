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
