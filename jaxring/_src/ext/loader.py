"""Loads jaxring's native extension (``jaxring._ext``, built from xla_ext/) and registers its FFI
targets for platform "cpu", and for "CUDA" when it was built with CUDA.

A missing or stale extension is not an error here: :data:`LOAD_ERROR` keeps the ``ImportError``
that says what to run, and :func:`require_extension` raises it where a kernel is needed.
"""

from __future__ import annotations

import jax
import jaxlib

#: What to run when the extension is missing or stale.
REBUILD_HINT = (
    "rebuild it from the jaxring checkout with `make install`, or with "
    "`pip install --no-build-isolation --no-deps -e .`"
)


def _load_extension():
  try:
    from jaxring import _ext
  except ImportError as e:
    raise ImportError(
        f"jaxring's native extension (jaxring._ext, built from xla_ext/) is missing or cannot "
        f"be loaded: {e}. {REBUILD_HINT[0].upper()}{REBUILD_HINT[1:]}."
    ) from e
  built = _ext.build_info()["jaxlib_version"]
  if built != jaxlib.__version__:
    raise ImportError(
        f"jaxring._ext was built against jaxlib {built} but jaxlib {jaxlib.__version__} is "
        f"installed; {REBUILD_HINT}."
    )
  return _ext


def _register_types(types: dict) -> None:
  """Registers the types of the handlers' states with XLA, before any target that uses them.

  Not through ``jax.ffi.register_ffi_type``: it queues a type until the CPU client is made, and
  jaxlib 0.10 then registers the queued targets first and the types after, which fails the
  client ("Types used by FFI handlers must be registered before the handler registration") and
  with it every CPU computation. XLA's type registry is global: the type goes there at once.
  Raises AttributeError where jaxlib does not offer that."""
  from jax._src.lib import xla_client
  register = xla_client._xla.register_custom_type   # noqa: SLF001
  for name, registration in types.items():
    register(name, registration)


def _register(ext) -> None:
  for name, capsule in ext.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  global INPROCESS_ERROR
  try:
    _register_types(ext.inprocess_types())
  except AttributeError as e:   # the in-process level stays off: XLA's collectives do its work
    INPROCESS_ERROR = e
  else:
    for name, stages in ext.inprocess_registrations().items():
      jax.ffi.register_ffi_target(name, stages, platform="cpu")
  for name, capsule in ext.window_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  for name, capsule in ext.cuda_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  for name, (cpu, cuda) in ext.host_registrations().items():   # host-only: every platform built
    jax.ffi.register_ffi_target(name, cpu, platform="cpu")
    jax.ffi.register_ffi_target(name, cuda, platform="CUDA")


#: Why the in-process collectives (cpu_inprocess.cc) were not registered, if they were not.
INPROCESS_ERROR: Exception | None = None
try:
  _ext = _load_extension()
except ImportError as e:
  _ext, LOAD_ERROR = None, e
else:
  LOAD_ERROR = None
  _register(_ext)

#: Whether the CUDA kernels were compiled into the extension (JAXRING_CUDA=auto|on at build).
CUDA_BUILT: bool = _ext is not None and bool(_ext.build_info()["cuda"])

def build_info() -> dict:
  """The extension's build facts (``jaxlib_version``, ``ffi_api_version``, ``cuda``).

  Raises:
    ImportError: the extension did not load (the message says how to build it).

  Example:
    >>> build_info()["jaxlib_version"] == jaxlib.__version__
    True
  """
  require_extension()
  return dict(_ext.build_info())


def registered_targets() -> dict[str, list[str]]:
  """The FFI targets the extension registered, per platform (``"cpu"``, ``"cuda"``).

  Example:
    >>> "jaxring_quantize_int8" in registered_targets()["cpu"]
    True
  """
  require_extension()
  cpu = {**_ext.registrations(), **getattr(_ext, "window_registrations", dict)()}
  return {"cpu": sorted(cpu), "cuda": sorted(_ext.cuda_registrations())}


def require_extension() -> None:
  """Raises the ImportError that says how to build the extension, if it did not load.

  Example:
      >>> require_extension()  # nothing happens when jaxring._ext is built and matches jaxlib
  """
  if LOAD_ERROR is not None:
    raise ImportError(str(LOAD_ERROR)) from LOAD_ERROR
