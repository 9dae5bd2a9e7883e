"""ResNet-50 v1.5 training throughput: ``@jaxring.train_step`` against a plain ``jax.jit`` step.

Both contenders run the recipe's step (``recipes.train.train_step_fn``: ResNet v1.5, Nesterov SGD
with masked weight decay, label smoothing, uint8 images normalized on the device) on the same
synthetic batch, already on the devices (the step, not the input pipeline, is measured):

* ``plain jit``: ``jax.jit(step)`` on the globally sharded batch; ``jaxring.value_and_grad`` is
  ``jax.value_and_grad`` there and XLA's partitioner inserts the gradient all-reduce;
* ``jaxring train_step``: the same step under ``@jaxring.train_step`` with ``--compression`` and
  ``--algorithm`` (default: uncompressed, ``auto``).

Contenders alternate repetition by repetition; each repetition times ``--steps`` consecutive
steps; medians over ``--reps``; "vs plain jit" is the median of the per-repetition time ratios.
On one device the two differ only by the decorator's own work (target on a GPU: within 2%).

Defaults follow the backend: on a GPU, batch 256 at 224x224 in bf16; on a CPU, where ResNet-50 at
224 takes seconds per image, batch 16 at 64x64 in f32 on one device (``--devices`` emulates more).

Example:
  $ jaxring bench resnet50 --data synthetic                    # GPU: batch 256, 224 px, bf16
  $ jaxring bench resnet50 --batch-size 32 --image-size 96 --devices 8 --compression int8
"""
from __future__ import annotations

import argparse
import statistics
import sys

from jaxring import bench

GPU_DEFAULTS = {"batch_size": 256, "image_size": 224, "dtype": "bfloat16"}
CPU_DEFAULTS = {"batch_size": 16, "image_size": 64, "dtype": "float32"}


def _contenders(config, mesh, schedule, compare_norms: bool):
  import dataclasses

  import jax
  from recipes import train

  step = train.train_step_fn(schedule, config.label_smoothing)
  contenders = {"plain jit": jax.jit(step, donate_argnums=(0,)),
                "jaxring train_step": train.make_train_step(config, schedule, mesh)}
  if compare_norms:  # the same step and state, the model's other BatchNorm (same parameter tree)
    other = "flax" if config.norm == "fused" else "fused"
    apply = train.create_model(dataclasses.replace(config, norm=other)).apply
    contenders[f"plain jit, {other} BatchNorm"] = jax.jit(
        lambda state, batch: step(state.replace(apply_fn=apply), batch), donate_argnums=(0,))
  return contenders


def run(args) -> dict:
  import dataclasses

  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring.data import SyntheticImages
  from recipes import imagenet_resnet50, optim, train

  config = dataclasses.replace(
      imagenet_resnet50.get_config(), depth=args.depth, width=args.width,
      batch_size=args.batch_size, image_size=args.image_size, dtype=args.dtype,
      compression=args.compression, algorithm=args.algorithm, dataset="synthetic", norm=args.norm)
  mesh = jt.default_mesh("data")
  if config.batch_size % mesh.size:
    raise SystemExit(f"--batch-size {config.batch_size} is not a multiple of {mesh.size} devices")
  schedule = optim.learning_rate_schedule(
      optim.peak_learning_rate(config.learning_rate, config.batch_size), 10_000, 100)
  tx = optim.make_optimizer(schedule, weight_decay=config.weight_decay,
                            momentum_in_step=train.momentum_in_step(config))
  model = train.create_model(config)
  fresh = train.create_train_state(config, model, tx)
  n_params = sum(int(np.size(p)) for p in jax.tree_util.tree_leaves(fresh.params))
  sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  batch = next(SyntheticImages(config.batch_size, image_size=config.image_size,
                               num_classes=config.num_classes, seed=0))
  batch = jax.tree_util.tree_map(
      lambda x: jax.make_array_from_process_local_data(sharded, x), batch)

  contenders = _contenders(config, mesh, schedule, args.compare_norms)
  states = bench.warm_up_contenders(contenders, lambda: fresh, batch, args.warmup, replicated)
  times = bench.time_interleaved(contenders, states, batch, reps=args.reps, steps=args.steps)

  base = times["plain jit"]
  rows = []
  for name, ts in times.items():
    med = statistics.median(ts)
    rows.append({"contender": name, "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts),
                 "images_per_s": config.batch_size / med,
                 "ratio": statistics.median(t / b for t, b in zip(ts, base)), "times_s": ts})
  return {"benchmark": "resnet50", "model": f"ResNet-{config.depth} v1.5 (width {config.width})",
          "params": n_params, "image_size": config.image_size, "dtype": config.dtype,
          "global_batch": config.batch_size, "devices": mesh.size,
          "platform": jax.devices()[0].platform, "compression": config.compression,
          "algorithm": config.algorithm, "norm": config.norm, "steps_per_rep": args.steps,
          "reps": args.reps,
          "warmup": args.warmup, "machine": bench.machine(), "rows": rows}


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring bench resnet50", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--data", choices=["synthetic"], default="synthetic",
                  help="synthetic images already on the devices (the step alone is timed)")
  ap.add_argument("--batch-size", type=int, default=None, help="global batch (GPU 256, CPU 16)")
  ap.add_argument("--image-size", type=int, default=None, help="pixels (GPU 224, CPU 64)")
  ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                  help="compute dtype (GPU bfloat16, CPU float32)")
  ap.add_argument("--depth", type=int, default=50, help="ResNet depth (18, 34, 50, 101, 152)")
  ap.add_argument("--width", type=int, default=64, help="channels of the first stage")
  ap.add_argument("--norm", choices=["fused", "flax"], default="fused",
                  help="the model's BatchNorm (recipes.models.NORMS)")
  ap.add_argument("--compare-norms", action="store_true",
                  help="add a plain-jit contender with the other BatchNorm")
  ap.add_argument("--compression", default="none",
                  help="none, bf16, fp16, int8[:block], topk[:density] (jaxring.codecs.parse)")
  ap.add_argument("--algorithm", default="auto", help="auto, xla, ring, hierarchical")
  ap.add_argument("--devices", type=int, default=0,
                  help="emulated CPU devices (CPU only; default: 1)")
  ap.add_argument("--steps", type=int, default=10, help="steps timed per repetition")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--out-dir", default=None)
  return ap


def main(argv=None) -> int:
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  if args.reps < 5:
    raise SystemExit("--reps must be at least 5 (medians of fewer are noise on a shared machine)")
  if args.devices:
    bench.set_cpu_devices(args.devices)
  import jax
  defaults = CPU_DEFAULTS if jax.devices()[0].platform == "cpu" else GPU_DEFAULTS
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)

  result = run(args)
  print(f"\n{result['model']}, {result['params']:,} params, {result['dtype']}, "
        f"{result['image_size']}x{result['image_size']}, global batch {result['global_batch']} on "
        f"{result['devices']} {result['platform']} device(s), jaxring compression "
        f"{result['compression']} ({result['algorithm']}), {result['norm']} BatchNorm, allocator "
        f"{result['machine']['allocator']}")
  bench.print_table(result["rows"], [
      ("contender", "contender", ""), ("median_ms", "median ms/step", ".1f"),
      ("min_ms", "min ms", ".1f"), ("images_per_s", "images/s", ".1f"),
      ("ratio", "vs plain jit (median of per-rep ratios)", ".3f")])
  path = bench.write_json("resnet50", result, args.out_dir)
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
