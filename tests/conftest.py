"""8 emulated CPU devices for every in-process test; strict dtype promotion; the ``slow`` marker."""
import atexit
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `auto` reads calibrated profiles from the cache: tests must not see the developer's own. The
# folder (one per pytest process) is deleted when the process ends.
_CACHE_ROOT = tempfile.mkdtemp(prefix="jaxring-test-cache-")
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
os.environ["JAXRING_CACHE_DIR"] = os.path.join(_CACHE_ROOT, "jaxring")
os.environ.pop("JAXRING_PROFILE", None)
# the flight recorder dumps when a watchdog gives up: into a temporary folder, not the checkout
os.environ["JAXRING_FLIGHT_DIR"] = os.path.join(os.environ["JAXRING_CACHE_DIR"], "flight")
_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The in-process tests compile thousands of programs and run each a few times: without LLVM's
# optimizations (XLA:CPU's level 2 by default) the compile-bound ones take half the time on the
# 2-core machine (docs/benchmarks.md, "The test suite's time"). Same numerics: no fast-math at
# either level. Processes started through multiproc.clean_env (multi-process and MPI tests, the
# docs' blocks) and the emulated cluster's jobs get the same level; XLA_FLAGS naming a level
# overrides it.
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
# XLA's persistent compilation cache, one folder for the whole run: pytest-xdist's workers inherit
# the controller's (setdefault) and multiproc.clean_env hands it to every process a test starts,
# so a program compiled once (an eager op every fresh process compiles, a worker's reference run
# repeated by each case) is read back, not compiled again. Entries are keyed by the program, the
# devices and XLA_FLAGS; executables with host callbacks are never cached. The folder goes with
# the controller's temporary folder.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_CACHE_ROOT, "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# `pytest -m "not slow"` (the quick loop, `make test-quick`) leaves out every test marked `slow`;
# `make test` runs everything. A test is marked `slow` where it is defined (`@pytest.mark.slow`,
# `pytest.param(..., marks=pytest.mark.slow)` or a module's `pytestmark`), with a comment saying
# why; the seconds there are one run on the 2-core development machine. Every test marked
# `multiprocess` or `netns` is slow too (it starts processes, MPI jobs or namespaces): the hook
# below adds the mark (tests/test_markers.py checks both rules).
SLOW_BECAUSE = ("multiprocess", "netns")


# `make test` hands whole modules to the workers (`--dist loadfile`), in the order they are
# collected; whichever module is handed out last runs while the other workers may have nothing
# left. So the modules that take longest (their seconds on the 2-core machine, a whole-suite run,
# roughly) go first, each one's tests together and in their order, and the many short ones fill
# in at the end. xdist would otherwise reorder the modules by their number of tests, which puts the
# few long multi-process tests (test_mpi.py, test_cluster.py) last: pytest_configure turns that
# off.
# The modules, longest first, are listed in heavy_modules.txt (not here: conftest.py names no test,
# tests/test_markers.py); a module renamed or not listed only loses its place at the front.
HEAVY_FIRST = tuple(
    line.split("#")[0].strip()
    for line in (pathlib.Path(__file__).parent / "heavy_modules.txt").read_text().splitlines()
    if line.split("#")[0].strip())


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep the order made below
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  for item in items:
    if any(item.get_closest_marker(name) for name in SLOW_BECAUSE):
      item.add_marker(pytest.mark.slow)
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  # sorted() is stable: the order within a module, and of the modules not named, is kept
  items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def toy(monkeypatch):
  """A codec registered for one test (and removed after): a nibble per value, in the sweep;
  what a new codec file adds (test_codec_parse.py, test_simulate.py)."""
  import dataclasses

  import jax.numpy as jnp

  from jaxring._src.codecs import base
  from jaxring._src.tools.simulate import calibrated  # noqa: F401 (its NAMES: the sweep before)
  monkeypatch.setattr(base, "_SPELLINGS", dict(base._SPELLINGS))
  monkeypatch.setattr(base, "_CLASSES", dict(base._CLASSES))

  @dataclasses.dataclass(frozen=True)
  class Toy(base.Codec):
    __qualname__ = "Toy"
    name = "toy"
    lossy = True
    bits: int = 4

    def wire_bytes(self, n, dtype=jnp.float32):
      return -(-int(n) * self.bits // 8)

  @base.spelling("toy[:bits]", "toy", sweep=True)
  def _read(args, inner):
    base.no_inner("toy", inner)
    return Toy(*map(int, args))
  return Toy
