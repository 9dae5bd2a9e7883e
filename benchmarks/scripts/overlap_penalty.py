"""Is a ``train_step`` whose bucket reductions are issued inside the backward pass slower than
the same step reducing after it, on the emulated cluster (JAX shape)? ``bench train-cluster``'s
step (ResNet-18-style, width 32, 4 MiB buckets), each of ``VARIANTS`` (comma-separated keys of
:data:`VARIANTS`; default ``none,int8``) with and without overlap, interleaved repetition by
repetition (``NO_OVERLAP_FIRST=1``: the step without overlap first; ``SETTLE=k``: k untimed steps
of each contender before its timed ones); rank 0 prints the median seconds per step of each.

  jaxring cluster up --name jrq --nodes 4
  jaxring cluster run --name jrq --nodes 4 --procs-per-node 1 --transport jax \
      --devices-per-proc 2 -- env VARIANTS=none,int8 SETTLE=0 \
      python benchmarks/scripts/overlap_penalty.py
"""
import os
import statistics

import jaxring.distributed

jaxring.distributed.initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxring  # noqa: E402
import jaxring.train as jt  # noqa: E402
from jaxring._src.tools.bench import common, train  # noqa: E402

REPS, STEPS, BUCKET = int(os.environ.get("REPS", "7")), 2, 4 << 20
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
int8 = {"node": jaxring.codecs.int8()}
VARIANTS = {   # name: train_step's arguments; each timed with and without overlap
    "none": {},
    "int8": {"compression": int8},                       # with error feedback
    "int8-noEF": {"compression": int8, "error_feedback": False},
    "int8-ring": {"compression": int8, "algorithm": "ring"},   # flat ring, error feedback
}
chosen = os.environ.get("VARIANTS", "none,int8").split(",")
order = (False, True) if os.environ.get("NO_OVERLAP_FIRST") else (True, False)
contenders = {f"{name}, overlap{'' if overlap else '=False'}":
              train._decorated(mesh, bucket_bytes=BUCKET, overlap=overlap, **VARIANTS[name])
              for name in chosen for overlap in order}
model = train._resnet(32)
variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
rng = np.random.RandomState(jax.process_index())
local = 4 * jax.local_device_count()
sharded = NamedSharding(mesh, P("data"))
batch = {"x": jax.make_array_from_process_local_data(
             sharded, rng.randn(local, 32, 32, 3).astype(np.float32)),
         "y": jax.make_array_from_process_local_data(
             sharded, rng.randint(0, 10, local).astype(np.int32))}
states = {}
for name, step in contenders.items():
  state = step.prepare(jt.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                            tx=optax.sgd(0.05, momentum=0.9),
                                            batch_stats=variables["batch_stats"]))
  states[name] = common.warm_up(step, state, batch, 2)
jaxring.distributed.barrier("timed", timeout_s=600)
times = common.time_interleaved(contenders, states, batch, reps=REPS, steps=STEPS,
                                settle=int(os.environ.get("SETTLE", "0")))
if jax.process_index() == 0:
  for name, ts in times.items():
    print(f"{name:<24} median {statistics.median(ts) * 1e3:7.1f} ms/step  "
          f"({', '.join(f'{t * 1e3:.0f}' for t in ts)})", flush=True)
