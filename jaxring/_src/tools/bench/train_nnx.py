"""``jaxring bench train --api nnx``: the cost of ``@jaxring.train_step`` on a Flax NNX step.

The network of the Linen bench written in Flax NNX (``nnx.Conv``, ``nnx.BatchNorm`` with momentum
0.9, ``nnx.Linear``; BasicBlocks [2, 2, 2, 2], 32x32 inputs, Flax's default initializers), trained
with ``nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)`` on the same global
batch over all devices by:

* ``hand-written``: Flax's performance guide made data-parallel by hand: ``nnx.split((model,
  optimizer))`` once, then ``jax.jit(jax.shard_map(per_replica))`` with the state donated, where
  ``per_replica`` merges the objects, takes ``nnx.value_and_grad``, ``lax.pmean``\\ s the gradients,
  calls ``optimizer.update``, ``lax.pmean``\\ s the ``nnx.BatchStat`` variables and the loss, and
  returns ``nnx.state((model, optimizer))``; the objects are updated from that state once, after
  the loop, as the guide does;
* ``train_step``: ``step(model, optimizer, batch)`` under ``@jaxring.train_step`` with
  ``jaxring.value_and_grad``, which updates the objects in place on every call.

Timing as in the Linen bench (:mod:`jaxring._src.tools.bench.train`). Every contender starts from
the same initialization and sees the same batch, and must train alike: after the timed steps every
contender is set to the hand-written step's state and takes two more steps; the second one's loss
(the first that sees the update) is compared to the hand-written step's. Their own trajectories
drift apart instead: a one-ulp difference of the third step's loss (the reductions' programs
differ) grows to 0.1% by the sixth, as training this small batch at this rate amplifies it.

Example:
  $ XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxring bench train --api nnx
"""
from __future__ import annotations

import functools
import statistics

from jaxring._src.tools.bench import common

HAND_WRITTEN = "hand-written nnx.split + jit(shard_map)+pmean"


@functools.cache
def _resnet_class():
  import jax
  import jax.numpy as jnp
  from flax import nnx

  def conv_bn(cin, cout, kernel, stride, rngs):
    return (nnx.Conv(cin, cout, kernel, stride, use_bias=False, rngs=rngs),
            nnx.BatchNorm(cout, momentum=0.9, rngs=rngs))

  class Block(nnx.Module):
    def __init__(self, cin: int, features: int, stride: int, *, rngs: nnx.Rngs):
      self.conv1, self.norm1 = conv_bn(cin, features, (3, 3), stride, rngs)
      self.conv2, self.norm2 = conv_bn(features, features, (3, 3), 1, rngs)
      # the Linen block's projection where the shapes differ
      self.shortcut = (nnx.Sequential(*conv_bn(cin, features, (1, 1), stride, rngs))
                       if stride != 1 or cin != features else None)

    def __call__(self, x):
      y = jax.nn.relu(self.norm1(self.conv1(x)))
      y = self.norm2(self.conv2(y))
      if self.shortcut is not None:
        x = self.shortcut(x)
      return jax.nn.relu(x + y)

  class ResNet18(nnx.Module):
    def __init__(self, width: int, num_classes: int = 10, *, rngs: nnx.Rngs):
      self.conv, self.norm = conv_bn(3, width, (3, 3), 1, rngs)
      blocks, cin = [], width
      for stage, features in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for block in range(2):
          blocks.append(Block(cin, features, 2 if stage > 0 and block == 0 else 1, rngs=rngs))
          cin = features
      self.blocks = nnx.List(blocks)
      self.head = nnx.Linear(cin, num_classes, rngs=rngs)

    def __call__(self, x):
      x = jax.nn.relu(self.norm(self.conv(x)))
      for block in self.blocks:
        x = block(x)
      return self.head(jnp.mean(x, axis=(1, 2)))

  return ResNet18


def resnet(width: int, seed: int = 0):
  """The bench's ResNet-18-style NNX model and its SGD-with-momentum ``nnx.Optimizer``.

  Example:
    >>> import jax.numpy as jnp
    >>> model, optimizer = resnet(4)
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
  """
  import optax
  from flax import nnx
  model = _resnet_class()(width, rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)


def _loss(model, batch):
  import optax
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def hand_written(mesh, model, optimizer):
  """``(step, state)``: the guide's ``jax.jit`` step over ``nnx.split``'s state, data-parallel by
  hand; ``step(state, batch) -> (state, metrics)``; the objects are left as they were."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  graphdef, state = nnx.split((model, optimizer))

  def per_replica(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    optimizer.update(model, lax.pmean(grads, "data"))
    nnx.update(model, lax.pmean(nnx.state(model, nnx.BatchStat), "data"))
    return nnx.state((model, optimizer)), {"loss": lax.pmean(loss, "data")}

  step = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=(P(), P()), check_vma=False), donate_argnums=(0,))
  return step, jax.device_put(jax.tree.map(jnp.copy, state), NamedSharding(mesh, P()))


def decorated(mesh, **kwargs):
  """The NNX step under ``@jaxring.train_step(mesh, **kwargs)``, called as the timing loop calls
  a step: ``call((model, optimizer), batch) -> ((model, optimizer), metrics)``, the objects
  updated in place. ``call.step`` is the TrainStep (its ``buckets``)."""
  import jaxring as jr

  @jr.train_step(mesh, **kwargs)
  def step(model, optimizer, batch):
    loss, grads = jr.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}

  def call(objects, batch):
    return objects, step(*objects, batch)
  call.step = step
  return call


def _contenders(mesh, args, bucket_bytes: int) -> dict:
  """name -> (step, start state): each from its own copy of the same initialization."""
  import jaxring
  small = common.fmt_bytes(bucket_bytes)
  out = {HAND_WRITTEN: hand_written(mesh, *resnet(args.width)),
         "train_step (defaults: auto, 25MiB buckets)": (decorated(mesh), resnet(args.width))}
  if bucket_bytes:
    out[f"train_step (auto, {small} buckets, overlap)"] = (
        decorated(mesh, bucket_bytes=bucket_bytes), resnet(args.width))
  if args.int8:
    size = bucket_bytes or 25 << 20
    out[f"train_step (ring, int8 + EF, {common.fmt_bytes(size)} buckets)"] = (decorated(
        mesh, bucket_bytes=size, algorithm="ring",
        compression=jaxring.codecs.int8()), resnet(args.width))
  return out


def _warm_up(contenders: dict, batch, steps: int) -> tuple[dict, dict]:
  """Each contender's state after ``steps`` steps (the first compiles), and its first loss."""
  import time

  import jax
  states, first = {}, {}
  for name, (step, state) in contenders.items():
    t0 = time.perf_counter()
    for i in range(steps):
      state, metrics = step(state, batch)
      if i == 0:
        first[name] = float(metrics["loss"])
    jax.block_until_ready((state, metrics))
    print(f"  {name}: compiled + {steps} warm-up steps in {time.perf_counter() - t0:.1f} s",
          flush=True)
    states[name] = state
  return states, first


def _train_alike(steps: dict, states: dict, batch) -> tuple[dict, dict]:
  """Each contender's loss one step after the timed ones (its own trajectory), and its loss of
  the second of two steps from the hand-written step's state (what one update did)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  last, synced = {}, {}
  for name, step in steps.items():
    states[name], metrics = step(states[name], batch)
    last[name] = float(metrics["loss"])
  reference = states[HAND_WRITTEN]
  for name, step in steps.items():
    if name == HAND_WRITTEN:
      state = jax.tree.map(jnp.copy, reference)
    else:   # the same Variables, given the reference's values (copies: the step donates them)
      state = states[name]
      nnx.update(state, jax.tree.map(jnp.copy, reference))
    for _ in range(2):
      state, metrics = step(state, batch)
    synced[name] = float(metrics["loss"])
  return last, synced


def _ratio_spread(ratios: list[float], resamples: int = 2000) -> dict:
  """The per-repetition ratios' 10th and 90th percentiles, and a 90% bootstrap interval of their
  median (the repetitions resampled): whether the median is told apart from 1 +- 2%."""
  import numpy as np
  r = np.asarray(ratios, np.float64)
  medians = np.median(r[np.random.default_rng(0).integers(0, r.size, (resamples, r.size))], axis=1)
  lo, hi = np.quantile(medians, [0.05, 0.95])
  return {"ratio_p10": float(np.quantile(r, 0.1)), "ratio_p90": float(np.quantile(r, 0.9)),
          "ratio_lo": float(lo), "ratio_hi": float(hi)}


def _rel(losses: dict, name: str) -> float:
  return abs(losses[name] - losses[HAND_WRITTEN]) / abs(losses[HAND_WRITTEN])


def run(args) -> dict:
  """The NNX bench's result (the Linen bench's layout, plus each row's losses)."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices()
  mesh = Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))
  n = len(devices)
  global_batch = args.batch_per_device * n
  bucket_bytes = int(args.bucket_mib * (1 << 20))
  n_params = sum(int(np.size(p)) for p in jax.tree.leaves(
      nnx.state(resnet(args.width)[0], nnx.Param)))

  rng = np.random.RandomState(0)
  batch = jax.device_put({"x": rng.randn(global_batch, 32, 32, 3).astype(np.float32),
                          "y": rng.randint(0, 10, global_batch).astype(np.int32)},
                         NamedSharding(mesh, P("data")))
  contenders = _contenders(mesh, args, bucket_bytes)
  steps = {name: step for name, (step, _) in contenders.items()}
  states, first = _warm_up(contenders, batch, args.warmup)
  times = common.time_interleaved(steps, states, batch, reps=args.reps, steps=args.steps)
  last, synced = _train_alike(steps, states, batch)

  base_times = times[HAND_WRITTEN]
  rows = []
  for name, ts in times.items():
    med = statistics.median(ts)
    ratio = statistics.median(t / b for t, b in zip(ts, base_times))
    buckets = getattr(getattr(steps[name], "step", None), "buckets", None)
    rows.append({"contender": name, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                 "images_per_s": global_batch / med, "ratio": ratio,
                 "min_ratio": min(ts) / min(base_times), "overhead_pct": (ratio - 1) * 100,
                 **_ratio_spread([t / b for t, b in zip(ts, base_times)]),
                 "buckets": None if buckets is None else len(buckets),
                 "first_loss": first[name], "last_loss": last[name],
                 "last_loss_rel_diff": _rel(last, name), "synced_loss": synced[name],
                 "synced_loss_rel_diff": _rel(synced, name), "times_s": ts})
  return {"benchmark": "train-nnx", "api": "nnx",
          "model": f"ResNet-18 NNX (BasicBlock [2,2,2,2], width {args.width})",
          "params": n_params, "image": "32x32x3", "devices": n, "global_batch": global_batch,
          "bucket_bytes": bucket_bytes, "steps_per_rep": args.steps, "reps": args.reps,
          "warmup": args.warmup, "trained_steps": args.warmup + args.reps * args.steps,
          "machine": common.machine(), "rows": rows}


def print_result(result: dict) -> None:
  """The table, and how far each contender's losses are from the hand-written step's."""
  print(f"\n{result['model']}, {result['params']:,} params "
        f"({common.fmt_bytes(4 * result['params'])} of f32 gradients), global batch "
        f"{result['global_batch']} on {result['devices']} devices, "
        f"allocator: {result['machine']['allocator']}")
  common.print_table(result["rows"], [
      ("contender", "contender", ""), ("median_ms", "median ms/step", ".1f"),
      ("min_ms", "min ms", ".1f"), ("images_per_s", "images/s", ".1f"),
      ("ratio", "vs hand-written (median of per-rep ratios)", ".3f"),
      ("ratio_lo", "90% interval", ".3f"), ("ratio_hi", "of it", ".3f"),
      ("ratio_p10", "ratios' p10", ".3f"), ("ratio_p90", "p90", ".3f"),
      ("buckets", "buckets", "")])
  print(f"\ntrain alike: losses at the first step, after {result['trained_steps'] + 1} steps "
        "(own trajectories: rounding differences amplified), and of the second step from the "
        "hand-written step's state (the check)")
  common.print_table(result["rows"], [
      ("contender", "contender", ""), ("first_loss", "first", ".7f"),
      ("last_loss", "own trajectory", ".7f"), ("last_loss_rel_diff", "rel. diff", ".1e"),
      ("synced_loss", "from the same state", ".7f"),
      ("synced_loss_rel_diff", "rel. diff", ".1e")])
