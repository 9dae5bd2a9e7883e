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
  trained = wire_bytes(step.lower(state, batch).compile().as_text())
  plain_step = train.make_train_step(config, optax.constant_schedule(0.0), step.mesh,
                                     compression="none")
  plain = wire_bytes(plain_step.lower(state.replace(residuals=None), batch).compile().as_text())
  return {"compressed": trained.sent_bytes, "uncompressed": plain.sent_bytes}


def _process_count() -> int:
  import jax
  return jax.process_count()


def run(config) -> dict:
  """Trains ``config`` (generating its data set if needed) and gathers the report's numbers.

  Returns:
    ``top1``, ``top5``, ``eval_images``, ``images_per_s``, ``wire_bytes`` (per device per step,
    ``compressed``/``uncompressed``), ``steps``, ``devices``, ``global_batch``, ``params``,
    ``compression``, ``compile_s``, ``train_s``.

  Example:
    >>> report = run(demo_config(_parser().parse_args([])))
    >>> print(format_report(report))
  """
  from recipes import train

  start = time.perf_counter()
  summary = train.train_and_evaluate(config)
  train_s = time.perf_counter() - start
  wire = step_wire_bytes(summary["step_fn"], summary["state"], config)
  final = summary["final"]
  return {"top1": final["eval_top1"], "top5": final["eval_top5"],
          "eval_images": final["eval_images"], "images_per_s": summary["train_images_per_s"],
          "wire_bytes": wire, "steps": summary["steps"], "devices": summary["devices"],
          "global_batch": summary["global_batch"], "params": summary["params"],
          "num_classes": config.num_classes, "compression": config.compression,
          "platform": __import__("jax").devices()[0].platform,
          "compile_s": summary["compile_s"], "train_s": train_s}


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
      f"ResNet-18-like ({r['params']:,} params), {r['steps']} steps, global batch "
      f"{r['global_batch']} on {where}, compression {r['compression']}",
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
  report = run(config)
  print()
  print(format_report(report))
  print(f"  total {time.perf_counter() - t0:.0f} s (data set in {config.data_dir})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
