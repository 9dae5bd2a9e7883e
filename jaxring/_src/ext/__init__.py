"""jaxring's native kernels: loads the extension built from xla_ext/ and registers its FFI targets.

Importing this package registers every ``jaxring_*`` target for platform "cpu", and for "CUDA" when
the extension was built with CUDA. When the extension is missing or was built against another
jaxlib, importing a kernel (``from jaxring._src.ext import quantize_int8``, or the ``kernels`` and
``chunks`` modules) raises an ``ImportError`` that says what to run; :mod:`.reference` (pure jnp)
stays importable, so that callers can fall back on it.
"""

from __future__ import annotations

import jax
import jaxlib

_REBUILD = (
    "rebuild it from the jaxring checkout with `make install`, or with "
    "`pip install --no-build-isolation --no-deps -e .`"
)


def _load_extension():
  try:
    from jaxring import _ext
  except ImportError as e:
    raise ImportError(
        f"jaxring's native extension (jaxring._ext, built from xla_ext/) is missing or cannot "
        f"be loaded: {e}. {_REBUILD[0].upper()}{_REBUILD[1:]}."
    ) from e
  built = _ext.build_info()["jaxlib_version"]
  if built != jaxlib.__version__:
    raise ImportError(
        f"jaxring._ext was built against jaxlib {built} but jaxlib {jaxlib.__version__} is "
        f"installed; {_REBUILD}."
    )
  return _ext


def _register(ext) -> None:
  for name, capsule in ext.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  for name, capsule in ext.cuda_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


try:
  _ext = _load_extension()
except ImportError as e:
  _ext, LOAD_ERROR = None, e
else:
  LOAD_ERROR = None
  _register(_ext)

#: Whether the CUDA kernels were compiled into the extension (JAXRING_CUDA=auto|on at build).
CUDA_BUILT: bool = _ext is not None and bool(_ext.build_info()["cuda"])

from jaxring._src.ext.table import FFI_KERNELS as FFI_KERNELS  # noqa: E402
from jaxring._src.ext.table import FFI_TARGETS as FFI_TARGETS  # noqa: E402
from jaxring._src.ext.table import KERNEL_TABLE as KERNEL_TABLE  # noqa: E402
from jaxring._src.ext.table import KERNELS as KERNELS  # noqa: E402

#: What to run when the extension is missing or stale.
REBUILD_HINT = _REBUILD


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
  return {"cpu": sorted(_ext.registrations()), "cuda": sorted(_ext.cuda_registrations())}


def require_extension() -> None:
  """Raises the ImportError that says how to build the extension, if it did not load.

  Example:
      >>> require_extension()  # nothing happens when jaxring._ext is built and matches jaxlib
  """
  if LOAD_ERROR is not None:
    raise ImportError(str(LOAD_ERROR)) from LOAD_ERROR


def __getattr__(name: str):
  if name in KERNELS:
    require_extension()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from jaxring._src.ext import reference as reference  # noqa: E402

if LOAD_ERROR is None:
  from jaxring._src.ext import kernels as _kernels  # noqa: E402

  globals().update({name: getattr(_kernels, name) for name in KERNELS})
