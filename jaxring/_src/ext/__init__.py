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

#: The one table of kernels: each public wrapper of :mod:`.kernels` (the reference in
#: :mod:`.reference` has the same name) and whether it is an FFI target ``jaxring_<name>`` of the
#: extension (False: computed in Python around the targets). Every list of kernel names (the
#: package's attributes, ``jaxring doctor``'s self-test and target check) is derived from it.
KERNEL_TABLE: dict[str, bool] = {
    "quantize_int8": True,
    "dequantize_int8": True,
    "fake_quantize_int8": False,   # quantize then dequantize, with a straight-through gradient
    "ring_hop_int8": True,
    "ring_hop_int8_last": True,
    "ring_hop_cast": True,
    "ring_hop_cast_last": True,
    "chunk_norms": True,
    "gather_chunks": True,
    "scatter_add_chunks": True,
    "num_blocks": False,           # block counts: integer arithmetic on static shapes
    "num_chunks": False,
}
KERNELS = tuple(KERNEL_TABLE)
#: The kernels that are FFI targets, and the targets' registered names.
FFI_KERNELS = tuple(name for name, is_target in KERNEL_TABLE.items() if is_target)
FFI_TARGETS = tuple(f"jaxring_{name}" for name in FFI_KERNELS)


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
