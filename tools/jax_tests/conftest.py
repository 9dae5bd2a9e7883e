"""pytest plugin for JAX's own test files (copied beside it by ``run.sh``): ``jax.lax.psum``,
``pmean``, ``psum_scatter`` and ``all_gather`` become jaxring's with ``algorithm=$JR_ALG`` for
the session, so that every test calling them -- as ``lax.psum`` or ``jax.lax.psum`` -- runs
jaxring's. jaxring's own calls to the native collectives stay lax's (jaxring._src.native).
Without ``JR_ALG`` nothing is replaced (the baseline run)."""
import functools
import os
import sys

ALG = os.environ.get("JR_ALG")


def pytest_collection_modifyitems(session, config, items):
  if not ALG:
    return
  import jax

  import jaxring
  for name in ("psum", "pmean", "psum_scatter", "all_gather"):
    setattr(jax.lax, name, functools.partial(getattr(jaxring, name), algorithm=ALG))
  print(f"jax.lax.psum & co. are jaxring's, algorithm={ALG!r}", file=sys.stderr)
