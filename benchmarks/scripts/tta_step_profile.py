"""Steps of `bench tta`'s contenders timed one by one, and where node 0's time goes
(docs/benchmarks.md, "Where top-k does not pay"; docs/simulations.md, "Training steps").

Each contender (NAMES, comma-separated; default the top-k and int8 ones) on `resnet_gn`, 16
images per device: 40 steps timed with one in flight, the computation alone beside them
(`common.ComputeShare`), then 10 steps under `jax.profiler` on every node; node 0 prints the
total time per step of each collective kind (all-reduce, ppermute, all-gather, custom call) and
the longest collectives, per device thread.

  sudo jaxring cluster up --name jrp --nodes 4 --link 10mbit      # or 1gbit
  sudo jaxring cluster run --name jrp --devices-per-proc 2 -- \\
      python benchmarks/scripts/tta_step_profile.py
  sudo jaxring cluster down --name jrp
"""
import collections
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jaxring.distributed

jaxring.distributed.initialize()
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxring.train as jt  # noqa: E402
from jaxring._src.data.hard_shapes import hard_shapes  # noqa: E402
from jaxring._src.tools.bench import common, tta  # noqa: E402
from jaxring._src.tools.bench.models import MODELS  # noqa: E402

KINDS = (("all-reduce", ("all-reduce", "psum")), ("ppermute", ("permute",)),
         ("all-gather", ("all-gather",)), ("custom call", ("ffi_call", "custom-call")))


def summary(trace_dir: str, steps: int) -> None:
  events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True)[0]))
  events = events["traceEvents"]
  names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "thread_name"}
  for thread in sorted(k for k, v in names.items() if "Eigen" in v):
    ops = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) == thread
           and not e["name"].startswith("end:") and e["name"] != "ThunkExecutor::Execute"]
    per = collections.Counter()
    coll = []
    for e in ops:
      kind = next((k for k, keys in KINDS if any(s in e["name"] for s in keys)), "computation")
      per[kind] += e["dur"] / 1e3 / steps
      if kind != "computation":
        coll.append((e["name"], round(e["dur"] / 1e3, 1)))
    print(f"  thread {names[thread]}: ms per step "
          + ", ".join(f"{k} {v:.1f}" for k, v in per.most_common()), flush=True)
    print(f"    longest collectives: {sorted(coll, key=lambda c: -c[1])[:10]}", flush=True)


me = jax.process_index()
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
members = [i for i, d in enumerate(devices) if d.process_index == me]
xtr, ytr, _, _ = hard_shapes()
batch_of = tta.Batches(xtr, ytr, len(devices), 16, members, NamedSharding(mesh, P("data")))
params = MODELS["resnet_gn"][0](jax.random.key(0))
steps_of = tta.contenders(mesh, 0.05, 1 << 20, 16, "resnet_gn", "cosine", 3000)
args = type("Args", (), {"compute_steps": 10, "model": "resnet_gn"})
compute = tta.compute_share(params, batch_of, args, mesh)
names = os.environ.get("NAMES", f"{tta.TOPK},{tta.INT8}").split(",")
for name in names:
  step, tx = steps_of[name]
  state = step.prepare(jt.TrainState.create(apply_fn=None, params=params, tx=tx))
  state = common.warm_up(step, state, batch_of(0), 3)
  jaxring.distributed.barrier("pre" + name, timeout_s=300)
  times = []
  for t in range(1, 41):
    t0 = time.perf_counter()
    state, metrics = step(state, batch_of(t))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  compute.sample(5)
  trace = tempfile.mkdtemp(prefix=f"tta-step-{me}-")
  jax.profiler.start_trace(trace, create_perfetto_trace=True)
  for t in range(41, 51):
    state, metrics = step(state, batch_of(t))
    jax.block_until_ready(metrics)
  jax.profiler.stop_trace()
  if me == 0:
    print(f"{name}: median {1e3 * statistics.median(times):.1f} ms a step; computation alone "
          f"{1e3 * compute.seconds:.1f} ms", flush=True)
    summary(trace, 10)
jaxring.distributed.barrier("end", timeout_s=300)
