"""Which heap allocator a process runs with, and where tcmalloc is installed.

XLA:CPU collectives are dominated by allocating fresh output buffers, so the allocator moves CPU
timings by 10-40% (4-5x for a single collective): benchmarks preload tcmalloc when it is installed
(``make tcmalloc``), say which allocator they ran with, and ``jaxring doctor`` warns without it.
"""
from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence

_TCMALLOC_GLOBS = ("/usr/lib/*/libtcmalloc_minimal.so*", "/usr/lib/*/libtcmalloc.so*",
                   "/usr/lib/libtcmalloc*.so*", "/usr/lib64/libtcmalloc*.so*")
INSTALL_HINT = ("install it with `make tcmalloc` (apt-get install libtcmalloc-minimal4); "
                "JAXRING_NO_TCMALLOC=1 keeps glibc malloc deliberately")


def tcmalloc_libraries() -> list[str]:
  """Installed tcmalloc shared libraries, sorted (``libtcmalloc_minimal`` before ``libtcmalloc``).

  Example:
    >>> all("tcmalloc" in p for p in tcmalloc_libraries())
    True
  """
  return sorted({p for g in _TCMALLOC_GLOBS for p in glob.glob(g)})


def allocator_in_use() -> str:
  """``tcmalloc (<path>)`` when this process preloads it, else ``glibc malloc``.

  Example:
    >>> allocator_in_use().split()[0] in ("glibc", "tcmalloc")
    True
  """
  pre = os.environ.get("LD_PRELOAD", "")
  return f"tcmalloc ({pre})" if "tcmalloc" in pre else "glibc malloc"


def maybe_reexec_with_tcmalloc(argv: Sequence[str], module: str = "jaxring") -> None:
  """Re-executes ``python -m <module> <argv>`` with tcmalloc preloaded when it is installed and not
  yet loaded; says on stderr when the run stays on glibc malloc, so that no figure silently
  depends on what happened to be installed. JAXRING_NO_TCMALLOC=1 opts out.
  """
  if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
    return
  if os.environ.get("JAXRING_NO_TCMALLOC"):
    print("jaxring: JAXRING_NO_TCMALLOC set: running with glibc malloc", file=sys.stderr)
    return
  libs = tcmalloc_libraries()
  if not libs:
    print(f"jaxring: tcmalloc is not installed, running with glibc malloc (CPU collectives "
          f"10-40% slower); {INSTALL_HINT}", file=sys.stderr)
    return
  env = dict(os.environ, LD_PRELOAD=libs[0])
  os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
