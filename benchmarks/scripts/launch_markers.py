"""What the stuck-peer check's launch markers cost a jaxring collective in the JAX shape (one
process per node, ``jax.distributed``): the hierarchical all-reduce of ``NB`` bytes per device
(default 1 MiB) traced while the watchdog marks launches, the same traced after
``launches.enable(0)`` (no marker), and gloo's ``lax.psum`` beside them. Each round calls the three
in alternating order, a barrier before each call; process 0 prints medians and quartiles and
writes ``benchmarks/results/launch-markers-<time>.json``.

  sudo jaxring cluster up --name jrq --nodes 4
  sudo jaxring cluster run --name jrq --nodes 4 --procs-per-node 1 --transport jax \\
      --devices-per-proc 2 -- python benchmarks/scripts/launch_markers.py
  sudo jaxring cluster down --name jrq
"""
import datetime
import json
import os
import pathlib
import time

import jax
import numpy as np

import jaxring
from emulated_jax import jax_shape
from jaxring._src.transport import launches

NB = int(os.environ.get("NB", str(1 << 20)))
ROUNDS = int(os.environ.get("ROUNDS", "40"))
mesh, axes, x, program = jax_shape(NB)
me = jax.process_index()

marked = launches.enabled()
progs = {"hierarchical, marked": program(
    lambda v: jaxring.psum(v, axes, algorithm="hierarchical"))}
jax.block_until_ready(progs["hierarchical, marked"](x))   # traced now, with the marker
launches.enable(0)
progs["hierarchical, no marker"] = program(
    lambda v: jaxring.psum(v, axes, algorithm="hierarchical"))
progs["gloo lax.psum"] = program(lambda v: jax.lax.psum(v, axes))
names = list(progs)
for f in progs.values():
  jax.block_until_ready(f(x))
  jax.block_until_ready(f(x))
times = {k: [] for k in names}
for r in range(ROUNDS):
  for k in (names if r % 2 else names[::-1]):
    jaxring.distributed.barrier(f"{r}-{k}", timeout_s=300)
    t = time.perf_counter()
    jax.block_until_ready(progs[k](x))
    times[k].append(time.perf_counter() - t)
if me == 0:
  rows = []
  print(f"{jax.process_count()} processes x {mesh.shape['local']} devices, {NB} bytes per "
        f"device, {ROUNDS} rounds; markers were {'on' if marked else 'off'} for the first program")
  for k in names:
    q1, med, q3 = np.percentile(times[k], [25, 50, 75])
    rows.append(dict(program=k, median_ms=med * 1e3, q1_ms=q1 * 1e3, q3_ms=q3 * 1e3))
    print(f"{k:>26}: {med * 1e3:7.2f} ms ({q1 * 1e3:.2f}-{q3 * 1e3:.2f})", flush=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = pathlib.Path(__file__).resolve().parents[1] / "results" / f"launch-markers-{stamp}.json"
  out.write_text(json.dumps(dict(
      bench="launch_markers", nbytes=NB, rounds=ROUNDS, processes=jax.process_count(),
      markers=marked, allocator=os.environ.get("LD_PRELOAD", "glibc"), jax=jax.__version__,
      rows=rows), indent=1))
  print("wrote", out)
jaxring.distributed.barrier("end", timeout_s=300)
