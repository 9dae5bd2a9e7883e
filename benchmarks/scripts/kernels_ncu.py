"""Nsight Compute times of the int8 kernels and of XLA's fusion of their jnp reference, on one GPU.

Each case runs in its own process under ``ncu --clock-control none`` (the clocks as the card runs
them), twice: the first run compiles and warms up, the kernels of the second are reported, with
their time (``gpu__time_duration.sum``) and DRAM throughput as a share of the card's peak
(``dram__throughput.avg.pct_of_peak_sustained_elapsed``). Inputs are made with NumPy and copied to
the device, so that no other kernel runs in the process.

  python benchmarks/scripts/kernels_ncu.py --out ncu.json            # every case, 64 M elements
  python benchmarks/scripts/kernels_ncu.py --only dequantize_int8_f32 dequantize_int8_bf16
  python benchmarks/scripts/kernels_ncu.py --case ring_hop_int8 --impl ext   # one, for ncu
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys

BLOCK = 256
AUTOTUNER = ("stream_executor", "void stream_executor")
METRICS = ("gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,"
           "dram__bytes.sum")


def _case(name: str, impl: str, n: int):
  import ml_dtypes
  import numpy as np

  from jaxring._src import ext
  from jaxring._src.ext import reference as ref
  k = ext if impl == "ext" else ref
  rng = np.random.default_rng(0)
  x = rng.standard_normal(n, dtype=np.float32)
  q = rng.integers(-127, 128, n, dtype=np.int8)
  s = rng.uniform(0.01, 1.0, -(-n // BLOCK)).astype(np.float32)
  bf = x.astype(ml_dtypes.bfloat16)
  return {
      "quantize_int8_f32": (lambda v: k.quantize_int8(v, BLOCK), (x,)),
      "quantize_int8_bf16": (lambda v: k.quantize_int8(v, BLOCK), (bf,)),
      "quantize_int8_f32_stochastic":
          (lambda v: k.quantize_int8(v, BLOCK, stochastic=True, seed=1), (x,)),
      "dequantize_int8_f32": (lambda a, b: k.dequantize_int8(a, b, BLOCK), (q, s)),
      "dequantize_int8_bf16":
          (lambda a, b: k.dequantize_int8(a, b, BLOCK, ml_dtypes.bfloat16), (q, s)),
      "ring_hop_int8": (lambda a, b, c: k.ring_hop_int8(a, b, c, BLOCK), (q, s, x)),
      "ring_hop_int8_last": (lambda a, b, c: k.ring_hop_int8_last(a, b, c, BLOCK), (q, s, x)),
      "ring_hop_cast_bf16": (k.ring_hop_cast, (bf, x)),
  }[name]


CASES = ["quantize_int8_f32", "quantize_int8_bf16", "quantize_int8_f32_stochastic",
         "dequantize_int8_f32", "dequantize_int8_bf16", "ring_hop_int8", "ring_hop_int8_last", "ring_hop_cast_bf16"]


def run_one(name: str, impl: str, n: int) -> None:
  import jax
  f, args = _case(name, impl, n)
  args = [jax.device_put(a) for a in args]
  jf = jax.jit(f)
  for _ in range(2):
    jax.block_until_ready(jf(*args))


def last_run(rows: list[dict]) -> list[dict]:
  """The kernels of the second of two identical runs: the shortest tail that repeats just before.

  XLA's autotuner launches kernels of its own while it compiles (some are named after the fusion
  it tunes), so halving the list is wrong; both runs execute the same compiled thunks, in order.
  """
  names = [r["kernel"] for r in rows]
  for k in range(1, len(names) // 2 + 1):
    if names[-k:] == names[-2 * k:-k]:
      return rows[-k:]
  raise RuntimeError(f"no repeated run among the profiled kernels: {names}")


def profile(name: str, impl: str, n: int, ncu: str) -> dict:
  cmd = [ncu, "--clock-control", "none", "--metrics", METRICS, "--csv", sys.executable,
         __file__, "--case", name, "--impl", impl, "--elements", str(n)]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  text = p.stdout[p.stdout.find('"ID"'):] if '"ID"' in p.stdout else ""
  kernels: dict[str, dict] = {}
  for row in csv.DictReader(io.StringIO(text)):
    k = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"][:80]})
    k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
  timed = last_run([r for r in kernels.values() if not r["kernel"].startswith(AUTOTUNER)])
  ns = sum(r.get("gpu__time_duration.sum", 0.0) for r in timed)
  dram = sum(r.get("dram__bytes.sum", 0.0) for r in timed)
  pct = (sum(r.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", 0.0)
             * r.get("gpu__time_duration.sum", 0.0) for r in timed) / ns) if ns else None
  return {"case": name, "impl": impl, "elements": n, "time_us": ns / 1e3, "dram_bytes": dram,
          "dram_pct_of_peak": pct, "kernels": timed, "returncode": p.returncode,
          "stderr_tail": p.stderr[-500:] if p.returncode else ""}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--case", choices=CASES)
  ap.add_argument("--impl", choices=["ext", "ref"])
  ap.add_argument("--elements", type=int, default=64 << 20)
  ap.add_argument("--ncu", default="ncu")
  ap.add_argument("--out", default=None)
  ap.add_argument("--only", nargs="+", choices=CASES, default=CASES, help="cases to profile")
  args = ap.parse_args()
  if args.case:
    run_one(args.case, args.impl, args.elements)
    return 0
  results = []
  print(f"{'case':30s} {'jaxring us':>11s} {'% peak':>7s} {'XLA us':>8s} {'% peak':>7s} {'ratio':>6s}")
  for name in args.only:
    e, r = (profile(name, impl, args.elements, args.ncu) for impl in ("ext", "ref"))
    results += [e, r]
    ratio = e["time_us"] / r["time_us"] if r["time_us"] else float("nan")
    print(f"{name:30s} {e['time_us']:11.1f} {e['dram_pct_of_peak'] or 0:7.1f} "
          f"{r['time_us']:8.1f} {r['dram_pct_of_peak'] or 0:7.1f} {ratio:6.2f}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
