"""Which heap allocator a process runs with, and how benchmarks get a fast one.

XLA:CPU collectives are dominated by allocating fresh output buffers. Plain glibc malloc serves
every buffer over 32 MiB with a fresh ``mmap`` and returns it on free, so each call page-faults its
outputs in again: a ``lax.psum`` of 32 MiB on 8 CPU devices runs about 2x slower than with the
tuning below (docs/benchmarks.md, "All-reduce on one host"). Two remedies, in order:

- tcmalloc, preloaded where it is installed (``make tcmalloc``);
- otherwise glibc malloc tuned through ``GLIBC_TUNABLES`` (nothing to install): large blocks come
  from the heap and stay there, and what is still mapped afresh is mapped in transparent huge
  pages (``GLIBC_TUNED``).

``jaxring bench``, ``jaxring demo`` and the processes ``jaxring cluster run`` starts use the first
that applies and say which; ``JAXRING_NO_TCMALLOC=1`` keeps plain glibc malloc deliberately.
"""
from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping, Sequence

_TCMALLOC_GLOBS = ("/usr/lib/*/libtcmalloc_minimal.so*", "/usr/lib/*/libtcmalloc.so*",
                   "/usr/lib/libtcmalloc*.so*", "/usr/lib64/libtcmalloc*.so*")
INSTALL_HINT = ("install it with `make tcmalloc` (apt-get install libtcmalloc-minimal4); "
                "JAXRING_NO_TCMALLOC=1 keeps plain glibc malloc deliberately")
ENV_OPT_OUT = "JAXRING_NO_TCMALLOC"
# Blocks up to 1 GiB from the heap (not mmap), freed memory kept up to 1 GiB. That holds in the
# main arena only: a thread's own arena grows in heaps of at most 64 MiB and maps a larger block
# afresh whatever the threshold (and XLA's threads allocate most buffers), so every such block is
# also asked for in transparent huge pages (hugetlb=1: 2 MiB a page fault instead of 4 KiB; a
# 32 MiB psum on 8 CPU devices 34-46 -> 24-25 ms, docs/benchmarks.md). And a thread arena's
# second heap, unmapped by glibc as soon as it is all free (whatever trim_threshold says) and
# mapped and zeroed again by the next large block, stays while top_pad is at least a heap's size
# (top_pad=64 MiB: a thread that holds two 40 MiB blocks at a time and frees them, 20 times,
# page-faults 10,666 times without it, 48 with it; tests/test_allocator.py). Not one arena:
# glibc.malloc.arena_max=1 made single collectives steadier but cost the demo's training step 40%
# (lock contention between XLA's threads: 272 against 438 images/s, docs/benchmarks.md)
GLIBC_TUNED = ("glibc.malloc.mmap_threshold=1073741824", "glibc.malloc.trim_threshold=1073741824",
               "glibc.malloc.hugetlb=1", "glibc.malloc.top_pad=67108864")


TUNED_GLIBC = ("glibc malloc, tuned (GLIBC_TUNABLES: heap blocks up to 1 GiB, kept; threads' heaps "
               "kept; huge pages)")


def tcmalloc_libraries() -> list[str]:
  """Installed tcmalloc shared libraries, sorted (``libtcmalloc_minimal`` before ``libtcmalloc``).

  Example:
    >>> all("tcmalloc" in p for p in tcmalloc_libraries())
    True
  """
  return sorted({p for g in _TCMALLOC_GLOBS for p in glob.glob(g)})


def _tuned(env: Mapping[str, str]) -> bool:
  have = set(env.get("GLIBC_TUNABLES", "").split(":"))
  return all(t in have for t in GLIBC_TUNED)


def transparent_huge_pages() -> str:
  """The kernel's transparent huge page mode: ``always``, ``madvise`` (on request, as the tuned
  glibc settings ask), ``never``, or ``""`` where it cannot be read (not Linux).

  Example:
    >>> transparent_huge_pages() in ("always", "madvise", "never", "")
    True
  """
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      text = f.read()
  except OSError:
    return ""
  return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def allocator_in_use(env: Mapping[str, str] | None = None) -> str:
  """``tcmalloc (<path>)``, ``glibc malloc, tuned`` or ``glibc malloc``, for this process (or a
  process started with ``env``).

  Example:
    >>> allocator_in_use({"GLIBC_TUNABLES": ":".join(GLIBC_TUNED)}) == TUNED_GLIBC
    True
    >>> allocator_in_use({})
    'glibc malloc'
  """
  env = os.environ if env is None else env
  pre = env.get("LD_PRELOAD", "")
  if "tcmalloc" in pre:
    return f"tcmalloc ({pre})"
  if _tuned(env):
    return TUNED_GLIBC
  return "glibc malloc"


def fast_allocator_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """``env`` (default: this process's) changed so that a process started with it runs tcmalloc
  where installed, else tuned glibc malloc; unchanged when it has one already or opts out
  (``JAXRING_NO_TCMALLOC``). A caller's own ``GLIBC_TUNABLES`` entries are kept.

  Example:
    >>> e = fast_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    >>> "tcmalloc" in e.get("LD_PRELOAD", "") or e["GLIBC_TUNABLES"].startswith("glibc.malloc.tc")
    True
    >>> fast_allocator_env({ENV_OPT_OUT: "1"}) == {ENV_OPT_OUT: "1"}
    True
  """
  out = dict(os.environ if env is None else env)
  if out.get(ENV_OPT_OUT) or allocator_in_use(out) != "glibc malloc":
    return out
  libs = tcmalloc_libraries()
  if libs:
    out["LD_PRELOAD"] = ":".join(p for p in (libs[0], out.get("LD_PRELOAD")) if p)
  else:
    out["GLIBC_TUNABLES"] = ":".join(t for t in (out.get("GLIBC_TUNABLES"), *GLIBC_TUNED) if t)
  return out


def maybe_reexec_with_fast_allocator(argv: Sequence[str], module: str = "jaxring") -> None:
  """Re-executes ``python -m <module> <argv>`` with :func:`fast_allocator_env` when this process
  runs plain glibc malloc, so that no figure depends on what happened to be installed; says on
  stderr which allocator a run uses when it is not tcmalloc. ``JAXRING_NO_TCMALLOC=1`` opts out.
  """
  if os.environ.get(ENV_OPT_OUT):
    print(f"jaxring: {ENV_OPT_OUT} set: running with plain glibc malloc", file=sys.stderr)
    return
  env = fast_allocator_env()
  if env == dict(os.environ):
    if not allocator_in_use().startswith("tcmalloc"):
      why = ("as this environment's GLIBC_TUNABLES asks" if tcmalloc_libraries() else
             f"tcmalloc is not installed: {INSTALL_HINT}")
      print(f"jaxring: running with {allocator_in_use()}; {why}", file=sys.stderr)
    return
  os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
