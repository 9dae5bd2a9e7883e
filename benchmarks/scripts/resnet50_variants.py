"""ResNet-50's plain-jit step on one device under variants of its memory-bound layers, timed
side by side (contenders interleaved repetition by repetition, medians, ratios to the first).

Variants (a comma-separated list of ``norm[+pool]``):
* ``flax``: ``flax.linen.BatchNorm`` then ``nn.relu`` (``recipes.models.FlaxBatchNorm``);
* ``fused``: ``recipes.batchnorm.BatchNorm`` (ReLU inside, its sums as ``jnp.sum``);
* ``fused-variadic``: the same with each pair of sums as one variadic ``lax.reduce``;
* ``+slices``: the stem's 3x3/2 max-pool as the maximum of nine strided slices (its gradient an
  elementwise select) instead of ``reduce_window`` (gradient: ``select_and_scatter``);
* ``+vjp``: ``reduce_window`` forward, the gradient of :func:`vjp_max_pool`.

  python benchmarks/scripts/resnet50_variants.py --batch-size 256 --variants flax,fused,fused+vjp
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys


def _variadic_sums(*operands, axes):
  import jax
  import jax.numpy as jnp
  zeros = tuple(jnp.zeros((), o.dtype) for o in operands)
  return jax.lax.reduce(operands, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), axes)


def slice_max_pool(x, window_shape, strides=None, padding="VALID"):
  """``nn.max_pool`` over H, W of NHWC ``x`` as the maximum of strided slices."""
  import jax
  import jax.numpy as jnp
  strides = strides or (1,) * len(window_shape)
  pads = jax.lax.padtype_to_pads(x.shape[1:3], window_shape, strides, padding)
  x = jnp.pad(x, [(0, 0), *pads, (0, 0)], constant_values=-jnp.inf)
  out = [(x.shape[1 + i] - window_shape[i]) // strides[i] + 1 for i in range(2)]
  result = None
  for di in range(window_shape[0]):
    for dj in range(window_shape[1]):
      s = jax.lax.slice(x, (0, di, dj, 0),
                        (x.shape[0], di + (out[0] - 1) * strides[0] + 1,
                         dj + (out[1] - 1) * strides[1] + 1, x.shape[3]), (1, *strides, 1))
      result = s if result is None else jnp.maximum(result, s)
  return result


def vjp_max_pool(x, window_shape, strides=None, padding="VALID"):
  """``nn.max_pool`` over H, W of NHWC ``x``: ``reduce_window`` forward in ``x``'s dtype, and a
  gradient that sends each window's cotangent to its first maximum (as ``select_and_scatter``
  does) by comparing strided slices of ``x`` with the output: no index arrays."""
  import jax
  import jax.numpy as jnp
  strides = tuple(strides or (1,) * len(window_shape))
  window_shape = tuple(window_shape)
  pads = jax.lax.padtype_to_pads(x.shape[1:3], window_shape, strides, padding)

  def forward(x):
    return jax.lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), jax.lax.max,
                                 (1, *window_shape, 1), (1, *strides, 1),
                                 [(0, 0), *pads, (0, 0)])

  @jax.custom_vjp
  def pool(x):
    return forward(x)

  def fwd(x):
    y = forward(x)
    return y, (x, y)

  def bwd(saved, g):
    x, y = saved
    xp = jnp.pad(x, [(0, 0), *pads, (0, 0)], constant_values=-jnp.inf)
    out = y.shape[1:3]
    taken = jnp.zeros(y.shape, bool)
    grad = jnp.zeros(xp.shape, jnp.float32)  # up to 4 windows overlap: sum in f32
    for di in range(window_shape[0]):
      for dj in range(window_shape[1]):
        s = jax.lax.slice(xp, (0, di, dj, 0),
                          (xp.shape[0], di + (out[0] - 1) * strides[0] + 1,
                           dj + (out[1] - 1) * strides[1] + 1, xp.shape[3]), (1, *strides, 1))
        hit = (s == y) & ~taken
        taken = taken | hit
        contrib = jnp.where(hit, g.astype(jnp.float32), 0.0)
        grad = grad + jax.lax.pad(
            contrib, jnp.float32(0),
            [(0, 0, 0), (di, xp.shape[1] - di - (out[0] - 1) * strides[0] - 1, strides[0] - 1),
             (dj, xp.shape[2] - dj - (out[1] - 1) * strides[1] - 1, strides[1] - 1), (0, 0, 0)])
    grad = grad[:, pads[0][0]:pads[0][0] + x.shape[1], pads[1][0]:pads[1][0] + x.shape[2]]
    return (grad.astype(x.dtype),)

  pool.defvjp(fwd, bwd)
  return pool(x)


@contextlib.contextmanager
def _patched(variant: str):
  """Active while a contender traces: the variant's sums and max-pool."""
  from recipes import batchnorm, models
  norm, _, pool = variant.partition("+")
  saved = batchnorm._sums, models.nn.max_pool
  try:
    if norm == "fused-variadic":
      batchnorm._sums = _variadic_sums
    if pool == "slices":
      models.nn.max_pool = slice_max_pool
    if pool == "vjp":
      models.nn.max_pool = vjp_max_pool
    yield
  finally:
    batchnorm._sums, models.nn.max_pool = saved


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch-size", type=int, default=256)
  ap.add_argument("--variants", default="flax,fused,fused+vjp")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--out", default=None, help="write the table as JSON here")
  args = ap.parse_args()

  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring import bench
  from jaxring.data import SyntheticImages
  from recipes import imagenet_resnet50, optim, train
  config = dataclasses.replace(imagenet_resnet50.get_config(), batch_size=args.batch_size,
                               image_size=224, dtype="bfloat16", dataset="synthetic")
  schedule = optim.learning_rate_schedule(
      optim.peak_learning_rate(config.learning_rate, args.batch_size), 10_000, 100)
  tx = optim.make_optimizer(schedule, weight_decay=config.weight_decay,
                            momentum_in_step=train.momentum_in_step(config))
  fresh = train.create_train_state(config, train.create_model(config), tx)
  mesh = jt.default_mesh("data")
  sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  batch = next(SyntheticImages(args.batch_size, image_size=224, num_classes=1000, seed=0))
  batch = jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharded, x),
                                 batch)
  step = train.train_step_fn(schedule, config.label_smoothing)
  contenders = {}
  for variant in args.variants.split(","):
    norm = variant.partition("+")[0]
    apply = train.create_model(dataclasses.replace(
        config, norm="flax" if norm == "flax" else "fused")).apply

    def run(state, batch, variant=variant, apply=apply):
      with _patched(variant):
        return step(state.replace(apply_fn=apply), batch)
    contenders[variant] = jax.jit(run, donate_argnums=(0,))
  states = bench.warm_up_contenders(contenders, lambda: fresh, batch, 3, replicated)
  times = bench.time_interleaved(contenders, states, batch, reps=args.reps, steps=args.steps)
  first = next(iter(times.values()))
  rows = [{"variant": v, "median_ms": 1e3 * statistics.median(t),
           "images_per_s": args.batch_size / statistics.median(t),
           "vs_first": statistics.median(a / b for a, b in zip(t, first)), "times_s": t}
          for v, t in times.items()]
  print(f"ResNet-50 plain-jit step, bf16, 224x224, batch {args.batch_size}, "
        f"{jax.devices()[0].device_kind}")
  bench.print_table(rows, [("variant", "variant", ""), ("median_ms", "median ms", ".2f"),
                           ("images_per_s", "images/s", ".0f"), ("vs_first", "vs first", ".3f")])
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"batch_size": args.batch_size, "device": jax.devices()[0].device_kind,
                 "machine": bench.machine(), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
