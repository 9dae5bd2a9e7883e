"""lax's own collectives, as jax defines them, whatever ``jax.lax`` holds later.

jaxring's drop-ins may be installed in ``jax.lax``'s place (``jax.lax.psum = jaxring.psum``: a
user's one-line switch, or JAX's own test suites run against jaxring, tools/jax_tests). Every call
jaxring makes to the native collective -- the ``xla`` plan, a ``vmap`` axis, the tangent and
transpose rules of jaxring._src.algorithms.linear -- must still be lax's primitive: looked up in
``jax.lax`` at call time it would be jaxring again, recursing on a ``vmap`` axis and, in a second
derivative, transposing the ring's custom rules, which JAX cannot (``NotImplementedError:
Transpose rule ... for 'custom_vjp_call'``).

Example:
  >>> jax.lax.psum = jaxring.psum      # doctest: +SKIP
  >>> native.psum is jaxring.psum      # doctest: +SKIP
  False
"""
from __future__ import annotations

try:  # where jax defines them: untouched by assignments to jax.lax's attributes
  from jax._src.lax import parallel as _defined
except ImportError:  # pragma: no cover - a jax that moved them: bound at import instead
  from jax import lax as _defined

psum = _defined.psum
pmean = _defined.pmean
psum_scatter = _defined.psum_scatter
all_gather = _defined.all_gather
