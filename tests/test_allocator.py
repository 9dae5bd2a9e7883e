"""The allocator settings benchmarks and cluster processes run with (jaxring._src.tools.allocator).

The tuned glibc settings are checked by their effect: a process that allocates, fills and frees a
64 MiB buffer 20 times page-faults it in every time under plain glibc malloc (a fresh mmap per
buffer), once under the tuned settings; a second thread (its own arena, as XLA's threads have)
maps it afresh every time even when tuned, but in huge pages; a thread that holds two 40 MiB blocks
at a time keeps the heap the second one took (top_pad) instead of mapping and zeroing it again. A
misspelt tunable is ignored by glibc, so it fails here.
"""
import os
import platform
import subprocess
import sys

import pytest

from jaxring._src.tools import allocator
from jaxring._src.tools.cluster import launch

# malloc through ctypes, as XLA:CPU allocates: numpy asks for huge pages on large arrays, which
# would hide the per-page faults this counts
_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def work():
  for _ in range(20):
    blocks = [libc.malloc(SIZE) for _ in range(AT_ONCE)]
    for p in blocks:
      ctypes.memset(p, 1, SIZE)
    for p in reversed(blocks):
      libc.free(p)

before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
if THREAD:   # a thread of its own takes an arena of its own
  import threading
  t = threading.Thread(target=work)
  t.start()
  t.join()
else:
  work()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env, thread: bool = False, size: int = 64 << 20, at_once: int = 1) -> int:
  head = f"THREAD = {thread}\nSIZE = {size}\nAT_ONCE = {at_once}\n"
  out = subprocess.run([sys.executable, "-c", head + _FAULTS], env=env,
                       capture_output=True, text=True, timeout=120, check=True)
  return int(out.stdout.strip())


def _plain_env() -> dict:
  return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunables")
@pytest.mark.skipif(allocator.transparent_huge_pages() == "always",
                    reason="huge pages for every mapping: faults are not pages")
def test_tuned_glibc_keeps_large_blocks_resident():
  plain = _faults(_plain_env())
  tuned = _faults(dict(_plain_env(), GLIBC_TUNABLES=":".join(allocator.GLIBC_TUNED)))
  pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
  assert plain > 0.8 * pages, plain            # every buffer faulted in again
  assert tuned < 0.2 * pages, (tuned, plain)   # the first one only


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunables")
@pytest.mark.skipif(allocator.transparent_huge_pages() != "madvise",
                    reason="transparent huge pages on request only")
def test_tuned_glibc_maps_a_threads_large_blocks_in_huge_pages():
  tuned = dict(_plain_env(), GLIBC_TUNABLES=":".join(allocator.GLIBC_TUNED))
  thresholds_only = dict(_plain_env(), GLIBC_TUNABLES=":".join(
      t for t in allocator.GLIBC_TUNED if "hugetlb" not in t))
  pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
  assert _faults(thresholds_only, thread=True) > 0.8 * pages   # every block mapped afresh
  assert _faults(tuned, thread=True) < 0.2 * pages             # ... in 2 MiB pages


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's tunables")
def test_tuned_glibc_keeps_a_threads_second_heap():
  """Two 40 MiB blocks at a time do not fit one 64 MiB heap: the second takes a heap of its own,
  which glibc unmaps as soon as it is all free unless top_pad covers a heap (then every round
  maps and zeroes 40 MiB again: 10,666 faults over 20 rounds here, 48 with top_pad). The first
  round faults its blocks in either way, a twentieth of all rounds' whatever the page size, so
  the bound is a factor of 5, not 20."""
  tuned = dict(_plain_env(), GLIBC_TUNABLES=":".join(allocator.GLIBC_TUNED))
  no_pad = dict(_plain_env(), GLIBC_TUNABLES=":".join(
      t for t in allocator.GLIBC_TUNED if "top_pad" not in t))
  kw = dict(thread=True, size=40 << 20, at_once=2)
  without, with_pad = _faults(no_pad, **kw), _faults(tuned, **kw)
  assert 5 * with_pad < without, (with_pad, without)


def test_fast_env_keeps_the_callers_tunables_and_is_idempotent(monkeypatch):
  monkeypatch.setattr(allocator, "tcmalloc_libraries", lambda: [])
  env = allocator.fast_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "A": "1"})
  assert env["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.tcache_count=0", *allocator.GLIBC_TUNED]
  assert env["A"] == "1"
  assert allocator.fast_allocator_env(env) == env
  assert allocator.allocator_in_use(env).startswith("glibc malloc, tuned")


def test_fast_env_prefers_tcmalloc_and_honours_the_opt_out(monkeypatch):
  monkeypatch.setattr(allocator, "tcmalloc_libraries",
                      lambda: ["/usr/lib/x/libtcmalloc_minimal.so.4"])
  env = allocator.fast_allocator_env({"LD_PRELOAD": "/opt/other.so"})
  assert env["LD_PRELOAD"] == "/usr/lib/x/libtcmalloc_minimal.so.4:/opt/other.so"
  assert "GLIBC_TUNABLES" not in env
  assert allocator.allocator_in_use(env).startswith("tcmalloc")
  opted = {allocator.ENV_OPT_OUT: "1"}
  assert allocator.fast_allocator_env(opted) == opted
  assert allocator.allocator_in_use(opted) == "glibc malloc"


def test_cluster_processes_get_the_fast_allocator(monkeypatch):
  monkeypatch.setattr(allocator, "tcmalloc_libraries", lambda: [])
  env = launch.child_env({"PATH": "/bin", "JAXRING_RANK": "3"})
  assert "JAXRING_RANK" not in env
  assert allocator.allocator_in_use(env).startswith("glibc malloc, tuned")
  assert launch.child_env({allocator.ENV_OPT_OUT: "1"}).get("GLIBC_TUNABLES") is None


@pytest.mark.parametrize("installed", [True, False])
def test_a_run_with_tuned_glibc_says_why_tcmalloc_is_not_used(monkeypatch, capsys, installed):
  """Tuned glibc asked for by the environment is said so, not "tcmalloc is not installed"
  where it is (no re-exec either way: the environment already has a fast allocator)."""
  monkeypatch.setattr(allocator, "tcmalloc_libraries",
                      lambda: ["/usr/lib/x/libtcmalloc_minimal.so.4"] if installed else [])
  monkeypatch.setenv("GLIBC_TUNABLES", ":".join(allocator.GLIBC_TUNED))
  monkeypatch.delenv("LD_PRELOAD", raising=False)
  monkeypatch.delenv(allocator.ENV_OPT_OUT, raising=False)
  allocator.maybe_reexec_with_fast_allocator([])
  said = capsys.readouterr().err
  assert "glibc malloc, tuned" in said
  assert ("not installed" in said) is not installed
  assert ("GLIBC_TUNABLES asks" in said) is installed
