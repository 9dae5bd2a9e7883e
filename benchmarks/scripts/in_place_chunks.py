"""The ring reading its local chunks in place against the same programs slicing them first
(docs/benchmarks.md, "The ring's chunks read in place"): the JAX shape's hierarchical all-reduce
per codec, traced once with the codecs' windowed kernels (jaxring._src.ext.window, as shipped)
and once with them turned off (each chunk sliced, which XLA copies before the custom call),
checked bit for bit against each other, timed side by side with gloo's ``lax.psum`` (every
contender once a round, each round in the other order, a barrier before each call), with each
process's CPU time per call.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 1 --transport jax \\
      --devices-per-proc 2 -- env CODECS=int8,bf16 ROUNDS=30 python \\
      benchmarks/scripts/in_place_chunks.py

Process 0 prints the table and writes ``benchmarks/results/in-place-chunks-<time>.json``.
"""
import datetime
import json
import os
import pathlib
import statistics
import time

import numpy as np

import jaxring.distributed

jaxring.distributed.initialize()

import jax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxring  # noqa: E402
from jaxring._src.codecs import kernels as codec_kernels  # noqa: E402

me = jax.process_index()
mesh = jaxring.distributed.process_mesh()
axes = ("node", "local")
MIB = int(os.environ.get("MIB", "32"))
ROUNDS = int(os.environ.get("ROUNDS", "30"))
CODECS = os.environ.get("CODECS", "int8,bf16").split(",")
n = MIB * (1 << 20) // 4
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P(axes)),
    np.random.default_rng(me).standard_normal((mesh.shape["local"], n), dtype=np.float32))


def program(body):
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))


def hierarchical(codec):
  comp = {"node": jaxring.codecs.parse(codec)}
  return program(lambda v: jaxring.psum(v, axes, algorithm="hierarchical", compression=comp))


def shards(out):
  return [np.asarray(s.data) for s in out.addressable_shards]


cases = {"gloo lax.psum": program(lambda v: lax.psum(v, axes))}
shipped = codec_kernels.in_place
for codec in CODECS:
  codec_kernels.in_place = lambda *a, **k: None    # every chunk sliced, as before
  sliced = hierarchical(codec)
  before = shards(sliced(x))
  codec_kernels.in_place = shipped
  in_place = hierarchical(codec)
  assert all((a == b).all() for a, b in zip(before, shards(in_place(x)))), codec
  cases[f"hierarchical {codec}, chunks sliced"] = sliced
  cases[f"hierarchical {codec}, chunks in place"] = in_place
for f in cases.values():
  for _ in range(2):
    jax.block_until_ready(f(x))

times = {k: [] for k in cases}
cpu = {k: [] for k in cases}
for r in range(ROUNDS):
  for k, f in (list(cases.items()) if r % 2 else list(cases.items())[::-1]):
    jaxring.distributed.barrier(f"in-place-{r}-{k}", timeout_s=300)
    c0, t0 = os.times(), time.perf_counter()
    jax.block_until_ready(f(x))
    times[k].append(time.perf_counter() - t0)
    c1 = os.times()
    cpu[k].append((c1.user - c0.user) + (c1.system - c0.system))

if me == 0:
  gloo = statistics.median(times["gloo lax.psum"])
  rows = []
  for k in cases:
    q1, med, q3 = np.percentile(times[k], [25, 50, 75])
    rows.append(dict(contender=k, median_ms=med * 1e3, q1_ms=q1 * 1e3, q3_ms=q3 * 1e3,
                     cpu_ms_per_call=float(np.mean(cpu[k])) * 1e3, vs_gloo=med / gloo))
    print(f"{k:>40}: {med * 1e3:7.1f} ms (quartiles {q1 * 1e3:.1f}-{q3 * 1e3:.1f})  "
          f"{med / gloo:.3f} x gloo  CPU {np.mean(cpu[k]) * 1e3:6.1f} ms a call (process 0)")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = pathlib.Path(__file__).resolve().parents[1] / "results" / f"in-place-chunks-{stamp}.json"
  out.write_text(json.dumps(dict(
      bench="in_place_chunks", mib=MIB, rounds=ROUNDS, processes=jax.process_count(),
      devices_per_process=mesh.shape["local"], jax=jax.__version__,
      allocator=os.environ.get("LD_PRELOAD") or os.environ.get("GLIBC_TUNABLES", "glibc"),
      rows=rows), indent=1))
  print("wrote", out)
