"""What ranking top-k chunks costs on one CPU device: ``TopKChunks.select`` by the summed norms
(the FFI norms kernel) against by random projections (momentum correction's ranking), on a
25 M-value buffer computed in the same program, as an optimizer's buffer is (docs/benchmarks.md,
"Convergence with compression"). Median of 7 calls, ms.

  python benchmarks/scripts/topk_ranking_cost.py
"""
import statistics
import time

import jax
import jax.numpy as jnp

from jaxring import codecs
from jaxring._src.optim.sparse import selection_key

N = 25_000_000


def median_ms(f, *args) -> float:
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(7):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


x = jax.random.normal(jax.random.key(0), (N,), jnp.float32)
y = jax.random.normal(jax.random.key(1), (N,), jnp.float32)
print(f"{'chunk':>6} {'norms ms':>9} {'projections ms':>15}")
for cs in (16, 4096):
  codec = codecs.topk_chunks(0.01, cs)
  norms = median_ms(lambda a, b: codec.select(a + 0.9 * b, lambda v: v), x, y)
  proj = median_ms(lambda a, b: codec.select(a + 0.9 * b, lambda v: v, None, selection_key(3)),
                   x, y)
  print(f"{cs:>6} {norms:>9.1f} {proj:>15.1f}")
