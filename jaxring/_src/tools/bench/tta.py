"""``jaxring bench tta``: time to a target test accuracy on the emulated cluster (root).

What a user buys: wall-clock time until the model is good enough. One process per node drives
``--devices-per-node`` CPU devices (JAX's shape, launched as ``jaxring bench train-cluster``
does); the task is the convergence benchmark's harder one (``hard_shapes``, 16 classes, label
noise) trained by its small ResNet (``jaxring._src.tools.bench.convergence``), 16 images per
member a step, momentum SGD (0.9, lr 0.03: from 0.05 up this ResNet diverges), each member
walking its shard of the training set as the convergence benchmark's members do. With
``--model resnet_gn --schedule cosine --lr 0.05`` it is the same ResNet with GroupNorm and the
rate decayed to 0 along a cosine over ``--steps``, where top-k with momentum correction trains
(the convergence benchmark's hard task). Contenders:

* ``hand-written jit(shard_map)+pmean``: ``jax.grad`` and ``lax.pmean`` of the gradients;
* ``train_step none``: ``@jaxring.train_step`` uncompressed (``auto``);
* ``train_step int8+EF``: int8 on the node level with error feedback;
* ``train_step top-k 1% + momentum correction``: ``topk_chunks(0.01, per_tensor=False)`` (the
  largest chunks of the whole gradient) on the node level, ``train_step(momentum=0.9)`` and a
  momentum-free ``optax.sgd``;
* ``train_step top-k 1% per tensor + momentum correction``: the same with ``topk_chunks(0.01)``
  (each tensor's share of the chunks, the default);
* ``diloco H=<H> ...`` (``--diloco-every H``): ``jaxring.diloco`` of that momentum SGD through
  ``train_step(axis_name=("node", "local"), grad_axes="local")``, uncompressed, int8+EF, and int8
  in ``--diloco-fragments``, top-k; evaluated on the outer parameters. With
  ``--diloco-host-delay D`` the job runs under ``mpirun`` (still JAX's shape, the node axis also
  bound to MPI) and adds uncompressed and int8 with ``transfer="host", delay=D``.

Contenders take turns, ``--eval-every`` steps each (so the machine's drifting load hits all
alike); after each turn the test accuracy of the replicated parameters is measured outside the
timed span, and a contender stops once it reaches ``--target`` (or ``--steps``). Time to target is
the timed training time until the first evaluation at or above the target. Before that and after
every turn, every node times the same step on its own devices only (no link crossed) while the
others do too: the median is the compute share, and the uncompressed step minus it the
communication share. One step is in flight at a time (``block_until_ready`` after each): with 50
queued, the hand-written step deadlocked in XLA:CPU's gloo all-reduces after ~15 steps (jax
0.10.2, 10 Mbit/s).

Prints a table (time to target, steps, final accuracy, MiB per node link and step), writes JSON
under benchmarks/results/ and, with matplotlib (``pip install jaxring[plot]``), a PNG of accuracy
against training time beside it.

Example:
  jaxring bench tta --full                   # 4 nodes x 2 devices, 10mbit links, target 75%
  jaxring bench tta --link 20mbit --target 50 --steps 600
  jaxring bench tta --full --model resnet_gn --schedule cosine --lr 0.05 --steps 1500 --target 80
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from jaxring._src.tools.bench import common

WORKER = "jaxring._src.tools.bench.tta"
HAND = "hand-written jit(shard_map)+pmean"
BASE = "train_step none"
INT8 = "train_step int8+EF"
TOPK = "train_step top-k 1% + momentum correction"
TOPK_PT = "train_step top-k 1% per tensor + momentum correction"
MOMENTUM = 0.9


def _loss(params, batch, model: str = "resnet"):
  import optax

  from jaxring._src.tools.bench.models import MODELS
  logits = MODELS[model][1](params, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def hand_written(mesh, model: str = "resnet"):
  """``jit(shard_map(step))`` with ``lax.pmean`` of the gradients (the pmap-era idiom)."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P
  loss_fn = functools.partial(_loss, model=model)

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    state = state.apply_gradients(grads=lax.pmean(grads, "data"))
    return state, {"loss": lax.pmean(loss, "data")}

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                               check_vma=False), donate_argnums=(0,))


def decorated(mesh, model: str = "resnet", **kwargs):
  """The single-device step under ``@jaxring.train_step(mesh, **kwargs)``."""
  import jaxring.train as jt
  loss_fn = functools.partial(_loss, model=model)

  @jt.train_step(mesh, **kwargs)
  def step(state, batch):
    loss, grads = jt.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  return step


def contenders(mesh, lr: float, bucket_bytes: int, chunk_size: int, model: str = "resnet",
               schedule: str = "constant", steps: int = 1000) -> dict:
  """name -> (step, optimizer) for each contender: momentum SGD at ``lr`` (held, or decayed
  along a cosine over ``steps``: ``convergence.learning_rate``) on ``model`` (``MODELS``)."""
  import optax

  import jaxring
  from jaxring._src.tools.bench.convergence import learning_rate
  rate = learning_rate(lr, schedule, steps)
  momentum_sgd = optax.sgd(rate, momentum=MOMENTUM)
  topk = jaxring.codecs.topk_chunks(0.01, chunk_size=chunk_size, per_tensor=False)
  per_tensor = jaxring.codecs.topk_chunks(0.01, chunk_size=chunk_size)
  return {
      HAND: (hand_written(mesh, model), momentum_sgd),
      BASE: (decorated(mesh, model, bucket_bytes=bucket_bytes), momentum_sgd),
      INT8: (decorated(mesh, model, bucket_bytes=bucket_bytes,
                       compression={"node": jaxring.codecs.int8()}), momentum_sgd),
      TOPK: (decorated(mesh, model, bucket_bytes=bucket_bytes, compression={"node": topk},
                       momentum=MOMENTUM), optax.sgd(rate)),
      TOPK_PT: (decorated(mesh, model, bucket_bytes=bucket_bytes,
                          compression={"node": per_tensor}, momentum=MOMENTUM), optax.sgd(rate)),
  }


def diloco_contenders(mesh, lr: float, bucket_bytes: int, model: str, schedule: str, steps: int,
                      every: int, fragments: int, warmup: int, chunk_size: int = 16,
                      host_delay: int = 0) -> dict:
  """name -> (step, optimizer) of the DiLoCo contenders on a ("node", "local") ``mesh``:
  uncompressed, int8, int8 in fragments and top-k 1% chunks (SparseLoCo's sparsity), each lossy
  codec with error feedback; with ``host_delay``, uncompressed and int8 also with
  ``transfer="host"`` (the sync moved by a host thread over MPI during ``host_delay`` steps)."""
  import optax

  import jaxring
  from jaxring._src.tools.bench.convergence import learning_rate
  inner, out = optax.sgd(learning_rate(lr, schedule, steps), momentum=MOMENTUM), {}
  codecs = {"none": None, "int8": jaxring.codecs.int8(),
            "topk": jaxring.codecs.topk_chunks(0.01, chunk_size=chunk_size, per_tensor=False)}
  runs = [("none", 1, 0), ("int8", 1, 0), ("int8", fragments, 0), ("topk", 1, 0)]
  runs += [("none", 1, host_delay), ("int8", 1, host_delay)] if host_delay else []
  for codec, p, delay in runs:
    tx = jaxring.diloco(inner, axis="node", every=every, fragments=p, warmup_steps=warmup,
                        compression=codecs[codec], delay=delay,
                        transfer="host" if delay else "program")
    name = (f"diloco H={every} {codec}" + (f" fragments={p}" if p > 1 else "") +
            (f" host delay={delay}" if delay else ""))
    out[name] = (decorated(mesh, model, axis_name=("node", "local"), grad_axes="local",
                           bucket_bytes=bucket_bytes), tx)
  return out


class Batches:
  """Each member's 16 images of step ``t``, as the convergence benchmark walks its shards."""

  def __init__(self, x, y, members: int, per_member: int, local_members: list[int], sharding):
    self.x = x.reshape(members, -1, *x.shape[1:])
    self.y = y.reshape(members, -1)
    self.per, self.n, self.members, self.sharding = (per_member, self.x.shape[1], local_members,
                                                   sharding)

  def local(self, t: int) -> dict:
    """This process's members' images and labels of step ``t`` (NumPy)."""
    import numpy as np
    i = (t % (self.n // self.per)) * self.per
    return {"x": np.concatenate([self.x[m, i:i + self.per] for m in self.members]),
            "y": np.concatenate([self.y[m, i:i + self.per] for m in self.members])}

  def __call__(self, t: int) -> dict:
    import jax
    return {k: jax.make_array_from_process_local_data(self.sharding, v)
            for k, v in self.local(t).items()}


def accuracy(params, xte, yte, model: str = "resnet") -> float:
  """Test accuracy (%) of replicated ``params``, from this process's copy; process 0's figure,
  so that every process stops a contender at the same step."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from jaxring._src.tools.bench.models import MODELS
  local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
  acc = float((np.asarray(_eval(MODELS[model][1])(local, xte)).argmax(1) == yte).mean() * 100)
  return float(multihost_utils.broadcast_one_to_all(np.float32(acc)))


@functools.cache
def _eval(fn):   # jitted once per model
  import jax
  return jax.jit(fn)


def compute_share(params, batch_of, args, mesh=None) -> common.ComputeShare:
  """The step's computation alone (:class:`common.ComputeShare`): gradients of ``_loss`` and a
  momentum SGD update on this process's devices, with no collective (with a local ``pmean`` of
  every leaf, which goes through gloo's loopback, the figure was 69 ms where this one is 14 ms;
  quiet machine, tta-20261123-195440 and -201457)."""
  import jax
  import optax

  import jaxring.train as jt

  def alone(state, batch):
    loss, grads = jax.value_and_grad(_loss)(state.params, batch, args.model)
    return state.apply_gradients(grads=grads), {"loss": loss}

  state = jt.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.0, momentum=MOMENTUM))
  return common.ComputeShare(alone, state, batch_of.local(0), args.compute_steps, mesh)


def worker(args) -> int:
  import jaxring.distributed
  jaxring.distributed.initialize()
  if args.diloco_host_delay:   # under mpirun: the slow axis (a process per node) bound to MPI too
    jaxring.distributed.bind_mpi_axis("node")   # (COMM_WORLD)
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring._src.algorithms import planner
  from jaxring._src.data.hard_shapes import hard_shapes
  from jaxring._src.tools.bench import cluster_worker
  from jaxring._src.tools.bench.models import MODELS

  me = jax.process_index()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
  members = [i for i, d in enumerate(devices) if d.process_index == me]
  xtr, ytr, xte, yte = hard_shapes()
  batch_of = Batches(xtr, ytr, len(devices), args.batch_per_device, members,
                     NamedSharding(mesh, P("data")))
  params = MODELS[args.model][0](jax.random.key(args.seed))
  n_params = sum(int(np.size(p)) for p in jax.tree.leaves(params))
  compute = compute_share(params, batch_of, args, mesh)
  # a cached calibration profile of this mesh moves `auto` off its defaults: recorded
  auto_profile = planner.find_profile_for(("data",), (len(devices),)) is not None
  iface = os.environ.get("JAXRING_INTERFACE", "jreth0")
  steps_of = contenders(mesh, args.lr, int(args.bucket_mib * (1 << 20)), args.chunk_size,
                        args.model, args.schedule, args.steps)
  batches = dict.fromkeys(steps_of, batch_of)
  if args.diloco_every:   # the same devices as (node, local): a row per process
    mesh2 = Mesh(np.asarray(devices).reshape(jax.process_count(), -1), ("node", "local"),
                 axis_types=(AxisType.Auto,) * 2)
    two = diloco_contenders(mesh2, args.lr, int(args.bucket_mib * (1 << 20)), args.model,
                            args.schedule, args.steps, args.diloco_every, args.diloco_fragments,
                            args.diloco_warmup, args.chunk_size, args.diloco_host_delay)
    steps_of.update(two)
    batches.update(dict.fromkeys(two, Batches(xtr, ytr, len(devices), args.batch_per_device,
                                              members, NamedSharding(mesh2, P(("node", "local"))))))
  names = [n for n in steps_of if not args.only or n in args.only.split(",")]
  start = accuracy(params, xte, yte, args.model)
  states, curves, left = {}, {n: [(0.0, 0, start)] for n in names}, set(names)
  done = {n: 0 for n in names}
  tx_bytes = {n: 0 for n in names}
  for name in names:
    step, tx = steps_of[name]
    state = jt.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = (step.prepare(state) if hasattr(step, "prepare") else
             jax.device_put(jax.tree.map(np.copy, state), NamedSharding(mesh, P())))
    # the first two steps compile (a host transfer's step has two programs): trained, untimed
    for t in range(2):
      state = common.warm_up(step, state, batches[name](t), 1)
    states[name], done[name] = state, 2
  turn = 0
  while left:
    for name in [n for n in names if n in left]:
      step = steps_of[name][0]
      jaxring.distributed.barrier(f"{name}-{turn}", timeout_s=900)
      b0 = cluster_worker.tx_bytes(iface)
      state, t0 = states[name], time.perf_counter()
      for t in range(done[name], min(done[name] + args.eval_every, args.steps)):
        state, metrics = step(state, batches[name](t))
        # one step in flight: with many steps queued, XLA:CPU's gloo all-reduces of the two
        # devices of a process deadlocked after ~15 steps of the hand-written step (10 Mbit/s,
        # jax 0.10.2: one device's execution waiting in gloo, the other's never launched)
        jax.block_until_ready(metrics)
      jax.block_until_ready((state, metrics))
      seconds = time.perf_counter() - t0
      tx_bytes[name] += cluster_worker.tx_bytes(iface) - b0
      done[name] = t + 1
      states[name] = state
      acc = accuracy(state.params, xte, yte, args.model)
      curves[name].append((curves[name][-1][0] + seconds, done[name], acc))
      if me == 0:
        print(f"  {name}: step {done[name]}, {curves[name][-1][0]:.1f} s, {acc:.2f}%", flush=True)
      # the curve so far, every turn: a run cut short by its timeout still reports
      cluster_worker.emit(contender=name, node=me, curve=curves[name], compute_s=compute.seconds,
                          compute_samples=compute.samples, skew_s=compute.skew,
                          auto_profile=auto_profile,
                          tx_per_step=tx_bytes[name] / max(done[name] - 2, 1), params=n_params)
      if (acc >= args.target and not args.full) or done[name] >= args.steps:
        left.discard(name)
    jaxring.distributed.barrier(f"compute-{turn}", timeout_s=900)
    compute.sample(max(2, args.compute_steps // 3))   # every node at once, as the steps ran
    turn += 1
  jaxring.distributed.barrier("done", timeout_s=300)
  return 0


def time_to_target(curve: list, target: float) -> tuple[float | None, int | None]:
  """``(seconds, steps)`` at the first evaluation at or above ``target`` (None, None: never).

  Example:
    >>> time_to_target([(0.0, 0, 6.0), (9.5, 50, 41.0), (19.0, 100, 62.5)], 60)
    (19.0, 100)
  """
  for seconds, steps, acc in curve:
    if acc >= target:
      return seconds, steps
  return None, None


def rows_of(recs: list[dict], target: float) -> list[dict]:
  """One table row per contender, from node 0's curve and every node's link bytes."""
  last = {(r["contender"], r["node"]): r for r in recs}   # each turn re-sends the whole curve
  recs = list(last.values())
  node0 = {r["contender"]: r for r in recs if r["node"] == 0}
  base = time_to_target(node0[BASE]["curve"], target)[0] if BASE in node0 else None
  hand = time_to_target(node0[HAND]["curve"], target)[0] if HAND in node0 else None
  rows = []
  for name, r in node0.items():
    seconds, steps = time_to_target(r["curve"], target)
    end = r["curve"][-1]
    txs = [x["tx_per_step"] for x in recs if x["contender"] == name]
    rows.append({"contender": name, "time_to_target_s": seconds, "steps_to_target": steps,
                 "speedup_vs_pmean": (hand / seconds) if hand and seconds else None,
                 "speedup_vs_none": (base / seconds) if base and seconds else None,
                 "steps": end[1], "final_accuracy": end[2],
                 "s_per_step": end[0] / max(end[1] - 1, 1),
                 "tx_mib_per_step": sum(txs) / len(txs) / (1 << 20), "curve": r["curve"]})
  return rows


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring bench tta", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nodes", type=int, default=4)
  ap.add_argument("--link", default="10mbit",
                  help="node link rate: at 10mbit the uncompressed step is link-bound ~3:1")
  ap.add_argument("--devices-per-node", type=int, default=2)
  ap.add_argument("--batch-per-device", type=int, default=16)
  ap.add_argument("--model", default="resnet", choices=("resnet", "resnet_gn"),
                  help="the small ResNet, or it with GroupNorm (trains at 0.05 with a cosine)")
  ap.add_argument("--lr", type=float, default=0.03,
                  help="momentum SGD (0.9), the peak with --schedule cosine; 0.05 and above "
                  "diverge on the ResNet without normalization")
  ap.add_argument("--schedule", default="constant", choices=("constant", "cosine"),
                  help="the learning rate held, or decayed to 0 along a cosine over --steps")
  ap.add_argument("--target", type=float, default=75.0, help="test accuracy (%%) to reach")
  ap.add_argument("--steps", type=int, default=1000, help="at most this many steps each")
  ap.add_argument("--eval-every", type=int, default=50)
  ap.add_argument("--full", action="store_true", help="train every contender --steps steps")
  ap.add_argument("--chunk-size", type=int, default=16, help="top-k chunk size")
  ap.add_argument("--bucket-mib", type=float, default=1.0)
  ap.add_argument("--compute-steps", type=int, default=10)
  ap.add_argument("--only", default="", help="comma-separated contenders to run")
  ap.add_argument("--diloco-every", type=int, default=0,
                  help="add jaxring.diloco contenders syncing the nodes every this many steps")
  ap.add_argument("--diloco-fragments", type=int, default=4)
  ap.add_argument("--diloco-warmup", type=int, default=0, help="synchronous steps first")
  ap.add_argument("--diloco-host-delay", type=int, default=0,
                  help="also the uncompressed and int8 contenders with transfer='host', the "
                  "sync applied this many steps after it was sent (the job runs under mpirun)")
  ap.add_argument("--seed", type=int, default=0)
  common.job_args(ap, 3600)
  return ap


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.worker:
    return worker(args)
  if common.lacks_root("tta"):
    return 2
  from jaxring._src.tools.bench import cluster, plots
  from jaxring._src.tools.cluster import netns

  name = "jrtta"
  if netns.load_state(name) is not None:
    netns.down(name)
  state = netns.up(name, args.nodes, rate=args.link)
  worker_args = common.worker_argv(args, ("nodes", "link", "devices_per_node"))
  load = os.getloadavg()
  try:
    transport = "mpi" if args.diloco_host_delay else "jax"   # host transfers: under mpirun
    rc, recs, log = cluster._run_job(name, args.nodes, 1, args.devices_per_node, transport,
                                     worker_args, args.timeout, worker=WORKER)
  finally:
    print(f"cluster {name!r}: deleted {len(netns.down(name))} objects", flush=True)
  if rc != 0:
    print(f"--- job exited {rc}; last output:\n" + "\n".join(log.splitlines()[-40:]),
          file=sys.stderr)
    if not recs:
      return rc or 1
    print(f"the job ended early (exit status {rc}): the table holds the curves up to then",
          file=sys.stderr)
  rows = rows_of(recs, args.target)
  first = next(r for r in recs if r["node"] == 0)
  # each node's median over all of its samples (its last record), the slowest node's
  compute = max({r["node"]: r["compute_s"] for r in recs}.values())
  skew = common.skew_of(recs)
  base = next((r for r in rows if r["contender"] == BASE), rows[0])
  for r in rows:   # compute utilization; the node links' bytes against the uncompressed step's
    r.update(compute_share=compute / r["s_per_step"],
             fewer_bytes=base["tx_mib_per_step"] / max(r["tx_mib_per_step"], 1e-12))
  print(f"\n{args.model} ({first['params']:,} params = {common.fmt_bytes(4 * first['params'])} of "
        f"f32 gradients) on hard_shapes, {args.nodes} nodes x {args.devices_per_node} devices x "
        f"{args.batch_per_device} images, momentum SGD lr {args.lr} ({args.schedule}), links "
        f"{state.rate}, "
        f"target {args.target:g}%")
  print(f"compute/communication split: a step on one node's devices alone (no link) "
        f"{compute * 1e3:.0f} ms; '{base['contender']}' {base['s_per_step'] * 1e3:.0f} ms a step, "
        f"so communication ~{max(base['s_per_step'] - compute, 0) * 1e3:.0f} ms "
        f"({max(base['s_per_step'] - compute, 0) / base['s_per_step']:.0%} of the step); "
        f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
  common.print_table(rows, [
      ("contender", "contender", ""), ("time_to_target_s", "time to target (s)", ".0f"),
      ("speedup_vs_pmean", "vs lax.pmean step", ".2f"),
      ("speedup_vs_none", "vs train_step none", ".2f"), ("steps_to_target", "steps", ""),
      ("final_accuracy", "final acc (%)", ".2f"), ("steps", "steps run", ""),
      ("s_per_step", "s/step", ".3f"), ("compute_share", "compute share", ".1%"),
      ("tx_mib_per_step", "MiB/node link/step", ".3f"), ("fewer_bytes", "bytes ÷", ".0f")])
  import jax
  path = common.write_json("tta", {
      "bench": "tta", "args": vars(args), "link": state.rate, "quickack": state.quickack,
      "compute_s": compute,
      "skew_s": skew, "auto_profile": any(r.get("auto_profile") for r in recs),
      "load_before": load, "load_after": os.getloadavg(), "allocator": common.allocator(),
      "job_exit": rc, "progress": [ln for ln in log.splitlines() if ": step " in ln],
      "jax": jax.__version__, "machine": common.machine(), "rows": rows, "raw": recs},
      args.out_dir)
  print(f"wrote {path}")
  png = plots.accuracy_curves(rows, args.target, f"time to {args.target:g}% on the emulated "
                              f"cluster ({args.nodes}x{args.devices_per_node}, {state.rate})",
                              path[:-5] + ".png")
  print(f"wrote {png}" if png else "no plot: matplotlib is not installed "
        "(pip install jaxring[plot])")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
