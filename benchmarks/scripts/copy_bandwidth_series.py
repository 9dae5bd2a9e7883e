"""The machine's memory bandwidth over time: every 2 s, the best of 5 copies of 256 MiB
(``np.copyto``), printed as GB/s (bytes read plus written) with the time, for ``argv[1]`` seconds
(default 60). Run two at once to load both cores of the 2-core VM:

  python benchmarks/scripts/copy_bandwidth_series.py 60 &
  python benchmarks/scripts/copy_bandwidth_series.py 60
"""
import sys
import time

import numpy as np

a = np.ones(64 << 20, np.float32)
b = np.empty_like(a)
t_end = time.time() + (float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
while time.time() < t_end:
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    np.copyto(b, a)
    best = min(best, time.perf_counter() - t)
  print(time.strftime("%H:%M:%S"), f"{2 * a.nbytes / best / 1e9:.1f} GB/s", flush=True)
  time.sleep(2)
