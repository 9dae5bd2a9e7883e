"""The kernels the codecs run: jaxring._src.ext's FFI kernels, resolved lazily.

The codecs call the C++ (CPU) / CUDA kernels behind ``jax.ffi`` for every encode, decode, fused
ring hop and top-k chunk operation. The extension is imported on first use, not when
``jaxring.codecs`` is imported, so that building a codec (a frozen dataclass) never needs it.

Where the extension cannot be loaded (not built in this checkout), the codecs run the pure-jnp
references of jaxring._src.ext.reference, which define the same numerics bit for bit, and say so
once with a warning; ``JAXRING_KERNELS=reference`` asks for them explicitly.

A custom call is not always the faster path: on an H100, XLA's own fusion of the int8 reference
ran 2x faster than the CUDA kernel. ``jaxring bench kernels --save-choice`` records, per
platform and measured size, the kernels whose reference measured faster
(``kernels-<platform>.json`` in jaxring's cache, or the file ``JAXRING_KERNEL_CHOICE`` names),
and the codecs run those references there: everywhere for a kernel slower at every size, else at
the calls whose size is nearest a size where it was slower (on an H200, ``ring_hop_int8_last``
lost to XLA by 10% at 64 MiB and was within 2% at 256). The numerics are the same bit for
bit either way. :func:`backend` tells what is in use.
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


def _measured_references(platform: str) -> tuple[frozenset, dict]:
  """Kernels whose jnp reference measured faster than the custom call on ``platform``: those
  faster at every measured size, and, per kernel faster at some sizes only, the sorted
  ``(elements, reference_faster)`` pairs measured."""
  try:
    with open(choice_path(platform)) as f:
      recorded = json.load(f)
  except (FileNotFoundError, ValueError):
    return frozenset(), {}
  if recorded.get("platform") != platform:
    return frozenset(), {}
  by_size = {n: sorted((int(e), bool(ref)) for e, ref in s)
             for n, s in recorded.get("reference_by_size", {}).items()}
  return frozenset(recorded.get("use_reference", ())), by_size


def _by_size(custom, reference, measured: list[tuple[int, bool]]):
  """``custom`` or ``reference`` per call, by the measured size nearest the call's first operand
  (in ratio: a call between two measured sizes takes the nearer's choice, one outside their
  range the end's). Shapes are static, so the choice is made once per trace."""
  import math

  @functools.wraps(custom)
  def kernel(x, *args, **kwargs):
    n = max(1, math.prod(x.shape))
    _, ref = min(measured, key=lambda m: abs(math.log(n / m[0])))
    return (reference if ref else custom)(x, *args, **kwargs)
  return kernel


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
  slower, by_size = _measured_references(platform)
  ns = _namespace(ext)
  for name in slower & set(vars(ns)):
    setattr(ns, name, getattr(reference, name))
  by_size = {n: m for n, m in by_size.items() if n in vars(ns) and n not in slower and m}
  for name, measured in by_size.items():
    setattr(ns, name, _by_size(getattr(ext, name), getattr(reference, name), measured))
  said = ([f"the references of {sorted(slower)}"] if slower else []) + [
      f"{n}'s reference at {[e for e, ref in m if ref]} elements" for n, m in by_size.items()]
  if said:
    return ns, f"ffi (measured faster on {platform}: {'; '.join(said)})"
  return ns, "ffi"


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


def in_place(name: str, base, n: int):
  """The wrapper of kernel ``name`` that reads ``n`` elements of the flat f32 ``base`` in place,
  ``f(..., base, offset, ...)`` (jaxring._src.ext.window), where the codecs run ``name``'s FFI
  target on the CPU; else None, and the caller slices and calls :func:`ops`'s kernel."""
  flat_f32 = base.ndim == 1 and base.dtype == "float32" and 0 < n <= base.shape[0] < 2**31
  if not flat_f32 or _platform() != "cpu":
    return None
  from jaxring._src import ext
  chosen = getattr(ops(), name)
  if ext.LOAD_ERROR is not None or chosen is not getattr(ext, name, None):
    return None
  if not hasattr(ext.loader._ext, "window_registrations"):   # built before the targets existed
    return None
  from jaxring._src.ext import window
  return getattr(window, name)


def backend() -> str:
  """``"ffi"`` when the codecs run the extension's kernels, else why they run the references.

  Example:
    >>> jaxring._src.codecs.kernels.backend()
    'ffi'
  """
  return _resolve(_platform())[1]
