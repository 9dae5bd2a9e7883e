"""``jaxring bench train-cluster``: training steps/s on the emulated cluster (root), where the
gradient all-reduce crosses shaped links.

One process per node drives ``--devices-per-node`` CPU devices (JAX's own shape); the same
ResNet-18-style step as ``jaxring bench train`` (``jaxring._src.tools.bench.train``) runs as:

* ``hand-written jit(shard_map)+pmean``: ``lax.pmean`` of the gradients (gloo across nodes);
* ``train_step none``: ``@jaxring.train_step`` uncompressed (``auto``; buckets of ``--bucket-mib``);
* ``train_step int8+EF, overlap``: int8 on the node level with error feedback, each bucket's
  reduction issued inside the backward pass; and the same with ``overlap=False``.

Contenders are interleaved repetition by repetition; each repetition times ``--steps`` steps of
each, after ``--settle`` untimed ones (the first step after another contender's can pay for the
switch: docs/design.md, "Investigations").
Reported: median ms/step, steps/s, images/s and the ratio to the uncompressed ``train_step``
(median of per-repetition ratios), the bytes each node put on its link per step, and the step's
computation alone (``common.ComputeShare``: each node's devices with no collective, sampled
after every repetition; the slowest node's median), which ``jaxring simulate --validate-steps``
adds the modelled reductions to.

Example:
  sudo jaxring bench train-cluster                 # 4 nodes x 2 devices, 1gbit
  sudo jaxring bench train-cluster --nodes 2 --reps 5 --width 16
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys

from jaxring._src.tools.bench import common

WORKER = "jaxring._src.tools.bench.train_cluster"
HAND = "hand-written jit(shard_map)+pmean"
BASE = "train_step none"


def worker(args) -> int:
  import jaxring.distributed
  jaxring.distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  import jaxring.train as jt
  from jaxring._src.tools.bench import cluster_worker, train

  me = jax.process_index()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
  bucket = int(args.bucket_mib * (1 << 20))
  int8 = {"node": jaxring.codecs.int8()}
  contenders = {
      HAND: train._hand_written(mesh),
      BASE: train._decorated(mesh, bucket_bytes=bucket),
      "train_step int8+EF, overlap": train._decorated(mesh, bucket_bytes=bucket, compression=int8),
      "train_step int8+EF, overlap=False": train._decorated(mesh, bucket_bytes=bucket,
                                                           compression=int8, overlap=False),
  }
  model = train._resnet(args.width)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
  n_params = sum(int(np.size(p)) for p in jax.tree.leaves(variables["params"]))
  local = args.batch_per_device * jax.local_device_count()
  rng = np.random.RandomState(me)
  sharded = NamedSharding(mesh, P("data"))
  local_batch = {"x": rng.randn(local, 32, 32, 3).astype(np.float32),
                 "y": rng.randint(0, 10, local).astype(np.int32)}
  batch = {k: jax.make_array_from_process_local_data(sharded, v) for k, v in local_batch.items()}

  def make_state():
    return jt.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                tx=optax.sgd(0.05, momentum=0.9),
                                batch_stats=variables["batch_stats"])

  def alone(state, b):   # the step's computation, no collective (common.ComputeShare)
    (loss, stats), grads = jax.value_and_grad(
        train._loss_fn(state.apply_fn, state.batch_stats, b), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}

  jaxring.distributed.barrier("compute", timeout_s=600)
  compute = common.ComputeShare(alone, make_state(), local_batch, args.steps, mesh)
  # a calibration profile of this mesh in the cache moves `auto` (train_step none) off the
  # native all-reduce: recorded, since the step model takes the default
  from jaxring._src.algorithms import planner
  auto_profile = planner.find_profile_for(("data",), (len(devices),)) is not None
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  states, tx = {}, {k: 0 for k in contenders}
  for name, step in contenders.items():
    state = make_state()
    if hasattr(step, "prepare"):
      state = step.prepare(state)
    else:  # copies: donation must not delete `variables`, shared by every contender
      state = jax.device_put(jax.tree.map(jnp.copy, state), NamedSharding(mesh, P()))
    states[name] = common.warm_up(step, state, batch, args.warmup)

  barriers = itertools.count()

  @contextlib.contextmanager
  def counted(name):   # all processes start each contender together; its bytes on the link
    jaxring.distributed.barrier(f"{name}-{next(barriers)}", timeout_s=600)
    b0 = cluster_worker.tx_bytes(iface)
    yield
    tx[name] += cluster_worker.tx_bytes(iface) - b0

  def sample_compute():   # every node at once, as the contenders ran
    jaxring.distributed.barrier(f"compute-{next(barriers)}", timeout_s=600)
    compute.sample(args.steps, args.settle)

  times = common.time_interleaved(contenders, states, batch, reps=args.reps, steps=args.steps,
                                  settle=args.settle, around=counted, between=sample_compute)
  leaves = {"grads": [4 * int(np.size(p)) for p in jax.tree.leaves(variables["params"])],
            "batch_stats": [4 * int(np.size(p)) for p in jax.tree.leaves(variables["batch_stats"])]}
  for name in contenders:
    cluster_worker.emit(contender=name, node=me, times=times[name],
                        tx_per_step=tx[name] / (args.reps * args.steps), params=n_params,
                        global_batch=local * jax.process_count(), compute_s=compute.seconds,
                        compute_samples=compute.samples, skew_s=compute.skew,
                        leaf_bytes=leaves, auto_profile=auto_profile)
  jaxring.distributed.barrier("done", timeout_s=120)
  return 0


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring bench train-cluster",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--link", default="1gbit")
  ap.add_argument("--devices-per-node", type=int, default=2)
  ap.add_argument("--width", type=int, default=32, help="channels of the first stage")
  ap.add_argument("--batch-per-device", type=int, default=4)
  ap.add_argument("--bucket-mib", type=float, default=4.0)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--steps", type=int, default=2, help="steps timed per repetition")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--settle", type=int, default=1,
                  help="untimed steps of each contender before its timed ones, every repetition")
  common.job_args(ap, 1500)
  return ap


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.worker:
    return worker(args)
  if common.lacks_root("train-cluster"):
    return 2
  from jaxring._src.tools.bench import cluster
  from jaxring._src.tools.cluster import netns

  name = "jrt"
  if netns.load_state(name) is not None:
    netns.down(name)
  state = netns.up(name, args.nodes, rate=args.link)
  worker_args = common.worker_argv(args, ("nodes", "link", "devices_per_node"))
  try:
    rc, recs, log = cluster._run_job(name, args.nodes, 1, args.devices_per_node, "jax",
                                     worker_args, args.timeout, worker=WORKER)
  finally:
    print(f"cluster {name!r}: deleted {len(netns.down(name))} objects", flush=True)
  if rc != 0 or not recs:
    print(f"--- job exited {rc}; last output:\n" + "\n".join(log.splitlines()[-40:]),
          file=sys.stderr)
    return rc or 1
  node0 = {r["contender"]: r for r in recs if r["node"] == 0}
  base = node0[BASE]["times"]
  rows = []
  for label, r in node0.items():
    med = statistics.median(r["times"])
    txs = [x["tx_per_step"] for x in recs if x["contender"] == label]
    rows.append({"contender": label, "ms": med * 1e3, "steps_per_s": 1 / med,
                 "images_per_s": r["global_batch"] / med,
                 "vs_uncompressed": statistics.median(t / b for t, b in zip(r["times"], base)),
                 "tx_mib": sum(txs) / len(txs) / (1 << 20), "times_s": r["times"]})
  first = next(iter(node0.values()))
  compute, skew = max(r["compute_s"] for r in recs), common.skew_of(recs)
  print(f"\nResNet-18 (width {args.width}, {first['params']:,} params = "
        f"{common.fmt_bytes(4 * first['params'])} of f32 gradients), 32x32, global batch "
        f"{first['global_batch']}, {args.nodes} nodes x {args.devices_per_node} devices, links "
        f"{state.rate}, buckets {args.bucket_mib} MiB, allocator {common.allocator()}")
  common.print_table(rows, [
      ("contender", "contender", ""), ("ms", "median ms/step", ".0f"),
      ("steps_per_s", "steps/s", ".2f"), ("images_per_s", "images/s", ".1f"),
      ("vs_uncompressed", "time vs train_step none", ".3f"),
      ("tx_mib", "MiB/node link/step", ".1f")])
  auto_profile = any(r.get("auto_profile") for r in recs)
  if auto_profile:
    print("auto read a calibration profile of this mesh (jaxring calibrate --axes data): "
          f"'{BASE}' ran the plan it chose, not the default native all-reduce")
  print(f"computation alone (no collective, slowest node): {compute * 1e3:.0f} ms a step, and "
        f"{skew * 1e3:.0f} ms more before a psum after it; '{BASE}' "
        f"{statistics.median(base) * 1e3:.0f} ms")
  import jax
  path = common.write_json("train-cluster", {
      "bench": "train-cluster", "args": vars(args), "link": state.rate, "quickack": state.quickack,
      "allocator": common.allocator(), "jax": jax.__version__, "machine": common.machine(),
      "compute_s": compute, "skew_s": skew, "leaf_bytes": first["leaf_bytes"],
      "auto_profile": auto_profile,
      # train_step averages the batch statistics and metrics in one pmean (train/state.py)
      "fused_statistics": True, "rows": rows, "raw": recs},
      args.out_dir)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
