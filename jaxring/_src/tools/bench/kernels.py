"""Benchmark of the FFI kernels: GB/s (bytes read + written) beside a memory copy (``np.copyto`` on a
CPU, a device-to-device copy on a GPU).

Run ``jaxring bench kernels`` (which preloads tcmalloc when it is installed) or ``python -m
jaxring._src.tools.bench.kernels``. For each size the memory copy (``np.copyto``: n bytes read and n
written) and each kernel are called in rotation, medians of ``--repeats`` calls after warm-up, so
that both see the same noise on a shared machine and their ratio is meaningful. The XLA column times
the kernel's pure-jnp reference, jitted, for comparison. XLA:CPU allocates every output buffer
afresh, so the allocator matters: it is printed, and ``--glibc-heap`` stops glibc from mmap-ing (and
page-faulting in) each large buffer. Above glibc's x86_non_temporal_threshold (192 MiB on the
development machine) np.copyto switches to non-temporal stores and runs ~1.5x faster, while the
kernels always use cached stores (their output is read again soon): compare ratios at 64 MiB.
Results go to ``benchmarks/results/kernels.json``.

Example:
    jaxring bench kernels --sizes 1 16 64 --repeats 7
    JAXRING_NO_TCMALLOC=1 python -m jaxring._src.tools.bench.kernels --glibc-heap
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from typing import Callable, NamedTuple

import numpy as np

from jaxring._src.tools.bench import common

MiB = 1 << 20
INT8_BLOCK = 256
FP4_BLOCK = 64   # each codec's default block
CHUNK = 4096  # f32 elements per top-k chunk (16 KiB)
TOPK_FRACTION = 0.1


class Case(NamedTuple):
  name: str
  run: Callable[[], object]  # one call, blocks until done
  reference: Callable[[], object] | None  # the jnp reference, jitted
  bytes: int  # bytes read + written by one call


def use_glibc_heap_for_large_buffers() -> None:
  """Keeps glibc from mmap-ing (and page-faulting in) every large output buffer afresh."""
  libc = ctypes.CDLL(None)
  m_trim_threshold, m_mmap_threshold = -1, -3
  libc.mallopt(m_mmap_threshold, 1 << 30)
  libc.mallopt(m_trim_threshold, 1 << 31)


def _interleaved_times(fns: list[Callable[[], object]], warmup: int, repeats: int,
                       inner: int) -> list[list[float]]:
  """Seconds per call of each function, sampled in rotation so that they share the noise.

  Each sample times ``inner`` back-to-back calls, so that small sizes are not dispatch jitter.
  """
  for fn in fns:
    for _ in range(warmup):
      fn()
  times: list[list[float]] = [[] for _ in fns]
  for _ in range(repeats):
    for fn, ts in zip(fns, times):
      t0 = time.perf_counter()
      for _ in range(inner):
        fn()
      ts.append((time.perf_counter() - t0) / inner)
  return times


def in_one_program(f, launches: int):
  """``f`` run ``launches`` times back to back inside one jitted program, so that a sample's time
  excludes dispatch: each run's inputs pass through an optimization barrier with the previous
  run's output, so XLA neither hoists nor merges the runs, and every run computes all of ``f``.

  Example:
    >>> g = in_one_program(lambda v: v * 2, 3)
    >>> float(g(jnp.ones(4))[0])
    2.0
  """
  import jax
  from jax import lax
  if launches <= 1:
    return jax.jit(f)

  def many(*args):
    def body(_, carry):
      tied, _ = lax.optimization_barrier((args, carry))
      return f(*tied)
    return lax.fori_loop(0, launches - 1, body, f(*args))
  return jax.jit(many)


def _cases(n: int, rng: np.random.Generator, launches: int = 1) -> list[Case]:
  import jax
  import jax.numpy as jnp

  from jaxring._src import ext
  from jaxring._src.ext import reference as ref

  def timed(f, *args, donate=()):
    jf = in_one_program(f, launches) if not donate else jax.jit(f, donate_argnums=donate)
    return lambda: jax.block_until_ready(jf(*args))

  x = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
  xb = x.astype(jnp.bfloat16)
  xh = x.astype(jnp.float16)
  partial = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
  q, s = jax.block_until_ready(ext.quantize_int8(x, INT8_BLOCK))
  nb, sb = s.shape[0], 4 * s.shape[0]
  nc = -(-n // CHUNK)
  k = max(1, int(nc * TOPK_FRACTION))
  idx = jnp.asarray(np.sort(rng.choice(nc - 1 if nc > 1 else 1, k, replace=False)).astype(np.int32))
  packed = jnp.asarray(rng.standard_normal(k * CHUNK, dtype=np.float32))
  del nb

  def scatter_chain(f):
    state = [jnp.array(x)]
    jf = jax.jit(f, donate_argnums=0)

    def run():
      state[0] = jax.block_until_ready(jf(state[0], idx, packed))

    return run

  bs = INT8_BLOCK
  return _blocks_per_warp_cases(timed, xb, xh, bs, 2 * n + n + sb) + _fp4_cases(
      timed, x, xb, partial) + [
      Case("quantize_int8 f32", timed(lambda v: ext.quantize_int8(v, bs), x),
           timed(lambda v: ref.quantize_int8(v, bs), x), 4 * n + n + sb),
      Case("quantize_int8 bf16", timed(lambda v: ext.quantize_int8(v, bs), xb),
           timed(lambda v: ref.quantize_int8(v, bs), xb), 2 * n + n + sb),
      Case("quantize_int8 f16", timed(lambda v: ext.quantize_int8(v, bs), xh),
           timed(lambda v: ref.quantize_int8(v, bs), xh), 2 * n + n + sb),
      Case("quantize_int8 f32 stochastic",
           timed(lambda v: ext.quantize_int8(v, bs, stochastic=True, seed=1), x),
           timed(lambda v: ref.quantize_int8(v, bs, stochastic=True, seed=1), x), 4 * n + n + sb),
      Case("dequantize_int8 ->f32", timed(lambda a, b: ext.dequantize_int8(a, b, bs), q, s),
           timed(lambda a, b: ref.dequantize_int8(a, b, bs), q, s), n + sb + 4 * n),
      Case("dequantize_int8 ->bf16",
           timed(lambda a, b: ext.dequantize_int8(a, b, bs, jnp.bfloat16), q, s),
           timed(lambda a, b: ref.dequantize_int8(a, b, bs, jnp.bfloat16), q, s), n + sb + 2 * n),
      Case("ring_hop_int8", timed(lambda a, b, c: ext.ring_hop_int8(a, b, c, bs), q, s, partial),
           timed(lambda a, b, c: ref.ring_hop_int8(a, b, c, bs), q, s, partial),
           (n + sb + 4 * n) + (4 * n + n + sb)),
      Case("ring_hop_int8_last",
           timed(lambda a, b, c: ext.ring_hop_int8_last(a, b, c, bs), q, s, partial),
           timed(lambda a, b, c: ref.ring_hop_int8_last(a, b, c, bs), q, s, partial),
           n + sb + 4 * n + 4 * n),
      Case("ring_hop_cast bf16", timed(ext.ring_hop_cast, xb, partial),
           timed(ref.ring_hop_cast, xb, partial), (2 * n + 4 * n) + (4 * n + 2 * n)),
      Case("ring_hop_cast f16", timed(ext.ring_hop_cast, xh, partial),
           timed(ref.ring_hop_cast, xh, partial), (2 * n + 4 * n) + (4 * n + 2 * n)),
      Case("chunk_norms", timed(lambda v: ext.chunk_norms(v, CHUNK), x),
           timed(lambda v: ref.chunk_norms(v, CHUNK), x), 4 * n + 4 * nc),
      Case(f"gather_chunks {TOPK_FRACTION:.0%}",
           timed(lambda v, i: ext.gather_chunks(v, i, CHUNK), x, idx),
           timed(lambda v, i: ref.gather_chunks(v, i, CHUNK), x, idx), 2 * 4 * k * CHUNK + 4 * k),
      Case(f"scatter_add_chunks {TOPK_FRACTION:.0%} (donated)",
           scatter_chain(lambda v, i, p: ext.scatter_add_chunks(v, i, p, CHUNK)),
           scatter_chain(lambda v, i, p: ref.scatter_add_chunks(v, i, p, CHUNK)),
           3 * 4 * k * CHUNK + 4 * k),
  ]


def _fp4_cases(timed, x, xb, partial) -> list[Case]:
  """The fp4 codec's kernels, as int8's: half a byte of codes a value, an f32 scale a block."""
  import jax

  from jaxring._src import ext
  from jaxring._src.ext import reference as ref
  n, bs = x.shape[0], FP4_BLOCK
  q, s = jax.block_until_ready(ext.quantize_fp4(x, bs))
  wire = ext.fp4_bytes(n) + 4 * s.shape[0]   # codes + scales
  return [
      Case("quantize_fp4 f32", timed(lambda v: ext.quantize_fp4(v, bs), x),
           timed(lambda v: ref.quantize_fp4(v, bs), x), 4 * n + wire),
      Case("quantize_fp4 bf16", timed(lambda v: ext.quantize_fp4(v, bs), xb),
           timed(lambda v: ref.quantize_fp4(v, bs), xb), 2 * n + wire),
      Case("quantize_fp4 f32 stochastic",
           timed(lambda v: ext.quantize_fp4(v, bs, stochastic=True, seed=1), x),
           timed(lambda v: ref.quantize_fp4(v, bs, stochastic=True, seed=1), x), 4 * n + wire),
      Case("dequantize_fp4 ->f32", timed(lambda a, b: ext.dequantize_fp4(a, b, bs), q, s),
           timed(lambda a, b: ref.dequantize_fp4(a, b, bs), q, s), wire + 4 * n),
      Case("ring_hop_fp4", timed(lambda a, b, c: ext.ring_hop_fp4(a, b, c, bs), q, s, partial),
           timed(lambda a, b, c: ref.ring_hop_fp4(a, b, c, bs), q, s, partial),
           (wire + 4 * n) + (4 * n + wire)),
      Case("ring_hop_fp4_last",
           timed(lambda a, b, c: ext.ring_hop_fp4_last(a, b, c, bs), q, s, partial),
           timed(lambda a, b, c: ref.ring_hop_fp4_last(a, b, c, bs), q, s, partial),
           wire + 4 * n + 4 * n),
  ]


#: The CUDA quantize kernel's setting timed beside its default on a GPU (xla_ext/cuda_handlers.cu).
BLOCKS_ENV = "JAXRING_CUDA_QUANTIZE_BLOCKS"
VARIANT = "blocks a warp"   # in a variant row's name; save_choice leaves those rows out


def _blocks_per_warp_cases(timed, xb, xh, bs: int, nbytes: int) -> list[Case]:
  """On a GPU, bf16/f16 quantize with each warp loading 2 and 4 quantization blocks before it
  reduces (``JAXRING_CUDA_QUANTIZE_BLOCKS``, read at each launch, set around each call)."""
  import jax

  from jaxring._src import ext
  from jaxring._src.ext import reference as ref
  if jax.default_backend() != "gpu":
    return []

  def setting(call, value: str):
    def run():
      before = os.environ.get(BLOCKS_ENV)
      os.environ[BLOCKS_ENV] = value
      try:
        return call()
      finally:
        if before is None:
          os.environ.pop(BLOCKS_ENV)
        else:
          os.environ[BLOCKS_ENV] = before
    return run
  return [Case(f"quantize_int8 {name}, {u} {VARIANT}",
               setting(timed(lambda v: ext.quantize_int8(v, bs), x), u),
               timed(lambda v: ref.quantize_int8(v, bs), x), nbytes)
          for name, x in (("bf16", xb), ("f16", xh)) for u in ("2", "4")]


def _copy_baseline(src: np.ndarray, launches: int = 1) -> Callable[[], object]:
  """The copy the kernels are measured against, on their own memory: ``np.copyto`` on a CPU; on an
  accelerator a device-to-device pass over the same bytes (``-x``: n read, n written, which XLA
  cannot elide like a plain copy), ``launches`` of them in one program like the kernels.
  """
  import jax
  if jax.default_backend() == "cpu" and launches <= 1:
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)
  x = jax.device_put(src)
  copy = in_one_program(lambda v: -v, launches)
  return lambda: jax.block_until_ready(copy(x))


def save_choice(rows: list[dict], platform: str) -> str:
  """Writes, per kernel and measured size, whether the codecs should run the jnp reference on
  ``platform``: where every measured variant of the kernel at that size ran more than 5% slower
  than the reference. A kernel slower at every size runs its reference everywhere; one slower at
  some sizes only runs it at the calls nearest those sizes (``codecs.kernels``)."""
  import json

  from jaxring._src.codecs import kernels as codec_kernels
  from jaxring._src.ext import FFI_KERNELS
  slower: dict[str, dict[int, list[bool]]] = {}
  for r in rows:
    name = r["kernel"].split()[0]
    if name in FFI_KERNELS and r["xla_reference_gbps"] and VARIANT not in r["kernel"]:
      elements = int(r["size_mib"] * MiB) // 4   # the case's element count (f32 input size)
      slower.setdefault(name, {}).setdefault(elements, []).append(
          r["xla_reference_gbps"] > 1.05 * r["gbps"])
  by_size = {n: sorted((e, all(v)) for e, v in sizes.items()) for n, sizes in slower.items()}
  use = sorted(n for n, s in by_size.items() if all(ref for _, ref in s))
  mixed = {n: s for n, s in by_size.items() if n not in use and any(ref for _, ref in s)}
  path = codec_kernels.choice_path(platform)
  os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump({"platform": platform, "use_reference": use, "reference_by_size": mixed,
               "measured": by_size}, f, indent=1)
  some = "".join(f"; {n} at {[e for e, ref in s if ref]} elements" for n, s in mixed.items())
  return (f"kernel choice for {platform}: references for {use or 'none'}{some}; wrote {path}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="jaxring bench kernels", description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64, 256],
                 help="f32 input sizes in MiB (default: 1 4 16 64 256)")
  p.add_argument("--repeats", type=int, default=11, help="timed samples per case (median)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--kernels", nargs="*", default=None, help="only cases whose name contains one")
  p.add_argument("--no-reference", action="store_true", help="skip the XLA (jnp) column")
  p.add_argument("--cpu-threads", type=int, default=None,
                 help="split buffers over this many threads (JAXRING_CPU_THREADS, default 1)")
  p.add_argument("--glibc-heap", action="store_true",
                 help="mallopt: serve large buffers from the glibc heap instead of fresh mmaps")
  p.add_argument("--launches", type=int, default=None,
                 help="kernel runs per timed call, in one jitted program so that dispatch is "
                 "excluded (default 1 on a CPU, 50 on an accelerator)")
  p.add_argument("--save-choice", action="store_true",
                 help="record, for this platform and each measured size, the kernels whose jnp "
                 "reference ran faster (by more than 5%%): the codecs use those references "
                 "there, at the calls whose size is nearest")
  p.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/results)")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  """Runs the kernel benchmark, prints the table and writes the JSON; returns the exit code."""
  args = _parse(argv)
  if args.cpu_threads is not None:
    os.environ["JAXRING_CPU_THREADS"] = str(args.cpu_threads)
  alloc = common.allocator()
  if args.glibc_heap and alloc == "glibc malloc":
    use_glibc_heap_for_large_buffers()
    alloc += " (mallopt: no mmap below 1 GiB, no trim)"

  import jax

  launches = args.launches or (1 if jax.default_backend() == "cpu" else 50)
  threads = os.environ.get("JAXRING_CPU_THREADS", "1 (default)")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}); allocator: {alloc}; "
        f"kernel threads: {threads}")
  rows = []
  rng = np.random.default_rng(0)
  header = f"{'kernel':36s} {'MiB':>6s} {'GB/s':>7s} {'memcpy':>7s} {'ratio':>6s} {'XLA GB/s':>9s}"
  copy_name = ("np.copyto" if jax.default_backend() == "cpu" and launches <= 1
               else f"-x on the device, {launches} per program")
  print(f"GB/s = (bytes read + bytes written) / median time; memcpy = {copy_name} timed in rotation "
        "with the kernel; ratio = median over rotations of kernel GB/s / memcpy GB/s; "
        "XLA = the kernel's jnp reference, jitted")
  print(header)
  print("-" * len(header))
  for mib in args.sizes:
    n = int(mib * MiB) // 4
    src = np.asarray(rng.standard_normal(n, dtype=np.float32))
    memcpy = _copy_baseline(src, launches)

    for case in _cases(n, rng, launches):
      if args.kernels and not any(k in case.name for k in args.kernels):
        continue
      fns = [memcpy, case.run]
      if not args.no_reference and case.reference is not None:
        fns.append(case.reference)
      inner = max(1, 16 * MiB // src.nbytes)
      times = _interleaved_times(fns, args.warmup, args.repeats, inner)
      per = launches if "donated" not in case.name else 1
      times = [times[0]] + [[t / per for t in ts] for ts in times[1:]]
      times[0] = [t / launches for t in times[0]] if copy_name != "np.copyto" else times[0]
      copy_gbps = 2 * src.nbytes / statistics.median(times[0]) / 1e9
      gbps = case.bytes / statistics.median(times[1]) / 1e9
      # The ratio is the median of per-rotation ratios: both sides of each saw the same load.
      ratio = statistics.median(c / k * case.bytes / (2 * src.nbytes)
                                for c, k in zip(times[0], times[1]))
      ref_gbps = case.bytes / statistics.median(times[2]) / 1e9 if len(times) > 2 else None
      ref_text = f"{ref_gbps:9.2f}" if ref_gbps is not None else f"{'-':>9s}"
      print(f"{case.name:36s} {mib:6g} {gbps:7.2f} {copy_gbps:7.2f} {ratio:6.2f} {ref_text}",
            flush=True)
      rows.append({"kernel": case.name, "size_mib": mib, "bytes": case.bytes,
                   "median_s": statistics.median(times[1]), "gbps": gbps,
                   "memcpy_gbps": copy_gbps, "ratio_to_memcpy": ratio,
                   "xla_reference_gbps": ref_gbps})
  if args.save_choice:
    print(save_choice(rows, jax.default_backend()))
  meta = {**common.machine(), "allocator": alloc, "copy_baseline": copy_name,
          "launches_per_call": launches, "kernel_threads": threads,
          "repeats": args.repeats, "warmup": args.warmup,
          "argv": list(sys.argv[1:] if argv is None else argv)}
  print(f"wrote {common.write_json('kernels', {'meta': meta, 'results': rows}, args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
