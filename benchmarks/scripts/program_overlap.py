"""Whether XLA:CPU runs a second program beside one already running (an outer sync as its own
program, the inner steps going on): times a compute-heavy program A on the 8 devices, then A
followed at once by a tiny program B on the same devices, on A's devices' other half, and the same
with single-device programs.

  .venv/bin/python benchmarks/scripts/program_overlap.py
"""
import os
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def heavy(x):
  return jax.lax.fori_loop(0, 200, lambda i, v: jnp.tanh(v @ v.T * 0.01), x)


def program(f, devices):
  mesh = Mesh(np.array(devices), ("d",))
  x = jax.device_put(jnp.ones((len(devices) * 256, 256)), NamedSharding(mesh, P("d")))
  fn = jax.jit(shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  fn(x).block_until_ready()
  return fn, x


def race(a, b, label):
  (fa, xa), (fb, xb) = a, b
  t = time.perf_counter()
  ra = fa(xa)
  rb = fb(xb)
  dispatched = time.perf_counter() - t
  rb.block_until_ready()
  b_done = time.perf_counter() - t
  ra.block_until_ready()
  print(f"{label}: B dispatched after {dispatched:.3f} s, done at {b_done:.3f} s, "
        f"A done at {time.perf_counter() - t:.3f} s")


dev = jax.devices()
A8 = program(heavy, dev)
t = time.perf_counter()
A8[0](A8[1]).block_until_ready()
print(f"A alone on 8 devices: {time.perf_counter() - t:.3f} s")
race(A8, program(lambda x: x * 2, dev), "same 8 devices")
race(program(heavy, dev[:4]), program(lambda x: x * 2, dev[4:]), "A on 4 devices, B on the others")
race(program(heavy, dev[:1]), program(lambda x: x * 2, dev[1:2]), "single devices, B on another")
race(program(heavy, dev[:1]), program(lambda x: x * 2, dev[:1]), "single devices, B on A's")
