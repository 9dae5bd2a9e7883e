"""Is `auto`'s top-k program the plan it chose, and does it time as that plan's row? In the JAX
shape, `bench cluster`'s `auto` top-k rows came out 5-7% above the hierarchical top-k row
(`cluster-20261129-144208.json`), where every other `auto` row matched its plan. This script
reuses the profile calibrated in this cluster (or calibrates), builds `auto` top-k and
hierarchical top-k as `bench cluster` builds them, reports whether their optimized HLO is the
same (instruction for instruction, names aside), and times them side by side: ``ROUNDS`` rounds,
each program once a round in alternating order, a barrier before each call.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 1 --transport jax \\
      --devices-per-proc 2 -- python benchmarks/scripts/auto_vs_plan_topk.py
  jaxring cluster down --name jrq

Process 0 prints the medians and writes ``benchmarks/results/auto-vs-plan-topk-<time>.json``.
"""
import datetime
import json
import os
import pathlib
import re
import statistics
import time

from emulated_jax import jax_shape

ROUNDS = int(os.environ.get("ROUNDS", "150"))
mesh, axes, x, program = jax_shape(32 << 20)

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxring  # noqa: E402
from jaxring._src.calibrate import choices  # noqa: E402

t0 = time.perf_counter()
profile = jaxring.calibrate(mesh, axes, codecs=["none", "bf16", "int8", "topk"])
calibrate_s = time.perf_counter() - t0
pick = choices(profile, [32 << 20], ["topk"])[32 << 20]["topk"]
comp = {"node": jaxring.codecs.parse("topk")}


def reducer(algorithm):
  return jax.jit(jax.shard_map(
      lambda v: jaxring.psum(v, axes, algorithm=algorithm, compression=comp), mesh=mesh,
      in_specs=P(axes), out_specs=P()))


programs = {a: reducer(a) for a in ("auto", "hierarchical")}


def canonical(text):
  """The optimized HLO without names, ids and metadata: what the instructions are."""
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r"%[\w.\-]+", "%v", text)
  return [line.strip() for line in text.splitlines() if line.strip()]


hlo = {a: canonical(f.lower(x).compile().as_text()) for a, f in programs.items()}
same = hlo["auto"] == hlo["hierarchical"]
diff = [(a, b) for a, b in zip(hlo["auto"], hlo["hierarchical"]) if a != b][:8]
calls = {a: (lambda f=f: jax.block_until_ready(f(x))) for a, f in programs.items()}
for call in calls.values():
  for _ in range(3):
    call()
times = {a: [] for a in calls}
for r in range(ROUNDS):
  for a in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
    jaxring.distributed.barrier(f"r{r}-{a}", timeout_s=120)
    t = time.perf_counter()
    calls[a]()
    times[a].append(time.perf_counter() - t)
if jax.process_index() == 0:
  med = {a: statistics.median(t) for a, t in times.items()}
  print(f"auto chose {pick}; calibrated in {calibrate_s:.1f} s; optimized HLO the same: {same} "
        f"({len(hlo['auto'])} and {len(hlo['hierarchical'])} lines)")
  for a, b in diff:
    print("  auto:", a[:160], "\n  hier:", b[:160])
  for a, m in med.items():
    q = statistics.quantiles(times[a], n=4)
    print(f"{a:>12} top-k: median {m * 1e3:.2f} ms, quartiles {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}")
  print(f"auto / hierarchical: {med['auto'] / med['hierarchical']:.3f}")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out = pathlib.Path(__file__).resolve().parents[1] / "results" / f"auto-vs-plan-topk-{stamp}.json"
  out.write_text(json.dumps({"pick": str(pick), "hlo_same": same, "hlo_lines": {
      a: len(h) for a, h in hlo.items()}, "diff": diff, "seconds": times, "medians": med,
      "calibrate_s": calibrate_s, "jax": jax.__version__}, indent=1))
  print("wrote", out)
