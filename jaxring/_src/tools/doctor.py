"""``jaxring doctor``: one screen to paste into a bug report, and an exit code that says whether
what the user asked for works.

In the spirit of DeepSpeed's ``ds_report`` and ``torch.utils.collect_env``: versions, devices,
the native extension (FFI targets per platform, and a short self-test of every kernel against its
pure-jnp reference), the CUDA build, MPI, the allocator, ``jax.distributed`` and the topology,
then one line per problem with its fix. Problems are errors (exit 1: the extension is missing, a
kernel disagrees with its reference, or something asked for with ``--require`` is absent) or
warnings (exit 0: e.g. glibc malloc).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import os
import platform
import sys
import time

from jaxring._src import extras
from jaxring._src.tools import allocator

REQUIRABLE = ("mpi", "cuda", "gpu", "tcmalloc")
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "mpi4py", "mpi4jax",
             "mpich")
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


@dataclasses.dataclass
class Report:
  """What doctor found: ``(section, key, value)`` rows and problems with their fixes."""
  rows: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
  errors: list[str] = dataclasses.field(default_factory=list)
  warnings: list[str] = dataclasses.field(default_factory=list)

  def add(self, section: str, key: str, value: object) -> None:
    self.rows.append((section, key, str(value)))

  def render(self) -> str:
    lines, section = [], None
    for sec, key, value in self.rows:
      if sec != section:
        lines.append(f"{sec}:")
        section = sec
      lines.append(f"  {key:<26} {value}")
    for tag, items in (("ERROR", self.errors), ("warning", self.warnings)):
      lines.extend(f"{tag}: {msg}" for msg in items)
    if not self.errors and not self.warnings:
      lines.append("no problems found")
    return "\n".join(lines)


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _versions(r: Report) -> None:
  import jaxring
  r.add("versions", "jaxring", f"{jaxring.__version__} ({os.path.dirname(jaxring.__file__)})")
  r.add("versions", "python", f"{platform.python_version()} ({sys.executable})")
  r.add("versions", "platform", platform.platform())
  for dist in _PACKAGES:
    r.add("versions", dist, _version(dist))


def _devices(r: Report, require: set[str]) -> None:
  import jax
  devices = jax.devices()
  r.add("devices", "default backend", jax.default_backend())
  r.add("devices", "count (local/global)", f"{jax.local_device_count()}/{jax.device_count()}")
  r.add("devices", "kinds", ", ".join(sorted({d.device_kind for d in devices})))
  if "gpu" in require and jax.default_backend() != "gpu":
    r.errors.append("--require gpu: JAX sees no GPU (backend "
                    f"{jax.default_backend()!r}); install jax with its CUDA plugin "
                    "(pip install 'jax[cuda13]') and check nvidia-smi")


def _self_test(platform_name: str) -> dict[str, str]:
  """Every kernel once on ``platform_name`` against its reference: ``name -> 'ok' | problem``."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxring._src import ext
  from jaxring._src.ext import reference as ref

  device = jax.devices(platform_name)[0]
  key = np.random.default_rng(0)
  x = jnp.asarray(key.standard_normal(1000), jnp.float32)
  partial = jnp.asarray(key.standard_normal(1000), jnp.float32)
  idx = jnp.asarray([3, 0, 7], jnp.int32)
  q, s = ref.quantize_int8(x, 64)
  q4, s4 = ref.quantize_fp4(x, 64)
  cases = {
      "quantize_int8": lambda m: m.quantize_int8(x, 64),
      "dequantize_int8": lambda m: m.dequantize_int8(q, s, 64),
      "ring_hop_int8": lambda m: m.ring_hop_int8(q, s, partial, 64),
      "ring_hop_int8_last": lambda m: m.ring_hop_int8_last(q, s, partial, 64),
      "ring_hop_cast": lambda m: m.ring_hop_cast(x.astype(jnp.bfloat16), partial),
      "ring_hop_cast_last": lambda m: m.ring_hop_cast_last(x.astype(jnp.bfloat16), partial),
      "chunk_norms": lambda m: m.chunk_norms(x, 100),
      "gather_chunks": lambda m: m.gather_chunks(x, idx, 100),
      "scatter_add_chunks": lambda m: m.scatter_add_chunks(x, idx, partial[:300], 100),
      "quantize_fp4": lambda m: m.quantize_fp4(x, 64, True, 3),
      "dequantize_fp4": lambda m: m.dequantize_fp4(q4, s4, 64),
      "ring_hop_fp4": lambda m: m.ring_hop_fp4(q4, s4, partial, 64),
      "ring_hop_fp4_last": lambda m: m.ring_hop_fp4_last(q4, s4, partial, 64),
  }
  results = {}
  for name in ext.FFI_KERNELS:  # the table, so that a kernel added without a case is reported
    results[name] = _compare(name, cases.get(name), device,
                             lambda call: jax.jit(lambda: call(ext))(), lambda call: call(ref))
  if platform_name == "cpu":   # the targets reading the ring's chunk in place (ext/window.py)
    from jaxring._src.ext import window
    lo, n = 200, 300        # the chunk partial[lo:lo + n], the offset traced
    chunk = partial[lo:lo + n]
    q3, s3 = ref.quantize_int8(x[:n], 64)
    n4 = n - 1 if n % 2 else n   # the windowed fp4 quantize takes an even count
    q5, s5 = ref.quantize_fp4(x[:n4], 64)
    bf = x[:n].astype(jnp.bfloat16)
    windowed = {   # name -> (the windowed call of (base, offset), the reference on the slice)
        "quantize_int8": (lambda b, o: window.quantize_int8(b, o, n, 64),
                          lambda: ref.quantize_int8(chunk, 64)),
        "ring_hop_int8": (lambda b, o: window.ring_hop_int8(q3, s3, b, o, 64),
                          lambda: ref.ring_hop_int8(q3, s3, chunk, 64)),
        "ring_hop_int8_last": (lambda b, o: window.ring_hop_int8_last(q3, s3, b, o, 64),
                               lambda: ref.ring_hop_int8_last(q3, s3, chunk, 64)),
        "ring_hop_cast": (lambda b, o: window.ring_hop_cast(bf, b, o),
                          lambda: ref.ring_hop_cast(bf, chunk)),
        "ring_hop_cast_last": (lambda b, o: window.ring_hop_cast_last(bf, b, o),
                               lambda: ref.ring_hop_cast_last(bf, chunk)),
        "quantize_fp4": (lambda b, o: window.quantize_fp4(b, o, n4, 64),
                         lambda: ref.quantize_fp4(chunk[:n4], 64)),
        "ring_hop_fp4": (lambda b, o: window.ring_hop_fp4(q5, s5, b, o, n4, 64),
                         lambda: ref.ring_hop_fp4(q5, s5, chunk[:n4], 64)),
        "ring_hop_fp4_last": (lambda b, o: window.ring_hop_fp4_last(q5, s5, b, o, n4, 64),
                              lambda: ref.ring_hop_fp4_last(q5, s5, chunk[:n4], 64)),
    }
    for name in ext.WINDOW_KERNELS:
      results[f"{name}_at"] = _compare(
          name, windowed.get(name), device,
          lambda case: jax.jit(case[0])(partial, jnp.int32(lo)), lambda case: case[1]())
  return results


def _compare(name: str, call, device, run, reference) -> str:
  """``'ok'`` if ``run(call)`` (on ``device``) equals ``reference(call)``, else the problem."""
  import jax
  import numpy as np
  if call is None:
    return "FAILED: no self-test case in jaxring/_src/tools/doctor.py"
  try:
    with jax.default_device(device):
      got = jax.tree.leaves(run(call))
    want = jax.tree.leaves(reference(call))
    # chunk_norms sums in another order than its reference (a few ulps); the rest are exact.
    rtol = 1e-5 if name == "chunk_norms" else 0.0
    ok = all(np.allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=0,
                         equal_nan=True) for g, w in zip(got, want, strict=True))
    return "ok" if ok else "DIFFERS from its reference"
  except Exception as e:  # noqa: BLE001 -- a report lists every failure, it does not stop
    return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _extension(r: Report, require: set[str], self_test: bool) -> None:
  import jax
  from jaxring._src import ext
  if ext.LOAD_ERROR is not None:
    r.add("extension", "jaxring._ext", "NOT LOADED")
    r.errors.append(f"{ext.LOAD_ERROR}")
    return
  info = ext.build_info()
  r.add("extension", "jaxring._ext", f"built for jaxlib {info['jaxlib_version']}, FFI API "
        f"{'.'.join(map(str, info['ffi_api_version']))}")
  r.add("extension", "CUDA kernels", "built" if ext.CUDA_BUILT else
        "not built (JAXRING_CUDA=auto found no toolkit, or JAXRING_CUDA=off)")
  targets = ext.registered_targets()
  for plat, names in targets.items():
    r.add("extension", f"FFI targets ({plat})", f"{len(names)} registered" if names else "none")
    expected = set(ext.FFI_TARGETS) | (set(ext.WINDOW_TARGETS) if plat == "cpu" else set())
    missing = sorted(expected - set(names))
    if missing and (plat == "cpu" or ext.CUDA_BUILT):
      r.errors.append(f"FFI targets missing for {plat}: {', '.join(missing)}; {ext.REBUILD_HINT}")
  if "cuda" in require and not ext.CUDA_BUILT:
    r.errors.append("--require cuda: the CUDA kernels were not built; rebuild with "
                    "`JAXRING_CUDA=on make install` (needs the CUDA toolkit, see docs/install.md)")
  if not self_test:
    return
  platforms = ["cpu"] + (["gpu"] if ext.CUDA_BUILT and jax.default_backend() == "gpu" else [])
  for plat in platforms:
    t0 = time.perf_counter()
    results = _self_test(plat)
    bad = {k: v for k, v in results.items() if v != "ok"}
    r.add("extension", f"self-test ({plat})",
          f"{len(results) - len(bad)}/{len(results)} kernels match their references "
          f"({time.perf_counter() - t0:.1f} s)")
    for name, problem in bad.items():
      r.errors.append(f"kernel {name} on {plat}: {problem}")


def _mpi(r: Report, require: set[str]) -> None:
  launched = [v for v in _LAUNCHER_VARS if v in os.environ]
  r.add("mpi", "launched by", f"an MPI launcher ({launched[0]} set)" if launched else "no launcher")
  needs = "jaxring's MPI transport needs MPICH, mpi4py and mpi4jax"
  try:
    mpi4py = extras.require("mpi4py", "mpi", needs)
    mpi4py.rc.initialize = False   # reading versions must not start MPI
    mpi4py.rc.finalize = False
    MPI = extras.require("mpi4py.MPI", "mpi", needs)
    r.add("mpi", "MPI library", MPI.Get_library_version().splitlines()[0].strip())
    r.add("mpi", "MPI standard", "%d.%d" % MPI.Get_version())
  except Exception as e:  # noqa: BLE001
    cause = e.__cause__ or e
    r.add("mpi", "MPI library", f"unavailable ({type(cause).__name__}: {cause})")
    if "mpi" in require or launched:
      r.errors.append(f"MPI is unavailable: {e} (see docs/install.md)")
    return
  try:
    mpi4jax = extras.require("mpi4jax", "mpi", needs)
    r.add("mpi", "mpi4jax", f"{mpi4jax.__version__} ("
          f"{'with' if mpi4jax.has_cuda_support() else 'without'} its CUDA bridge)")
  except Exception as e:  # noqa: BLE001
    cause = e.__cause__ or e
    r.add("mpi", "mpi4jax", f"unavailable ({type(cause).__name__}: {cause})")
    if "mpi" in require or launched:
      r.errors.append("mpi4jax is not importable, so the MPI transport (jaxring.distributed."
                      "bind_mpi_axis) cannot run; build it with `make install` (see "
                      f"docs/install.md). Import error: {e}")


def _allocator(r: Report, require: set[str]) -> None:
  libs = allocator.tcmalloc_libraries()
  r.add("allocator", "this process", allocator.allocator_in_use())
  r.add("allocator", "tcmalloc installed", libs[0] if libs else "no")
  # tuned glibc asks for huge pages for the blocks a thread maps afresh (allocator.GLIBC_TUNED)
  r.add("allocator", "transparent huge pages", allocator.transparent_huge_pages() or "unknown")
  if not libs:
    msg = ("tcmalloc is not installed: `jaxring bench` and `jaxring cluster run` tune glibc malloc "
           "instead (GLIBC_TUNABLES, jaxring._src.tools.allocator); for XLA:CPU collectives in "
           f"your own programs export GLIBC_TUNABLES={':'.join(allocator.GLIBC_TUNED)}, or "
           f"{allocator.INSTALL_HINT}")
    (r.errors if "tcmalloc" in require else r.warnings).append(msg)


def _distributed(r: Report) -> None:
  import jax
  from jaxring._src import distributed, topology
  if distributed.is_initialized():
    r.add("distributed", "jax.distributed", f"process {jax.process_index()} of "
          f"{jax.process_count()}")
  else:
    r.add("distributed", "jax.distributed", "not initialized (one process)")
  try:
    topo = topology.default_topology()
    r.add("distributed", "topology", " > ".join(f"{lv.name}={lv.size}" for lv in topo.levels))
  except Exception as e:  # noqa: BLE001
    r.add("distributed", "topology", f"unavailable ({e})")
    r.errors.append(f"the default topology cannot be built: {e}")


def collect(require: set[str] = frozenset(), self_test: bool = True) -> Report:
  """Runs every check.

  Example:
    >>> report = collect(self_test=False)
    >>> any(key == "jaxring" for _, key, _ in report.rows)
    True
  """
  unknown = set(require) - set(REQUIRABLE)
  if unknown:
    raise ValueError(f"unknown requirement(s) {sorted(unknown)}; choose from {REQUIRABLE}")
  r = Report()
  _versions(r)
  _devices(r, set(require))
  _extension(r, set(require), self_test)
  _mpi(r, set(require))
  _allocator(r, set(require))
  _distributed(r)
  return r


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="jaxring doctor", description=__doc__.split("\n\n")[0])
  p.add_argument("--require", default="", help="comma-separated: what must work, an error "
                 f"otherwise ({', '.join(REQUIRABLE)})")
  p.add_argument("--brief", action="store_true", help="skip the kernel self-test; print problems "
                 "only (used after `make install`)")
  args = p.parse_args(argv)
  require = {x.strip() for x in args.require.split(",") if x.strip()}
  try:
    report = collect(require, self_test=not args.brief)
  except ValueError as e:
    p.error(str(e))
  if args.brief:
    lines = [f"ERROR: {m}" for m in report.errors] + [f"warning: {m}" for m in report.warnings]
    print("\n".join(lines) or "jaxring doctor: no problems found")
  else:
    print(report.render())
  return 1 if report.errors else 0


if __name__ == "__main__":
  sys.exit(main())
