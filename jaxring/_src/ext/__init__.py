"""jaxring's native kernels: loads the extension built from xla_ext/ and registers its FFI targets.

Importing this package registers every ``jaxring_*`` target for platform "cpu", and for "CUDA" when
the extension was built with CUDA. When the extension is missing or was built against another
jaxlib, importing a kernel (``from jaxring._src.ext import quantize_int8``, or the ``kernels`` and
``chunks`` modules) raises an ``ImportError`` that says what to run; :mod:`.reference` (pure jnp)
stays importable, so that callers can fall back on it.
"""

from jaxring._src.ext.loader import CUDA_BUILT as CUDA_BUILT
from jaxring._src.ext.loader import LOAD_ERROR as LOAD_ERROR
from jaxring._src.ext.loader import REBUILD_HINT as REBUILD_HINT
from jaxring._src.ext.loader import build_info as build_info
from jaxring._src.ext.loader import registered_targets as registered_targets
from jaxring._src.ext.loader import require_extension as require_extension
from jaxring._src.ext.table import FFI_KERNELS as FFI_KERNELS
from jaxring._src.ext.table import FFI_TARGETS as FFI_TARGETS
from jaxring._src.ext.table import KERNEL_TABLE as KERNEL_TABLE
from jaxring._src.ext.table import KERNELS as KERNELS
from jaxring._src.ext.table import WINDOW_KERNELS as WINDOW_KERNELS
from jaxring._src.ext.table import WINDOW_TARGETS as WINDOW_TARGETS


def __getattr__(name: str):
  if name in KERNELS:
    require_extension()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from jaxring._src.ext import reference as reference

if LOAD_ERROR is None:
  from jaxring._src.ext import kernels as _kernels

  globals().update({name: getattr(_kernels, name) for name in KERNELS})
