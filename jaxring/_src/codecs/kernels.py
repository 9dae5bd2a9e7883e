"""The kernels the codecs run: jaxring._src.ext's FFI kernels, resolved lazily.

The codecs call the C++ (CPU) / CUDA kernels behind ``jax.ffi`` for every encode, decode, fused
ring hop and top-k chunk operation. The extension is imported on first use, not when
``jaxring.codecs`` is imported, so that building a codec (a frozen dataclass) never needs it.

Where the extension cannot be loaded (not built in this checkout), the codecs run the pure-jnp
references of jaxring._src.ext.reference, which define the same numerics bit for bit, and say so
once with a warning; ``JAXRING_KERNELS=reference`` asks for them explicitly.

A custom call is not always the faster path: on an H100, XLA's own fusion of the int8 reference
ran 2x faster than the CUDA kernel. ``jaxring bench kernels --save-choice`` records, per platform,
the kernels whose reference measured faster (``kernels-<platform>.json`` in jaxring's cache,
or the file ``JAXRING_KERNEL_CHOICE`` names), and the codecs run those references there. The
numerics are the same bit for bit either way. :func:`backend` tells what is in use.
"""
from __future__ import annotations

import functools
import json
import os
import types
import warnings


ENV_CHOICE = "JAXRING_KERNEL_CHOICE"


def choice_path(platform: str):
  """The file of measured kernel choices for ``platform`` ("cpu", "gpu", ...)."""
  from jaxring._src import cache
  return os.environ.get(ENV_CHOICE) or cache.cache_dir() / f"kernels-{platform}.json"


def _measured_references(platform: str) -> frozenset:
  """Kernels whose jnp reference measured faster than the custom call on ``platform``."""
  try:
    with open(choice_path(platform)) as f:
      recorded = json.load(f)
  except (FileNotFoundError, ValueError):
    return frozenset()
  if recorded.get("platform") != platform:
    return frozenset()
  return frozenset(recorded.get("use_reference", ()))


@functools.lru_cache(maxsize=None)
def _resolve(platform: str) -> tuple[types.SimpleNamespace, str]:
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
  slower = _measured_references(platform)
  if slower:
    ns = _namespace(ext)
    for name in slower & set(vars(ns)):
      setattr(ns, name, getattr(reference, name))
    return ns, f"ffi (measured faster on {platform}: the references of {sorted(slower)})"
  return _namespace(ext), "ffi"


def _namespace(module) -> types.SimpleNamespace:
  # Both the FFI wrappers and the jnp references type their results varying over the manual axes
  # their inputs vary over (shard_map with check_vma=True), so they are used as they are.
  # The FFI kernels are the ones with a reference of the same name (ext/table.py).
  from jaxring._src.ext.table import FFI_KERNELS
  return types.SimpleNamespace(**{n: getattr(module, n) for n in FFI_KERNELS})


def _platform() -> str:
  import jax
  return jax.default_backend()


def ops() -> types.SimpleNamespace:
  """The kernel functions (``quantize_int8``, ``ring_hop_int8``, ``gather_chunks``, ...)."""
  return _resolve(_platform())[0]


def backend() -> str:
  """``"ffi"`` when the codecs run the extension's kernels, else why they run the references.

  Example:
    >>> jaxring._src.codecs.kernels.backend()
    'ffi'
  """
  return _resolve(_platform())[1]
