"""In what order XLA:CPU runs side-effecting custom calls that no data orders, and what orders
them: the question behind taking mpi4jax's ordered effect off jaxring's MPI programs (the
effect sends every such program through JAX's Python dispatch; docs/benchmarks.md, "What the
effects cost, measured").

One process, no MPI. Each program holds ``K`` host callbacks (custom calls with a side effect)
that sleep 50 ms and log when they ran, each on its own 4 MiB input:

- ``pure_callback``, nothing ordering them (no JAX effect: the program takes the C++ dispatch);
- ``pure_callback``, each callback's input passed through ``lax.optimization_barrier`` with the
  previous callback's output (the "chain by data" a library could add without an effect);
- ``io_callback(ordered=True)`` (an ordered JAX effect: JAX threads a token through them).

It prints, for ``ROUNDS`` runs of each program, how many runs had two callbacks overlapping in
time and the orders in which they started::

  python benchmarks/scripts/custom_call_order.py
"""
import os
import threading
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback

K = 6
ROUNDS = int(os.environ.get("ROUNDS", "5"))
N = 1 << 20
log = []


def sleeper(tag):
  def run(x):
    start = time.perf_counter()
    time.sleep(0.05)
    log.append((tag, start, time.perf_counter(), threading.get_ident()))
    return x
  return run


def program(kind):
  def fn(*xs):
    outs, prev = [], None
    for i, x in enumerate(xs):
      x = jnp.sin(x) * (i + 1)
      if kind == "barrier" and prev is not None:
        prev, x = lax.optimization_barrier((prev, x))
      shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
      if kind == "ordered":
        y = io_callback(sleeper(str(i)), shape, x, ordered=True)
      else:
        y = jax.pure_callback(sleeper(str(i)), shape, x)
      outs.append(jnp.cos(y))
      prev = y
    return outs
  return jax.jit(fn)


def main():
  xs = [jnp.full(N, float(i)) for i in range(K)]
  print(f"{K} side-effecting callbacks of 50 ms a program, {ROUNDS} runs each, "
        f"jax {jax.__version__}")
  print(f"{'what orders them':<44} {'runs with overlap':>18} {'threads':>8}  start orders")
  for kind, label in (("none", "nothing (pure_callback)"),
                      ("barrier", "optimization_barrier chain (pure_callback)"),
                      ("ordered", "ordered effect's token (io_callback)")):
    f = program(kind)
    jax.block_until_ready(f(*xs))
    overlapped, orders, threads = 0, set(), set()
    for _ in range(ROUNDS):
      log.clear()
      jax.block_until_ready(f(*xs))
      runs = sorted(log, key=lambda r: r[1])
      orders.add("".join(r[0] for r in runs))
      threads |= {r[3] for r in runs}
      overlapped += any(b[1] < a[2] for a, b in zip(runs, runs[1:]))
    print(f"{label:<44} {overlapped:>10} of {ROUNDS:<5} {len(threads):>8}  "
          f"{' '.join(sorted(orders))}")


if __name__ == "__main__":
  main()
