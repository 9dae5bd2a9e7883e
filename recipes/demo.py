"""``make demo``: train a small ResNet data-parallel on 8 emulated CPU devices with int8 gradients.

No download and no GPU: a 10-class data set of real JPEG files is generated once (cached under
``~/.cache/jaxring``), the ``recipes.small_cpu`` config (a ResNet-18-like network at 32x32) trains
on it through ``@jaxring.train_step`` with ``compression=jaxring.codecs.int8()``, and a short report
closes the run: validation accuracy, training images/s, and the bytes each device sends per step,
read from the compiled HLO of the int8 step and of the same step without compression (compiled
only, not run).

Example:
  $ python -m jaxring demo                       # ~2-3 minutes on 2 cores
  $ python -m recipes.demo --steps 200 --compression bf16   # the same, from the checkout
  $ python -m jaxring demo --api nnx             # the same network in Flax NNX
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxring demo", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
  ap.add_argument("--compression", default="int8",
                  help="none, bf16, fp16, int8[:block], topk[:density] (jaxring.codecs.parse; "
                  "default int8)")
  ap.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
  ap.add_argument("--batch-size", type=int, default=None, help="global batch")
  ap.add_argument("--data-dir", default=None, help="where the generated data set is cached")
  ap.add_argument("--workdir", default="", help="checkpoints and metrics.jsonl (default: none)")
  ap.add_argument("--no-progress", action="store_true", help="no progress bar")
  ap.add_argument("--api", choices=("linen", "nnx"), default="linen",
                  help="the model's Flax API: linen (recipes/models.py, the default) or nnx "
                  "(recipes/models_nnx.py, stepped as step(model, optimizer, batch))")
  return ap


def demo_config(args: argparse.Namespace):
  """``recipes.small_cpu``'s config with the demo's command-line choices applied."""
  from recipes import small_cpu
  config = small_cpu.get_config()
  changes = {"compression": args.compression, "workdir": args.workdir,
             "progress": not args.no_progress, "cpu_devices": args.devices}
  for name, value in (("num_steps", args.steps), ("batch_size", args.batch_size),
                      ("data_dir", args.data_dir)):
    if value is not None:
      changes[name] = value
  return dataclasses.replace(config, **changes)


def step_wire_bytes(step, state, config) -> dict[str, float]:
  """Bytes one device sends per step: the trained step and the same step uncompressed.

  Both come from compiled HLO (jaxring._src.tools.hlo_bytes); the trained step's compilation is
  cached from training, the uncompressed one is compiled here and never run.
  """
  import numpy as np
  import optax

  from jaxring.bench import wire_bytes
  from recipes import train

  local = config.batch_size // _process_count()
  batch = {"image": np.zeros((local, config.image_size, config.image_size, 3), np.uint8),
           "label": np.zeros((local,), np.int32)}
  if isinstance(state, tuple):   # NNX objects: the same step function, uncompressed
    import jaxring.train as jt
    trained = wire_bytes(step.lower(*state, batch).compile().as_text())
    plain_step = jt.train_step(step.mesh, axis_name=step.config.axis_name)(step.__wrapped__)
    plain = wire_bytes(plain_step.lower(*state, batch).compile().as_text())
    return {"compressed": trained.sent_bytes, "uncompressed": plain.sent_bytes}
  trained = wire_bytes(step.lower(state, batch).compile().as_text())
  plain_step = train.make_train_step(config, optax.constant_schedule(0.0), step.mesh,
                                     compression="none")
  plain = wire_bytes(plain_step.lower(state.replace(residuals=None), batch).compile().as_text())
  return {"compressed": trained.sent_bytes, "uncompressed": plain.sent_bytes}


def nnx_train_step_fn(schedule, label_smoothing: float, value_and_grad=None):
  """The recipe's single-device step with the model in NNX: ``(model, optimizer, batch) ->
  metrics``, updating the objects in place (BatchNorm's running statistics included).

  ``value_and_grad`` defaults to ``jaxring.value_and_grad`` (under ``@jaxring.train_step`` the
  gradients come back averaged over the replicas); ``nnx.value_and_grad`` for a reference.
  """
  import jax.numpy as jnp

  import jaxring
  from recipes import input_pipeline, train

  value_and_grad = value_and_grad or jaxring.value_and_grad

  def step(model, optimizer, batch):
    images = input_pipeline.normalize(batch["image"])
    labels = batch["label"]

    def loss_fn(model):
      logits = model(images)
      return train.cross_entropy(logits, labels, label_smoothing), logits

    (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(model)
    learning_rate = schedule(optimizer.step[...])
    optimizer.update(model, grads)
    top1 = jnp.mean(train.topk_correct(logits, labels, ks=(1,))["top1"].astype(jnp.float32))
    return {"loss": loss, "top1": top1, "learning_rate": learning_rate}
  return step


def nnx_eval_step():
  """``((model, optimizer), batch) -> summed {loss, top1, top5, count}`` over a global batch
  (masked), the model under ``nnx.jit`` in ``eval()`` mode (running BatchNorm statistics)."""
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from recipes import input_pipeline, train

  @nnx.jit
  def summed(model, batch):
    logits = model(input_pipeline.normalize(batch["image"]))
    mask = batch["mask"].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    sums = {k: jnp.sum(v.astype(jnp.float32) * mask)
            for k, v in train.topk_correct(logits, batch["label"], ks=(1, 5)).items()}
    return dict(sums, loss=jnp.sum(losses * mask), count=jnp.sum(mask))

  def eval_step(objects, batch):
    if "mask" not in batch:
      batch = dict(batch, mask=np.ones(np.shape(batch["label"]), bool))
    model = objects[0]
    model.eval()
    try:
      return summed(model, batch)
    finally:
      model.train()
  return eval_step


def train_nnx(config) -> dict:
  """:func:`recipes.train.train_and_evaluate` with the network in Flax NNX
  (:mod:`recipes.models_nnx`): the same data, schedule, optimizer, reduction and loop
  (``jaxring.train.fit``), the objects ``(model, optimizer)`` in place of the ``TrainState``.

  Returns:
    The same summary; its ``state`` is the objects, trained in place.
  """
  import os

  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring.data import prefetch_to_device
  from recipes import input_pipeline, models_nnx, optim, train

  axis = train.axis_name(config)
  mesh = jt.default_mesh(axis)
  batches, steps_per_epoch = input_pipeline.train_batches(config)
  batches = prefetch_to_device(batches, 2, NamedSharding(mesh, P(axis)))
  eval_batches = input_pipeline.eval_batches(config)
  total_steps = config.num_steps or int(round(config.num_epochs * steps_per_epoch))
  warmup = int(round(config.warmup_epochs * steps_per_epoch))
  warmup = warmup if warmup < total_steps else total_steps // 10   # as recipes.train's
  schedule = optim.learning_rate_schedule(
      optim.peak_learning_rate(config.learning_rate, config.batch_size, config.lr_scaling),
      total_steps, warmup)
  in_step = train.momentum_in_step(config)
  tx = optim.make_optimizer(schedule, optimizer=config.optimizer, momentum=config.momentum,
                            nesterov=config.nesterov, weight_decay=config.weight_decay,
                            trust_coefficient=config.lars_trust_coefficient,
                            momentum_in_step=in_step)
  model = models_nnx.create_model(config)
  objects = (model, nnx.Optimizer(model, tx, wrt=nnx.Param))
  step = jt.train_step(
      mesh, axis_name=axis, algorithm=config.algorithm,
      compression=train.step_compression(config), error_feedback=config.error_feedback,
      bucket_bytes=int(config.bucket_mib * (1 << 20)),
      momentum=config.momentum if in_step else None, nesterov=in_step and config.nesterov,
      shard=config.shard, hpz=config.hpz)(nnx_train_step_fn(schedule, config.label_smoothing))
  eval_step = nnx_eval_step()
  eval_count = config.eval_steps or (1 if config.dataset == "synthetic"
                                      else eval_batches.batches_per_epoch)

  def evaluate_and_log(objs) -> dict:
    result = train.evaluate(eval_step, step, objs, eval_batches, eval_count)
    if jax.process_index() == 0:
      from tqdm.auto import tqdm
      tqdm.write(f"step {int(jax.device_get(objs[1].step[...]))}: top-1 "
                 f"{result['eval_top1']:.4f}, top-5 {result['eval_top5']:.4f}, loss "
                 f"{result['eval_loss']:.4f} on {result['eval_images']} images")
    return result

  fitted = jt.FitSummary()
  ckpt = jt.Checkpointer(os.path.join(config.workdir, "checkpoints")) if config.workdir else None
  try:
    jt.fit(step, objects, batches, num_steps=total_steps, checkpointer=ckpt,
           checkpoint_every=config.checkpoint_every, log_every=config.log_every,
           metrics_path=(os.path.join(config.workdir, "metrics.jsonl") if config.workdir
                         else None), progress=config.progress, steady_state=True,
           evaluate=evaluate_and_log,
           eval_every=int(round(config.eval_every_epochs * steps_per_epoch)), summary=fitted)
  finally:
    if ckpt is not None:
      ckpt.close()
  params = nnx.state(model, nnx.Param)
  return {"steps": total_steps, "start_step": fitted.start_step, "final": fitted.last_eval,
          "state": objects, "train_images_per_s": fitted.images_per_s,
          "compile_s": fitted.compile_s, "global_batch": config.batch_size,
          "devices": mesh.size, "step_fn": step,
          "params": sum(int(np.size(p)) for p in jax.tree_util.tree_leaves(params))}


def _process_count() -> int:
  import jax
  return jax.process_count()


def run(config, api: str = "linen") -> dict:
  """Trains ``config`` (generating its data set if needed) and gathers the report's numbers.

  ``api="nnx"`` trains the network in Flax NNX (:func:`train_nnx`).

  Returns:
    ``top1``, ``top5``, ``eval_images``, ``images_per_s``, ``wire_bytes`` (per device per step,
    ``compressed``/``uncompressed``), ``steps``, ``devices``, ``global_batch``, ``params``,
    ``compression``, ``compile_s``, ``train_s``.

  Example:
    >>> report = run(demo_config(_parser().parse_args([])))
    >>> print(format_report(report))
  """
  from recipes import train

  if api not in ("linen", "nnx"):
    raise ValueError(f"api must be 'linen' or 'nnx', got {api!r}")
  start = time.perf_counter()
  summary = train.train_and_evaluate(config) if api == "linen" else train_nnx(config)
  train_s = time.perf_counter() - start
  wire = step_wire_bytes(summary["step_fn"], summary["state"], config)
  final = summary["final"]
  return {"top1": final["eval_top1"], "top5": final["eval_top5"],
          "eval_images": final["eval_images"], "images_per_s": summary["train_images_per_s"],
          "wire_bytes": wire, "steps": summary["steps"], "devices": summary["devices"],
          "global_batch": summary["global_batch"], "params": summary["params"],
          "num_classes": config.num_classes, "compression": config.compression,
          "platform": __import__("jax").devices()[0].platform,
          "compile_s": summary["compile_s"], "train_s": train_s, "api": api}


def format_report(r: dict) -> str:
  """The demo's closing report, a few aligned lines.

  Example:
    >>> print(format_report(run(config)))
  """
  from jaxring.bench import fmt_bytes

  wire = r["wire_bytes"]
  rate = r["images_per_s"]
  platform = r.get("platform", "cpu")
  where = (f"{r['devices']} emulated CPU device{'s' if r['devices'] > 1 else ''}"
           if platform == "cpu" else f"{r['devices']} {platform.upper()} device"
           f"{'s' if r['devices'] > 1 else ''}")
  if wire["compressed"]:
    ratio = wire["uncompressed"] / wire["compressed"]
    wire_line = (f"  wire bytes per device per step  {fmt_bytes(wire['compressed'])} with "
                 f"{r['compression']}, {fmt_bytes(wire['uncompressed'])} uncompressed "
                 f"({ratio:.2f}x less)")
  else:   # one device: nothing to reduce
    wire_line = "  wire bytes per device per step  none: one device sends nothing"
  lines = [
      f"ResNet-18-like{' (NNX)' if r.get('api') == 'nnx' else ''} ({r['params']:,} params), "
      f"{r['steps']} steps, global batch {r['global_batch']} on {where}, compression "
      f"{r['compression']}",
      f"  validation accuracy  top-1 {100 * r['top1']:.1f}%  top-5 {100 * r['top5']:.1f}%  "
      f"({r['eval_images']} images, {r['num_classes']} classes: chance is "
      f"{100 / r['num_classes']:.0f}%)",
      f"  training throughput  {rate:.1f} images/s" if rate else
      "  training throughput  (no timed steps)",
      wire_line,
      f"  time  {r['train_s']:.0f} s training and evaluation, of which {r['compile_s']:.0f} s "
      f"compiling the step",
  ]
  return "\n".join(lines)


def main(argv=None) -> int:
  from jaxring import bench

  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  # before jax starts: XLA:CPU collectives are allocator-bound (jaxring._src.tools.allocator)
  bench.maybe_reexec_with_fast_allocator(sys.argv[1:] if argv is None else argv,
                                         module="recipes.demo")
  bench.set_cpu_devices(args.devices)
  config = demo_config(args)
  t0 = time.perf_counter()
  report = run(config, args.api)
  print()
  print(format_report(report))
  print(f"  total {time.perf_counter() - t0:.0f} s (data set in {config.data_dir})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
