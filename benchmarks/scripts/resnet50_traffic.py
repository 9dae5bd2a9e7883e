"""Where a ResNet-50 training step's device-memory traffic goes, read off its compiled program.

Builds the recipe's plain-jit step (``recipes.train.train_step_fn``, bf16, synthetic batch) on the
default backend, compiles it and sums, per kind of kernel in the entry computation (XLA's
reduction fusions, its elementwise fusions, each cuDNN convolution call, copies), the bytes of
every kernel's operands and results. That is the traffic if nothing stays in cache, so its time at
the card's copy bandwidth is a floor estimate for the memory-bound part of the step, beside the
step's measured time.

  python benchmarks/scripts/resnet50_traffic.py --batch-size 256 --copy-gbs 2900
  python benchmarks/scripts/resnet50_traffic.py --hlo step.txt   # an HLO text saved earlier
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}
_ARRAY = re.compile(r"\b(pred|s8|u8|bf16|f16|f32|s32|u32)\[([0-9,]*)\]")
_DEF = re.compile(r"\s*(?:ROOT )?%(\S+) = (\([^=]*?\)|\S+) ")
_KERNEL = re.compile(r"\s*(?:ROOT )?%(\S+) = (\([^=]*?\)|\S+) "
                     r"(fusion|custom-call|copy)\((.*?)\)(.*)")


def array_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def traffic(hlo: str) -> dict[str, list[int]]:
  """{kind: [kernels, bytes of operands + results]} over the entry computation's kernels."""
  lines = hlo[hlo.index("\nENTRY"):].split("\n")[1:]
  shapes = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
  kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for m in filter(None, map(_KERNEL.match, lines)):
    _, out, op, args, rest = m.groups()
    operands = [a.strip().lstrip("%") for a in args.split(",") if a.strip().startswith("%")]
    moved = array_bytes(out) + sum(array_bytes(shapes.get(a, "")) for a in operands)
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    kind = re.search(r"kind=(k\w+)", rest)
    key = target.group(1) if target else {"kInput": "XLA reduction fusions",
                                          "kLoop": "XLA elementwise fusions",
                                          "kCustom": "other fusions"}.get(
                                              kind.group(1) if kind else op, op)
    kinds[key][0] += 1
    kinds[key][1] += moved
  return dict(kinds)


def compiled_step(norm: str, batch_size: int) -> tuple[str, float]:
  """The recipe's plain-jit ResNet-50 step: its compiled HLO text and median seconds per step."""
  import dataclasses

  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxring.train as jt
  from jaxring.data import SyntheticImages
  from recipes import imagenet_resnet50, optim, train
  config = dataclasses.replace(imagenet_resnet50.get_config(), batch_size=batch_size,
                               image_size=224, dtype="bfloat16", dataset="synthetic",
                               norm=norm)
  schedule = optim.learning_rate_schedule(
      optim.peak_learning_rate(config.learning_rate, batch_size), 10_000, 100)
  tx = optim.make_optimizer(schedule, weight_decay=config.weight_decay,
                            momentum_in_step=train.momentum_in_step(config))
  state = train.create_train_state(config, train.create_model(config), tx)
  sharded = NamedSharding(jt.default_mesh("data"), P("data"))
  batch = next(SyntheticImages(batch_size, image_size=224, num_classes=config.num_classes, seed=0))
  batch = jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharded, x),
                                 batch)
  step = jax.jit(train.train_step_fn(schedule, config.label_smoothing), donate_argnums=(0,))
  hlo = step.lower(state, batch).compile().as_text()
  for _ in range(3):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(10):
      state, _ = step(state, batch)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / 10)
  return hlo, statistics.median(times)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch-size", type=int, default=256)
  ap.add_argument("--norm", choices=["fused", "flax"], default="fused",
                  help="the model's BatchNorm (recipes.models.NORMS)")
  ap.add_argument("--hlo", help="read this compiled HLO text instead of building the step")
  ap.add_argument("--save-hlo", help="write the compiled HLO text here")
  ap.add_argument("--copy-gbs", type=float, default=2900.0,
                  help="the card's device-to-device copy, GB/s read + written (H100: ~2,900)")
  args = ap.parse_args()
  if args.hlo:
    with open(args.hlo) as f:
      hlo, step_s = f.read(), None
  else:
    hlo, step_s = compiled_step(args.norm, args.batch_size)
    if args.save_hlo:
      with open(args.save_hlo, "w") as f:
        f.write(hlo)
  kinds = traffic(hlo)
  total = sum(b for _, b in kinds.values())
  print(f"{'kernels of kind':34s} {'count':>5s} {'GB':>7s} {'share':>6s} {'ms at copy rate':>16s}")
  for key, (n, b) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
    print(f"{key:34s} {n:5d} {b / 1e9:7.2f} {100 * b / total:5.1f}% {b / args.copy_gbs / 1e6:16.2f}")
  print(f"{'all':34s} {sum(n for n, _ in kinds.values()):5d} {total / 1e9:7.2f} {'':6s} "
        f"{total / args.copy_gbs / 1e6:16.2f}")
  if step_s is not None:
    print(f"measured step: {1e3 * step_s:.2f} ms ({args.batch_size / step_s:.0f} images/s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
