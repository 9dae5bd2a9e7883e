"""The harder image task (``hard_shapes``, ``resnet_gn``) trained through ``@jaxring.train_step``,
the path the recipes take, one seed per run (docs/benchmarks.md, "Convergence with compression").

Same task, members, batches, model and schedule as ``jaxring bench convergence --task shapes
--model resnet_gn --schedule cosine --steps 3600 --lr 0.05``, which trains through optax chains
(``jr.compressed_optimizer``): 8 CPU devices, 16 images per member a step, momentum 0.9.
``topk`` is ``train_step(compression=topk_chunks(0.01, chunk_size=16), momentum=0.9)`` with its
default clipping (``clip_norm="auto"``, per bucket) over ``optax.sgd``; ``int8`` and ``none``
reduce under ``train_step`` before ``optax.sgd(momentum=0.9)``. Prints one JSON line.

  python benchmarks/scripts/shapes_train_step.py --seed 0 --codec topk
"""
import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.train as jt
from jaxring._src.data.hard_shapes import hard_shapes
from jaxring._src.tools.bench import tta
from jaxring._src.tools.bench.convergence import learning_rate
from jaxring._src.tools.bench.models import MODELS

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--codec", default="topk", choices=("topk", "int8", "none"))
ap.add_argument("--steps", type=int, default=3600)
ap.add_argument("--lr", type=float, default=0.05)
args = ap.parse_args()

MODEL = "resnet_gn"
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
xtr, ytr, xte, yte = hard_shapes()
batches = tta.Batches(xtr, ytr, 8, 16, list(range(8)), NamedSharding(mesh, P("data")))
rate = learning_rate(args.lr, "cosine", args.steps)
if args.codec == "topk":
  step = tta.decorated(mesh, MODEL, momentum=0.9,
                       compression=jaxring.codecs.topk_chunks(0.01, chunk_size=16))
  tx = optax.sgd(rate)
else:
  step = tta.decorated(mesh, MODEL, compression=jaxring.codecs.int8()
                       if args.codec == "int8" else None)
  tx = optax.sgd(rate, momentum=0.9)
state = jt.TrainState.create(apply_fn=None, params=MODELS[MODEL][0](jax.random.key(args.seed)),
                             tx=tx)
t0 = time.time()
for t in range(args.steps):
  state, metrics = step(state, batches(t))
jax.block_until_ready(metrics)
params = jax.tree.map(np.asarray, state.params)
acc = float((np.asarray(jax.jit(MODELS[MODEL][1])(params, xte)).argmax(1) == yte).mean() * 100)
print(json.dumps({"seed": args.seed, "codec": args.codec, "trainer": "train_step", "accuracy": acc,
                  "steps": args.steps, "seconds": round(time.time() - t0, 1)}), flush=True)
