"""pytest plugin for JAX's own test files (copied beside it by ``run.sh``): in every collected
test module whose ``lax`` is ``jax.lax``, ``lax`` becomes a module that is ``jax.lax`` except for
``psum``, ``pmean``, ``psum_scatter`` and ``all_gather``, which are jaxring's with
``algorithm=$JR_ALG``. Without ``JR_ALG`` nothing is replaced (the baseline run)."""
import functools
import os
import sys
import types

ALG = os.environ.get("JR_ALG")


def pytest_collection_modifyitems(session, config, items):
  if not ALG:
    return
  import jax

  import jaxring
  lax = types.ModuleType("lax_with_jaxring")
  lax.__getattr__ = lambda name: getattr(jax.lax, name)
  for name in ("psum", "pmean", "psum_scatter", "all_gather"):
    setattr(lax, name, functools.partial(getattr(jaxring, name), algorithm=ALG))
  for module in {id(item.module): item.module for item in items
                 if getattr(item, "module", None) is not None}.values():
    if getattr(module, "lax", None) is jax.lax:
      module.lax = lax
      print(f"{module.__name__}: lax.psum & co. are jaxring's, algorithm={ALG!r}", file=sys.stderr)
