"""The cost of ``@jaxring.train_step``: a small ResNet step against a hand-written SPMD step.

Both contenders run the same Flax ResNet-18-style network (BasicBlocks [2, 2, 2, 2], 32x32 inputs,
BatchNorm, SGD with momentum) on the same global batch over all devices:

* ``hand-written``: ``jax.jit(jax.shard_map(step))`` with ``jax.value_and_grad`` and
  ``lax.pmean`` of the gradients, batch statistics and loss (the pmap-era idiom);
* ``train_step``: the single-device step under ``@jaxring.train_step`` with
  ``jaxring.value_and_grad``, uncompressed: with the default 25 MiB buckets (one bucket for this
  small network), and with small buckets (``--bucket-mib``) with and without overlap; optionally
  int8 compression with error feedback.

Contenders are interleaved repetition by repetition (each repetition times ``--steps`` consecutive
steps of every contender), so the machine's noise hits all alike; medians of ``--reps``
repetitions after ``--warmup`` warm-up steps; the comparison is the median over repetitions of
each repetition's time ratio to the hand-written step. On emulated CPU devices the "network" is a memory
copy: this measures the decorator's overhead, not what overlap buys on a real network.

``--api nnx`` runs the same comparison on the network written in Flax NNX
(:mod:`jaxring._src.tools.bench.train_nnx`) and writes ``train-nnx.json``.

Example:
  $ XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxring._src.tools.bench.train
"""
from __future__ import annotations

import argparse
import statistics
import sys

from jaxring._src.tools.bench import common


def _resnet(width: int, num_classes: int = 10):
  import flax.linen as nn
  import jax.numpy as jnp

  class Block(nn.Module):
    features: int
    stride: int

    @nn.compact
    def __call__(self, x, train):
      norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
      y = nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(x)
      y = nn.relu(norm()(y))
      y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
      if x.shape != y.shape:
        x = norm()(nn.Conv(self.features, (1, 1), self.stride, use_bias=False)(x))
      return nn.relu(x + y)

  class ResNet18(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
          nn.Conv(width, (3, 3), use_bias=False)(x)))
      for stage, features in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for block in range(2):
          x = Block(features, 2 if stage > 0 and block == 0 else 1)(x, train)
      return nn.Dense(num_classes)(jnp.mean(x, axis=(1, 2)))

  return ResNet18()


def _loss_fn(apply_fn, batch_stats, batch):
  import optax

  def loss_fn(params):
    logits, updates = apply_fn({"params": params, "batch_stats": batch_stats}, batch["x"],
                               mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]
  return loss_fn


def _hand_written(mesh):
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P

  def step(state, batch):
    (loss, stats), grads = jax.value_and_grad(
        _loss_fn(state.apply_fn, state.batch_stats, batch), has_aux=True)(state.params)
    grads = lax.pmean(grads, "data")
    state = state.apply_gradients(grads=grads, batch_stats=lax.pmean(stats, "data"))
    return state, {"loss": lax.pmean(loss, "data")}

  spmd = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                       check_vma=False)
  return jax.jit(spmd, donate_argnums=(0,))


def _decorated(mesh, **kwargs):
  import jaxring.train as jt

  @jt.train_step(mesh, **kwargs)
  def step(state, batch):
    (loss, stats), grads = jt.value_and_grad(
        _loss_fn(state.apply_fn, state.batch_stats, batch), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}
  return step


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring
  import jaxring.train as jt

  devices = jax.devices()
  mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
  n = len(devices)
  global_batch = args.batch_per_device * n
  model = _resnet(args.width)
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
  tx = optax.sgd(0.05, momentum=0.9)
  n_params = sum(int(np.size(p)) for p in jax.tree.leaves(variables["params"]))
  bucket_bytes = int(args.bucket_mib * (1 << 20))

  small = common.fmt_bytes(bucket_bytes)
  contenders = {"hand-written jit(shard_map)+pmean": _hand_written(mesh),
                "train_step (defaults: auto, 25MiB buckets)": _decorated(mesh)}
  if bucket_bytes:
    contenders[f"train_step (auto, {small} buckets, overlap)"] = _decorated(
        mesh, bucket_bytes=bucket_bytes)
    contenders[f"train_step (auto, {small} buckets, overlap=False)"] = _decorated(
        mesh, bucket_bytes=bucket_bytes, overlap=False)
  if args.int8:
    contenders[f"train_step (ring, int8 + EF, {small} buckets)"] = _decorated(
        mesh, bucket_bytes=bucket_bytes or 25 << 20, algorithm="ring",
        compression=jaxring.codecs.int8())

  rng = np.random.RandomState(0)
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  batch = jax.device_put({"x": rng.randn(global_batch, 32, 32, 3).astype(np.float32),
                          "y": rng.randint(0, 10, global_batch).astype(np.int32)}, sharded)
  states = common.warm_up_contenders(
      contenders, lambda: jt.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                               tx=tx, batch_stats=variables["batch_stats"]),
      batch, args.warmup, replicated)
  times = common.time_interleaved(contenders, states, batch, reps=args.reps, steps=args.steps)

  base_times = times["hand-written jit(shard_map)+pmean"]
  rows = []
  for name, ts in times.items():
    med = statistics.median(ts)
    # the machine's load drifts during a run; a repetition's contenders ran back to back, so the
    # ratio within each repetition is the robust comparison
    ratio = statistics.median(t / b for t, b in zip(ts, base_times))
    buckets = getattr(contenders[name], "buckets", None)
    rows.append({"contender": name, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                 "images_per_s": global_batch / med, "ratio": ratio,
                 "min_ratio": min(ts) / min(base_times), "overhead_pct": (ratio - 1) * 100,
                 "buckets": None if buckets is None else len(buckets), "times_s": ts})
  return {"benchmark": "train", "model": f"ResNet-18 (BasicBlock [2,2,2,2], width {args.width})",
          "params": n_params, "image": "32x32x3", "devices": n, "global_batch": global_batch,
          "bucket_bytes": bucket_bytes, "steps_per_rep": args.steps, "reps": args.reps,
          "warmup": args.warmup, "machine": common.machine(), "rows": rows}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jaxring._src.tools.bench.train", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--api", choices=("linen", "nnx"), default="linen",
                  help="the network and its steps in Flax Linen (TrainState) or Flax NNX "
                  "(nnx.Optimizer, updated in place); nnx writes train-nnx.json")
  ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
  ap.add_argument("--width", type=int, default=16, help="channels of the first stage")
  ap.add_argument("--batch-per-device", type=int, default=8)
  ap.add_argument("--bucket-mib", type=float, default=0.5,
                  help="also time this bucket size, with and without overlap (nnx: with "
                  "overlap only; 0: skip)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--steps", type=int, default=2, help="steps timed per repetition")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--int8", action="store_true", help="also time int8 ring + error feedback")
  ap.add_argument("--no-tcmalloc", action="store_true",
                  help="keep this process's allocator (no tcmalloc, no glibc tuning)")
  ap.add_argument("--out-dir", default=None)
  args = ap.parse_args(argv)
  if args.reps < 5:
    ap.error("--reps must be at least 5 (medians of fewer are noise on a shared machine)")
  if not args.no_tcmalloc:
    common.maybe_reexec_with_fast_allocator(sys.argv[1:] if argv is None else list(argv),
                                            module="jaxring._src.tools.bench.train")
  common.set_cpu_devices(args.devices)

  if args.api == "nnx":
    from jaxring._src.tools.bench import train_nnx
    result = train_nnx.run(args)
    train_nnx.print_result(result)
    print(f"\nwrote {common.write_json('train-nnx', result, args.out_dir)}")
    return 0
  result = run(args)
  print(f"\n{result['model']}, {result['params']:,} params "
        f"({common.fmt_bytes(4 * result['params'])} of f32 gradients), global batch "
        f"{result['global_batch']} on {result['devices']} devices, "
        f"allocator: {result['machine']['allocator']}")
  common.print_table(result["rows"], [
      ("contender", "contender", ""), ("median_ms", "median ms/step", ".1f"),
      ("min_ms", "min ms", ".1f"), ("images_per_s", "images/s", ".1f"),
      ("ratio", "vs hand-written (median of per-rep ratios)", ".3f"),
      ("min_ratio", "min vs min", ".3f"), ("buckets", "buckets", "")])
  path = common.write_json("train", result, args.out_dir)
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
