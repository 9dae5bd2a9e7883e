"""Training and evaluation of a ResNet recipe, data-parallel through ``@jaxring.train_step``.

The loop is the library's, :func:`jaxring.train.fit`: resume from the newest checkpoint (state and
data position), step, read the metrics every ``log_every`` steps (progress bar and JSON lines from
process 0 only; a non-finite loss raises), evaluate top-1/top-5 every ``eval_every_epochs``,
checkpoint every ``checkpoint_every`` steps and at the end; throughput in the steady state (the
compiling first step, evaluation and checkpointing left out). This module supplies the model, the
optimizer, the steps and the evaluation.

The per-replica step is the single-device step: ``jaxring.value_and_grad`` averages the gradients
inside the backward pass with the configured algorithm and codec, and the decorator averages the
BatchNorm statistics and the metrics over the replicas.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.train as jt
from jaxring.data import prefetch_to_device
from jaxring.train import FitSummary
from recipes import input_pipeline, models, optim
from recipes.config import Config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
  """Mean cross entropy against one-hot targets smoothed to ``(1 - e) * onehot + e / classes``.

  Example:
    >>> cross_entropy(jnp.zeros((2, 10)), jnp.array([3, 7]), 0.1)  # log(10)
    Array(2.3025851, dtype=float32)
  """
  num_classes = logits.shape[-1]
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes, dtype=jnp.float32),
                                label_smoothing)
  return jnp.mean(optax.softmax_cross_entropy(logits.astype(jnp.float32), targets))


def topk_correct(logits: jax.Array, labels: jax.Array, ks=(1, 5)) -> dict[str, jax.Array]:
  """Per example, whether the label is among the ``k`` largest logits (``{"top1": bool[n], ...}``).

  Ties count against the label: it is in the top k if fewer than k logits are strictly larger.

  Example:
    >>> topk_correct(jnp.array([[0.1, 0.9, 0.0]]), jnp.array([0]), ks=(1, 2))
    {'top1': Array([False], dtype=bool), 'top2': Array([ True], dtype=bool)}
  """
  label_logit = jnp.take_along_axis(logits, labels[:, None], axis=-1)
  rank = jnp.sum(logits > label_logit, axis=-1)
  return {f"top{k}": rank < k for k in ks}


def create_model(config: Config) -> models.ResNet:
  return models.resnet(config.depth, num_classes=config.num_classes, width=config.width,
                       stem=config.stem, dtype=DTYPES[config.dtype], norm=config.norm)


def create_train_state(config: Config, model, tx: optax.GradientTransformation) -> jt.TrainState:
  """Initialized parameters, BatchNorm statistics and optimizer state (identical on every process:
  same seed), made by one compiled function rather than hundreds of eager ops.

  The key is an ``rbg`` key: XLA:CPU compiles the threefry initializers of a ResNet-18 in ~14 s
  and the ``rbg`` ones (XLA's RngBitGenerator) in ~3 s (measured on 2 cores).
  """
  shape = (1, config.image_size, config.image_size, 3)

  def create(key):
    variables = model.init(key, jnp.zeros(shape, jnp.float32), train=False)
    return jt.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                batch_stats=variables["batch_stats"])
  return jax.jit(create)(jax.random.key(config.seed, impl="rbg"))


def train_step_fn(schedule: optax.Schedule, label_smoothing: float) -> Callable:
  """The single-device step ``(state, batch) -> (state, metrics)``, for any data-parallel wrapper.

  Inside ``@jaxring.train_step`` the gradients come back averaged over the replicas; under a plain
  ``jax.jit`` on a globally sharded batch (the benchmark's baseline), ``jaxring.value_and_grad`` is
  ``jax.value_and_grad`` and XLA's partitioner inserts the reduction.
  """
  def step(state, batch):
    images = input_pipeline.normalize(batch["image"])
    labels = batch["label"]

    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                       images, train=True, mutable=["batch_stats"])
      return cross_entropy(logits, labels, label_smoothing), (logits, updates["batch_stats"])

    (loss, (logits, stats)), grads = jaxring.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads, batch_stats=stats)
    top1 = jnp.mean(topk_correct(logits, labels, ks=(1,))["top1"].astype(jnp.float32))
    return new_state, {"loss": loss, "top1": top1, "learning_rate": schedule(state.step)}
  return step


def axis_name(config: Config):
  return ("node", "local") if config.mesh == "hierarchical" else "data"


def momentum_in_step(config: Config, compression: str | None = None) -> bool:
  """Whether the momentum runs inside the gradient reduction (momentum correction): with a
  sparsifying codec (top-k) and error feedback, where momentum after the reduction trains to
  chance (README, "Compression and optimizers")."""
  codec = jaxring.codecs.parse(config.compression if compression is None else compression)
  return bool(getattr(codec, "sparsifying", False) and config.error_feedback and config.momentum)


def step_compression(config, compression: str | None = None):
  """The train step's ``compression=`` from a config's ``compression`` (or ``compression``) and,
  under ``shard="params"``, ``param_compression``: ``{"params": ..., "grads": ...}`` (FSDP's
  parameter all-gather has its own codec)."""
  codec = jaxring.codecs.parse(config.compression if compression is None else compression)
  if config.shard == "params":
    return {"params": jaxring.codecs.parse(config.param_compression), "grads": codec}
  if config.param_compression not in ("none", ""):
    raise ValueError("--config.param_compression compresses the parameters' all-gather of "
                     f"--config.shard=params; this run has --config.shard={config.shard}")
  return codec


def make_train_step(config: Config, schedule: optax.Schedule, mesh=None,
                    compression: str | None = None) -> jt.TrainStep:
  """The recipe's step under ``@jaxring.train_step`` (``compression`` overrides the config's).

  With top-k the step runs the optimizer's momentum itself (:func:`momentum_in_step`); the state's
  optimizer is then :func:`recipes.optim.make_optimizer`'s momentum-free form.
  """
  in_step = momentum_in_step(config, compression)
  codec = step_compression(config, compression)
  return jt.train_step(
      mesh if mesh is not None else jt.default_mesh(axis_name(config)),
      axis_name=axis_name(config), algorithm=config.algorithm, compression=codec,
      error_feedback=config.error_feedback, bucket_bytes=int(config.bucket_mib * (1 << 20)),
      momentum=config.momentum if in_step else None, nesterov=in_step and config.nesterov,
      shard=config.shard, hpz=config.hpz)(train_step_fn(schedule, config.label_smoothing))


def make_eval_step(mesh, axis) -> Callable:
  """``(state, batch) -> summed {loss, top1, top5, count}`` over the global batch (masked)."""
  def per_replica(params, batch_stats, batch, apply_fn):
    logits = apply_fn({"params": params, "batch_stats": batch_stats},
                      input_pipeline.normalize(batch["image"]), train=False)
    mask = batch["mask"].astype(jnp.float32)
    labels = batch["label"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    sums = {k: jnp.sum(v.astype(jnp.float32) * mask)
            for k, v in topk_correct(logits, labels, ks=(1, 5)).items()}
    sums.update(loss=jnp.sum(losses * mask), count=jnp.sum(mask))
    return lax.psum(sums, axis)

  compiled = {}

  def eval_step(state, batch):
    if "mask" not in batch:
      batch = dict(batch, mask=np.ones(np.shape(batch["label"]), bool))
    fn = compiled.get(state.apply_fn)
    if fn is None:
      fn = jax.jit(jax.shard_map(lambda p, s, b: per_replica(p, s, b, state.apply_fn), mesh=mesh,
                                 in_specs=(P(), P(), P(axis)), out_specs=P()))
      compiled[state.apply_fn] = fn
    return fn(state.params, state.batch_stats, batch)
  return eval_step


def evaluate(eval_step, step: jt.TrainStep, state, batches, num_batches: int) -> dict:
  """top-1, top-5 and loss over ``num_batches`` batches (padding excluded by the mask)."""
  totals = None
  for _ in range(num_batches):
    out = eval_step(state, step.shard_batch(next(batches)))
    totals = out if totals is None else jax.tree_util.tree_map(jnp.add, totals, out)
  totals = {k: float(np.asarray(v.addressable_data(0))) for k, v in totals.items()}
  n = max(totals["count"], 1.0)
  return {"eval_top1": totals["top1"] / n, "eval_top5": totals["top5"] / n,
          "eval_loss": totals["loss"] / n, "eval_images": int(totals["count"])}


def _log(message: str) -> None:
  if jax.process_index() == 0:
    from tqdm.auto import tqdm
    tqdm.write(message)


def train_and_evaluate(config: Config) -> dict[str, Any]:
  """Trains ``config`` to its last step (resuming from ``workdir``) and evaluates it.

  Returns:
    A summary: ``steps``, ``final`` (the last evaluation), ``train_images_per_s`` (steady state:
    compilation, evaluation and checkpoint time excluded), ``compile_s``, ``global_batch``,
    ``devices``, ``params``.

  Example:
    >>> summary = train_and_evaluate(small_cpu.get_config())
    >>> summary["final"]["eval_top1"]  # the generated 10-class data: above 0.9
  """
  axis = axis_name(config)
  mesh = jt.default_mesh(axis)
  if config.batch_size % mesh.size or config.eval_batch_size % mesh.size:
    raise ValueError(f"batch_size {config.batch_size} and eval_batch_size "
                     f"{config.eval_batch_size} must be multiples of the {mesh.size} devices")
  batches, steps_per_epoch = input_pipeline.train_batches(config)
  eval_batches = input_pipeline.eval_batches(config)
  # the next batches' host-to-device copies run while the current step computes
  batches = prefetch_to_device(batches, 2, NamedSharding(mesh, P(axis)))
  total_steps = config.num_steps or int(round(config.num_epochs * steps_per_epoch))
  peak = optim.peak_learning_rate(config.learning_rate, config.batch_size, config.lr_scaling)
  warmup = int(round(config.warmup_epochs * steps_per_epoch))
  if warmup >= total_steps:   # a short run (a smoke test's num_steps): warm up over a tenth of it
    logging.info("warm-up of %d steps clipped to %d: the run has %d steps", warmup,
                 total_steps // 10, total_steps)
    warmup = total_steps // 10
  schedule = optim.learning_rate_schedule(peak, total_steps, warmup)
  tx = optim.make_optimizer(schedule, optimizer=config.optimizer, momentum=config.momentum,
                            nesterov=config.nesterov, weight_decay=config.weight_decay,
                            trust_coefficient=config.lars_trust_coefficient,
                            momentum_in_step=momentum_in_step(config))
  model = create_model(config)
  step = make_train_step(config, schedule, mesh)
  state = create_train_state(config, model, tx)   # fit prepares it for the step
  eval_step = make_eval_step(mesh, axis)
  eval_every = int(round(config.eval_every_epochs * steps_per_epoch))
  eval_count = config.eval_steps or (1 if config.dataset == "synthetic"
                                      else eval_batches.batches_per_epoch)

  def evaluate_and_log(state) -> dict:
    result = evaluate(eval_step, step, state, eval_batches, eval_count)
    _log(f"step {int(jax.device_get(state.step))}: top-1 {result['eval_top1']:.4f}, top-5 "
         f"{result['eval_top5']:.4f}, loss {result['eval_loss']:.4f} on "
         f"{result['eval_images']} images")
    return result

  ckpt = jt.Checkpointer(os.path.join(config.workdir, "checkpoints")) if config.workdir else None
  fitted = FitSummary()
  try:
    state = jt.fit(step, state, batches, num_steps=total_steps, checkpointer=ckpt,
                   checkpoint_every=config.checkpoint_every, log_every=config.log_every,
                   metrics_path=(os.path.join(config.workdir, "metrics.jsonl") if config.workdir
                                 else None), progress=config.progress,
                   evaluate=evaluate_and_log, eval_every=eval_every, steady_state=True,
                   summary=fitted)
  finally:
    if ckpt is not None:
      ckpt.close()
  return {"steps": total_steps, "start_step": fitted.start_step, "final": fitted.last_eval,
          "state": state, "train_images_per_s": fitted.images_per_s,
          "compile_s": fitted.compile_s,
          "global_batch": config.batch_size, "devices": mesh.size,
          "params": sum(int(np.size(p)) for p in jax.tree_util.tree_leaves(state.params)),
          "step_fn": step, "config": dataclasses.asdict(config)}


def run(config: Config, argv=None) -> dict[str, Any]:
  """A recipe's ``main``: command-line overrides, multi-process start-up, training, a summary.

  ``jaxring.distributed.initialize()`` joins the job when a launcher started several processes
  (mpirun/Slurm/``jaxring cluster run``) and otherwise does nothing; it must run before anything
  starts a JAX backend, hence here and not at import.
  """
  import sys

  import jaxring.distributed
  from recipes.config import override

  argv = sys.argv[1:] if argv is None else list(argv)
  if "-h" in argv or "--help" in argv:
    print("options (--config.name=value or --name value):")
    for name, value in dataclasses.asdict(config).items():
      print(f"  --{name.replace('_', '-')} {value!r}")
    return {}
  config = override(config, argv)
  jaxring.distributed.initialize(local_device_count=config.cpu_devices or None)
  summary = train_and_evaluate(config)
  if jax.process_index() == 0:
    final = summary["final"]
    rate = summary["train_images_per_s"]
    print(f"ResNet-{config.depth} ({summary['params']:,} params) on {summary['devices']} devices,"
          f" global batch {config.batch_size}, {summary['steps']} steps, compression "
          f"{config.compression}: top-1 {final['eval_top1']:.4f}, top-5 {final['eval_top5']:.4f}, "
          + (f"{rate:.1f} images/s" if rate else "no timed steps"))
  return summary
