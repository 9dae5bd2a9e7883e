"""Varying-manual-axes (vma) typing across jax versions, in one place.

Inside ``shard_map(check_vma=True)`` every value is typed as varying or invariant over each manual
axis. jax has no communication-free cast from varying to invariant, so a ring all-reduce must end
with a collective whose output is typed invariant (``all_gather_invariant``, or the in-process
gather's custom call, typed by its declared result: transport/inprocess.py); with
``check_vma=False`` (and in ``pmap``) no value is typed varying and the plain ``all_gather`` is used,
whose transpose is a reduce-scatter, matching ``lax.psum``'s transpose in that mode.
"""
from __future__ import annotations

import jax
from jax import lax

try:  # public in some jax versions, private in 0.10
  all_gather_invariant = lax.all_gather_invariant  # type: ignore[attr-defined]
except AttributeError:
  from jax._src.lax.parallel import all_gather_invariant  # noqa: F401


def varying_axes(x) -> frozenset:
  """The manual axes ``x`` is typed as varying over (empty when vma is not checked)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def unreduced_axes(x) -> frozenset:
  """The manual axes ``x`` is typed unreduced over (``lax.pcast(x, axis, to="unreduced")``)."""
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(getattr(mat, "unreduced", ()))


def reduced_axes(x) -> frozenset:
  """The axes ``x`` is typed reduced over (``lax.all_gather(..., to="reduced")``)."""
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(getattr(mat, "reduced", ()))


def is_varying(x, axes: tuple) -> bool:
  return set(axes) <= varying_axes(x)


def pvary(x, axes: tuple):
  """Marks ``x`` varying over ``axes`` (a no-op where vma is not checked or already varying)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)  # jax < 0.8.2
