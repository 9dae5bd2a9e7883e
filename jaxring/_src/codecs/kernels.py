"""The kernels the codecs run: jaxring._src.ext's FFI kernels, resolved lazily.

The codecs call the C++ (CPU) / CUDA kernels behind ``jax.ffi`` for every encode, decode, fused
ring hop and top-k chunk operation. The extension is imported on first use, not when
``jaxring.codecs`` is imported, so that building a codec (a frozen dataclass) never needs it.

Where the extension cannot be loaded (not built in this checkout), the codecs run the pure-jnp
references of jaxring._src.ext.reference, which define the same numerics bit for bit, and say so
once with a warning; ``JAXRING_KERNELS=reference`` asks for them explicitly.
:func:`backend` tells which one is in use.
"""
from __future__ import annotations

import functools
import os
import types
import warnings


@functools.lru_cache(maxsize=None)
def _resolve() -> tuple[types.SimpleNamespace, str]:
  from jaxring._src.ext import reference
  if os.environ.get("JAXRING_KERNELS", "") == "reference":
    return _namespace(reference), "reference (JAXRING_KERNELS=reference)"
  try:
    from jaxring._src import ext
    missing = [n for n in ext.FFI_KERNELS if not hasattr(ext, n)]
    if missing:
      raise ImportError(f"jaxring._src.ext lacks {missing}")
  except ImportError as e:
    warnings.warn(f"jaxring codecs: the FFI kernels could not be loaded ({e}); running the "
                  "pure-jnp references instead (same numerics, slower)", RuntimeWarning,
                  stacklevel=3)
    return _namespace(reference), f"reference ({e})"
  return _namespace(ext), "ffi"


def _namespace(module) -> types.SimpleNamespace:
  # Both the FFI wrappers and the jnp references type their results varying over the manual axes
  # their inputs vary over (shard_map with check_vma=True), so they are used as they are.
  # The FFI kernels are the ones with a reference of the same name (ext/table.py).
  from jaxring._src.ext.table import FFI_KERNELS
  return types.SimpleNamespace(**{n: getattr(module, n) for n in FFI_KERNELS})


def ops() -> types.SimpleNamespace:
  """The kernel functions (``quantize_int8``, ``ring_hop_int8``, ``gather_chunks``, ...)."""
  return _resolve()[0]


def backend() -> str:
  """``"ffi"`` when the codecs run the extension's kernels, else why they run the references.

  Example:
    >>> jaxring._src.codecs.kernels.backend()
    'ffi'
  """
  return _resolve()[1]
