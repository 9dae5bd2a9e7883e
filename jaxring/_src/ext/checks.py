"""Argument checks and the ffi_call helper shared by the kernel wrappers.

Everything here runs at trace time on static shapes and dtypes, so bad input raises before any
kernel is launched, with the argument's name in the message.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from jaxring._src import vma
from jaxring._src.ext.loader import require_extension

require_extension()  # the kernels and chunks modules need the FFI targets registered

__all__ = ["positive_int", "flat", "same_length", "call"]


# The largest block or chunk size the kernels take. The C++ handlers count blocks as
# (n + size - 1) / size in int64, which overflows for sizes near 2**63 (and sizes from 2**63 on
# do not fit the i64 attribute at all); any size from n on is one block anyway.
MAX_SIZE = 2**31 - 1


def positive_int(name: str, value) -> int:
  """Returns ``value`` as a Python int, or raises if it is not a static integer in
  ``[1, MAX_SIZE]``."""
  try:
    v = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be a static Python int, got {value!r}") from None
  if v <= 0:
    raise ValueError(f"{name} must be a positive integer, got {v}")
  if v > MAX_SIZE:
    raise ValueError(f"{name} must be at most {MAX_SIZE} (2**31 - 1), got {v}")
  return v


def flat(name: str, x, dtypes=None) -> jax.Array:
  """Returns ``x`` as a 1-D array whose dtype is one of ``dtypes``, or raises naming ``name``."""
  x = jnp.asarray(x)
  if x.ndim != 1:
    raise ValueError(f"{name} must be a flat 1-D array, got shape {x.shape}")
  if dtypes is not None and x.dtype not in dtypes:
    names = " or ".join(str(d) for d in dtypes)
    raise TypeError(f"{name} must have dtype {names}, got {x.dtype}")
  return x


def same_length(name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> None:
  if x.shape[0] != ref.shape[0]:
    raise ValueError(
        f"{name} has {x.shape[0]} elements but {ref_name} has {ref.shape[0]}; they must match"
    )


def call(target: str, results, *args, aliases=None, vmap_method="broadcast_all", **attrs):
  """Calls target ``jaxring_<target>``; batching runs the handler over leading rows (or, with
  ``vmap_method="sequential"``, calls it once per row: handlers of flat operands only).

  Inside ``shard_map(check_vma=True)`` the results are typed varying over every manual axis an
  argument varies over: ``jax.ffi.ffi_call`` (jax 0.10) types them from ``results``, which carry
  no varying axes, so a per-device result would otherwise be typed invariant, and a collective
  after it would treat it as replicated. The arguments are cast to the same axes first (ffi_call
  requires them to agree). The casts are type-only.
  """
  axes = tuple(sorted(frozenset().union(*map(vma.varying_axes, args)), key=str))
  args = tuple(vma.pvary(a, axes) for a in args)
  out = jax.ffi.ffi_call(
      f"jaxring_{target}", results, vmap_method=vmap_method, input_output_aliases=aliases
  )(*args, **attrs)
  return jax.tree_util.tree_map(lambda o: vma.pvary(o, axes), out)
